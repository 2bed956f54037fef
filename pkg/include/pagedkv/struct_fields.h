/* Field tables of C structs, for bindings that build a matching view at run time (the
 * NumPy structured dtypes of pagedkv.allocator and pagedkv.hfqm.index are made from
 * these, so the struct in its header is the only statement of a layout).
 *
 * PKV_STRUCT_FIELD(T, F) describes member F of struct T as this compiler lays it out:
 * name, byte offset, byte size and the NumPy type code of one element ("<u8", "u1", ...;
 * an array member has size = count * element size). Host C11 only (offsetof, _Generic).
 */
#ifndef PAGEDKV_STRUCT_FIELDS_H
#define PAGEDKV_STRUCT_FIELDS_H

#include <stddef.h>
#include <stdint.h>

typedef struct pkv_struct_field {
    const char *name;
    size_t offset;        /* bytes from the start of the struct */
    size_t size;          /* bytes of the whole member (arrays: every element) */
    const char *numpy_code; /* NumPy type code of one element, little-endian */
} pkv_struct_field;

/* An array member converts to a pointer to its element type in the controlling
 * expression, so arrays of the listed types map to their element's code too. */
#define PKV_NUMPY_CODE(x) _Generic((x), \
    uint64_t: "<u8", int64_t: "<i8", uint32_t: "<u4", int32_t: "<i4", \
    uint16_t: "<u2", int16_t: "<i2", uint8_t: "u1", int8_t: "i1", \
    uint64_t *: "<u8", int64_t *: "<i8", uint32_t *: "<u4", int32_t *: "<i4", \
    uint16_t *: "<u2", int16_t *: "<i2", uint8_t *: "u1", int8_t *: "i1")

#define PKV_STRUCT_FIELD(T, F) \
    { #F, offsetof(T, F), sizeof(((T *)0)->F), PKV_NUMPY_CODE(((T *)0)->F) }

#define PKV_COUNT_OF(a) (sizeof(a) / sizeof((a)[0]))

#endif /* PAGEDKV_STRUCT_FIELDS_H */
