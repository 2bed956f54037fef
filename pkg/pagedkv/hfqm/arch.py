"""HFQM ``arch_id`` values (docs/contracts/hfqm-and-quant.md, '2.5 arch_id') and the writer's
model_type mapping."""

from __future__ import annotations

import re

from pagedkv.errors import InvalidArgument, InvalidArgumentType

__all__ = ["ARCH_NAMES", "QWEN35_ARCH_IDS", "arch_id_for", "arch_name", "is_qwen35_metadata"]

#: Known arch ids. 2-4 are never assigned; forks reuse 15-19 with other meanings,
#: so those (and ids above 23 other than the sentinels) read as unknown.
ARCH_NAMES: dict[int, str] = {
    0: "LLaMA/Mistral dense",
    1: "Qwen3",
    5: "Qwen3.5/3.6/3.8 dense (DeltaNet hybrid)",
    6: "Qwen3.5/3.6/3.8 MoE",
    7: "Qwen2 dense",
    8: "dots.ocr",
    9: "DeepSeek V4 Flash",
    10: "MiniMax-M2",
    11: "LFM2.5(-MoE)",
    12: "Cohere2-MoE",
    13: "Gemma4",
    14: "Muse Glimmer",
    20: "DFlash draft sidecar",
    21: "Qwen3.5 MTP head",
    22: "Gemma4 EAGLE draft",
    23: "Muse Glimmer DFlash draft",
    0xFF: "toy/template",
    0xFFFFFFFF: "unclaimed",
}

# Ids the contract never assigns ('2.5 arch_id': "2-4 never assign"): the writer refuses them.
_NEVER_ASSIGNED = frozenset({2, 3, 4})

#: Writer mapping of HF ``config.model_type`` to arch_id (pagedkv maps qwen2 to 7).
_MODEL_TYPE_ARCH: dict[str, int] = {
    "llama": 0, "mistral": 0, "qwen3": 1,
    "qwen3_5": 5, "qwen3_5_text": 5, "qwen3_5_moe": 6, "qwen3_5_moe_text": 6,
    "qwen2": 7,
}

# An integer arch_id given as text: decimal (leading zeros allowed) or 0x-hex, ASCII only.
_INTEGER_TEXT = re.compile(r"-?(?:0[xX][0-9a-fA-F]+|[0-9]+)")

#: Metadata naming Qwen3.5/3.6 is only valid with these arch ids (docs/contracts/hfqm-and-quant.md,
# '2.4 Reader validation' rule 6).
QWEN35_ARCH_IDS = frozenset({5, 6})


def arch_name(arch_id: int) -> str:
    """Human name of ``arch_id``, or ``"unknown"``."""
    return ARCH_NAMES.get(int(arch_id), "unknown")


def _known_ids() -> str:
    """The known arch ids as ranges: ``0, 1, 5-14, 20-23, 255, 4294967295``."""
    runs: list[list[int]] = []
    for i in sorted(ARCH_NAMES):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def arch_id_for(arch: str | int) -> int:
    """arch_id for an architecture name (HF ``model_type``) or an integer id (``"7"`` too).

    Unknown names and the never-assigned ids 2-4 raise
    :class:`~pagedkv.errors.InvalidArgument`: pass a known id.
    """
    if isinstance(arch, bool) or not isinstance(arch, (str, int)):
        raise InvalidArgumentType(f"arch must be a name or an int, got {type(arch).__name__}")
    if isinstance(arch, str) and _INTEGER_TEXT.fullmatch(arch.strip()):
        text = arch.strip()
        arch = int(text, 16) if text.lower().startswith(("0x", "-0x")) else int(text, 10)
    if isinstance(arch, int):
        if not 0 <= arch <= 0xFFFFFFFF:
            raise InvalidArgument(f"arch_id {arch} is outside the u32 range 0..4294967295")
        if arch in _NEVER_ASSIGNED:
            raise InvalidArgument(
                f"arch_id {arch} is never assigned (2-4 are reserved: "
                f"docs/contracts/hfqm-and-quant.md, '2.5 arch_id'); known arch ids: "
                f"{_known_ids()}, or a name: {', '.join(sorted(_MODEL_TYPE_ARCH))}")
        return arch
    arch_id = _MODEL_TYPE_ARCH.get(arch.lower())
    if arch_id is None:
        raise InvalidArgument(
            f"architecture {arch!r} has no arch_id mapping; known: "
            f"{', '.join(sorted(_MODEL_TYPE_ARCH))}; pass an integer arch_id (--arch N)")
    return arch_id


def _is_qwen35_name(value: object) -> bool:
    return isinstance(value, str) and value.lower().replace(".", "_").startswith(
        ("qwen3_5", "qwen3_6", "qwen3_8", "qwen3_5moe"))


def is_qwen35_metadata(metadata: dict) -> bool:
    """True where ``architecture``, ``config.model_type`` or ``config.architectures[]``
    names Qwen3.5/3.6 (HF class names like ``Qwen3_5ForCausalLM`` included)."""
    config = metadata.get("config")
    names: list[object] = [metadata.get("architecture")]
    if isinstance(config, dict):
        names.append(config.get("model_type"))
        archs = config.get("architectures")
        if isinstance(archs, list):
            names.extend(archs)
    return any(_is_qwen35_name(n) for n in names)
