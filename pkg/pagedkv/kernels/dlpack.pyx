# cython: language_level=3
"""DLPack capsules for :class:`pagedkv.kernels.DeviceArray` (the protocol of the Python
array API: ``__dlpack__`` / ``from_dlpack``), in C because a capsule's destructor and a
managed tensor's deleter are C callbacks that may run on any thread.

Export (:func:`export_capsule`): one ``malloc`` holds the managed tensor (legacy
``DLManagedTensor``, capsule name ``"dltensor"``, or, when the consumer asks for
``max_version >= (1, 0)``, ``DLManagedTensorVersioned``, name ``"dltensor_versioned"``),
its shape and its strides. ``manager_ctx`` holds a strong reference to the exported
owner (the DeviceArray), so the memory stays alive while the consumer holds the tensor.
A consumer renames the capsule to ``"used_dltensor"`` (``"used_dltensor_versioned"``)
and later calls the deleter, which drops that reference and frees the block; a capsule
dropped unconsumed calls the deleter from its destructor.

Import (:func:`import_capsule`): reads a (versioned or legacy) capsule, renames it to
its ``used_`` name (a capsule is consumed once) and returns an :class:`ImportedTensor`,
which calls the producer's deleter when it is collected; a DeviceArray made from it
keeps it as its ``base``.
"""

from cpython.pycapsule cimport (
    PyCapsule_Destructor,
    PyCapsule_CheckExact,
    PyCapsule_GetName,
    PyCapsule_GetPointer,
    PyCapsule_IsValid,
    PyCapsule_New,
    PyCapsule_SetName,
)
from cpython.ref cimport Py_DECREF, Py_INCREF
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc

from pagedkv.errors import InvalidArgument

cdef extern from *:
    """
    typedef struct { int32_t device_type; int32_t device_id; } pkv_DLDevice;
    typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } pkv_DLDataType;
    typedef struct {
      void *data; pkv_DLDevice device; int32_t ndim; pkv_DLDataType dtype;
      int64_t *shape; int64_t *strides; uint64_t byte_offset;
    } pkv_DLTensor;
    typedef struct pkv_DLManagedTensor {
      pkv_DLTensor dl_tensor; void *manager_ctx;
      void (*deleter)(struct pkv_DLManagedTensor *self);
    } pkv_DLManagedTensor;
    typedef struct { uint32_t major; uint32_t minor; } pkv_DLPackVersion;
    typedef struct pkv_DLManagedTensorVersioned {
      pkv_DLPackVersion version; void *manager_ctx;
      void (*deleter)(struct pkv_DLManagedTensorVersioned *self);
      uint64_t flags; pkv_DLTensor dl_tensor;
    } pkv_DLManagedTensorVersioned;
    """
    ctypedef struct pkv_DLDevice:
        int32_t device_type
        int32_t device_id
    ctypedef struct pkv_DLDataType:
        uint8_t code
        uint8_t bits
        uint16_t lanes
    ctypedef struct pkv_DLTensor:
        void *data
        pkv_DLDevice device
        int32_t ndim
        pkv_DLDataType dtype
        int64_t *shape
        int64_t *strides
        uint64_t byte_offset
    ctypedef struct pkv_DLManagedTensor:
        pkv_DLTensor dl_tensor
        void *manager_ctx
        void (*deleter)(pkv_DLManagedTensor *) noexcept nogil
    ctypedef struct pkv_DLPackVersion:
        uint32_t major
        uint32_t minor
    ctypedef struct pkv_DLManagedTensorVersioned:
        pkv_DLPackVersion version
        void *manager_ctx
        void (*deleter)(pkv_DLManagedTensorVersioned *) noexcept nogil
        uint64_t flags
        pkv_DLTensor dl_tensor

#: DLPack version this module writes in versioned capsules.
DLPACK_VERSION = (1, 0)
#: ``DLManagedTensorVersioned.flags`` bits.
FLAG_READ_ONLY = 1
FLAG_IS_COPIED = 2

cdef const char *LEGACY = b"dltensor"
cdef const char *USED_LEGACY = b"used_dltensor"
cdef const char *VERSIONED = b"dltensor_versioned"
cdef const char *USED_VERSIONED = b"used_dltensor_versioned"


cdef void _release_owner(void *ctx) noexcept nogil:
    with gil:
        Py_DECREF(<object>ctx)


cdef void _delete_legacy(pkv_DLManagedTensor *self) noexcept nogil:
    if self == NULL:
        return
    if self.manager_ctx != NULL:
        _release_owner(self.manager_ctx)
    free(self)


cdef void _delete_versioned(pkv_DLManagedTensorVersioned *self) noexcept nogil:
    if self == NULL:
        return
    if self.manager_ctx != NULL:
        _release_owner(self.manager_ctx)
    free(self)


cdef void _capsule_destructor(object capsule) noexcept:
    # A consumer renamed a capsule it took ("used_..."): it owns the deleter call now.
    cdef pkv_DLManagedTensor *legacy
    cdef pkv_DLManagedTensorVersioned *versioned
    if PyCapsule_IsValid(capsule, LEGACY):
        legacy = <pkv_DLManagedTensor *>PyCapsule_GetPointer(capsule, LEGACY)
        if legacy.deleter != NULL:
            legacy.deleter(legacy)
    elif PyCapsule_IsValid(capsule, VERSIONED):
        versioned = <pkv_DLManagedTensorVersioned *>PyCapsule_GetPointer(capsule, VERSIONED)
        if versioned.deleter != NULL:
            versioned.deleter(versioned)


cdef void _fill(pkv_DLTensor *t, uint64_t ptr, int32_t device_type, int32_t device_id,
                tuple shape, tuple dtype_triple, int64_t *dims) noexcept:
    cdef int i
    cdef int n = len(shape)
    cdef int64_t stride = 1
    t.data = <void *>ptr
    t.device.device_type = device_type
    t.device.device_id = device_id
    t.ndim = n
    t.dtype.code = dtype_triple[0]
    t.dtype.bits = dtype_triple[1]
    t.dtype.lanes = dtype_triple[2]
    t.shape = dims
    t.strides = dims + n
    t.byte_offset = 0
    for i in range(n - 1, -1, -1):  # C-contiguous strides, in elements
        dims[i] = shape[i]
        dims[n + i] = stride
        stride *= <int64_t>shape[i]


def export_capsule(object owner, uint64_t ptr, tuple shape, tuple dtype_triple,
                   int32_t device_type, int32_t device_id, bint versioned,
                   bint read_only=False):
    """A DLPack capsule over ``ptr`` (C-contiguous ``shape``; ``dtype_triple`` = DLPack
    ``(code, bits, lanes)``) that keeps ``owner`` alive until the consumer's deleter runs
    (or the capsule is dropped unconsumed)."""
    cdef int n = len(shape)
    cdef size_t head
    cdef void *block
    cdef pkv_DLManagedTensor *legacy
    cdef pkv_DLManagedTensorVersioned *ver
    head = sizeof(pkv_DLManagedTensorVersioned) if versioned else sizeof(pkv_DLManagedTensor)
    head = (head + 7) // 8 * 8
    block = malloc(head + 2 * sizeof(int64_t) * max(n, 1))
    if block == NULL:
        raise MemoryError("DLPack export: malloc failed")
    Py_INCREF(owner)
    if versioned:
        ver = <pkv_DLManagedTensorVersioned *>block
        ver.version.major = DLPACK_VERSION[0]
        ver.version.minor = DLPACK_VERSION[1]
        ver.manager_ctx = <void *>owner
        ver.deleter = _delete_versioned
        ver.flags = FLAG_READ_ONLY if read_only else 0
        _fill(&ver.dl_tensor, ptr, device_type, device_id, shape, dtype_triple,
              <int64_t *>(<char *>block + head))
        return PyCapsule_New(block, VERSIONED, <PyCapsule_Destructor>_capsule_destructor)
    legacy = <pkv_DLManagedTensor *>block
    legacy.manager_ctx = <void *>owner
    legacy.deleter = _delete_legacy
    _fill(&legacy.dl_tensor, ptr, device_type, device_id, shape, dtype_triple,
          <int64_t *>(<char *>block + head))
    return PyCapsule_New(block, LEGACY, <PyCapsule_Destructor>_capsule_destructor)


cdef class ImportedTensor:
    """A consumed DLPack capsule: its description, and the producer's deleter, called once
    when this object is collected (keep it alive while the memory is used)."""

    cdef pkv_DLManagedTensor *_legacy
    cdef pkv_DLManagedTensorVersioned *_versioned
    cdef readonly uint64_t data
    cdef readonly tuple shape
    cdef readonly object strides
    cdef readonly tuple dtype
    cdef readonly tuple device
    cdef readonly tuple version
    cdef readonly bint read_only

    def __dealloc__(self):
        if self._versioned != NULL and self._versioned.deleter != NULL:
            self._versioned.deleter(self._versioned)
        elif self._legacy != NULL and self._legacy.deleter != NULL:
            self._legacy.deleter(self._legacy)

    def __repr__(self):
        return (f"ImportedTensor(data=0x{self.data:x}, shape={self.shape}, dtype={self.dtype}, "
                f"device={self.device}, version={self.version})")


def import_capsule(object capsule):
    """Consume a ``"dltensor"`` or ``"dltensor_versioned"`` capsule: rename it ``used_…``
    and return its :class:`ImportedTensor`. ``InvalidArgument`` for anything else (a used
    capsule, another object)."""
    cdef pkv_DLTensor *t
    cdef ImportedTensor out = ImportedTensor.__new__(ImportedTensor)
    cdef int i
    cdef const char *name
    if PyCapsule_IsValid(capsule, VERSIONED):
        out._versioned = <pkv_DLManagedTensorVersioned *>PyCapsule_GetPointer(capsule, VERSIONED)
        if out._versioned.version.major != 1:
            major = out._versioned.version.major
            out._versioned = NULL  # not ours to delete: the capsule keeps it
            raise InvalidArgument(f"DLPack version {major}.x: this build reads 1.x")
        t = &out._versioned.dl_tensor
        out.version = (out._versioned.version.major, out._versioned.version.minor)
        out.read_only = (out._versioned.flags & FLAG_READ_ONLY) != 0
        PyCapsule_SetName(capsule, USED_VERSIONED)
    elif PyCapsule_IsValid(capsule, LEGACY):
        out._legacy = <pkv_DLManagedTensor *>PyCapsule_GetPointer(capsule, LEGACY)
        t = &out._legacy.dl_tensor
        out.version = (0, 0)
        out.read_only = False
        PyCapsule_SetName(capsule, USED_LEGACY)
    else:
        what = type(capsule).__name__
        if PyCapsule_CheckExact(capsule):
            name = PyCapsule_GetName(capsule)
            what = ("an unnamed capsule" if name == NULL else
                    f"a capsule named {(<bytes>name).decode(errors='replace')!r}")
        raise InvalidArgument(f"DLPack: expected an unconsumed 'dltensor' or "
                              f"'dltensor_versioned' capsule, got {what}")
    out.data = <uint64_t>t.data + t.byte_offset
    out.shape = tuple(t.shape[i] for i in range(t.ndim))
    out.strides = None if t.strides == NULL else tuple(t.strides[i] for i in range(t.ndim))
    out.dtype = (t.dtype.code, t.dtype.bits, t.dtype.lanes)
    out.device = (t.device.device_type, t.device.device_id)
    return out
