"""Fuzz target: ``pagedkv convert`` with an arbitrary JSON side file. The first input byte
picks the file (config.json, tokenizer.json, tokenizer_config.json,
generation_config.json); the rest is its bytes; the shard and the other files stay valid.

Expected: exit 0 and an HFQM file the reader opens, or exit 1 with one error line naming
the file and no output file. Anything else is a finding.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from convert_model import (
    CONFIG,
    GENERATION_CONFIG,
    SIDE_FILES,
    TOKENIZER,
    TOKENIZER_CONFIG,
    run_convert,
    write_model,
)
from runner import Scratch

_SCRATCH = Scratch("convert_json")


def one_input(data: bytes) -> None:
    if not data:
        return
    root = _SCRATCH.path / "model"
    name = SIDE_FILES[data[0] % len(SIDE_FILES)]
    write_model(root, side={name: data[1:]})
    run_convert(root, _SCRATCH.path / "out.hfq", "hf4")


def seeds() -> Iterable[tuple[str, bytes]]:
    """Each side file as convert expects it, plus shapes of JSON loaders trip on: Qwen3.5
    configs (text_config, arch mapping), escapes, a BOM, numbers at the float64 edge."""
    out = []
    for i, (name, value) in enumerate(zip(SIDE_FILES, (CONFIG, TOKENIZER, TOKENIZER_CONFIG,
                                                       GENERATION_CONFIG), strict=True)):
        out.append((name, bytes([i]) + json.dumps(value, ensure_ascii=False).encode()))
    qwen = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForCausalLM"],
            "text_config": {"hidden_size": 256, "layer_types": ["full_attention"]}}
    out.append(("qwen35_config", b"\0" + json.dumps(qwen).encode()))
    out.append(("escapes", b"\0" + b'{"model_type": "llama", "n": "\\ud800\\u00e9\\n", '
                                   b'"x": [1e308, -0.0, 12345678901234567890]}'))
    out.append(("bom_tokenizer", b"\1" + "\ufeff".encode() + json.dumps(TOKENIZER).encode()))
    out.append(("null_generation", b"\3null"))
    return out


if __name__ == "__main__":
    from runner import main
    main(one_input, seeds)
