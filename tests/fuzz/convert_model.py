"""The small safetensors model both convert targets start from, and how they run
``pagedkv convert`` on it (a helper module of the fuzz targets, not a target)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CONFIG = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 1,
          "architectures": ["LlamaForCausalLM"]}
TOKENIZER = {"model": {"type": "BPE", "vocab": {"a": 0, "é": 1}}, "added_tokens": []}
TOKENIZER_CONFIG = {"chat_template": [{"name": "default", "template": "{{ x }}"}]}
GENERATION_CONFIG = {"eos_token_id": 2}
SIDE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json")


def model_tensors(seed: int = 0) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """One tensor per policy path: a matrix, a norm, an embedding, a BF16 weight with
    K % 256 != 0, stacked experts and an integer buffer (left out)."""
    rng = np.random.default_rng(seed)

    def f32(*shape):
        return rng.standard_normal(shape).astype("<f4")
    bf16 = (f32(2, 384).view("<u4") >> 16).astype("<u2")
    return {
        "model.embed_tokens.weight": ("F16", (4, 256), f32(4, 256).astype("<f2").tobytes()),
        "model.layers.0.input_layernorm.weight": ("F32", (256,), f32(256).tobytes()),
        "model.layers.0.self_attn.q_proj.weight": ("F32", (2, 256), f32(2, 256).tobytes()),
        "model.layers.0.mlp.down_proj.weight": ("BF16", (2, 384), bf16.tobytes()),
        "model.layers.0.mlp.experts.gate_up_proj": ("F32", (2, 2, 256),
                                                    f32(2, 2, 256).tobytes()),
        "model.embeddings.position_ids": ("I64", (2,), np.arange(2, dtype="<i8").tobytes()),
    }


def write_model(root: Path, shard: bytes | None = None,
                side: dict[str, bytes] | None = None) -> None:
    """The model in ``root``: ``shard`` as model.safetensors (default: the model's), the
    four JSON side files (``side`` replaces any of them by name). Files that already
    hold the wanted bytes are not rewritten (a fuzz input changes one file)."""
    root.mkdir(parents=True, exist_ok=True)
    files = {"config.json": CONFIG, "tokenizer.json": TOKENIZER,
             "tokenizer_config.json": TOKENIZER_CONFIG,
             "generation_config.json": GENERATION_CONFIG}
    wanted = {"model.safetensors": shard if shard is not None else _default_shard()}
    for name, value in files.items():
        data = (side or {}).get(name)
        wanted[name] = data if data is not None else _default_json(name, value)
    for name, data in wanted.items():
        path = root / name
        if _written.get(path) != data:
            path.write_bytes(data)
            _written[path] = data


_written: dict[Path, bytes] = {}


def _default_shard() -> bytes:
    from hfqm_samples import safetensors_bytes  # tests/: on sys.path once runner is imported
    if "shard" not in _defaults:
        _defaults["shard"] = safetensors_bytes(model_tensors())
    return _defaults["shard"]


def _default_json(name: str, value: dict) -> bytes:
    if name not in _defaults:
        _defaults[name] = json.dumps(value, ensure_ascii=False).encode()
    return _defaults[name]


_defaults: dict[str, bytes] = {}


def run_convert(root: Path, out: Path, fmt: str) -> None:
    """``pagedkv convert`` in-process. Raises AssertionError unless it either wrote a file
    that opens (exit 0) or failed with exactly one error line and no output file (1)."""
    from runner import run_cli

    from pagedkv.errors import FormatError
    from pagedkv.hfqm import HfqmFile
    status, stdout, err = run_cli(["convert", str(root), "-o", str(out), "--format", fmt,
                                   "--no-progress"])
    leftovers = [p.name for p in out.parent.iterdir() if p.name.endswith(".tmp")]
    if leftovers:
        raise AssertionError(f"exit {status} left temporary files behind: {leftovers}")
    if status == 1:
        lines = err.splitlines()
        if (stdout or len(lines) != 1 or not lines[0].startswith("pagedkv convert: error: ")
                or out.exists()):
            raise AssertionError(f"exit 1 without one error line: stderr {err[:500]!r}, "
                                 f"output written: {out.exists()}")
        return
    if status != 0 or err or not stdout.startswith(f"wrote {out}"):
        raise AssertionError(f"exit {status}, stderr {err[:500]!r}")
    try:
        with HfqmFile(out) as f:
            f.metadata  # noqa: B018 (what convert wrote must read back)
    except FormatError as exc:
        raise AssertionError(f"convert wrote a file its reader refuses: {exc}") from exc
    out.unlink()
