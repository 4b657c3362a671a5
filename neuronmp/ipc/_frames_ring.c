/* neuronmp.ipc._frames: put / get, frames into and out of a ring. */
#include "_frames.h"

static void publish_counter(char *base, Py_ssize_t off_ctr, Py_ssize_t off_flag, uint64_t v)
{
    publish_at(base + off_ctr, base + off_flag, v);
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
    Enc *e = PyMem_Malloc(sizeof(Enc));
    if (!e)
        return PyErr_NoMemory();
    e->n = 0;
    e->skel_len = 0;
    PyObject *result = NULL;
    int r = walk(e, args[1], 0);
    if (r != 1) {
        if (r == 0 || PyErr_ExceptionMatches(PyExc_Exception)) {
            /* "not mine": codec.py redoes the work and raises any clear error */
            PyErr_Clear();
            result = PyLong_FromLong(0);
        }
        PyMem_Free(e);
        return result;
    }
    int kind = frame_kind(e, args[1]);
    size_t length = layout_frame(e);
    Py_buffer view;
    if (length > (size_t)max_inline || length > UINT32_MAX) {
        PyMem_Free(e);
        return PyLong_FromLong(0);
    }
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) < 0) {
        PyMem_Free(e);
        return NULL;
    }
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
            result = PyLong_FromLongLong(-(long long)(target - cap));
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
    result = PyLong_FromUnsignedLongLong(target);
out:
    PyBuffer_Release(&view);
    PyMem_Free(e);
    return result;
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
