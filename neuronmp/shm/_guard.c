/*
 * neuronmp.shm._guard: copies between a file mapping and process memory that a
 * file shrunk under them cannot turn into a process kill.
 *
 * A mapping touched past its file's end raises SIGBUS, whose default kills the
 * process.  The server maps files a client owns (system shared-memory regions,
 * server/shm.py), and the client may ftruncate one at any moment, so every copy
 * on such a mapping runs guarded:
 *
 *     guarded copy (GIL released)              SIGBUS handler (process-wide)
 *     sigsetjmp(jmp) ─ 0 ─▶ this thread's      fault, and this thread is in a
 *         guard = {&jmp, operand ranges}       guarded copy at an address of its
 *         memcpy                         ◀──── operands?  siglongjmp(jmp, 1)
 *         guard = {0}  ─▶ True                 else: pass it on to the disposition
 *     sigsetjmp ─ 1 ─▶ guard = {0} ─▶ False     that was there before (faulthandler,
 *                                              the default: the process dies as before)
 *
 * The handler is installed once, at the first guarded copy (so after a
 * faulthandler.enable() at start-up, which it then chains to).  If something
 * replaces it later (signal.signal, faulthandler enabled again) nothing is
 * copied any more: every copy returns False without touching memory and the
 * caller takes its slower path that needs no guard (pread/pwrite).
 *
 * The per-thread guard is initial-exec TLS: the handler reads it without the
 * lazy allocation a dlopened module's TLS may otherwise need on first use, which
 * is not safe in a signal handler.  Interrupting memcpy and jumping out of it is
 * sound: it holds no lock and no state beyond its registers.
 *
 *   ready() -> bool                  the handler is (now) installed and in place
 *   copy(dst_address, src_address, n) -> bool
 *   read(buf, off, dst_address, n) -> bool     n bytes of buffer buf at off out
 *   write(buf, off, src_address, n) -> bool    n bytes into buffer buf at off
 * True: copied; False: a SIGBUS on an operand ended the copy part-way (or the
 * handler is not in place and nothing was copied).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>

/* copies at least this big run with the GIL released */
#define NOGIL_COPY 65536

struct guard {
    sigjmp_buf *jmp;
    uintptr_t lo[2], hi[2];
};

static __thread struct guard guard __attribute__((tls_model("initial-exec")));
static struct sigaction previous;
static int installed;   /* changed under the GIL only */

static int inside(const struct guard *g, uintptr_t a)
{
    return (a >= g->lo[0] && a < g->hi[0]) || (a >= g->lo[1] && a < g->hi[1]);
}

/* The disposition that was there before ours: a handler is called; the default
 * (or ignore, which a fault overrides) is restored and the signal raised again,
 * so the process dies of it once this handler returns, as it would have. */
static void pass_on(int sig, siginfo_t *info, void *ctx)
{
    if (previous.sa_flags & SA_SIGINFO) {
        previous.sa_sigaction(sig, info, ctx);
        return;
    }
    if (previous.sa_handler == SIG_IGN && info->si_code <= 0)
        return;   /* a sent SIGBUS that was ignored before stays ignored */
    if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
        previous.sa_handler(sig);
        return;
    }
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, NULL);
    raise(sig);
}

static void on_sigbus(int sig, siginfo_t *info, void *ctx)
{
    struct guard *g = &guard;
    sigjmp_buf *jmp = g->jmp;
    /* si_code > 0: raised by the kernel for a fault, not sent by kill() */
    if (jmp && info->si_code > 0 && inside(g, (uintptr_t)info->si_addr)) {
        g->jmp = NULL;
        siglongjmp(*jmp, 1);
    }
    pass_on(sig, info, ctx);
}

/* Install the handler the first time; 1 when it is the current disposition. */
static int ensure_installed(void)
{
    struct sigaction cur;
    if (sigaction(SIGBUS, NULL, &cur) < 0)
        return 0;
    if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_sigbus)
        return 1;
    if (installed)
        return 0;   /* replaced since: chaining again could loop through a stale handler */
    struct sigaction act;
    memset(&act, 0, sizeof act);
    act.sa_sigaction = on_sigbus;
    act.sa_flags = SA_SIGINFO;
    sigemptyset(&act.sa_mask);
    previous = cur;
    if (sigaction(SIGBUS, &act, NULL) < 0)
        return 0;
    installed = 1;
    return 1;
}

static int guarded_memcpy(char *dst, const char *src, size_t n)
{
    sigjmp_buf jmp;
    struct guard *g = &guard;
    /* savemask 1: the jump out of the handler unblocks SIGBUS again */
    if (sigsetjmp(jmp, 1)) {
        g->jmp = NULL;
        return 0;
    }
    g->lo[0] = (uintptr_t)dst;
    g->hi[0] = (uintptr_t)dst + n;
    g->lo[1] = (uintptr_t)src;
    g->hi[1] = (uintptr_t)src + n;
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    g->jmp = &jmp;
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    memcpy(dst, src, n);
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    g->jmp = NULL;
    return 1;
}

static PyObject *run(char *dst, const char *src, Py_ssize_t n)
{
    int ok;
    if (!ensure_installed())
        Py_RETURN_FALSE;
    if (n >= NOGIL_COPY) {
        Py_BEGIN_ALLOW_THREADS
        ok = guarded_memcpy(dst, src, (size_t)n);
        Py_END_ALLOW_THREADS
    } else {
        ok = n > 0 ? guarded_memcpy(dst, src, (size_t)n) : 1;
    }
    return PyBool_FromLong(ok);
}

static int check_nargs(Py_ssize_t nargs, Py_ssize_t want, const char *name)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
        return -1;
    }
    return 0;
}

static PyObject *py_ready(PyObject *self, PyObject *unused)
{
    return PyBool_FromLong(ensure_installed());
}

static PyObject *py_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs(nargs, 3, "copy") < 0)
        return NULL;
    char *dst = PyLong_AsVoidPtr(args[0]);
    const char *src = PyLong_AsVoidPtr(args[1]);
    Py_ssize_t n = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred())
        return NULL;
    if (n < 0 || (n && (!dst || !src))) {
        PyErr_Format(PyExc_ValueError, "copy(): bad address or size %zd", n);
        return NULL;
    }
    return run(dst, src, n);
}

/* buf[off, off + n) of a buffer (the mapping), n bytes of memory at an address */
static PyObject *on_buffer(PyObject *const *args, Py_ssize_t nargs, const char *name,
                           int writable)
{
    if (check_nargs(nargs, 4, name) < 0)
        return NULL;
    Py_ssize_t off = PyLong_AsSsize_t(args[1]);
    char *mem = PyLong_AsVoidPtr(args[2]);
    Py_ssize_t n = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *out;
    if (off < 0 || n < 0 || off > view.len || n > view.len - off || (n && !mem)) {
        PyErr_Format(PyExc_ValueError, "%s(): bytes [%zd, %zd + %zd) are outside the "
                     "buffer's %zd bytes, or the address is 0", name, off, off, n, view.len);
        out = NULL;
    } else {
        char *at = (char *)view.buf + off;
        out = writable ? run(at, mem, n) : run(mem, at, n);
    }
    PyBuffer_Release(&view);
    return out;
}

static PyObject *py_read(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return on_buffer(args, nargs, "read", 0);
}

static PyObject *py_write(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return on_buffer(args, nargs, "write", 1);
}

static PyMethodDef methods[] = {
    {"ready", py_ready, METH_NOARGS, "install the SIGBUS guard; whether it is in place"},
    {"copy", (PyCFunction)(void (*)(void))py_copy, METH_FASTCALL,
     "guarded memcpy between addresses: False when a SIGBUS ended it"},
    {"read", (PyCFunction)(void (*)(void))py_read, METH_FASTCALL,
     "guarded copy out of a buffer: False when a SIGBUS ended it"},
    {"write", (PyCFunction)(void (*)(void))py_write, METH_FASTCALL,
     "guarded copy into a writable buffer: False when a SIGBUS ended it"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "neuronmp.shm._guard",
    "Copies on file mappings that survive the file shrinking (SIGBUS guard).", -1, methods,
};

PyMODINIT_FUNC PyInit__guard(void)
{
    return PyModule_Create(&module);
}
