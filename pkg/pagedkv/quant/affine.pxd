# Affine weight codecs: HFQ v1, MQ v1, MQ V2 family, MQ4C (docs/contracts/hfqm-and-quant.md, '4.1
# HFQ generic affine v1' to '4.4 MQ4CG256 (qt 45)').

cpdef enum AffineFamily:
    HFQ = 0        # qt 6-12: f32 scale, f32 min, not rotated
    MQ_V1 = 1      # qt 13, 15, 17, 18, 31: HFQ bytes of the FWHT-256-rotated group
    MQ_V2 = 2      # qt 44, 47-50: per-128 f16 (scale, zero), rotated
    MQ4C = 3       # qt 45: one f16 (scale, zero) per 256, rotated

# Raises InvalidArgument unless (family, bits, group) is a geometry the loops handle: the
# low-level entry points index fixed 256-float scratch buffers and 128-float planes.
cdef int check_affine_geometry(int family, int bits, Py_ssize_t group) except -1
