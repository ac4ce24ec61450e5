# cython: language_level=3
"""What every kernel module shares: argument checks that hand out data pointers, unaligned 64-bit loads, a
write prefetch, the checksum's mix, and the fused element types the kernels are specialised on.

A kernel's ``def`` wrapper checks each array argument once (an ndarray, its element width and kind, 1-D and
contiguous, writeable where written) and takes its data pointer; the loop then runs on pointers without the
GIL. A wrong argument raises ``TypeError``/``ValueError`` instead of reading memory of another layout.
Positions, bounds and addresses the kernels follow are the caller's to validate, as before.
"""

cimport numpy as cnp
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    /* an 8-byte load from any address (memcpy: no alignment or aliasing assumption; one instruction) */
    static inline uint64_t ds_load64(const void *p) { uint64_t v; memcpy(&v, p, 8); return v; }
    /* a hint to fetch the cache line at p for writing (never faults) */
    #define DS_C1 0x9E3779B97F4A7C15ULL
    #define DS_C2 0xBF58476D1CE4E5B9ULL
    #define DS_C3 0x94D049BB133111EBULL
    static inline void ds_prefetch_w(const void *p) {
    #if defined(__GNUC__) || defined(__clang__)
        __builtin_prefetch(p, 1, 3);
    #endif
    }
    """
    uint64_t ds_load64(const void *p) noexcept nogil
    void ds_prefetch_w(const void *p) noexcept nogil
    const uint64_t C1 "DS_C1"
    const uint64_t C2 "DS_C2"
    const uint64_t C3 "DS_C3"

ctypedef fused bits_t:
    uint8_t
    uint16_t
    uint32_t
    uint64_t

# kinds an array argument may have
cdef enum:
    ANY = 0        # any integer or bool dtype (raw bits)
    SIGNED = 1     # a signed integer dtype (positions, bounds, counts)
    UNSIGNED = 2   # an unsigned integer or bool dtype
    ADDRESS = 3    # int64 or uint64 (addresses)
    FLOAT64 = 4    # float64

cdef inline uint64_t fmix(uint64_t x) noexcept nogil:
    x ^= x >> 30
    x *= C2
    x ^= x >> 27
    x *= C3
    x ^= x >> 31
    return x


cdef inline bint _kind_ok(cnp.ndarray a, int kind) noexcept:
    if kind == SIGNED:
        return cnp.PyArray_ISSIGNED(a)
    if kind == UNSIGNED:
        return cnp.PyArray_ISUNSIGNED(a) or cnp.PyArray_ISBOOL(a)
    if kind == ADDRESS:
        return cnp.PyArray_ISINTEGER(a) and cnp.PyArray_ITEMSIZE(a) == 8
    if kind == FLOAT64:
        return cnp.PyArray_TYPE(a) == cnp.NPY_DOUBLE
    return cnp.PyArray_ISINTEGER(a) or cnp.PyArray_ISBOOL(a)


cdef inline char* arr(object a, Py_ssize_t itemsize, int kind, bint write, str name) except? NULL:
    """The data pointer of ``a``: a 1-D contiguous ndarray of ``itemsize``-byte elements of ``kind``
    (``itemsize`` 0: any width), writeable if ``write``; else ``TypeError``/``ValueError``."""
    if not cnp.PyArray_Check(a):
        raise TypeError(f"{name}: expected a numpy array, got {type(a).__name__}")
    cdef cnp.ndarray x = <cnp.ndarray>a
    if (itemsize and cnp.PyArray_ITEMSIZE(x) != itemsize) or not _kind_ok(x, kind):
        raise TypeError(f"{name}: unexpected dtype {x.dtype}")
    if cnp.PyArray_NDIM(x) != 1 or not cnp.PyArray_IS_C_CONTIGUOUS(x):
        raise ValueError(f"{name}: expected a 1-D contiguous array")
    if write and not cnp.PyArray_ISWRITEABLE(x):
        raise ValueError(f"{name}: array is read-only")
    return <char*>cnp.PyArray_DATA(x)


cdef inline char* arr2(object a, bint write, str name, Py_ssize_t* rows, Py_ssize_t* cols,
                       Py_ssize_t* row_stride, Py_ssize_t* col_stride) except? NULL:
    """The data pointer of a 2-D uint8 array of any strides (a column slice or a transpose of planes), its shape
    and its strides in bytes."""
    if not cnp.PyArray_Check(a):
        raise TypeError(f"{name}: expected a numpy array, got {type(a).__name__}")
    cdef cnp.ndarray x = <cnp.ndarray>a
    if cnp.PyArray_ITEMSIZE(x) != 1 or not (cnp.PyArray_ISUNSIGNED(x) or cnp.PyArray_ISBOOL(x)):
        raise TypeError(f"{name}: unexpected dtype {x.dtype}")
    if cnp.PyArray_NDIM(x) != 2:
        raise ValueError(f"{name}: expected a 2-D array")
    if write and not cnp.PyArray_ISWRITEABLE(x):
        raise ValueError(f"{name}: array is read-only")
    rows[0] = cnp.PyArray_DIM(x, 0)
    cols[0] = cnp.PyArray_DIM(x, 1)
    row_stride[0] = cnp.PyArray_STRIDE(x, 0)
    col_stride[0] = cnp.PyArray_STRIDE(x, 1)
    return <char*>cnp.PyArray_DATA(x)


cdef inline Py_ssize_t size(object a) noexcept:
    """Elements of an array already checked by :func:`arr`."""
    return cnp.PyArray_SIZE(<cnp.ndarray>a)


cdef inline int width_of(object like) except -1:
    """The element width of ``like`` (an array whose dtype names the kernel's element type): 1, 2, 4 or 8."""
    if not cnp.PyArray_Check(like):
        raise TypeError(f"like: expected a numpy array, got {type(like).__name__}")
    cdef int w = <int>cnp.PyArray_ITEMSIZE(<cnp.ndarray>like)
    if w != 1 and w != 2 and w != 4 and w != 8:
        raise TypeError(f"like: element width {w} is not 1, 2, 4 or 8")
    return w


cdef extern from "_simd.h":
    uint64_t ds_mix_dense_1(const uint8_t* b, int64_t start, int64_t stop, uint64_t key) noexcept nogil
    uint64_t ds_mix_dense_2(const uint16_t* b, int64_t start, int64_t stop, uint64_t key) noexcept nogil
    uint64_t ds_mix_dense_4(const uint32_t* b, int64_t start, int64_t stop, uint64_t key) noexcept nogil
    uint64_t ds_mix_dense_8(const uint64_t* b, int64_t start, int64_t stop, uint64_t key) noexcept nogil
    uint64_t ds_mix_sparse_1(const int64_t* p, const uint8_t* b, int64_t start, int64_t stop,
                             uint64_t key) noexcept nogil
    uint64_t ds_mix_sparse_2(const int64_t* p, const uint16_t* b, int64_t start, int64_t stop,
                             uint64_t key) noexcept nogil
    uint64_t ds_mix_sparse_4(const int64_t* p, const uint32_t* b, int64_t start, int64_t stop,
                             uint64_t key) noexcept nogil
    uint64_t ds_mix_sparse_8(const int64_t* p, const uint64_t* b, int64_t start, int64_t stop,
                             uint64_t key) noexcept nogil


cdef inline uint64_t mix_dense(const bits_t* bits, int64_t start, int64_t stop, uint64_t key) noexcept nogil:
    """``sum(mix(key, i, bits[i]) for i in range(start, stop)) mod 2**64`` (see ``kernels/checksum.py``)."""
    if bits_t is uint8_t:
        return ds_mix_dense_1(bits, start, stop, key)
    elif bits_t is uint16_t:
        return ds_mix_dense_2(bits, start, stop, key)
    elif bits_t is uint32_t:
        return ds_mix_dense_4(bits, start, stop, key)
    else:
        return ds_mix_dense_8(bits, start, stop, key)


cdef inline uint64_t mix_sparse(const int64_t* positions, const bits_t* bits, int64_t start, int64_t stop,
                                uint64_t key) noexcept nogil:
    """``sum(mix(key, positions[i], bits[i]) for i in range(start, stop)) mod 2**64``."""
    if bits_t is uint8_t:
        return ds_mix_sparse_1(positions, bits, start, stop, key)
    elif bits_t is uint16_t:
        return ds_mix_sparse_2(positions, bits, start, stop, key)
    elif bits_t is uint32_t:
        return ds_mix_sparse_4(positions, bits, start, stop, key)
    else:
        return ds_mix_sparse_8(positions, bits, start, stop, key)
