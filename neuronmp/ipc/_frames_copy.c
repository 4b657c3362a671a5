/* neuronmp.ipc._frames: copies into, out of and beside shared mappings. */
#include "_frames.h"

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

static int copy_args(PyObject *const *args, Py_ssize_t nargs, const char *name, Py_buffer *view,
                     char **shm, void **mem, Py_ssize_t *n, int writable)
{
    if (check_nargs(nargs, 4, name) < 0)
        return -1;
    *mem = PyLong_AsVoidPtr(args[2]);
    *n = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred())
        return -1;
    if (PyObject_GetBuffer(args[0], view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
        return -1;
    *shm = at(view, args[1], *n);
    if (!*shm) {
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/*
 * memcpy, but a copy bigger than the caches is written with non-temporal
 * (streaming) stores: a plain store first reads each destination line into
 * the cache only to overwrite it, and those reads cost about a third of the
 * bandwidth (docs/performance.md, "Large frames, stop and wait").  SSE2 is baseline on
 * x86-64; other machines keep memcpy.
 */
void bulk_copy(void *dst_, const void *src_, size_t n)
{
#if defined(__x86_64__)
    if (n >= NT_COPY) {
        char *dst = dst_;
        const char *src = src_;
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        memcpy(dst, src, head);
        size_t i = head;
        for (; i + 64 <= n; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
        /* streaming stores are weakly ordered: fence them before the
         * release store that publishes the frame */
        _mm_sfence();
        memcpy(dst + i, src + i, n - i);
        return;
    }
#endif
    memcpy(dst_, src_, n);
}

void big_copy(void *dst, const void *src, Py_ssize_t n)
{
    if (n >= NOGIL_COPY) {
        Py_BEGIN_ALLOW_THREADS
        bulk_copy(dst, src, (size_t)n);
        Py_END_ALLOW_THREADS
    } else if (n > 0) {
        memcpy(dst, src, (size_t)n);
    }
}

/* one copy between the mapping and process memory, `into_shm` saying which way */
static PyObject *copy_shm(PyObject *const *args, Py_ssize_t nargs, const char *name,
                          int into_shm)
{
    Py_buffer view;
    char *shm;
    void *mem;
    Py_ssize_t n;
    if (copy_args(args, nargs, name, &view, &shm, &mem, &n, into_shm) < 0)
        return NULL;
    if (into_shm)
        big_copy(shm, mem, n);
    else
        big_copy(mem, shm, n);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* copy_in(buf, off, src_address, n): n bytes from process memory into the mapping */
PyObject *py_copy_in(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return copy_shm(args, nargs, "copy_in", 1);
}

/* copy_out(buf, off, dst_address, n): n bytes from the mapping into process memory */
PyObject *py_copy_out(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return copy_shm(args, nargs, "copy_out", 0);
}

/* copy(dst_address, src_address, n): process memory to process memory (a
 * received view into a caller's tensor), cache-bypassing when big, GIL
 * released for big copies */
PyObject *py_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs(nargs, 3, "copy") < 0)
        return NULL;
    void *dst = PyLong_AsVoidPtr(args[0]);
    void *src = PyLong_AsVoidPtr(args[1]);
    Py_ssize_t n = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred())
        return NULL;
    if (n < 0 || (n && (!dst || !src))) {
        PyErr_SetString(PyExc_ValueError, "copy(): bad address or size");
        return NULL;
    }
    big_copy(dst, src, n);
    Py_RETURN_NONE;
}

