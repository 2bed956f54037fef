"""GGUF import throughput (``pagedkv convert MODEL.gguf``, docs/formats/gguf.md).

A 4-layer llama-shaped GGUF (Q4_K FFN, Q8_0 attention, F16 embeddings; about 40 MiB of
weights as float32) converted to HFQ4G256 without the error pass, beside the same-run
baseline of dequantizing every tensor with the ``gguf`` package alone (the part of the
work pagedkv cannot avoid): the ratio is the conversion's overhead over reading.

Run as asv benchmarks, or as a script: ``cd asv_bench && python -m benchmarks.gguf_import``.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

H, I, LAYERS = 1024, 2816, 4


def write_model(path: str) -> int:
    """The benchmark GGUF at ``path``; returns its weight count."""
    import gguf
    from gguf.quants import quantize
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("llama.block_count", LAYERS)
    w.add_uint32("llama.embedding_length", H)
    w.add_uint32("llama.attention.head_count", 8)
    w.add_uint32("llama.attention.head_count_kv", 8)
    numel = 0

    def k_quant(rows, k):
        raw = rng.integers(0, 256, (rows, k // 256, 144), dtype=np.uint8)
        raw[..., 0:4] = np.frombuffer(np.array([0.01, 0.002], np.float16).tobytes(), np.uint8)
        return raw.reshape(rows, -1)

    w.add_tensor("token_embd.weight", rng.standard_normal((2048, H)).astype(np.float16))
    numel += 2048 * H
    for li in range(LAYERS):
        for name, shape in (("attn_q", (H, H)), ("attn_k", (H, H)), ("attn_v", (H, H)),
                            ("attn_output", (H, H))):
            data = quantize(rng.standard_normal(shape).astype(np.float32),
                            gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(f"blk.{li}.{name}.weight", data,
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            numel += shape[0] * shape[1]
        for name, (rows, k) in (("ffn_gate", (I, H)), ("ffn_up", (I, H)), ("ffn_down", (H, I))):
            w.add_tensor(f"blk.{li}.{name}.weight", k_quant(rows, k),
                         raw_dtype=gguf.GGMLQuantizationType.Q4_K)
            numel += rows * k
        w.add_tensor(f"blk.{li}.attn_norm.weight", np.ones(H, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return numel


class GgufImport:
    number = 1
    repeat = 3
    timeout = 300

    def setup(self):
        if getattr(self, "path", None) is None:
            self.dir = tempfile.mkdtemp(prefix="pagedkv-gguf-bench-")
            self.path = os.path.join(self.dir, "m.gguf")
            self.numel = write_model(self.path)

    def time_convert_hf4(self):
        from pagedkv.hfqm.convert import convert_gguf
        convert_gguf(self.path, os.path.join(self.dir, "o.hfq"), measure_error=False)

    def time_gguf_dequantize_baseline(self):
        import gguf
        from gguf.quants import dequantize
        for t in gguf.GGUFReader(self.path).tensors:
            dequantize(t.data, t.tensor_type)


def main() -> None:
    import time
    bench = GgufImport()
    bench.setup()
    best = {}
    for name in ("time_gguf_dequantize_baseline", "time_convert_hf4"):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            getattr(bench, name)()
            times.append(time.perf_counter() - t0)
        best[name] = min(times)
    mb = bench.numel * 4 / 1e6
    base, conv = best["time_gguf_dequantize_baseline"], best["time_convert_hf4"]
    print(f"# {bench.numel / 1e6:.1f} M weights ({mb:.0f} MB as float32); best of 3, wall")
    print(f"gguf dequantize only  {base:6.2f} s  {mb / base:7.1f} MB/s (float32 out)")
    print(f"convert to hf4        {conv:6.2f} s  {mb / conv:7.1f} MB/s  {conv / base:4.2f}x "
          "the dequantize baseline")


if __name__ == "__main__":
    main()
