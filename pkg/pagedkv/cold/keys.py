"""SHA-256 cold keys: one chain per group over a request's full blocks (docs/contracts/cold-tier.md,
'3.2 Key recipe' to '3.3 Sidecar keys')."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from pagedkv.argument_checks import int_argument
from pagedkv.cold.format import ColdFormat
from pagedkv.cold.groups import ColdGroup
from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.hashing import as_domain_id, as_token_array, per_block_extra_keys

__all__ = ["KEY_BYTES", "cold_key_chain", "sidecar_key"]

KEY_BYTES = 32
_ZERO_KEY = bytes(KEY_BYTES)
_u64 = struct.Struct("<Q").pack


def _check_fingerprint(fingerprint: bytes) -> bytes:
    if not isinstance(fingerprint, (bytes, bytearray)):
        raise InvalidArgumentType(
            f"fingerprint must be 32 bytes, got {type(fingerprint).__name__}")
    if len(fingerprint) != KEY_BYTES:
        raise InvalidArgument(f"fingerprint must be 32 bytes, got {len(fingerprint)}")
    return bytes(fingerprint)


def cold_key_chain(fmt: ColdFormat, group: ColdGroup, fingerprint: bytes, tokens,
                   block_size: int, *, extra_keys: Sequence[int] = (),
                   extra_keys_per_block: Sequence[Sequence[int]] | None = None,
                   cache_salt: int = 0, max_blocks: int | None = None) -> list[bytes]:
    """Keys (32 bytes each) of every full block of ``tokens`` in ``group``'s chain.

    Each key is SHA-256 of: the group's tag, the fingerprint, the parent key (zeros for
    block 0), u64 block index, u64 token count + u32 tokens, u64 key count + u64 keys,
    and u64 salt (the domain id on block 0, else 0). ``max_blocks`` stops early.
    """
    if not isinstance(fmt, ColdFormat):
        raise InvalidArgumentType(f"fmt must be a ColdFormat, got {type(fmt).__name__}")
    if not isinstance(group, ColdGroup):
        raise InvalidArgumentType(f"group must be a ColdGroup, got {type(group).__name__}")
    fp = _check_fingerprint(fingerprint)
    toks = as_token_array(tokens)
    bs = int_argument("block_size", block_size, 1)
    salt = as_domain_id(cache_salt)
    full = len(toks) // bs
    if max_blocks is not None:
        full = min(full, int_argument("max_blocks", max_blocks))
    keys_per_block = per_block_extra_keys(full, extra_keys, extra_keys_per_block)
    tag = fmt.tag(group.tag_name)
    tok_count = _u64(bs)
    row = 4 * bs
    toks_le = toks[:full * bs].astype("<u4", copy=False).tobytes()
    no_keys, no_salt = _u64(0), _u64(0)
    # The tag and fingerprint open every block's hash: hash them once and copy the state;
    # the rest of a block's fields go in as one buffer (the per-call overhead of many small
    # updates is most of a key's cost, and the sidecar capture pays it on the inference
    # thread for every block under its anchor).
    head = hashlib.sha256(tag)
    head.update(fp)
    out: list[bytes] = []
    parent = _ZERO_KEY
    for i, keys in enumerate(keys_per_block):
        h = head.copy()
        h.update(b"".join((
            parent, _u64(i), tok_count, toks_le[i * row:(i + 1) * row],
            _u64(len(keys)) + struct.pack(f"<{len(keys)}Q", *keys) if keys else no_keys,
            _u64(salt) if i == 0 else no_salt)))
        parent = h.digest()
        out.append(parent)
    return out


def sidecar_key(fmt: ColdFormat, group: ColdGroup, fingerprint: bytes, tokens,
                block_size: int, boundary_tokens: int, **chain_kwargs) -> bytes:
    """Key of the ``group`` sidecar at ``boundary_tokens`` (a positive multiple of the
    block size): the key of block ``boundary/bs - 1`` in that group's chain
    (docs/contracts/cold-tier.md, '3.3 Sidecar keys')."""
    if group is ColdGroup.KV:
        raise InvalidArgument("sidecar_key: group must be a sidecar group, got ColdGroup.KV")
    b = int_argument("boundary_tokens", boundary_tokens, 1)
    if b % int_argument("block_size", block_size, 1):
        raise InvalidArgument(f"boundary_tokens = {b} must be a positive multiple of "
                              f"block_size {block_size}")
    chain = cold_key_chain(fmt, group, fingerprint, tokens, block_size,
                           max_blocks=b // int(block_size), **chain_kwargs)
    if len(chain) < b // int(block_size):
        raise InvalidArgument(f"boundary_tokens = {b} is past the {len(chain)} full blocks "
                              "of tokens")
    return chain[-1]
