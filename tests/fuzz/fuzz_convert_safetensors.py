"""Fuzz target: ``pagedkv convert`` on an arbitrary ``model.safetensors`` (the JSON side
files stay valid). The first input byte picks the output format; the rest is the shard.

Expected: exit 0 and an HFQM file the reader opens, or exit 1 with one error line and
no output file (tests/fuzz/convert_model.py, ``run_convert``). Anything else, a
traceback above all (the safetensors loader's SafetensorError), is a finding.
"""

from __future__ import annotations

from collections.abc import Iterable

from convert_model import model_tensors, run_convert, write_model
from runner import Scratch

_SCRATCH = Scratch("convert_safetensors")
FORMATS = ("hf4", "mq4", "q8", "mq6", "hfq2g128", "f16", "mq4cg256", "hf6")


def one_input(data: bytes) -> None:
    if not data:
        return
    root = _SCRATCH.path / "model"
    write_model(root, shard=data[1:])
    run_convert(root, _SCRATCH.path / "out.hfq", FORMATS[data[0] % len(FORMATS)])


def seeds() -> Iterable[tuple[str, bytes]]:
    """The model's shard (every format), one tensor per dtype the loader knows, a
    ``__metadata__`` block and an empty shard."""
    from hfqm_samples import safetensors_bytes  # tests/: on sys.path once runner is imported
    out = [(f"model_{fmt}", bytes([i]) + safetensors_bytes(model_tensors()))
           for i, fmt in enumerate(FORMATS)]
    one_each = {f"t.{dtype.lower()}.weight": (dtype, (2, 4), bytes(2 * 4 * bits // 8))
                for dtype, bits in (("F32", 32), ("F16", 16), ("BF16", 16), ("I8", 8),
                                    ("U8", 8), ("BOOL", 8), ("F64", 64), ("F8_E4M3", 8),
                                    ("F4", 4), ("C64", 64))}
    out.append(("dtypes", b"\0" + safetensors_bytes(one_each, {"format": "pt"})))
    out.append(("empty", b"\0" + safetensors_bytes({})))
    return out


if __name__ == "__main__":
    from runner import main
    main(one_input, seeds)
