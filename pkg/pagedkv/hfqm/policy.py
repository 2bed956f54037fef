"""Quantizer tensor policy (docs/contracts/hfqm-and-quant.md, '2.9 Quantizer tensor policy'): which
qt each source tensor gets.

* ``mtp.*`` and (unless asked) ``model.visual.*`` are skipped; integer and bool
  buffers are left out; both are listed in the conversion summary. F64 tensors are
  floating-point tensors like F32/F16/BF16 (read as float32).
* Norms and biases (case-insensitive), every 1-D tensor and names without
  ``weight`` stay F16.
* Embeddings, ``lm_head`` and MoE routers are Q8F16 under every MQ/HFQ recipe.
* Stacked experts ``…mlp.experts.gate_up_proj`` [E, 2I, H] / ``…down_proj`` [E, H, I]
  become E 2-D tensors ``…mlp.experts.{e}.gate_up_proj.weight``.
* A K (last dim) not divisible by 256 takes the G128/G256 fallback of the table below.
* With ``promote`` (hipfire's K-map, full mode; off unless asked for), the
  first and last two layers' FFN weights (every weight of those layers on MoE
  models) and every routed expert are stored at 6 bits: :data:`PROMOTE_6BIT`.
  docs/formats/hfqm.md, "Edge-layer 6-bit promotion".
"""

from __future__ import annotations

import re
from typing import NamedTuple

from pagedkv.errors import InvalidArgument
from pagedkv.hfqm.arch import is_qwen35_metadata
from pagedkv.quant.qtypes import QuantType, qtype

__all__ = [
    "BUFFER_DTYPES",
    "FLOAT_DTYPES",
    "FORMAT_ALIASES",
    "K_FALLBACK",
    "PROMOTE_6BIT",
    "TensorPlan",
    "default_format",
    "layer_index",
    "plan_tensor",
    "promoted",
    "resolve_format",
]

#: ``--format`` short names (docs/contracts/hfqm-and-quant.md, '2.9 Quantizer tensor policy'); any
# lower-case qt name is accepted too.
FORMAT_ALIASES: dict[str, int] = {"mq4": 44, "mq6": 15, "mq6v2": 47, "hf4": 6, "hf6": 8, "q8": 3}

#: qt used instead when K % 256 != 0 (upstream for 13, 14, 15; pagedkv's choice for the
#: rest). Formats not listed (HFQ v1, Q8F16) let groups straddle rows.
K_FALLBACK: dict[int, int] = {
    13: 7, 44: 7, 45: 7,          # MQ4 v1 / V2 / MQ4C -> HFQ4G128
    15: 8, 47: 8, 31: 8, 48: 8,   # MQ6 / MQ6V2 / MQ5 / MQ5V2 -> HFQ6G256
    14: 3,                        # MQ8 -> Q8F16
    17: 12, 49: 12,               # MQ3 / MQ3V2 -> HFQ3G128
    18: 10, 50: 10,               # MQ2 / MQ2V2 -> HFQ2G128
    4: 7,                         # Q4K (GGML Q4_K: whole super-blocks per row) -> HFQ4G128
}

#: 6-bit qt a promoted weight gets, per base qt (hipfire's ``default_promote_target``:
#: MQ v1/MQ4V2/MQ4C/Lloyd -> MQ6G256, the other V2 -> MQ6G256V2, HFQ -> HFQ6G256). Bases not
#: listed (Q8F16, Q4K, raw types) are not promoted.
PROMOTE_6BIT: dict[int, int] = {
    13: 15, 15: 15, 17: 15, 18: 15, 31: 15, 44: 15, 45: 15, 19: 15, 20: 15, 30: 15,
    47: 47, 48: 47, 49: 47, 50: 47,
    6: 8, 7: 8, 8: 8, 9: 8, 10: 8, 11: 8, 12: 8,
}

#: Source dtypes (safetensors names; a GGUF source reports F32/F16/BF16) quantized as
#: floating-point tensors; F64 is read as float32, as the GGUF path reads GGUF F64.
FLOAT_DTYPES = frozenset({"F32", "F16", "BF16", "F64"})
#: Integer and bool buffers (e.g. BERT's position_ids): left out and listed, as the
# tensor policy says. A source refuses any dtype in neither set.
BUFFER_DTYPES = frozenset({"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64"})

_F16, _Q8F16 = 1, 3
_LAYER = re.compile(r"(?:layers|blk)\.(\d+)\.")
_RAW_TARGETS = frozenset({1, 2, 16})
_EXPERTS = re.compile(r"^(?P<prefix>.*mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


class TensorPlan(NamedTuple):
    """What happens to one (part of a) source tensor. ``qt`` is None for a skipped
    tensor; ``expert`` selects one expert of a stacked tensor; ``role`` is the
    tensor class the conversion summary groups errors by."""

    name: str
    source: str
    shape: tuple[int, ...]
    qt: int | None
    role: str
    reason: str
    expert: int | None = None


def resolve_format(fmt: str) -> QuantType:
    """``mq4``/``mq6``/``mq6v2``/``hf4``/``hf6``/``q8`` or a lower-case qt name -> its qt."""
    key = fmt.lower()
    if key in FORMAT_ALIASES:
        return qtype(FORMAT_ALIASES[key])
    try:
        row = qtype(key)
    except InvalidArgument:
        raise InvalidArgument(
            f"--format {fmt!r} is not a format: use one of {', '.join(FORMAT_ALIASES)} or a "
            "lower-case qt name such as hfq4g256 or mq4g256v2") from None
    if not row.decodable:
        raise InvalidArgument(f"--format {fmt!r}: {row.name} is registered but pagedkv does "
                              f"not encode it (status {row.status})")
    from pagedkv.quant.formats import CODECS, GL
    codec = CODECS.get(row.id)
    if codec is None:
        # TidI32 (qt 22) is decodable (read raw as u32) but is a routing table, not a
        # weight format: no codec quantizes into it.
        raise InvalidArgument(f"--format {fmt!r}: {row.name} is not a weight format (pagedkv "
                              "reads it raw and has no codec that writes it)")
    if not codec.encodes:
        raise InvalidArgument(f"--format {fmt!r}: pagedkv does not encode {row.name}, it only "
                              "decodes it (docs/formats/quant.md, 'P2 formats')")
    if codec.kind == GL:
        # GL stores every group's indices before every scale, and convert writes a tensor
        # in blocks of rows: its payload cannot be streamed that way.
        raise InvalidArgument(f"--format {fmt!r}: {row.name} is not a convert target (its "
                              "scales follow the whole tensor's indices, convert streams row "
                              "blocks); quantize it with pagedkv.quant.quantize")
    return row


def default_format(config: dict) -> str:
    """``mq4`` for Qwen3.5+ models (MQ helps only there), ``hf4`` otherwise."""
    return "mq4" if is_qwen35_metadata({"config": config}) else "hf4"


def _role(lower: str) -> str:
    if "embed" in lower or "wte" in lower:
        return "embedding"
    if "lm_head" in lower:
        return "lm_head"
    if lower.endswith("mlp.gate.weight") or "shared_expert_gate" in lower:
        return "router"
    if "experts" in lower:
        return "expert"
    if "attn" in lower or "attention" in lower:
        return "attention"
    if "mlp" in lower or "ffn" in lower or "feed_forward" in lower:
        return "mlp"
    return "other"


def _weight_qt(target: QuantType, shape: tuple[int, ...], role: str) -> tuple[int, str]:
    is_mq_hfq = target.id not in _RAW_TARGETS and target.id != _Q8F16
    if role in ("embedding", "lm_head", "router") and is_mq_hfq:
        return _Q8F16, f"{role}: Q8F16 under every MQ/HFQ recipe"
    k = shape[-1]
    if k % 256 != 0 and target.id in K_FALLBACK:
        fallback = K_FALLBACK[target.id]
        return fallback, f"K={k} not a multiple of 256: {qtype(fallback).name}"
    return target.id, target.name


def layer_index(name: str) -> int | None:
    """Decoder layer of a tensor name (``…layers.N.…`` or GGUF ``blk.N.…``), else None."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def promoted(name: str, n_layers: int, is_moe: bool) -> bool:
    """hipfire's K-map full mode for a quantized weight: routed experts of a MoE model,
    and the first/last two layers (``idx < 2`` or ``idx >= n_layers - 2``) — all their
    weights on MoE models, only the FFN (``mlp.``/``ffn``) on dense ones."""
    if is_moe and "mlp.experts." in name:
        return True
    idx = layer_index(name)
    if n_layers <= 0 or idx is None or not (idx < 2 or idx >= max(n_layers - 2, 0)):
        return False
    return is_moe or "mlp." in name or "ffn" in name


def plan_tensor(name: str, dtype: str, shape: tuple[int, ...], target: QuantType, *,
                include_visual: bool = False, promote: bool = False, n_layers: int = 0,
                is_moe: bool = False) -> list[TensorPlan]:
    """The output tensor(s) for one source tensor (several for stacked experts).
    ``promote`` applies the edge-layer/expert 6-bit promotion (``n_layers`` decoder
    layers; ``is_moe`` widens it as :func:`promoted` says)."""
    if promote and target.id in PROMOTE_6BIT:
        plans = plan_tensor(name, dtype, shape, target, include_visual=include_visual)
        return [_promote(p, n_layers, is_moe) for p in plans]
    lower = name.lower()
    if name.startswith("mtp.") or (name.startswith("model.visual.") and not include_visual):
        return [TensorPlan(name, name, shape, None, "skipped",
                           "MTP head" if name.startswith("mtp.") else "vision tower")]
    if dtype not in FLOAT_DTYPES:
        return [TensorPlan(name, name, shape, None, "skipped",
                           f"{dtype} buffer, not a floating-point weight")]
    experts = _EXPERTS.match(name)
    if experts and len(shape) == 3:
        out = []
        for e in range(shape[0]):
            out_name = f"{experts['prefix']}.{e}.{experts['proj']}.weight"
            qt, reason = _weight_qt(target, shape[1:], "expert")
            out.append(TensorPlan(out_name, name, shape[1:], qt, "expert", reason, e))
        return out
    if ("norm" in lower or "bias" in lower or len(shape) <= 1 or "weight" not in lower):
        role = "norm" if "norm" in lower else "bias" if "bias" in lower else "other-f16"
        return [TensorPlan(name, name, shape, _F16, role, "norm/bias/1-D: F16")]
    role = _role(lower)
    qt, reason = _weight_qt(target, shape, role)
    return [TensorPlan(name, name, shape, qt, role, reason)]


def _promote(p: TensorPlan, n_layers: int, is_moe: bool) -> TensorPlan:
    if p.qt is None or p.qt in (_F16, _Q8F16) or p.role in ("embedding", "lm_head", "router"):
        return p
    # hipfire promotes only where K % 256 == 0; elsewhere the K fallback stands.
    if not p.shape or p.shape[-1] % 256 or not promoted(p.name, n_layers, is_moe):
        return p
    six = PROMOTE_6BIT.get(p.qt)
    if six is None:
        return p
    return p._replace(qt=six, reason=f"edge layer/expert: promoted to {qtype(six).name}")
