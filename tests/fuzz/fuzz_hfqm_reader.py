"""Fuzz target: the HFQM reader (``pagedkv.hfqm.HfqmFile``) on arbitrary bytes.

Each input is written to a file and opened twice, mapped and through the plain-read
path of files above the mapping limit; everything the reader offers is exercised
(header fields, index, metadata, every tensor as a view, a typed array and, where
small, decoded; the MTP head) and the two paths must agree exactly. Expected: a
``FormatError`` (the file is broken), the same one on both paths. Anything else,
or any disagreement, is a finding.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np
from runner import Scratch

from pagedkv.errors import FormatError
from pagedkv.hfqm import HfqmFile

_SCRATCH = Scratch("hfqm_reader")
# Decode only tensors this small: the point is the argument paths, not the codecs' speed.
_DECODE_MAX_BYTES = 1 << 16


def _outcome(call) -> tuple:
    """("ok", value) or ("error", class name, message) for an expected FormatError."""
    try:
        return ("ok", call())
    except FormatError as exc:
        return ("error", type(exc).__name__, str(exc))


def _digest(array: np.ndarray) -> tuple:
    return (array.dtype.str, array.shape, hashlib.sha1(array.tobytes()).hexdigest())


def _tensor(f: HfqmFile, i: int) -> tuple:
    info = f.tensors[i]
    raw = f.raw(i)
    assert raw.dtype == np.uint8 and raw.size == info.nbytes and not raw.flags.writeable
    assert info.offset + info.nbytes <= f.file_bytes
    typed = f[info.name]
    assert not typed.flags.writeable
    decoded = _outcome(lambda: _digest(f.dequantize(i))) if info.nbytes <= _DECODE_MAX_BYTES \
        else None
    return (info, _digest(raw), _digest(typed), decoded)


def _everything(f: HfqmFile, depth: int = 0) -> tuple:
    header = (f.version, f.arch_id, f.arch_name, f.metadata_offset, f.metadata_bytes,
              f.data_offset, f.index_bytes, f.payload_bytes, len(f), repr(f))
    tensors = [_tensor(f, i) for i in range(len(f))]
    for name in f.names:                       # lookups by name and alias agree
        assert f.info(name) == f.info(f.names.index(name))
    # (not repr: metadata may nest as deep as the JSON parser allows, repr would recurse)
    metadata = _outcome(lambda: (type(f.metadata).__name__, sorted(f.metadata)))
    mtp = _outcome(lambda: f.mtp)
    if mtp[0] == "ok" and mtp[1] is not None:
        assert depth == 0, "a head never has a head"
        mtp = ("ok", _everything(mtp[1], depth + 1))
    return (header, tensors, metadata, mtp)


def _open(path, **kwargs) -> tuple:
    try:
        f = HfqmFile(path, **kwargs)
    except FormatError as exc:
        return ("error", type(exc).__name__, str(exc))
    with f:
        return ("ok", _everything(f))


def one_input(data: bytes) -> None:
    path = _SCRATCH.write("x.hfq", data)
    mapped = _open(path)
    read = _open(path, _whole_file_mmap_limit_bytes=0)
    if mapped != read:
        raise AssertionError(f"mapped and read paths disagree:\n  {mapped!r}\n  {read!r}")


def seeds() -> Iterable[tuple[str, bytes]]:
    """Files written by pagedkv: every codec, odd payload offsets, raw and P2 qts,
    a bundle, streaming (data_offset past the formula) and empty files."""
    import pagedkv.quant as Q
    from pagedkv.hfqm import HfqmWriter, write_mtp_bundle
    work = Scratch("hfqm_reader_seeds")
    rng = np.random.default_rng(10)
    out: list[tuple[str, bytes]] = []

    def write(label: str, arch_id: int, metadata, tensors, **kwargs) -> None:
        path = work.path / f"{label}.hfq"
        with HfqmWriter(path, arch_id=arch_id, metadata=metadata, **kwargs) as w:
            for name, qt, shape, payload in tensors:
                w.add(name, qt, shape, payload)
        out.append((label, path.read_bytes()))

    meta = {"architecture": "llama", "config": {"model_type": "llama", "hidden_size": 256,
                                                "num_hidden_layers": 1}}
    w = rng.standard_normal((2, 256)).astype(np.float32)
    codecs = [(f"t.{c.name}", c.name, [2, 256], Q.quantize(w, c.name))
              for c in sorted(Q.CODECS.values(), key=lambda c: c.qt.id)
              if c.qt.id != 50 and c.encodes]   # MQ2G256V2 warns on encode
    write("codecs", 0, meta, codecs, add_quantization_hash=True)
    write("odd_offsets", 7, {"architecture": "qwen2", "tokenizer": '{"é": 1}'}, [
        ("model.language_model.embed_tokens.weight", "q8f16", [1, 32],
         rng.integers(0, 256, 34, dtype=np.uint8)),
        ("b", "bf16", [2, 3], np.arange(6, dtype=np.uint16) + 0x3F80),
        ("tid", "tidi32", [4], np.arange(4, dtype=np.uint32)),
        ("p2", "hfp4g32", [1, 32], rng.integers(0, 256, 33, dtype=np.uint8)),
        ("n", "f32", [3], np.array([1.5, -2, 3], np.float32)),
    ])
    write("empty", 0, {}, [])
    write("streamed", 0, meta, [("a", "f16", [4], np.ones(4, np.float16))], buffer_bytes=0,
          index_reserve_bytes=100)
    write("head", 21, {"architecture": "qwen3_5_mtp"},
          [("enorm", "f32", [2], np.array([0.25, 4], np.float32))])
    write("qwen35", 5, {"architecture": "qwen3_5", "config": {"model_type": "qwen3_5"}},
          [("x", "mq4g256v2", [1, 256], Q.quantize(w[:1], "mq4g256v2"))])
    bundle = work.path / "bundle.hfq"
    write_mtp_bundle(work.path / "empty.hfq", work.path / "head.hfq", bundle)
    out.append(("bundle", bundle.read_bytes()))
    return out


if __name__ == "__main__":
    from runner import main
    main(one_input, seeds)
