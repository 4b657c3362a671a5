/*
 * neuronmp.ipc._sync: the few things Python cannot do safely on shared memory.
 *
 *   - acquire loads / release stores of 64-bit counters inside a mapping, so a
 *     frame's bytes are visible before the counter that publishes them, on
 *     aarch64 as well as x86-64;
 *   - futex wait (with timeout) / wake on the low 32 bits of such a counter.
 *     The mapping is shared between processes, so the futex ops are the
 *     non-PRIVATE ones (keyed by the page, not the address space);
 *   - the whole wait loop -- bounded spin, then futex sleep -- with the GIL
 *     released, so other Python threads keep running while one waits;
 *   - memcpy into / out of the mapping, GIL released for large copies.
 *
 * Every function takes the mapping as a Python buffer (the mmap object) plus
 * byte offsets, and holds the buffer for the duration of the call: a
 * concurrent mmap.close() then fails with BufferError instead of unmapping
 * memory under a sleeping waiter.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <sched.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if PY_BIG_ENDIAN
#define LOW_WORD_OFFSET 4
#else
#define LOW_WORD_OFFSET 0
#endif

/* copies at least this big run with the GIL released */
#define NOGIL_COPY 65536

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#endif
}

static inline double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static long futex_wait(uint32_t *word, uint32_t expected, double timeout)
{
    struct timespec ts;
    if (timeout < 0)
        timeout = 0;
    ts.tv_sec = (time_t)timeout;
    ts.tv_nsec = (long)((timeout - (double)ts.tv_sec) * 1e9);
    return syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, NULL, 0);
}

static long futex_wake(uint32_t *word)
{
    return syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Resolve buffer + offset into a pointer to `size` bytes, 8-byte aligned. */
static char *at(Py_buffer *view, PyObject *off_obj, Py_ssize_t size)
{
    Py_ssize_t off = PyLong_AsSsize_t(off_obj);
    if (off == -1 && PyErr_Occurred())
        return NULL;
    if (off < 0 || size < 0 || off > view->len - size) {
        PyErr_Format(PyExc_IndexError,
                     "offset %zd + size %zd outside the mapping of %zd bytes",
                     off, size, view->len);
        return NULL;
    }
    return (char *)view->buf + off;
}

static char *counter_at(Py_buffer *view, PyObject *off_obj)
{
    char *p = at(view, off_obj, 8);
    if (p && ((uintptr_t)p & 7)) {
        PyErr_SetString(PyExc_ValueError, "counter offset is not 8-byte aligned");
        return NULL;
    }
    return p;
}

static int check_nargs(Py_ssize_t nargs, Py_ssize_t want, const char *name)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
        return -1;
    }
    return 0;
}

/* load(buf, off) -> int: acquire load of the u64 at off */
static PyObject *py_load(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    if (check_nargs(nargs, 2, "load") < 0 || PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    char *p = counter_at(&view, args[1]);
    uint64_t v = p ? __atomic_load_n((uint64_t *)p, __ATOMIC_ACQUIRE) : 0;
    PyBuffer_Release(&view);
    return p ? PyLong_FromUnsignedLongLong(v) : NULL;
}

/* store(buf, off, value): release store of the u64 at off */
static PyObject *py_store(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    if (check_nargs(nargs, 3, "store") < 0)
        return NULL;
    unsigned long long v = PyLong_AsUnsignedLongLong(args[2]);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) < 0)
        return NULL;
    char *p = counter_at(&view, args[1]);
    if (p)
        __atomic_store_n((uint64_t *)p, (uint64_t)v, __ATOMIC_RELEASE);
    PyBuffer_Release(&view);
    if (!p)
        return NULL;
    Py_RETURN_NONE;
}

/*
 * publish(buf, off_counter, value, off_sleeping) -> bool
 * Store the counter (release, and sequentially consistent so the following
 * load of the sleeping flag cannot move before it: Dekker with the waiter's
 * "set flag, re-read counter"), then wake the peer only if it sleeps.
 */
static PyObject *py_publish(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    if (check_nargs(nargs, 4, "publish") < 0)
        return NULL;
    unsigned long long v = PyLong_AsUnsignedLongLong(args[2]);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) < 0)
        return NULL;
    char *ctr = counter_at(&view, args[1]);
    char *flag = ctr ? at(&view, args[3], 4) : NULL;
    int woke = 0;
    if (flag) {
        __atomic_store_n((uint64_t *)ctr, (uint64_t)v, __ATOMIC_SEQ_CST);
        if (__atomic_load_n((uint32_t *)flag, __ATOMIC_SEQ_CST)) {
            futex_wake((uint32_t *)(ctr + LOW_WORD_OFFSET));
            woke = 1;
        }
    }
    PyBuffer_Release(&view);
    if (!flag)
        return NULL;
    return PyBool_FromLong(woke);
}

/* wake(buf, off_counter): wake every sleeper on that counter (used by close) */
static PyObject *py_wake(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    if (check_nargs(nargs, 2, "wake") < 0 || PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    char *ctr = counter_at(&view, args[1]);
    if (ctr)
        futex_wake((uint32_t *)(ctr + LOW_WORD_OFFSET));
    PyBuffer_Release(&view);
    if (!ctr)
        return NULL;
    Py_RETURN_NONE;
}

/*
 * wait(buf, off_counter, old, off_sleeping, off_closed, spin_s, timeout_s) -> int
 * Wait until the u64 counter differs from `old`, the u32 at off_closed becomes
 * non-zero, or timeout_s passes; return the counter's value (== old when it
 * did not move).  Spins up to spin_s first, then sleeps on a futex with the
 * sleeping flag raised so the writer knows to wake us.  GIL released.
 */
static PyObject *py_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    if (check_nargs(nargs, 7, "wait") < 0)
        return NULL;
    unsigned long long old = PyLong_AsUnsignedLongLong(args[2]);
    if (old == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    double spin = PyFloat_AsDouble(args[5]);
    double timeout = PyFloat_AsDouble(args[6]);
    if (PyErr_Occurred())
        return NULL;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) < 0)
        return NULL;
    char *ctr_p = counter_at(&view, args[1]);
    char *flag_p = ctr_p ? at(&view, args[3], 4) : NULL;
    char *closed_p = flag_p ? at(&view, args[4], 4) : NULL;
    if (!closed_p) {
        PyBuffer_Release(&view);
        return NULL;
    }
    uint64_t *ctr = (uint64_t *)ctr_p;
    uint32_t *flag = (uint32_t *)flag_p, *closed = (uint32_t *)closed_p;
    uint32_t *word = (uint32_t *)(ctr_p + LOW_WORD_OFFSET);
    uint64_t v = __atomic_load_n(ctr, __ATOMIC_ACQUIRE);

    if (v == old && timeout > 0) {
        Py_BEGIN_ALLOW_THREADS
        double t0 = now_s();
        double deadline = t0 + timeout;
        double spin_end = t0 + (spin < timeout ? spin : timeout);
        unsigned i = 0;
        for (;;) {
            v = __atomic_load_n(ctr, __ATOMIC_ACQUIRE);
            if (v != old || __atomic_load_n(closed, __ATOMIC_RELAXED))
                goto done;
            if (++i < 256) {
                cpu_relax();
                continue;
            }
            if (now_s() >= spin_end)
                break;
            /* on a busy host our spinning would keep the very peer we wait
             * for off the CPU: give the CPU away while we poll */
            sched_yield();
        }
        for (;;) {
            __atomic_store_n(flag, 1, __ATOMIC_SEQ_CST);
            v = __atomic_load_n(ctr, __ATOMIC_SEQ_CST);
            if (v != old || __atomic_load_n(closed, __ATOMIC_SEQ_CST))
                break;
            double left = deadline - now_s();
            if (left <= 0)
                break;
            futex_wait(word, (uint32_t)old, left);
        }
        __atomic_store_n(flag, 0, __ATOMIC_RELAXED);
        v = __atomic_load_n(ctr, __ATOMIC_ACQUIRE);
    done:;
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(v);
}

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

static void big_copy(void *dst, const void *src, Py_ssize_t n)
{
    if (n >= NOGIL_COPY) {
        Py_BEGIN_ALLOW_THREADS
        memcpy(dst, src, (size_t)n);
        Py_END_ALLOW_THREADS
    } else if (n > 0) {
        memcpy(dst, src, (size_t)n);
    }
}

/* copy_in(buf, off, src_address, n): n bytes from process memory into the mapping */
static PyObject *py_copy_in(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    char *shm;
    void *mem;
    Py_ssize_t n;
    if (copy_args(args, nargs, "copy_in", &view, &shm, &mem, &n, 1) < 0)
        return NULL;
    big_copy(shm, mem, n);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* copy_out(buf, off, dst_address, n): n bytes from the mapping into process memory */
static PyObject *py_copy_out(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    char *shm;
    void *mem;
    Py_ssize_t n;
    if (copy_args(args, nargs, "copy_out", &view, &shm, &mem, &n, 0) < 0)
        return NULL;
    big_copy(mem, shm, n);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"load", (PyCFunction)(void (*)(void))py_load, METH_FASTCALL, "acquire load of a u64"},
    {"store", (PyCFunction)(void (*)(void))py_store, METH_FASTCALL, "release store of a u64"},
    {"publish", (PyCFunction)(void (*)(void))py_publish, METH_FASTCALL,
     "store a counter, wake the peer if it sleeps"},
    {"wake", (PyCFunction)(void (*)(void))py_wake, METH_FASTCALL, "wake all sleepers"},
    {"wait", (PyCFunction)(void (*)(void))py_wait, METH_FASTCALL,
     "spin then futex-sleep until a counter moves (GIL released)"},
    {"copy_in", (PyCFunction)(void (*)(void))py_copy_in, METH_FASTCALL, "memcpy into mapping"},
    {"copy_out", (PyCFunction)(void (*)(void))py_copy_out, METH_FASTCALL, "memcpy from mapping"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "neuronmp.ipc._sync",
    "Atomics, futexes and GIL-free copies on shared mappings.", -1, methods,
};

PyMODINIT_FUNC PyInit__sync(void)
{
    return PyModule_Create(&module);
}
