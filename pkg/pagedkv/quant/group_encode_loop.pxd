# The one group loop of the weight encoders (q8, legacy, affine, codebook, gaussian_codebook,
# fp4): walk x in groups (or rows) of `group` values, refuse the first NaN/Inf, hand each
# group to the format's encoder. Inline, so each module's loop is compiled beside its own
# group encoders (the pointer is a constant there and the call may be inlined).
from pagedkv.quant.quant_header cimport pkv_first_nonfinite

# Encode group g, the `count` values at x (count < group only for the short last group of
# a format whose groups may straddle rows); ctx is the format's own job (output, scratch,
# bits). Returns whether the group is stored: False when its finite values are beyond what
# the format can store (a rotation or an f16 scale that overflows).
ctypedef bint (*group_encoder)(const float *x, Py_ssize_t count, Py_ssize_t g,
                               void *ctx) noexcept nogil


# Encode the n values at x as ceil(n/group) groups. Returns -1 when every group is stored;
# i >= 0, the index of the first NaN/Inf of x (no group after its own is encoded); or
# -2 - g when group g's encoder refused it. The contract every format's encode() returns.
cdef inline Py_ssize_t encode_groups(const float *x, Py_ssize_t n, Py_ssize_t group,
                                     group_encoder encode_group, void *ctx) noexcept nogil:
    cdef Py_ssize_t g, start, count, bad
    for g in range((n + group - 1) // group):
        start = g * group
        count = min(group, n - start)
        bad = pkv_first_nonfinite(&x[start], count)
        if bad >= 0:
            return bad + start
        if not encode_group(&x[start], count, g, ctx):
            return -2 - g
    return -1
