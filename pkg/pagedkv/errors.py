"""Every exception of pagedkv (docs/contracts/paged-kv.md, '1.2 Errors').

One module holds the allocator's, the pool's, the cold tier's, the HFQM
reader's and the kernels' exceptions, so callers catch classes, never match
message substrings. Malformed arguments raise :class:`InvalidArgument` (a
``ValueError``) or :class:`InvalidArgumentType` (a ``TypeError``); messages
name the argument, the value and the valid range or the fix.
"""

from __future__ import annotations

__all__ = [  # noqa: RUF022 (hierarchy order, as the classes below)
    "PagedKVError",
    "InvalidArgument",
    "InvalidArgumentType",
    "SidecarLayoutMismatch",
    "FormatError",
    "BadMagic",
    "UnsupportedVersion",
    "Truncated",
    "CountMismatch",
    "SizeMismatch",
    "UnknownQuantType",
    "UnsupportedQuantType",
    "CorruptPayload",
    "BadName",
    "BadMetadata",
    "BadBundle",
    "TensorNotFound",
    "ContextLengthExceeded",
    "CapacityExceeded",
    "PoolExhausted",
    "LookupAlreadyDone",
    "AuxStateUnconfirmed",
    "InvariantViolation",
    "TopologyError",
    "DuplicateLayer",
    "InvalidLayout",
    "MissingSharedKVAnchor",
    "SharedKVAnchorIsAlias",
    "SharedKVIncompatible",
    "ManagerCountMismatch",
    "NonContiguousGroupIds",
    "MissingLayerAssignment",
    "IncompatibleGroupLayer",
    "GroupManagerMismatch",
    "StaleBlockTable",
    "ColdTierClosed",
    "ColdBackendError",
    "ColdBackendAuthError",
    "ColdBackendTLSError",
    "RequestClosed",
    "UnsupportedModel",
    "NoDeviceError",
    "DeviceError",
]


class PagedKVError(RuntimeError):
    """Base of every pagedkv error."""


class InvalidArgument(PagedKVError, ValueError):
    """A malformed argument value: out-of-range id or size, NaN/Inf, wrong shape or ndim,
    an empty or over-long salt."""


class InvalidArgumentType(PagedKVError, TypeError):
    """An argument of the wrong type or dtype kind (float/bool/object tokens, a ``str``
    where a domain id is expected)."""


class SidecarLayoutMismatch(InvalidArgument):
    """Out-of-pool state (or a restored sidecar) whose dtype, shape or dims disagree with
    the layout its sidecar policy expects at that boundary (docs/cold.md, "Sidecars").
    Capture skips such state rather than mislabel it; install refuses it and leaves the
    target arrays as they were."""


# --- formats (docs/contracts/hfqm-and-quant.md, '2.4 Reader validation',
# docs/contracts/cold-tier.md, '6.6 Decoding') ---


class FormatError(PagedKVError, ValueError):
    """A file or buffer breaks its format. The message names the file, the tensor or
    field, and the byte offset."""

    def __init__(self, message: str, *, path: str | None = None, tensor: str | None = None,
                 offset: int | None = None) -> None:
        parts = []
        if path is not None:
            parts.append(str(path))
        if tensor is not None:
            parts.append(f"tensor {tensor!r}")
        if offset is not None:
            parts.append(f"offset {offset}")
        prefix = ": ".join([", ".join(parts)]) + ": " if parts else ""
        super().__init__(prefix + message)
        self.path = path
        self.tensor = tensor
        self.offset = offset


class BadMagic(FormatError):
    """The magic bytes are not the expected ones (e.g. ``HFQ!`` where ``HFQM`` is needed)."""


class UnsupportedVersion(FormatError):
    """A format version this build does not read (e.g. HFQM v2)."""


class Truncated(FormatError):
    """A field, index entry or payload extends past the end of the file or buffer."""


class CountMismatch(FormatError):
    """A declared count disagrees with what was found."""


class SizeMismatch(FormatError):
    """A payload size disagrees with what its type and shape require."""


class UnknownQuantType(FormatError):
    """A quant-type id that is not in the register."""


class UnsupportedQuantType(FormatError):
    """A registered quant type this build cannot decode."""


class CorruptPayload(FormatError):
    """A quantized payload of the right size whose bytes break its format (an FP4 row
    header that disagrees with the shape, a reserved scale byte)."""


class BadName(FormatError):
    """A tensor name that is not UTF-8, or is duplicated."""


class BadMetadata(FormatError):
    """Metadata JSON that is malformed, not an object, or inconsistent with the file."""


class BadBundle(FormatError):
    """A file that ends in an MTP bundle trailer (``HFBNDMTP`` + u64 offset) that does not
    point past the trunk, inside the file, at an HFQM section of the MTP arch."""


class TensorNotFound(PagedKVError, KeyError):
    """A tensor name (after aliasing) that the file does not hold. A ``KeyError``, so
    mapping-style code (``name in file``, ``file.get``) keeps working."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


# --- capacity ----------------------------------------------------------------------------


class ContextLengthExceeded(PagedKVError):
    """Umbrella for capacity failures; ``str(e)`` starts with ``context_length_exceeded:``."""

    _PREFIX = "context_length_exceeded: "

    def __init__(self, message: str = "") -> None:
        if not message.startswith(self._PREFIX):
            message = self._PREFIX + message
        super().__init__(message)


class CapacityExceeded(ContextLengthExceeded):
    """The request can never fit: more tokens than ``max_num_blocks * block_size``."""


class PoolExhausted(ContextLengthExceeded):
    """It would fit the max pool, but blocks are not available now (after grow and
    eviction). Schedulers preempt on this."""


# --- lifecycle and state -----------------------------------------------------------------


class LookupAlreadyDone(PagedKVError):
    """A second ``find_cached_prefix`` for one request."""


class AuxStateUnconfirmed(PagedKVError):
    """A write-side call while the aux latch is set (docs/contracts/paged-kv.md, '7.5 Aux
    latch')."""


class InvariantViolation(PagedKVError):
    """Double free, refcount underflow, freeing an in-range id that is not allocated,
    groups disagreeing, or a reserve failing after its preflight passed."""


class StaleBlockTable(PagedKVError):
    """A block table or DecodeBatch of another pool generation was passed in."""


class ColdTierClosed(PagedKVError):
    """A job was offered to a stopped cold writer."""


class ColdBackendError(PagedKVError):
    """The cold tier's remote backend (Redis/Valkey) cannot be opened: unreachable, the
    ``redis`` client missing (``pip install pagedkv[redis]``), or a refusal named by a
    subclass. Raised at open only; once open, a remote failure is a counted miss or write
    error, never an exception in inference."""


class ColdBackendAuthError(ColdBackendError):
    """The Redis/Valkey server refused the credentials (wrong or missing password/user)."""


class ColdBackendTLSError(ColdBackendError):
    """TLS does not match between the URL and the server: ``rediss://`` to a plain server,
    ``redis://`` to a TLS-only one, or a certificate the client does not trust."""


class RequestClosed(PagedKVError):
    """A call on an engine-integration request that already ended, was released, or whose
    caches were handed to a batch (e.g. ``PagedRequest.end`` twice)."""


class UnsupportedModel(PagedKVError, NotImplementedError):
    """A model with a layer kind this build cannot page yet. ``layer`` (index in the model's
    cache list), ``kind`` and ``missing`` (what would serve it) say which and why."""

    def __init__(self, message: str, *, layer: int | None = None, kind: str | None = None,
                 missing: str | None = None) -> None:
        super().__init__(message)
        self.layer = layer
        self.kind = kind
        self.missing = missing


# --- topology (docs/contracts/paged-kv.md, '8.2 Validation and errors') ---------------------------


class TopologyError(PagedKVError):
    """Invalid layer specs or group/manager wiring."""


class DuplicateLayer(TopologyError):
    def __init__(self, layer: int) -> None:
        super().__init__(f"layer {layer} appears more than once in the layer specs")
        self.layer = layer


class InvalidLayout(TopologyError):
    def __init__(self, layer: int) -> None:
        super().__init__(f"layer {layer} has an invalid KV layout")
        self.layer = layer


class MissingSharedKVAnchor(TopologyError):
    def __init__(self, layer: int, anchor: int) -> None:
        super().__init__(f"layer {layer} shares KV with layer {anchor}, which does not exist")
        self.layer = layer
        self.anchor = anchor


class SharedKVAnchorIsAlias(TopologyError):
    def __init__(self, layer: int, anchor: int, anchor_of_anchor: int) -> None:
        super().__init__(
            f"layer {layer} shares KV with layer {anchor}, which itself aliases layer "
            f"{anchor_of_anchor}: alias chains are not allowed; point it at {anchor_of_anchor}")
        self.layer = layer
        self.anchor = anchor
        self.anchor_of_anchor = anchor_of_anchor


class SharedKVIncompatible(TopologyError):
    def __init__(self, layer: int, anchor: int) -> None:
        super().__init__(
            f"layer {layer} shares KV with layer {anchor}, whose kind or layout differs")
        self.layer = layer
        self.anchor = anchor


class ManagerCountMismatch(TopologyError):
    def __init__(self, expected: int, actual: int) -> None:
        super().__init__(f"expected {expected} group managers, got {actual}")
        self.expected = expected
        self.actual = actual


class NonContiguousGroupIds(TopologyError):
    def __init__(self, message: str = "group ids must be 0..n-1 without gaps") -> None:
        super().__init__(message)


class MissingLayerAssignment(TopologyError):
    def __init__(self, layer: int) -> None:
        super().__init__(f"layer {layer} is not assigned to any group")
        self.layer = layer


class IncompatibleGroupLayer(TopologyError):
    def __init__(self, group: int, layer: int, reason: str = "") -> None:
        super().__init__(f"layer {layer} does not match the spec of group {group}"
                         + (f": {reason}" if reason else
                            ": its attention kind or physical layout differs"))
        self.group = group
        self.layer = layer


class GroupManagerMismatch(TopologyError):
    """A group's manager (allocator and pool) does not implement the group: another block
    size, geometry, physical layer count, attention kind or window."""

    def __init__(self, group: int, reason: str) -> None:
        super().__init__(f"the manager of group {group} does not fit the group: {reason}")
        self.group = group
        self.reason = reason


# --- devices -----------------------------------------------------------------------------


class NoDeviceError(PagedKVError):
    """No GPU runtime library or no device; the message is one line saying which."""


class DeviceError(PagedKVError):
    """A GPU runtime call failed. ``name`` and ``runtime_message`` are the runtime's own."""

    def __init__(self, call: str, code: int, name: str, runtime_message: str) -> None:
        super().__init__(f"{call} failed: {name} ({code}): {runtime_message}")
        self.call = call
        self.code = code
        self.name = name
        self.runtime_message = runtime_message

    @property
    def out_of_memory(self) -> bool:
        """Whether the runtime said it is out of device memory (an allocation that may
        succeed later, after something is freed), not that a call is wrong."""
        return self.name in _OUT_OF_MEMORY_NAMES


#: The runtimes' out-of-memory error names (CUDA driver API, HIP; HIP's pre-5.0 name).
_OUT_OF_MEMORY_NAMES = frozenset({"CUDA_ERROR_OUT_OF_MEMORY", "hipErrorOutOfMemory",
                                  "hipErrorMemoryAllocation"})
