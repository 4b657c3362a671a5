/*
 * What neuronmp.shm._waits and neuronmp.ipc._frames share: byte offsets into a
 * Python buffer (a shared mapping), and the publish step -- a counter stored
 * with sequential consistency, then a futex wake only if the peer said it
 * sleeps.  Everything here is static inline: each extension gets its own copy.
 */
#ifndef NEURONMP_IPC_SHM_H
#define NEURONMP_IPC_SHM_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* a futex is 32 bits: a waiter on a u64 counter sleeps on its low word */
#if PY_BIG_ENDIAN
#define LOW_WORD_OFFSET 4
#else
#define LOW_WORD_OFFSET 0
#endif

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

static inline long futex_wake(uint32_t *word)
{
    return syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Resolve buffer + offset into a pointer to `size` bytes, 8-byte aligned. */
static inline char *at(Py_buffer *view, PyObject *off_obj, Py_ssize_t size)
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

static inline char *counter_at(Py_buffer *view, PyObject *off_obj)
{
    char *p = at(view, off_obj, 8);
    if (p && ((uintptr_t)p & 7)) {
        PyErr_SetString(PyExc_ValueError, "counter offset is not 8-byte aligned");
        return NULL;
    }
    return p;
}

static inline int check_nargs(Py_ssize_t nargs, Py_ssize_t want, const char *name)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
        return -1;
    }
    return 0;
}

/* Store a counter (release, and sequentially consistent so that the following
 * load of the sleeping flag cannot move before it: Dekker with the waiter's
 * "set flag, re-read counter"), then wake the peer only if it sleeps.
 * 1 when a wake-up was sent. */
static inline int publish_at(char *ctr, char *flag, uint64_t v)
{
    __atomic_store_n((uint64_t *)ctr, v, __ATOMIC_SEQ_CST);
    if (!__atomic_load_n((uint32_t *)flag, __ATOMIC_SEQ_CST))
        return 0;
    futex_wake((uint32_t *)(ctr + LOW_WORD_OFFSET));
    return 1;
}

#endif
