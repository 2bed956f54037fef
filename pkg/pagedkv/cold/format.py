"""Cold-object key format: namespace, ABI and the domain tags (docs/contracts/cold-tier.md, '3.1
Format and namespace')."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import InvalidArgument, InvalidArgumentType

__all__ = [
    "DEFAULT_FORMAT",
    "MARKER_DOWNLOAD",
    "MARKER_FULL_DIGEST",
    "MARKER_HFQM",
    "MARKER_INDEX_JSON",
    "MARKER_MANIFEST",
    "UPSTREAM_KEY_FORMAT",
    "ColdFormat",
]

# Literal, un-namespaced markers of the weight identity (docs/contracts/cold-tier.md, '3.1 Format
# and namespace' and '4.3 Weight identity').
MARKER_MANIFEST = b"cold-identity:manifest:v1\0"
MARKER_FULL_DIGEST = b"cold-identity:full-digest:v1\0"
MARKER_HFQM = b"cold-identity:hfqm:v1\0"
MARKER_DOWNLOAD = b"download-marker\0"
MARKER_INDEX_JSON = b"index.json\0"


@dataclass(frozen=True)
class ColdFormat:
    """Namespace and ABI of cold objects.

    ``namespace`` prefixes every domain tag, so two namespaces never share a key;
    ``abi`` is written into every object's metadata and checked on decode.
    """

    namespace: str = "pagedkv:"
    abi: str = "pagedkv-v1"

    def __post_init__(self) -> None:
        for field, value, limit in (("namespace", self.namespace, 64), ("abi", self.abi, 64)):
            if not isinstance(value, str):
                raise InvalidArgumentType(
                    f"ColdFormat.{field} must be a str, got {type(value).__name__}")
            if not 1 <= len(value) <= limit or not all(0x20 <= ord(c) < 0x7F for c in value):
                raise InvalidArgument(
                    f"ColdFormat.{field} = {value!r}: need 1-{limit} printable ASCII characters")

    def tag(self, name: str) -> bytes:
        """``namespace + name + ":v1\\0"`` as ASCII: the domain separator of one hash use."""
        return (self.namespace + name + ":v1\0").encode("ascii")


#: What production writes.
DEFAULT_FORMAT = ColdFormat()

#: mlx-node's namespace, only to reproduce its golden key vectors (objects differ anyway).
UPSTREAM_KEY_FORMAT = ColdFormat("mlx-node:", "mlx-paged-v1")
