"""Small HFQM files for the container and CLI tests (no codec dependency)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from pagedkv.errors import InvalidArgument, InvalidArgumentType

MINIMAL_METADATA = {"architecture": "llama", "config": {"model_type": "llama"}}
MINIMAL_SHA256 = "ee181b53e6078fd7f68a4f855db3960df8701d0912eb3ba4fd4233ee3f66250b"
MINIMAL_QUANTIZATION_HASH = "43f356738983a9fd"


def hfq4g256_ramp_group() -> np.ndarray:
    """HFQ4G256 of x[i] = (i - 128)/64 (docs/contracts/hfqm-and-quant.md, '5.2 Ramp group per
    format', sha256[:16] 9b951e76fb1696b7), in f32
    steps as docs/contracts/hfqm-and-quant.md, '4.1 HFQ generic affine v1' says; kept here so the
    container tests need no codec."""
    x = (np.arange(256, dtype=np.float32) - np.float32(128)) / np.float32(64)
    mn = x.min()
    scale = np.float32((x.max() - mn) / np.float32(15))
    inv = np.float32(1) / scale
    q = np.minimum(15, np.floor((x - mn) * inv + np.float32(0.5))).astype(np.uint8)
    packed = (q[0::2] | (q[1::2] << 4)).astype(np.uint8)
    return np.concatenate([np.frombuffer(np.float32(scale).tobytes() + mn.tobytes(), np.uint8),
                           packed])


def write_minimal(path, arch_id=0, **writer_kwargs) -> None:
    """The docs/contracts/hfqm-and-quant.md, '5.4 Minimal HFQM v1 file (layout verified, hashes
    derived)' minimal file (``arch_id=21`` makes it an MTP head)."""
    from pagedkv.hfqm import HfqmWriter
    with HfqmWriter(path, arch_id=arch_id, metadata=MINIMAL_METADATA, **writer_kwargs) as w:
        w.add("a.weight", "hfq4g256", [1, 256], hfq4g256_ramp_group())
        w.add("a.norm", "f16", [4], np.array([1, 2, 3, 4], dtype=np.float16))


def write_mixed(path, **writer_kwargs) -> dict[str, np.ndarray]:
    """A file with every raw qt, odd payload offsets and a P2 qt; returns the arrays."""
    from pagedkv.hfqm import HfqmWriter
    rng = np.random.default_rng(7)
    tensors = {
        "model.language_model.embed_tokens.weight": ("q8f16", [1, 32],
                                                     rng.integers(0, 256, 34, dtype=np.uint8)),
        "model.layers.0.input_layernorm.weight": ("f32", [3],
                                                  np.array([1.5, -2, 3], np.float32)),
        "model.layers.0.mlp.up_proj.weight": ("mq4g256v2", [2, 256],
                                              rng.integers(0, 256, 272, dtype=np.uint8)),
        "lm_head.weight": ("bf16", [2, 3], np.arange(6, dtype=np.uint16) + 0x3F80),
        "tid2eid": ("tidi32", [4], np.arange(4, dtype=np.uint32) * 7),
        "model.layers.0.self_attn.q_proj.weight": ("hfp4g32", [1, 32],
                                                   rng.integers(0, 256, 33, dtype=np.uint8)),
        "h.norm": ("f16", [2, 2], np.array([[1, -1], [0.5, 65504]], np.float16)),
    }
    with HfqmWriter(path, arch_id=7, metadata={"architecture": "qwen2", "tokenizer": "{\"x\": \"é\"}",
                                               "config": {"model_type": "qwen2"}},
                    **writer_kwargs) as w:
        for name, (qt, shape, data) in tensors.items():
            w.add(name, qt, shape, data)
    return {name: data for name, (qt, shape, data) in tensors.items()}


def write_odd_summary(path) -> dict:
    """A file whose metadata summary needs care (inspect): summarised values that are lists
    of non-strings, deep objects, long lists and strings, a lone surrogate, a tab, and a
    stored quantization hash. Returns its config."""
    from pagedkv.hfqm import HfqmWriter
    nested: dict = {"a": 1}
    for _ in range(500):
        nested = {"x": nested}
    config = {"model_type": ["llama", 2], "hidden_size": [1, 2.5, None, True],
              "num_hidden_layers": nested, "vocab_size": list(range(100)),
              "rope_theta": "\ud800lone surrogate", "head_dim": "tab\there",
              "max_position_embeddings": "x" * 1000,
              "text_config": {"num_attention_heads": 8}}
    metadata = {"architecture": [[1]], "config": config, "parameter_counts": {"total_params": 7},
                "source": "gguf", "extra": None}
    with HfqmWriter(path, arch_id=0, metadata=metadata, add_quantization_hash=True) as w:
        w.add("n", "f16", [1], np.ones(1, np.float16))
    return config


def safetensors_bytes(tensors: dict[str, tuple[str, tuple[int, ...], bytes]],
                      metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors file written by hand (the NumPy backend cannot write BF16): ``tensors``
    maps a name to (dtype, shape, raw bytes), laid out in order."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    blobs, offset = [], 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + b"".join(blobs)


def check_row_index(read, name: str, want: np.ndarray, int_row) -> None:
    """The row-index contract the model sources' ``read(tensor, (rows,))`` share
    (``pagedkv.argument_checks.row_span``), for ``read`` bound to one tensor named
    ``name`` holding ``want``: ``int_row(want, r)`` is what an int row ``r`` gives."""
    n = want.shape[0]
    for row in (0, n - 1, -1, -n):
        np.testing.assert_array_equal(read((row,)), int_row(want, row))
    np.testing.assert_array_equal(read((slice(n - 3, n + 50),)), want[n - 3:])
    assert read((slice(5, 2),)).shape == (0, *want.shape[1:])
    for row in (n, -n - 1, 10**6):
        with pytest.raises(InvalidArgument, match=rf"row {row} of '{name}' is out of "
                                                  rf"range: the tensor has {n} rows"):
            read((row,))
    with pytest.raises(InvalidArgument, match="has step 2; only contiguous rows"):
        read((slice(0, 10, 2),))
    with pytest.raises(InvalidArgumentType, match="must be an int or a slice, got float"):
        read((1.0,))
