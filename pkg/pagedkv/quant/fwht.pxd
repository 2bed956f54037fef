# FWHT-256 rotation of the MQ formats (docs/contracts/hfqm-and-quant.md, '3.5 Sign tables' to '3.6
# FWHT rotation').

# y[r] = R x[r] for n_rows consecutive rows of 256 floats (y may equal x).
cdef void rotate256(const float *x, float *y, Py_ssize_t n_rows) noexcept nogil
# y[r] = Rᵀ x[r], the inverse.
cdef void unrotate256(const float *x, float *y, Py_ssize_t n_rows) noexcept nogil
