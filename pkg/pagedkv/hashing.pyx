# cython: language_level=3
"""Hot block hashes and cache-salt domain ids (docs/contracts/paged-kv.md, '2. Block hashing' and
'3. cache_salt domain id').

The hot hash keys the in-process prefix table. It is process-local (seeded per
allocator) and may change between versions; the cold tier's on-disk keys are a
separate, stable SHA-256 format and live in :mod:`pagedkv.cold`.

One block hashes this little-endian buffer with XXH3-64 (a result of 0 becomes 1)::

    parent u64 | tokens u32 * bs | extra-key count u64 | keys u64 * count | salt u64

(the salt only on block 0 and only when it is non-zero).

XXH3 is called from C through the system libxxhash when the build found it
(``XXH3_SOURCE == "libxxhash"``), else through the ``xxhash`` wheel
(``"xxhash-wheel"``); both give identical digests.
"""

import hashlib

import numpy as np

cimport numpy as cnp
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc

from pagedkv.argument_checks import is_int
from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.identity import BlockIdentity, extra_keys_digest

cnp.import_array()

__all__ = [
    "BlockIdentity", "XXH3_SOURCE", "as_token_array", "chain_hashes", "hot_block_hash",
    "per_block_extra_keys", "salt_domain_id",
]

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    #include "pkv_build.h"
    #if PKV_HAVE_LIBXXHASH
    #include <xxhash.h>
    static inline uint64_t pkv_xxh3_native(const void *p, size_t n, uint64_t seed) {
        return (uint64_t)XXH3_64bits_withSeed(p, n, (XXH64_hash_t)seed);
    }
    #else
    static inline uint64_t pkv_xxh3_native(const void *p, size_t n, uint64_t seed) {
        (void)p; (void)n; (void)seed;
        return 0;
    }
    #endif

    /* Explicit little-endian stores: the buffer is a byte format, not a host struct.
       Compilers turn these loops into single stores on little-endian targets. */
    static inline void pkv_store_le64(uint8_t *p, uint64_t v) {
        for (int i = 0; i < 8; ++i) p[i] = (uint8_t)(v >> (8 * i));
    }
    static inline void pkv_store_le32(uint8_t *p, uint32_t v) {
        for (int i = 0; i < 4; ++i) p[i] = (uint8_t)(v >> (8 * i));
    }

    /* Writes the hot-hash input of one block (docs/contracts/paged-kv.md, '2.1 Hot block hash');
    returns its length. */
    static inline size_t pkv_hot_buffer(uint8_t *out, uint64_t parent, const uint32_t *tokens,
                                        size_t block_size, const uint64_t *keys,
                                        size_t key_count, uint64_t salt, int64_t block_index) {
        uint8_t *p = out;
        pkv_store_le64(p, parent); p += 8;
    #if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        memcpy(p, tokens, 4 * block_size); p += 4 * block_size;
    #else
        for (size_t i = 0; i < block_size; ++i) { pkv_store_le32(p, tokens[i]); p += 4; }
    #endif
        pkv_store_le64(p, (uint64_t)key_count); p += 8;
        for (size_t i = 0; i < key_count; ++i) { pkv_store_le64(p, keys[i]); p += 8; }
        if (block_index == 0 && salt != 0) { pkv_store_le64(p, salt); p += 8; }
        return (size_t)(p - out);
    }
    """
    int PKV_HAVE_LIBXXHASH
    uint64_t pkv_xxh3_native(const void *p, size_t n, uint64_t seed) noexcept nogil
    size_t pkv_hot_buffer(uint8_t *out, uint64_t parent, const uint32_t *tokens,
                          size_t block_size, const uint64_t *keys, size_t key_count,
                          uint64_t salt, int64_t block_index) noexcept nogil


#: Where XXH3 comes from in this build: ``"libxxhash"`` (system library, called from C)
#: or ``"xxhash-wheel"`` (the ``xxhash`` Python package).
XXH3_SOURCE = "libxxhash" if PKV_HAVE_LIBXXHASH else "xxhash-wheel"

cdef bint _use_native = PKV_HAVE_LIBXXHASH
cdef object _wheel_xxh3 = None

_U64_MAX = (1 << 64) - 1
_U32_MAX = (1 << 32) - 1
_SALT_MAX_BYTES = 256
_EMPTY_KEYS = np.zeros(0, dtype=np.uint64)


def _set_xxh3_source(str source):
    """Test hook: route XXH3 through ``"libxxhash"`` or ``"xxhash-wheel"``; returns the
    previous source. Lets one process prove both paths give identical digests."""
    global _use_native
    previous = "libxxhash" if _use_native else "xxhash-wheel"
    if source == "libxxhash":
        if not PKV_HAVE_LIBXXHASH:
            raise InvalidArgument(
                "source='libxxhash' is not available: this build did not find the system "
                "libxxhash (meson option system_xxhash)")
        _use_native = True
    elif source == "xxhash-wheel":
        _wheel()
        _use_native = False
    else:
        raise InvalidArgument(
            f"source={source!r} is not one of 'libxxhash', 'xxhash-wheel'")
    return previous


cdef object _wheel():
    global _wheel_xxh3
    if _wheel_xxh3 is None:
        import xxhash
        _wheel_xxh3 = xxhash.xxh3_64_intdigest
    return _wheel_xxh3


# --- argument validation (shared with pagedkv.allocator) ------------------------------

cpdef object as_token_array(object tokens, str name="tokens"):
    """Return ``tokens`` as a 1-D C-contiguous ``uint32`` array (docs/contracts/paged-kv.md, '2.1
    Hot block hash').

    A C-contiguous 1-D ``uint32`` ndarray is returned as is (no copy). Other integer
    array-likes are range-checked (``0 <= t < 2**32``) and converted. Float, bool or
    object input raises InvalidArgumentType; ``ndim != 1`` raises InvalidArgument.
    """
    if (type(tokens) is np.ndarray and (<cnp.ndarray>tokens).dtype.num == cnp.NPY_UINT32
            and cnp.PyArray_NDIM(<cnp.ndarray>tokens) == 1
            and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>tokens)
            and cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray>tokens)):
        return tokens
    is_array = isinstance(tokens, np.ndarray)
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidArgumentType(
            f"{name} must be a 1-D array-like of integers in [0, 2**32); "
            f"got {type(tokens).__name__} ({exc})") from None
    if arr.ndim != 1:
        raise InvalidArgument(
            f"{name} must be 1-D, got ndim={arr.ndim} (shape {arr.shape}); "
            f"pass one sequence's token ids")
    if arr.size == 0 and not is_array:
        return np.zeros(0, dtype=np.uint32)
    kind = arr.dtype.kind
    if kind == "O":
        # NumPy falls back to object for Python ints beyond int64/uint64.
        values = arr.tolist()
        for t in values:
            if type(t) is not int:
                break
        else:
            for t in values:
                if not 0 <= t <= _U32_MAX:
                    raise InvalidArgument(
                        f"{name} contains {t}, outside the token range [0, 2**32)")
    if kind not in "iu":
        raise InvalidArgumentType(
            f"{name} must hold integers, got dtype {arr.dtype}: float, bool and object "
            f"tokens are rejected; convert with np.asarray(tokens, dtype=np.uint32)")
    if arr.size:
        lo = int(arr.min())
        hi = int(arr.max())
        if lo < 0 or hi > _U32_MAX:
            bad = lo if lo < 0 else hi
            raise InvalidArgument(
                f"{name} contains {bad}, outside the token range [0, 2**32)")
    return np.ascontiguousarray(arr, dtype=np.uint32)


cpdef uint64_t as_u64(object value, str name) except? 0:
    """An int in [0, 2**64) (bool and non-integers are InvalidArgumentType)."""
    if not is_int(value):
        raise InvalidArgumentType(
            f"{name} must be an int in [0, 2**64), got {type(value).__name__}")
    v = int(value)
    if not 0 <= v <= _U64_MAX:
        raise InvalidArgument(f"{name} = {v} is outside [0, 2**64)")
    return <uint64_t>v


cpdef uint64_t as_domain_id(object cache_salt, str name="cache_salt") except? 0:
    """A u64 domain id; a ``str`` salt is rejected with a pointer to salt_domain_id."""
    if isinstance(cache_salt, (str, bytes)):
        raise InvalidArgumentType(
            f"{name} must be a u64 domain id, got {type(cache_salt).__name__} "
            f"{cache_salt!r}: convert the salt with pagedkv.hashing.salt_domain_id(salt)")
    if cache_salt is None:
        return 0
    return as_u64(cache_salt, name)


cdef tuple _keys_tuple(object keys, str name):
    if isinstance(keys, (str, bytes)) or not hasattr(keys, "__iter__"):
        raise InvalidArgumentType(
            f"{name} must be a sequence of ints in [0, 2**64), got {type(keys).__name__}")
    out = tuple(keys)
    for i, k in enumerate(out):
        as_u64(k, f"{name}[{i}]")
    return tuple([int(k) for k in out])


cdef class ChainKeys:
    """Validated extra keys of one chain (see hashing.pxd)."""

    def __repr__(self):
        if self.per_block:
            return f"ChainKeys(per_block, max_blocks={self.max_blocks})"
        return f"ChainKeys(uniform={self.uniform_tuple!r})"

    cdef object tuple_of(self, Py_ssize_t block):
        if self.block_tuples is None:
            return self.uniform_tuple
        return self.block_tuples[block]

    cdef Py_ssize_t blocks_for(self, Py_ssize_t full_blocks) noexcept:
        if self.max_blocks >= 0 and self.max_blocks < full_blocks:
            return self.max_blocks
        return full_blocks


cdef ChainKeys _UNIFORM_NONE = None


cpdef ChainKeys make_chain_keys(object extra_keys=(), object extra_keys_per_block=None):
    """Validate ``extra_keys`` / ``extra_keys_per_block`` (docs/contracts/paged-kv.md, '2.2
    Chains')."""
    global _UNIFORM_NONE
    cdef ChainKeys ck
    cdef cnp.ndarray flat, offsets
    if extra_keys_per_block is not None:
        # Checked as keys first: len() of an int or a generator is a bare TypeError.
        if extra_keys is not None and len(_keys_tuple(extra_keys, "extra_keys")) != 0:
            raise InvalidArgument(
                "pass either extra_keys (same keys on every block) or extra_keys_per_block, "
                "not both")
        if isinstance(extra_keys_per_block, (str, bytes)) or not hasattr(
                extra_keys_per_block, "__len__"):
            raise InvalidArgumentType(
                "extra_keys_per_block must be a sequence of key sequences, got "
                f"{type(extra_keys_per_block).__name__}")
        tuples = [_keys_tuple(k, f"extra_keys_per_block[{i}]")
                  for i, k in enumerate(extra_keys_per_block)]
        n = len(tuples)
        offsets = np.zeros(n + 1, dtype=np.intp)
        total = 0
        for i, t in enumerate(tuples):
            total += len(t)
            offsets[i + 1] = total
        flat = np.array([k for t in tuples for k in t], dtype=np.uint64)
        ck = ChainKeys.__new__(ChainKeys)
        ck.per_block = True
        ck.max_blocks = n
        ck.flat_keys = flat
        ck.key_offsets = offsets
        ck.keys_ptr = <const uint64_t*>cnp.PyArray_DATA(flat)
        ck.offsets_ptr = <const Py_ssize_t*>cnp.PyArray_DATA(offsets)
        ck.block_tuples = tuples
        _set_digests(ck, tuples)
        return ck
    if extra_keys is None or (type(extra_keys) is tuple and len(extra_keys) == 0):
        if _UNIFORM_NONE is None:
            _UNIFORM_NONE = _uniform(())
        return _UNIFORM_NONE
    return _uniform(_keys_tuple(extra_keys, "extra_keys"))


def per_block_extra_keys(Py_ssize_t num_full_blocks, extra_keys=(), extra_keys_per_block=None):
    """The validated extra keys of each chained block, one tuple of ints per block, with the
    chain's stopping rule (docs/contracts/paged-kv.md, '2.2 Chains'): ``extra_keys`` applies
    to every one of ``num_full_blocks``; ``extra_keys_per_block[i]`` to block ``i``, and the
    chain stops at the first block without an entry."""
    cdef ChainKeys keys = make_chain_keys(extra_keys, extra_keys_per_block)
    cdef Py_ssize_t i, n = keys.blocks_for(max(num_full_blocks, 0))
    return [keys.tuple_of(i) for i in range(n)]


cdef ChainKeys _uniform(tuple keys):
    cdef ChainKeys ck = ChainKeys.__new__(ChainKeys)
    cdef cnp.ndarray flat = np.array(keys, dtype=np.uint64) if keys else _EMPTY_KEYS
    ck.per_block = False
    ck.max_blocks = -1
    ck.flat_keys = flat
    ck.key_offsets = None
    ck.keys_ptr = <const uint64_t*>cnp.PyArray_DATA(flat)
    ck.offsets_ptr = NULL
    ck.uniform_count = len(keys)
    ck.uniform_tuple = keys
    ck.block_tuples = None
    _set_digests(ck, [keys])
    return ck


cdef _set_digests(ChainKeys ck, list key_tuples):
    """Identity digests, flat, so the verify loop reads them without Python objects."""
    cdef Py_ssize_t m = len(key_tuples), i
    cdef cnp.ndarray digests = np.zeros((max(m, 1), 16), dtype=np.uint8)
    cdef cnp.ndarray lens = np.zeros(max(m, 1), dtype=np.uint32)
    for i in range(m):
        d = extra_keys_digest(key_tuples[i])
        if d:
            digests[i] = np.frombuffer(d, dtype=np.uint8)
            lens[i] = len(d)
    ck.digests = digests
    ck.digest_lens = lens
    ck.digests_ptr = <const uint8_t*>cnp.PyArray_DATA(digests)
    ck.digest_lens_ptr = <const uint32_t*>cnp.PyArray_DATA(lens)


# --- the hash -------------------------------------------------------------------------

cdef size_t hot_buffer_bytes(Py_ssize_t block_size, Py_ssize_t key_count) noexcept nogil:
    return <size_t>(8 + 4 * block_size + 8 + 8 * key_count + 8)


cdef bint xxh3_native() noexcept nogil:
    """Whether hash_block_native may be used (system libxxhash, not routed to the wheel)."""
    return _use_native


cdef uint64_t hash_block_native(uint64_t parent, const uint32_t* tokens, Py_ssize_t block_size,
                                const uint64_t* keys, Py_ssize_t key_count, uint64_t cache_salt,
                                int64_t block_index, uint64_t seed,
                                uint8_t* scratch) noexcept nogil:
    """hash_block through libxxhash, without the GIL; only valid while xxh3_native()."""
    cdef size_t n = pkv_hot_buffer(scratch, parent, tokens, <size_t>block_size, keys,
                                   <size_t>key_count, cache_salt, block_index)
    cdef uint64_t h = pkv_xxh3_native(scratch, n, seed)
    return h if h != 0 else 1


cdef uint64_t hash_block(uint64_t parent, const uint32_t* tokens, Py_ssize_t block_size,
                         const uint64_t* keys, Py_ssize_t key_count, uint64_t cache_salt,
                         int64_t block_index, uint64_t seed, uint8_t* scratch) except 0:
    """Hot hash of one full block; ``scratch`` holds hot_buffer_bytes(bs, key_count)."""
    cdef size_t n = pkv_hot_buffer(scratch, parent, tokens, <size_t>block_size, keys,
                                   <size_t>key_count, cache_salt, block_index)
    cdef uint64_t h
    if _use_native:
        h = pkv_xxh3_native(scratch, n, seed)
    else:
        h = <uint64_t>_wheel()(PyBytes_FromStringAndSize(<char*>scratch, <Py_ssize_t>n), seed)
    return h if h != 0 else 1


cdef int chain_into(const uint32_t* tokens, Py_ssize_t n_blocks, Py_ssize_t block_size,
                    ChainKeys keys, uint64_t cache_salt, uint64_t seed,
                    uint64_t* out) except -1:
    """Hash ``n_blocks`` chained full blocks into ``out`` (block i's parent is out[i-1])."""
    return chain_segment_into(tokens, n_blocks, block_size, keys, cache_salt, seed, 0, 0, out)


cdef int chain_segment_into(const uint32_t* tokens, Py_ssize_t n_blocks, Py_ssize_t block_size,
                            ChainKeys keys, uint64_t cache_salt, uint64_t seed,
                            uint64_t parent, int64_t first_block, uint64_t* out) except -1:
    """Hash a chain *segment*: ``n_blocks`` full blocks that are chain blocks
    ``first_block ..`` (their block indices), the first one chaining from ``parent`` (the
    hash of block ``first_block - 1``; 0 when the segment starts the chain). Keys are read
    segment-relative: block ``first_block + j`` takes ``keys`` entry ``j``."""
    cdef Py_ssize_t i, most_keys = 0, count
    cdef uint64_t h
    cdef size_t n
    cdef uint8_t* scratch
    if n_blocks <= 0:
        return 0
    for i in range(n_blocks):
        count = keys.key_count(i)
        if count > most_keys:
            most_keys = count
    scratch = <uint8_t*>malloc(hot_buffer_bytes(block_size, most_keys))
    if scratch == NULL:
        raise MemoryError("chain_hashes: scratch buffer")
    try:
        if _use_native:
            with nogil:
                for i in range(n_blocks):
                    n = pkv_hot_buffer(scratch, parent, tokens + i * block_size,
                                       <size_t>block_size, keys.keys_of(i),
                                       <size_t>keys.key_count(i), cache_salt, first_block + i)
                    h = pkv_xxh3_native(scratch, n, seed)
                    parent = h if h != 0 else 1
                    out[i] = parent
        else:
            for i in range(n_blocks):
                parent = hash_block(parent, tokens + i * block_size, block_size,
                                    keys.keys_of(i), keys.key_count(i), cache_salt,
                                    first_block + i, seed, scratch)
                out[i] = parent
    finally:
        free(scratch)
    return 0


def hot_block_hash(parent, tokens, extra_keys=(), cache_salt=0, block_index=0, *, seed=0):
    """XXH3-64 hot hash of one full block (docs/contracts/paged-kv.md, '2.1 Hot block hash').

    parent: hot hash of the previous block, 0 for block 0 (u64).
    tokens: the block's token ids (its length is the block size).
    extra_keys: u64 keys, order-sensitive. cache_salt: u64 domain id (salt_domain_id),
    hashed only when ``block_index == 0``. seed: XXH3 seed (u64). Never returns 0.
    """
    cdef uint64_t p = as_u64(parent, "parent")
    cdef uint64_t salt = as_domain_id(cache_salt)
    cdef uint64_t s = as_u64(seed, "seed")
    cdef cnp.ndarray tok = as_token_array(tokens)
    cdef tuple keys = _keys_tuple(extra_keys, "extra_keys")
    if not is_int(block_index):
        raise InvalidArgumentType(
            f"block_index must be an int >= 0, got {type(block_index).__name__}")
    if not 0 <= int(block_index) < (1 << 63):
        raise InvalidArgument(f"block_index = {block_index} is outside [0, 2**63)")
    cdef cnp.ndarray karr = np.array(keys, dtype=np.uint64) if keys else _EMPTY_KEYS
    cdef Py_ssize_t bs = tok.shape[0]
    cdef uint8_t* scratch = <uint8_t*>malloc(hot_buffer_bytes(bs, len(keys)))
    if scratch == NULL:
        raise MemoryError("hot_block_hash: scratch buffer")
    try:
        return hash_block(p, <const uint32_t*>cnp.PyArray_DATA(tok), bs,
                          <const uint64_t*>cnp.PyArray_DATA(karr), len(keys), salt,
                          <int64_t>int(block_index), s, scratch)
    finally:
        free(scratch)


def chain_hashes(tokens, block_size, *, extra_keys=(), extra_keys_per_block=None,
                 cache_salt=0, seed=0):
    """Hot hashes of the full blocks of ``tokens`` as ``uint64[k]`` (docs/contracts/paged-kv.md,
    '2.2 Chains').

    ``k = len(tokens) // block_size`` (trailing partial tokens are ignored; block_size 0
    gives an empty array), capped at ``len(extra_keys_per_block)`` when per-block keys
    are given. Block ``i`` chains from block ``i - 1``; the salt enters block 0 only.
    """
    cdef cnp.ndarray tok = as_token_array(tokens)
    if not is_int(block_size):
        raise InvalidArgumentType(
            f"block_size must be an int >= 0, got {type(block_size).__name__}")
    if not 0 <= block_size <= _U32_MAX:
        raise InvalidArgument(f"block_size = {block_size} is outside [0, 2**32)")
    cdef uint64_t salt = as_domain_id(cache_salt)
    cdef uint64_t s = as_u64(seed, "seed")
    cdef ChainKeys keys = make_chain_keys(extra_keys, extra_keys_per_block)
    cdef Py_ssize_t bs = block_size
    cdef Py_ssize_t n = 0 if bs == 0 else keys.blocks_for(tok.shape[0] // bs)
    cdef cnp.ndarray out = np.empty(n, dtype=np.uint64)
    chain_into(<const uint32_t*>cnp.PyArray_DATA(tok), n, bs, keys, salt, s,
               <uint64_t*>cnp.PyArray_DATA(out))
    return out


def salt_domain_id(salt):
    """Domain id (u64) of a ``cache_salt`` string (docs/contracts/paged-kv.md, '3. cache_salt domain
    id').

    ``None`` → 0 (the shared domain). Otherwise a non-empty ``str`` of at most 256 UTF-8
    bytes; the id is the first 8 bytes of its SHA-256, little-endian, with 0 remapped to 1.
    """
    if salt is None:
        return 0
    if not isinstance(salt, str):
        raise InvalidArgumentType(
            f"salt must be a str or None, got {type(salt).__name__}; decode bytes first")
    try:
        raw = salt.encode("utf-8", "strict")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"salt is not encodable as strict UTF-8: {exc}") from None
    if not raw:
        raise InvalidArgument(
            "salt is empty: pass None for the shared domain, or a non-empty tenant salt")
    if len(raw) > _SALT_MAX_BYTES:
        raise InvalidArgument(
            f"salt is {len(raw)} UTF-8 bytes; the limit is {_SALT_MAX_BYTES} bytes")
    d = int.from_bytes(hashlib.sha256(raw).digest()[:8], "little")
    return d if d != 0 else 1
