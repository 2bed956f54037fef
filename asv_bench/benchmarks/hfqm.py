"""HFQM open + index and first-tensor-view speed, with same-run baselines.

Targets (issue 3): open + index a 1,000-tensor HFQM file <= 1 ms warm; first
tensor view <= 0.1 ms. Baselines measured in the same run: a pure-Python
``struct.unpack`` index parser over the same file, and ``safetensors.safe_open``
(+ ``get_tensor`` of the first tensor) over an equivalent 1,000-tensor file.

Run as asv benchmarks, or as a script: ``python asv_bench/benchmarks/hfqm.py``.
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile

import numpy as np

N_TENSORS = 1000


def _names():
    per_layer = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                 "mlp.down_proj.weight", "input_layernorm.weight",
                 "post_attention_layernorm.weight", "self_attn.q_norm.weight")
    return [f"model.layers.{i // len(per_layer)}.{per_layer[i % len(per_layer)]}"
            for i in range(N_TENSORS)]


def write_files(directory: str) -> tuple[str, str]:
    """A 1,000-tensor HFQM file (HFQ4G256 [1, 256] and F16 [64] tensors, small payloads so
    the index dominates) and an equivalent safetensors file (F16 tensors)."""
    from safetensors.numpy import save_file

    from pagedkv.hfqm import HfqmWriter
    hfq = os.path.join(directory, "bench.hfq")
    st = os.path.join(directory, "bench.safetensors")
    group = np.zeros(136, np.uint8)
    norm = np.ones(64, np.float16)
    with HfqmWriter(hfq, arch_id=0, metadata={"architecture": "llama",
                                              "config": {"model_type": "llama"}},
                    fsync=False) as w:
        for i, name in enumerate(_names()):
            if "norm" in name:
                w.add(name, "f16", [64], norm)
            else:
                w.add(name, "hfq4g256", [1, 256], group)
    save_file({name: (norm if "norm" in name else np.zeros((1, 68), np.float16))
               for name in _names()}, st)
    return hfq, st


def python_struct_index(path: str) -> dict:
    """Baseline: mmap + struct.unpack walk of header, JSON extent and index."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    _, _version, _arch, _n, meta_off, data_off = struct.unpack_from("<4sIIIQQ", mm, 0)
    depth, in_str, esc, p = 0, False, False, meta_off
    while True:
        c = mm[p]
        if in_str:
            if esc:
                esc = False
            elif c == 0x5C:
                esc = True
            elif c == 0x22:
                in_str = False
        elif c == 0x22:
            in_str = True
        elif c == 0x7B:
            depth += 1
        elif c == 0x7D:
            depth -= 1
            if depth == 0:
                break
        p += 1
    pos = p + 1
    (count,) = struct.unpack_from("<I", mm, pos)
    pos += 4
    offset = data_off
    index = {}
    for _ in range(count):
        (name_len,) = struct.unpack_from("<H", mm, pos)
        name = mm[pos + 2:pos + 2 + name_len].decode()
        pos += 2 + name_len
        qt, ndim = mm[pos], mm[pos + 1]
        shape = struct.unpack_from(f"<{ndim}I", mm, pos + 2)
        pos += 2 + 4 * ndim
        group_size, size = struct.unpack_from("<IQ", mm, pos)
        pos += 12
        index[name] = (qt, shape, group_size, offset, size)
        offset += size
    return index


class HfqmOpen:
    """Open + parse header and 1,000-entry index; first tensor view."""

    def setup(self):
        from pagedkv.hfqm import HfqmFile
        self._tmp = tempfile.TemporaryDirectory()
        self.hfq, self.st = write_files(self._tmp.name)
        self.HfqmFile = HfqmFile
        HfqmFile(self.hfq).close()  # warm: page cache and imports
        self.opened = HfqmFile(self.hfq)
        self.first = self.opened.names[0]

    def teardown(self):
        self.opened.close()
        self._tmp.cleanup()

    def time_open_and_index(self):
        self.HfqmFile(self.hfq).close()

    def time_open_and_index_baseline_python_struct(self):
        python_struct_index(self.hfq)

    def time_open_baseline_safetensors(self):
        from safetensors import safe_open
        with safe_open(self.st, framework="numpy") as f:
            f.keys()

    def time_first_tensor_view(self):
        self.opened[self.first]

    def time_open_and_first_view(self):
        with self.HfqmFile(self.hfq) as f:
            f[self.first]

    def time_open_and_first_view_baseline_safetensors(self):
        from safetensors import safe_open
        with safe_open(self.st, framework="numpy") as f:
            f.get_tensor(self.first)


def _main() -> None:
    import timeit
    bench = HfqmOpen()
    bench.setup()
    try:
        for name in sorted(n for n in dir(bench) if n.startswith("time_")):
            fn = getattr(bench, name)
            number = 200
            best = min(timeit.repeat(fn, number=number, repeat=7)) / number
            print(f"{name:50s} {best * 1e6:10.1f} us")
    finally:
        bench.teardown()


if __name__ == "__main__":
    _main()
