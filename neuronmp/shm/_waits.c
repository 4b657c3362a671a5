/*
 * neuronmp.shm._waits: the waits and atomics Python cannot do safely.
 *
 *   - acquire loads / release stores of 64-bit counters inside a shared
 *     mapping, so a frame's bytes are visible before the counter that
 *     publishes them, on aarch64 as well as x86-64;
 *   - an atomic fetch-and-add on such a counter (an arrival ticket: the rank
 *     that draws the last one knows every peer's writes before it are done),
 *     and a publish that wakes a counter's sleepers when any of several
 *     waiters' flags says one sleeps;
 *   - futex wait (with timeout) / wake on the low 32 bits of such a counter.
 *     The mapping is shared between processes, so the futex ops are the
 *     non-PRIVATE ones (keyed by the page, not the address space);
 *   - the whole wait loop -- bounded spin, then futex sleep -- with the GIL
 *     released, so other Python threads keep running while one waits;
 *   - flags: one-shot events between threads of one process (answer slots);
 *   - a sleep until a moment of the monotonic clock (an answer's due time).
 *
 * Every function on a mapping takes it as a Python buffer (the mmap object)
 * plus byte offsets, and holds the buffer for the duration of the call: a
 * concurrent mmap.close() then fails with BufferError instead of unmapping
 * memory under a sleeping waiter.
 */
#include "_shm.h"

#include <sys/prctl.h>

static long futex_wait(uint32_t *word, uint32_t expected, double timeout)
{
    struct timespec ts;
    if (timeout < 0)
        timeout = 0;
    ts.tv_sec = (time_t)timeout;
    ts.tv_nsec = (long)((timeout - (double)ts.tv_sec) * 1e9);
    return syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, NULL, 0);
}

/* The u64 counter at args[1] of the buffer args[0]; on success the view is
 * held (release it), on failure it is released and NULL returned. */
static char *counter_arg(PyObject *const *args, Py_buffer *view, int flags)
{
    if (PyObject_GetBuffer(args[0], view, flags) < 0)
        return NULL;
    char *p = counter_at(view, args[1]);
    if (!p)
        PyBuffer_Release(view);
    return p;
}

/* The writable u64 counter at args[1] of args[0] and the u64 value at args[2], for
 * a call of `want` arguments; as counter_arg, the view is held on success. */
static char *counter_and_value(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want,
                               const char *name, Py_buffer *view, uint64_t *value)
{
    if (check_nargs(nargs, want, name) < 0)
        return NULL;
    unsigned long long v = PyLong_AsUnsignedLongLong(args[2]);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    *value = (uint64_t)v;
    return counter_arg(args, view, PyBUF_WRITABLE);
}

/* load(buf, off) -> int: acquire load of the u64 at off */
static PyObject *py_load(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    char *p;
    if (check_nargs(nargs, 2, "load") < 0 || !(p = counter_arg(args, &view, PyBUF_SIMPLE)))
        return NULL;
    uint64_t v = __atomic_load_n((uint64_t *)p, __ATOMIC_ACQUIRE);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(v);
}

/* store(buf, off, value): release store of the u64 at off */
static PyObject *py_store(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    uint64_t v;
    char *p = counter_and_value(args, nargs, 3, "store", &view, &v);
    if (!p)
        return NULL;
    __atomic_store_n((uint64_t *)p, v, __ATOMIC_RELEASE);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* publish(buf, off_counter, value, off_sleeping) -> bool: publish_at (_shm.h) */
static PyObject *py_publish(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    uint64_t v;
    char *ctr = counter_and_value(args, nargs, 4, "publish", &view, &v);
    if (!ctr)
        return NULL;
    char *flag = at(&view, args[3], 4);
    int woke = flag ? publish_at(ctr, flag, v) : 0;
    PyBuffer_Release(&view);
    if (!flag)
        return NULL;
    return PyBool_FromLong(woke);
}

/* fetch_add(buf, off, delta) -> int: the u64 at off before adding delta,
 * sequentially consistent (a full barrier: what this process wrote before it is
 * visible to whoever draws a later ticket) */
static PyObject *py_fetch_add(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    uint64_t d;
    char *p = counter_and_value(args, nargs, 3, "fetch_add", &view, &d);
    if (!p)
        return NULL;
    uint64_t old = __atomic_fetch_add((uint64_t *)p, d, __ATOMIC_SEQ_CST);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(old);
}

/* publish_any(buf, off_counter, value, off_flags, nflags) -> bool: store the
 * counter (sequentially consistent, as publish_at), then make one wake system
 * call if any of the nflags u32 sleeping flags from off_flags on is raised:
 * several waiters sleep on one counter, each behind a flag of its own. */
static PyObject *py_publish_any(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    uint64_t v;
    if (check_nargs(nargs, 5, "publish_any") < 0)
        return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(args[4]);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "publish_any: nflags must be >= 0, not %zd", n);
        return NULL;
    }
    char *ctr = counter_and_value(args, nargs, 5, "publish_any", &view, &v);
    if (!ctr)
        return NULL;
    char *flags = at(&view, args[3], 4 * n);
    int woke = 0;
    if (flags) {
        __atomic_store_n((uint64_t *)ctr, v, __ATOMIC_SEQ_CST);
        for (Py_ssize_t i = 0; i < n && !woke; i++)
            woke = __atomic_load_n((uint32_t *)flags + i, __ATOMIC_SEQ_CST) != 0;
        if (woke)
            futex_wake((uint32_t *)(ctr + LOW_WORD_OFFSET));
    }
    PyBuffer_Release(&view);
    if (!flags)
        return NULL;
    return PyBool_FromLong(woke);
}

/* wake(buf, off_counter): wake every sleeper on that counter (used by close) */
static PyObject *py_wake(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    char *ctr;
    if (check_nargs(nargs, 2, "wake") < 0 || !(ctr = counter_arg(args, &view, PyBUF_SIMPLE)))
        return NULL;
    futex_wake((uint32_t *)(ctr + LOW_WORD_OFFSET));
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/*
 * wait(buf, off_counter, old, off_sleeping, off_closed, spin_s, timeout_s
 *      [, pause_s]) -> int
 * Wait until the u64 counter differs from `old`, the u32 at off_closed becomes
 * non-zero, or timeout_s passes; return the counter's value (== old when it
 * did not move).  GIL released.  Three stages:
 *   - the first pause_s (default 20 us) spin on the counter with cpu_relax:
 *     a peer answering a small message does so within a few microseconds,
 *     and giving the CPU away now would cost more than that to get it back;
 *   - until spin_s, poll with sched_yield between reads: on a busy host the
 *     peer may be waiting for this very CPU;
 *   - then sleep on a futex with the sleeping flag raised, so the writer
 *     knows to wake us (and only then makes the wake syscall).
 */
static PyObject *py_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    if (nargs != 8 && check_nargs(nargs, 7, "wait") < 0)
        return NULL;
    unsigned long long old = PyLong_AsUnsignedLongLong(args[2]);
    if (old == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    double spin = PyFloat_AsDouble(args[5]);
    double timeout = PyFloat_AsDouble(args[6]);
    double pause = nargs == 8 ? PyFloat_AsDouble(args[7]) : 20e-6;
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
        if (spin > timeout)
            spin = timeout;
        double pause_end = t0 + (pause < spin ? pause : spin);
        double spin_end = t0 + spin;
        unsigned i = 0;
        for (;;) {
            v = __atomic_load_n(ctr, __ATOMIC_ACQUIRE);
            if (v != old || __atomic_load_n(closed, __ATOMIC_RELAXED))
                goto done;
            cpu_relax();
            if ((++i & 63) == 0 && now_s() >= pause_end)
                break;
        }
        while (now_s() < spin_end) {
            sched_yield();
            v = __atomic_load_n(ctr, __ATOMIC_ACQUIRE);
            if (v != old || __atomic_load_n(closed, __ATOMIC_RELAXED))
                goto done;
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

/*
 * Flags: one-shot events between threads of this process, for answer slots.
 * A flag is a bytearray of at least 4 bytes whose first u32 is 0 (unset),
 * 1 (set) or 2 (unset, and someone sleeps on it).  flag_wait sleeps on it
 * with the GIL released; flags_set sets many and wakes their sleepers in one
 * call, also with the GIL released: a batch of answers costs its futex
 * wake-ups outside the GIL instead of one lock release each inside it.
 */
static uint32_t *flag_word(PyObject *obj)
{
    if (!PyByteArray_Check(obj) || PyByteArray_GET_SIZE(obj) < 4) {
        PyErr_SetString(PyExc_TypeError, "a flag is a bytearray of at least 4 bytes");
        return NULL;
    }
    return (uint32_t *)PyByteArray_AS_STRING(obj);
}

/* flag_wait(flag, timeout) -> bool: wait until set (timeout < 0: forever) */
static PyObject *py_flag_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs(nargs, 2, "flag_wait") < 0)
        return NULL;
    uint32_t *w = flag_word(args[0]);
    double timeout = PyFloat_AsDouble(args[1]);
    if (!w || (timeout == -1.0 && PyErr_Occurred()))
        return NULL;
    if (__atomic_load_n(w, __ATOMIC_ACQUIRE) == 1)
        Py_RETURN_TRUE;
    double deadline = now_s() + timeout;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        uint32_t zero = 0;
        __atomic_compare_exchange_n(w, &zero, 2, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
        /* a bounded sleep, so that signals reach the main thread's handlers */
        double left = timeout < 0 ? 0.05 : deadline - now_s();
        if (left > 0.05)
            left = 0.05;
        if (__atomic_load_n(w, __ATOMIC_ACQUIRE) != 1 && left > 0) {
            struct timespec ts = {(time_t)left, (long)((left - (double)(time_t)left) * 1e9)};
            syscall(SYS_futex, w, FUTEX_WAIT_PRIVATE, 2, &ts, NULL, 0);
        }
        Py_END_ALLOW_THREADS
        if (__atomic_load_n(w, __ATOMIC_ACQUIRE) == 1)
            Py_RETURN_TRUE;
        /* after every slice, not only on EINTR: a signal that came just before the
         * futex call interrupts nothing, and its handler would wait for the flag */
        if (PyErr_CheckSignals() < 0)
            return NULL;
        if (timeout >= 0 && now_s() >= deadline)
            Py_RETURN_FALSE;
    }
}

/* flags_set(flags): set every flag of a list or tuple and wake their sleepers */
static PyObject *py_flags_set(PyObject *self, PyObject *seq)
{
    PyObject *fast = PySequence_Fast(seq, "flags_set takes a list or tuple of flags");
    if (!fast)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    uint32_t *stack[64], **words = n <= 64 ? stack : PyMem_Malloc(n * sizeof *words);
    if (!words) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!(words[i] = flag_word(PySequence_Fast_GET_ITEM(fast, i)))) {
            if (words != stack)
                PyMem_Free(words);
            Py_DECREF(fast);
            return NULL;
        }
    }
    /* set them all first; only flags with a sleeper need a system call, and only
     * then is the GIL let go (the list keeps the bytearrays alive meanwhile) */
    Py_ssize_t sleepers = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (__atomic_exchange_n(words[i], 1, __ATOMIC_ACQ_REL) == 2)
            words[sleepers++] = words[i];
    if (sleepers) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < sleepers; i++)
            syscall(SYS_futex, words[i], FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
        Py_END_ALLOW_THREADS
    }
    if (words != stack)
        PyMem_Free(words);
    Py_DECREF(fast);
    Py_RETURN_NONE;
}

/*
 * sleep_until(target_ns, wake_ns) -> int
 * Sleep (GIL released) until CLOCK_MONOTONIC (time.perf_counter_ns) reaches
 * wake_ns, then spin until target_ns; return how many ns after wake_ns the sleep
 * ended (what the caller learns its spin margin from).  The sleep runs with this
 * thread's timer slack at 1 ns: the default 50 us would be added to every wait
 * for a due answer.  The caller's own slack is restored before returning.
 */
static PyObject *py_sleep_until(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs(nargs, 2, "sleep_until") < 0)
        return NULL;
    long long target = PyLong_AsLongLong(args[0]);
    long long wake = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    if (wake > target)
        wake = target;
    long long late = 0;
    Py_BEGIN_ALLOW_THREADS
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    long long t = (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
    if (t < wake) {
        struct timespec ts = {(time_t)(wake / 1000000000LL), (long)(wake % 1000000000LL)};
        int slack = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
        if (slack > 1)
            prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0);
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
            ;
        if (slack > 1)
            prctl(PR_SET_TIMERSLACK, (unsigned long)slack, 0, 0, 0);
        clock_gettime(CLOCK_MONOTONIC, &now);
        t = (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
        late = t > wake ? t - wake : 0;
    }
    while (t < target) {
        cpu_relax();
        clock_gettime(CLOCK_MONOTONIC, &now);
        t = (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(late);
}


static PyMethodDef methods[] = {
    {"load", (PyCFunction)(void (*)(void))py_load, METH_FASTCALL, "acquire load of a u64"},
    {"store", (PyCFunction)(void (*)(void))py_store, METH_FASTCALL, "release store of a u64"},
    {"publish", (PyCFunction)(void (*)(void))py_publish, METH_FASTCALL,
     "store a counter, wake the peer if it sleeps"},
    {"wake", (PyCFunction)(void (*)(void))py_wake, METH_FASTCALL, "wake all sleepers"},
    {"fetch_add", (PyCFunction)(void (*)(void))py_fetch_add, METH_FASTCALL,
     "atomic fetch-and-add on a u64 (sequentially consistent)"},
    {"publish_any", (PyCFunction)(void (*)(void))py_publish_any, METH_FASTCALL,
     "store a counter, wake its sleepers if any of several flags is raised"},
    {"wait", (PyCFunction)(void (*)(void))py_wait, METH_FASTCALL,
     "spin then futex-sleep until a counter moves (GIL released)"},
    {"flag_wait", (PyCFunction)(void (*)(void))py_flag_wait, METH_FASTCALL,
     "wait until a flag is set (GIL released)"},
    {"flags_set", (PyCFunction)py_flags_set, METH_O,
     "set flags and wake their waiters (GIL released)"},
    {"sleep_until", (PyCFunction)(void (*)(void))py_sleep_until, METH_FASTCALL,
     "sleep until a monotonic-clock moment, spinning through the last part"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "neuronmp.shm._waits",
    "Atomics and futex waits on shared mappings; one-shot flags between threads.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__waits(void)
{
    return PyModule_Create(&module);
}
