# cython: language_level=3
"""Block-table row loops of the request lifecycle, in C (docs/adapter.md, "Block tables and
decode batches"; docs/coordinator.md, "Sliding null sentinel").

Each call does one group's share of a decode step for a batch of rows: find the rows that
cross a block boundary, append their new blocks, build the kernel batch, and drop the
blocks a sliding window no longer reaches. The tables are the flat int32 arrays of
``GroupBlocks``; every array argument is checked for its dtype, dimensions and contiguity
(``InvalidArgumentType`` / ``InvalidArgument``) before any pointer is read, and row indices
are trusted to come from the lifecycle's own row map.
"""

import numpy as np

cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc

from pagedkv.allocator cimport PKV_BLOCK_CACHED, BlockAllocator
from pagedkv.hashing cimport ChainKeys, make_chain_keys

from pagedkv.errors import InvalidArgument, InvalidArgumentType, InvariantViolation

cnp.import_array()

#: Row publication modes of a sliding group's dropped blocks (SequenceRows.publish).
PUBLISH_NONE = 0
PUBLISH_PLAIN = 1   # the request has no extra keys: published here
PUBLISH_KEYED = 2   # extra keys: published by the Python path (the row is handed back)


cdef int _check(cnp.ndarray a, int typenum, int ndim, str name) except -1:
    if cnp.PyArray_TYPE(a) != typenum:
        raise InvalidArgumentType(f"{name} has dtype {a.dtype}, expected "
                                  f"{np.dtype(cnp.PyArray_DescrFromType(typenum))}")
    if a.ndim != ndim or not cnp.PyArray_IS_C_CONTIGUOUS(a):
        raise InvalidArgument(f"{name} must be a C-contiguous {ndim}-D array")
    return 0


def crossing_rows(cnp.ndarray num_blocks, cnp.ndarray rows, cnp.ndarray ends,
                  Py_ssize_t block_size):
    """``(crossing, width)``: the entries of ``rows`` (intp) whose ``ends`` (int32 tokens)
    pass ``num_blocks[row] * block_size``, in order, and the table width appending one block
    to each needs (0 when none crosses)."""
    _check(num_blocks, cnp.NPY_INT32, 1, "num_blocks")
    _check(rows, cnp.NPY_INTP, 1, "rows")
    _check(ends, cnp.NPY_INT32, 1, "ends")
    cdef Py_ssize_t n = rows.shape[0], i, k = 0, width = 0, r
    if ends.shape[0] != n:
        raise InvalidArgument(f"ends has {ends.shape[0]} entries for {n} rows")
    cdef const int32_t* nb = <const int32_t*>cnp.PyArray_DATA(num_blocks)
    cdef const Py_ssize_t* rp = <const Py_ssize_t*>cnp.PyArray_DATA(rows)
    cdef const int32_t* e = <const int32_t*>cnp.PyArray_DATA(ends)
    cdef cnp.ndarray out = np.empty(n, dtype=np.intp)
    cdef Py_ssize_t* o = <Py_ssize_t*>cnp.PyArray_DATA(out)
    with nogil:
        for i in range(n):
            r = rp[i]
            if e[i] > <int64_t>nb[r] * block_size:
                o[k] = r
                k += 1
                if nb[r] + 1 > width:
                    width = nb[r] + 1
    return out[:k], width


def append_blocks(cnp.ndarray table, cnp.ndarray num_blocks, cnp.ndarray revision,
                  cnp.ndarray rows, cnp.ndarray blocks):
    """Append ``blocks[i]`` (int32) to the table row ``rows[i]`` (intp, distinct), bumping
    its ``num_blocks`` and ``revision``. The table must already be wide enough."""
    _check(table, cnp.NPY_INT32, 2, "table")
    _check(num_blocks, cnp.NPY_INT32, 1, "num_blocks")
    _check(revision, cnp.NPY_INT64, 1, "revision")
    _check(rows, cnp.NPY_INTP, 1, "rows")
    _check(blocks, cnp.NPY_INT32, 1, "blocks")
    cdef Py_ssize_t n = rows.shape[0], i, r, width = table.shape[1]
    if blocks.shape[0] != n:
        raise InvalidArgument(f"blocks has {blocks.shape[0]} entries for {n} rows")
    cdef int32_t* t = <int32_t*>cnp.PyArray_DATA(table)
    cdef int32_t* nb = <int32_t*>cnp.PyArray_DATA(num_blocks)
    cdef int64_t* rev = <int64_t*>cnp.PyArray_DATA(revision)
    cdef const Py_ssize_t* rp = <const Py_ssize_t*>cnp.PyArray_DATA(rows)
    cdef const int32_t* b = <const int32_t*>cnp.PyArray_DATA(blocks)
    for i in range(n):
        if nb[rp[i]] >= width:
            raise InvalidArgument(f"row {rp[i]} is full ({width} entries): widen the table")
    with nogil:
        for i in range(n):
            r = rp[i]
            t[r * width + nb[r]] = b[i]
            nb[r] += 1
            rev[r] += 1


def decode_batch(cnp.ndarray table, cnp.ndarray num_blocks, cnp.ndarray rows, cnp.ndarray lens,
                 Py_ssize_t block_size):
    """``(tables, slots)`` of a decode step: ``int32[n, width]`` copies of the rows' tables
    (``width`` = the longest, -1 padded) and ``int64[n]`` slots of each row's last position
    ``lens[i] - 1`` (every ``lens[i]`` >= 1)."""
    _check(table, cnp.NPY_INT32, 2, "table")
    _check(num_blocks, cnp.NPY_INT32, 1, "num_blocks")
    _check(rows, cnp.NPY_INTP, 1, "rows")
    _check(lens, cnp.NPY_INT32, 1, "lens")
    cdef Py_ssize_t n = rows.shape[0], i, j, r, width = 0, stride = table.shape[1]
    cdef const int32_t* t = <const int32_t*>cnp.PyArray_DATA(table)
    cdef const int32_t* nb = <const int32_t*>cnp.PyArray_DATA(num_blocks)
    cdef const Py_ssize_t* rp = <const Py_ssize_t*>cnp.PyArray_DATA(rows)
    cdef const int32_t* ln = <const int32_t*>cnp.PyArray_DATA(lens)
    cdef int64_t last
    for i in range(n):
        if nb[rp[i]] > width:
            width = nb[rp[i]]
        if ln[i] < 1 or ln[i] > <int64_t>nb[rp[i]] * block_size:
            raise InvalidArgument(f"row {rp[i]}: {ln[i]} tokens for {nb[rp[i]]} blocks")
    cdef cnp.ndarray tables = np.empty((n, width), dtype=np.int32)
    cdef cnp.ndarray slots = np.empty(n, dtype=np.int64)
    cdef int32_t* o = <int32_t*>cnp.PyArray_DATA(tables)
    cdef int64_t* s = <int64_t*>cnp.PyArray_DATA(slots)
    with nogil:
        for i in range(n):
            r = rp[i]
            for j in range(width):
                o[i * width + j] = t[r * stride + j] if j < nb[r] else -1
            last = ln[i] - 1
            s[i] = <int64_t>t[r * stride + last // block_size] * block_size + last % block_size
    return tables, slots


def prune_rows(BlockAllocator allocator, cnp.ndarray table, cnp.ndarray num_blocks,
               cnp.ndarray null_upto, cnp.ndarray revision, cnp.ndarray parent_hash,
               cnp.ndarray parent_known, cnp.ndarray rows, cnp.ndarray committed,
               Py_ssize_t window, cnp.ndarray tokens, cnp.ndarray salts,
               cnp.ndarray publish):
    """Drop what a sliding window of ``window`` tokens no longer reaches, for each
    ``rows[i]`` at ``committed[i]`` (int32) committed tokens: entries below
    ``max(0, committed - window + 1) // bs`` become the allocator's null block and their
    blocks are freed, newest first. Rows whose ``publish`` mode is PUBLISH_PLAIN first
    publish those blocks as a chain segment (no extra keys, the row's salt); PUBLISH_KEYED
    rows are left untouched and returned for the Python path.

    Every row is checked before any is changed (all or nothing): ``tokens`` too narrow for a
    row (``InvalidArgument``), a dropped entry outside the pool or freed more often than it is
    held (``InvariantViolation``), a hash hook that raises, or no memory for the buffers
    leave every row, refcount and the prefix table as they were.

    Returns ``(blocks freed, intp rows handed back)``. O(blocks freed) per row."""
    _check(table, cnp.NPY_INT32, 2, "table")
    _check(num_blocks, cnp.NPY_INT32, 1, "num_blocks")
    _check(null_upto, cnp.NPY_INT32, 1, "null_upto")
    _check(revision, cnp.NPY_INT64, 1, "revision")
    _check(parent_hash, cnp.NPY_UINT64, 1, "parent_hash")
    _check(parent_known, cnp.NPY_BOOL, 1, "parent_known")
    _check(rows, cnp.NPY_INTP, 1, "rows")
    _check(committed, cnp.NPY_INT32, 1, "committed")
    _check(tokens, cnp.NPY_UINT32, 2, "tokens")
    _check(salts, cnp.NPY_UINT64, 1, "salts")
    _check(publish, cnp.NPY_UINT8, 1, "publish")
    if allocator.null_block_id is None:
        raise InvalidArgument("prune_rows needs an allocator with a null block")
    cdef Py_ssize_t n = rows.shape[0], i, j, r, first, cut, count, width = table.shape[1]
    if committed.shape[0] != n:
        raise InvalidArgument(f"committed has {committed.shape[0]} entries for {n} rows")
    cdef Py_ssize_t bs = allocator.block_size, tok_width = tokens.shape[1], freed = 0
    cdef int32_t null_id = <int32_t>allocator.null_block_id
    cdef int32_t* t = <int32_t*>cnp.PyArray_DATA(table)
    cdef const int32_t* nb = <const int32_t*>cnp.PyArray_DATA(num_blocks)
    cdef int32_t* nu = <int32_t*>cnp.PyArray_DATA(null_upto)
    cdef int64_t* rev = <int64_t*>cnp.PyArray_DATA(revision)
    cdef uint64_t* ph = <uint64_t*>cnp.PyArray_DATA(parent_hash)
    cdef uint8_t* pk = <uint8_t*>cnp.PyArray_DATA(parent_known)
    cdef const Py_ssize_t* rp = <const Py_ssize_t*>cnp.PyArray_DATA(rows)
    cdef const int32_t* cm = <const int32_t*>cnp.PyArray_DATA(committed)
    cdef const uint32_t* tk = <const uint32_t*>cnp.PyArray_DATA(tokens)
    cdef const uint64_t* sl = <const uint64_t*>cnp.PyArray_DATA(salts)
    cdef const uint8_t* pub = <const uint8_t*>cnp.PyArray_DATA(publish)
    cdef ChainKeys plain = make_chain_keys(())
    cdef uint64_t parent
    cdef uint64_t* chain = NULL
    cdef int32_t* dropped = NULL
    cdef Py_ssize_t capacity = 0
    cdef bint published = False
    cdef bint hooked = allocator._hash_fn is not None and allocator._capacity > 0
    # Pass 1 changes nothing: each row's span as pass 2 will see it (``upto``: a row may
    # repeat), the token width, every dropped id (in range, held as often as it is dropped
    # over the whole call: release_ids's check) and, through a hash hook, every hash pass 2
    # computes (a hook that raises fails here).
    cdef cnp.ndarray upto = null_upto.copy()
    cdef int32_t* vu = <int32_t*>cnp.PyArray_DATA(upto)
    cdef int32_t b
    cdef int32_t* mult = allocator.multiplicity
    cdef Py_ssize_t bad_row = -1, bad_at = -1
    to_hash = []
    try:
        for i in range(n):
            r = rp[i]
            cut = _prune_cut(cm[i], window, bs, nb[r])
            first = vu[r]
            if cut <= first or pub[r] == PUBLISH_KEYED:
                continue
            if cut * bs > tok_width:
                raise InvalidArgument(f"row {r}: tokens holds {tok_width}, {cut * bs} needed")
            vu[r] = <int32_t>cut
            if cut > capacity:
                capacity = cut
            if hooked and pub[r] == PUBLISH_PLAIN:
                to_hash.append((r, cut))
            for j in range(first, cut):
                b = t[r * width + j]
                if b < 0 or b >= allocator._num_blocks:
                    bad_row, bad_at = r, j
                    break
                mult[b] += 1
                if mult[b] > allocator.blocks[b].refcount - (
                        1 if allocator.blocks[b].flags & PKV_BLOCK_CACHED else 0):
                    bad_row, bad_at = r, j
                    break
            if bad_row >= 0:
                break
    finally:
        vu = <int32_t*>cnp.PyArray_DATA(upto)
        for i in range(n):      # zero the scratch again (ids out of range were not counted)
            r = rp[i]
            for j in range(nu[r], vu[r]):
                b = t[r * width + j]
                if 0 <= b < allocator._num_blocks:
                    mult[b] = 0
    if bad_row >= 0:
        b = t[bad_row * width + bad_at]
        raise InvariantViolation(
            f"prune_rows: row {bad_row} entry {bad_at} = block {b} is "
            + ("outside the pool" if not 0 <= b < allocator._num_blocks else
               f"dropped more often than it is held (refcount {allocator.blocks[b].refcount})")
            + "; nothing was pruned")
    if capacity > 0:            # one buffer pair for every row of the call
        chain = <uint64_t*>malloc(capacity * sizeof(uint64_t))
        dropped = <int32_t*>malloc(capacity * sizeof(int32_t))
        if chain == NULL or dropped == NULL:
            free(chain)
            free(dropped)
            raise MemoryError("prune_rows buffers")
    handed_back = []
    try:
        for r, cut in to_hash:
            allocator.hash_chain(tk + r * tok_width, cut, plain, sl[r], 0, 0, chain)
        # Pass 2: the checked rows, nothing left to refuse.
        for i in range(n):
            r = rp[i]
            cut = _prune_cut(cm[i], window, bs, nb[r])
            first = nu[r]
            if cut <= first:
                continue
            if pub[r] == PUBLISH_KEYED:
                handed_back.append(r)
                continue
            count = cut - first
            if pub[r] == PUBLISH_PLAIN and allocator._capacity > 0:
                if pk[r]:
                    parent = ph[r]
                elif first == 0:
                    parent = 0
                else:           # once per row: the chain up to the window
                    allocator.hash_chain(tk + r * tok_width, first, plain, sl[r], 0, 0, chain)
                    parent = chain[first - 1]
                allocator.register_chain(tk + r * tok_width + first * bs, t + r * width + first,
                                         count, plain, sl[r], parent, first, chain)
                ph[r] = chain[count - 1]
                pk[r] = 1
                published = True
            for j in range(count):      # newest first
                dropped[j] = t[r * width + cut - 1 - j]
            allocator.release_ids(dropped, count)
            for j in range(first, cut):
                t[r * width + j] = null_id
            nu[r] = <int32_t>cut
            rev[r] += 1
            freed += count
    finally:
        free(chain)
        free(dropped)
        if published:
            allocator.flush_events()
    return freed, np.asarray(handed_back, dtype=np.intp)


cdef inline Py_ssize_t _prune_cut(int32_t committed, Py_ssize_t window, Py_ssize_t bs,
                                  int32_t num_blocks) noexcept:
    """The table entries below which a row at ``committed`` tokens is out of the window."""
    cdef int64_t keep = <int64_t>committed - window + 1
    cdef Py_ssize_t cut = keep // bs if keep > 0 else 0
    return num_blocks if cut > num_blocks else cut
