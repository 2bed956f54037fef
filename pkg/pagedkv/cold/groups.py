"""Cold groups: which chain a key belongs to, and the file-name label (docs/contracts/cold-tier.md,
'13.1 Groups and layouts')."""

from __future__ import annotations

import enum

__all__ = ["ColdGroup"]


class ColdGroup(enum.Enum):
    """A cold key's domain. The value is ``(label, tag name)``.

    Hashing the group into the key (vLLM's ``BlockHashWithGroupId`` idea) keeps a
    sidecar and a KV block over identical tokens from ever sharing a name.
    """

    KV = ("kv", "cold-prefix-block")
    GDN_STATE = ("gdn_state", "cold-sidecar-gdn-state")
    SLIDING_WINDOW = ("sliding_window", "cold-sidecar-sliding-window")
    CONV_STATE = ("conv_state", "cold-sidecar-conv-state")

    @property
    def label(self) -> str:
        """File-name infix of a sidecar (``kv`` is never an infix)."""
        return self.value[0]

    @property
    def tag_name(self) -> str:
        return self.value[1]

    @classmethod
    def from_label(cls, label: str) -> ColdGroup:
        for g in cls:
            if g.label == label:
                return g
        raise KeyError(label)

    def __repr__(self) -> str:
        return f"ColdGroup.{self.name}"
