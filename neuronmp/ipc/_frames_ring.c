/* neuronmp.ipc._frames: put / get, frames into and out of a ring. */
#include "_frames.h"

static void publish_counter(char *base, Py_ssize_t off_ctr, Py_ssize_t off_flag, uint64_t v)
{
    publish_at(base + off_ctr, base + off_flag, v);
}

/* Wake the sleeping reader of each of the first `n` rings of put_many's items
 * (their heads are stored already). */
static void wake_readers(PyObject *items, Py_ssize_t n)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_buffer view;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(PyList_GET_ITEM(items, i), 0), &view,
                               PyBUF_WRITABLE) < 0) {
            PyErr_Clear();
            continue;
        }
        char *base = view.buf;
        if (__atomic_load_n((uint32_t *)(base + C.off_rsleep), __ATOMIC_SEQ_CST))
            futex_wake((uint32_t *)(base + C.off_head + LOW_WORD_OFFSET));
        PyBuffer_Release(&view);
    }
    PyErr_Restore(type, value, tb);
}

/*
 * Encode obj straight into the ring `buf` at byte counter `head`; publish
 * as put() says.  1 put (*out: the new head), 0 not for the fast path or
 * bigger than max_inline, 2 no room (*out: the tail to wait for), -1 an
 * exception.
 */
static int put_one(PyObject *buf, PyObject *obj, uint64_t head, Py_ssize_t max_inline,
                   long publish, uint64_t *out)
{
    Enc *e = PyMem_Malloc(sizeof(Enc));
    if (!e) {
        PyErr_NoMemory();
        return -1;
    }
    e->n = 0;
    e->skel_len = 0;
    int r = walk(e, obj, 0);
    if (r != 1) {
        PyMem_Free(e);
        if (r == 0 || PyErr_ExceptionMatches(PyExc_Exception)) {
            /* "not mine": codec.py redoes the work and raises any clear error */
            PyErr_Clear();
            return 0;
        }
        return -1;
    }
    int kind = frame_kind(e, obj);
    size_t length = layout_frame(e);
    Py_buffer view;
    if (length > (size_t)max_inline || length > UINT32_MAX) {
        PyMem_Free(e);
        return 0;
    }
    if (PyObject_GetBuffer(buf, &view, PyBUF_WRITABLE) < 0) {
        PyMem_Free(e);
        return -1;
    }
    int status = -1;
    char *base = view.buf;
    uint64_t cap = *(uint64_t *)(base + C.off_cap);
    if (cap == 0 || (Py_ssize_t)(C.header + cap) > view.len) {
        PyErr_SetString(PyExc_ValueError, "not a ring mapping");
        goto out;
    }
    uint64_t pos = head % cap, room = cap - pos, pad = length > room ? room : 0;
    if (!pad && pos >= WRAP_MIN && pos >= length &&
        __atomic_load_n((uint64_t *)(base + C.off_tail), __ATOMIC_ACQUIRE) == head)
        pad = room;  /* the reader has released everything: go back to the start */
    uint64_t target = head + pad + length;  /* the tail must reach target - cap */
    if (target > cap) {
        uint64_t tail = __atomic_load_n((uint64_t *)(base + C.off_tail), __ATOMIC_ACQUIRE);
        if (tail < target - cap) {
            *out = target - cap;
            status = 2;
            goto out;
        }
    }
    char *data = base + C.header;
    if (pad) {
        uint32_t p[4] = {(uint32_t)pad, K_PAD, 0, 0};
        memcpy(data + pos, p, sizeof p);
        pos = 0;
    }
    write_frame(data + pos, e, kind, length);
    if (publish == 2)
        __atomic_store_n((uint64_t *)(base + C.off_head), (uint64_t)target, __ATOMIC_SEQ_CST);
    else if (publish)
        publish_counter(base, C.off_head, C.off_rsleep, target);
    *out = target;
    status = 1;
out:
    PyBuffer_Release(&view);
    PyMem_Free(e);
    return status;
}

/*
 * put(ring_buf, obj, head, max_inline, publish) -> int
 * Encode obj straight into the ring at byte counter `head` and (if publish)
 * publish it: 1 wakes the reader if it sleeps, 2 leaves that to a later
 * publish of the same head (a sender of several frames to several rings wakes
 * their readers once all are sent).  A ring the reader has emptied is restarted at its beginning
 * (WRAP_MIN).  Returns the new head; 0 when obj is not for the fast path or
 * is bigger than max_inline (use codec.py); -target when the ring lacks room
 * until the reader's tail reaches target (wait, then call again).  A record
 * that would cross the end of the circle goes after a PAD record, both
 * published by the one head store.
 */
PyObject *py_put(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs(nargs, 5, "put") < 0 || need_setup() < 0)
        return NULL;
    unsigned long long head = PyLong_AsUnsignedLongLong(args[2]);
    Py_ssize_t max_inline = PyLong_AsSsize_t(args[3]);
    long publish = PyLong_AsLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    uint64_t out = 0;
    switch (put_one(args[0], args[1], head, max_inline, publish, &out)) {
    case 1:
        return PyLong_FromUnsignedLongLong(out);
    case 2:
        return PyLong_FromLongLong(-(long long)out);
    case 0:
        return PyLong_FromLong(0);
    default:
        return NULL;
    }
}

/*
 * put_many(items, wake) -> list of int
 * items: a list of (ring_buf, obj, head, max_inline), each ring once: put's
 * fast path for each in turn, one C call for a message to each of many rings.
 * Every head is stored before any reader is woken; with `wake`, the readers
 * that sleep are woken then, so no woken reader delays the next put.  Returns
 * one slot per item: the new head of each item put, in order, then None from
 * the first that put would not take at once (not for the fast path, no room,
 * or an error) on: the caller sends that one and the rest one by one (and so
 * meets the error).
 */
PyObject *py_put_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs(nargs, 2, "put_many") < 0 || need_setup() < 0)
        return NULL;
    if (!PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "put_many(): items must be a list");
        return NULL;
    }
    int wake = PyObject_IsTrue(args[1]);
    if (wake < 0)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(args[0]), done = 0;
    PyObject *heads = PyList_New(n);
    if (!heads)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_INCREF(Py_None);
        PyList_SET_ITEM(heads, i, Py_None);
    }
    for (; done < n; done++) {
        PyObject *item = PyList_GET_ITEM(args[0], done);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 4)
            break;
        unsigned long long head = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(item, 2));
        Py_ssize_t max_inline = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 3));
        uint64_t out = 0;
        if (PyErr_Occurred() || put_one(PyTuple_GET_ITEM(item, 0), PyTuple_GET_ITEM(item, 1),
                                        head, max_inline, 2, &out) != 1) {
            /* the caller's own send of this item meets the same error and raises it */
            PyErr_Clear();
            break;
        }
        PyObject *v = PyLong_FromUnsignedLongLong(out);
        if (!v) {   /* as put() after its store: out of memory, the ring's head is lost */
            Py_DECREF(heads);
            heads = NULL;
            done++;
            break;
        }
        PyList_SET_ITEM(heads, done, v);   /* steals v, drops the None */
        Py_DECREF(Py_None);
    }
    if (wake)
        wake_readers(args[0], done);
    return heads;
}


/*
 * get(ring_buf, read, copy, release) -> int | (start, end, value)
 * The reader's side of put: skip PAD records from byte counter `read`; if
 * no frame is published there, return the counter reached (wait for the
 * head to move past it).  Otherwise decode the frame (value is
 * NotImplemented for kinds codec.py decodes) and, with `release` (no
 * frame still viewed), publish the tail past it, waking a sleeping writer.
 */
PyObject *py_get(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    if (check_nargs(nargs, 4, "get") < 0 || need_setup() < 0)
        return NULL;
    unsigned long long read = PyLong_AsUnsignedLongLong(args[1]);
    int copy = PyObject_IsTrue(args[2]);
    int release = PyObject_IsTrue(args[3]);
    if (PyErr_Occurred())
        return NULL;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) < 0)
        return NULL;
    char *base = view.buf;
    PyObject *result = NULL;
    uint64_t cap = *(uint64_t *)(base + C.off_cap);
    if (cap == 0 || (Py_ssize_t)(C.header + cap) > view.len) {
        PyErr_SetString(PyExc_ValueError, "not a ring mapping");
        goto out;
    }
    uint64_t head = __atomic_load_n((uint64_t *)(base + C.off_head), __ATOMIC_ACQUIRE);
    for (;;) {
        if (head == read) {
            if (release)
                publish_counter(base, C.off_tail, C.off_wsleep, read);
            result = PyLong_FromUnsignedLongLong(read);
            goto out;
        }
        uint64_t pos = read % cap;
        uint32_t h[2];
        memcpy(h, base + C.header + pos, sizeof h);
        if (h[0] < REC_SIZE || h[0] > cap - pos || h[0] > head - read) {
            bad_record("length");
            goto out;
        }
        if (h[1] != K_PAD) {
            Py_ssize_t off = C.header + (Py_ssize_t)pos;
            PyObject *v = decode_record(args[0], base + off, off, h[0], copy);
            if (!v)
                goto out;
            uint64_t end = read + h[0];
            if (release && v != Py_NotImplemented)
                publish_counter(base, C.off_tail, C.off_wsleep, end);
            result = Py_BuildValue("KKN", (unsigned long long)read, (unsigned long long)end, v);
            goto out;
        }
        read += h[0];
    }
out:
    PyBuffer_Release(&view);
    return result;
}
