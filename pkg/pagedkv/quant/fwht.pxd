# FWHT-256 rotation of the MQ formats (docs/contracts/hfqm-and-quant.md, '3.5 Sign tables' to '3.6
# FWHT rotation').

# y[r] = R x[r] for n_rows consecutive rows of 256 floats (y may equal x).
cdef void rotate256(const float *x, float *y, Py_ssize_t n_rows) noexcept nogil
# y[r] = Rᵀ x[r], the inverse.
cdef void unrotate256(const float *x, float *y, Py_ssize_t n_rows) noexcept nogil
# y = x[0..count) zero-padded to 256, rotated by R when `rotate`; False when the rotation
# overflows float32 (y then holds Inf/NaN). The group load of every rotated encoder.
cdef bint group256(const float *x, Py_ssize_t count, float *y, bint rotate) noexcept nogil
