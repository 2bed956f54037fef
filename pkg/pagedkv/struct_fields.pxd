# Field tables of C structs (pagedkv/struct_fields.h), from which the NumPy views of the
# records are built (pagedkv.c_struct_dtype). Declarations only: no struct_fields module.

cdef extern from "pagedkv/struct_fields.h" nogil:
    ctypedef struct pkv_struct_field:
        const char* name
        size_t offset
        size_t size
        const char* numpy_code


cdef inline list field_table(const pkv_struct_field* fields, Py_ssize_t n):
    """``[(name, offset_bytes, size_bytes, numpy_code), ...]`` of the ``n`` entries."""
    cdef Py_ssize_t i
    return [(fields[i].name.decode("ascii"), fields[i].offset, fields[i].size,
             fields[i].numpy_code.decode("ascii")) for i in range(n)]
