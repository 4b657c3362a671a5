/* neuronmp.ipc._frames: the encoder (a frame's tensors and skeleton). */
#include "_frames.h"

static int skel_put(Enc *e, const void *p, size_t n)
{
    if (e->skel_len + n > SKEL_MAX)
        return 0;
    memcpy(e->skel + e->skel_len, p, n);
    e->skel_len += n;
    return 1;
}

static int skel_tag(Enc *e, char tag, const void *p, size_t n)
{
    unsigned char c = (unsigned char)tag;
    return skel_put(e, &c, 1) && skel_put(e, p, n);
}

/* A codec.Rows (description, tensor, start, count) made by the row cutter
 * (neuronmp.session._rowcut): the whole tensor's description is copied, not asked of
 * torch again, and narrowed to the rows.  Trusted only under _tensor.h's
 * contract.  1 described, 0 not for the fast path, -1 exception. */
static int rows_info(PyObject *o, TInfo *ti)
{
    if (PyTuple_GET_SIZE(o) != 4)
        return 0;
    PyObject *cap = PyTuple_GET_ITEM(o, 0);
    const nmp_desc *info = PyCapsule_GetPointer(cap, NMP_ROWS_CAPSULE);
    if (!info) {
        PyErr_Clear();
        return 0;
    }
    if (info->size != sizeof *info || PyCapsule_GetContext(cap) != PyTuple_GET_ITEM(o, 1))
        return PyErr_Occurred() ? -1 : 0;
    ti->desc = *info;
    long long start = PyLong_AsLongLong(PyTuple_GET_ITEM(o, 2));
    long long count = PyLong_AsLongLong(PyTuple_GET_ITEM(o, 3));
    if (PyErr_Occurred())
        return -1;
    if (ti->nd < 1 || ti->nd > FAST_NDIM || ti->code < 0 || ti->code >= MAX_CODES ||
        !C.itemsize[ti->code] || start < 0 || count < 0 || start + count > ti->shape[0])
        return 0;
    size_t row = ti->shape[0] ? ti->nbytes / (size_t)ti->shape[0] : 0;
    ti->ptr = (const char *)ti->ptr + (size_t)start * row;
    ti->shape[0] = count;
    ti->nbytes = (size_t)count * row;
    return 1;
}

/* Walk obj, collecting tensors and writing the skeleton: 1 ok, 0 not for
 * the fast path, -1 exception. */
int walk(Enc *e, PyObject *o, int depth)
{
    if (depth > MAX_DEPTH)
        return 0;
    PyTypeObject *tp = Py_TYPE(o);
    int rows = tp == (PyTypeObject *)C.rows_type;
    if (rows || tp == (PyTypeObject *)C.tensor_type) {
        if (e->n >= FAST_TENSORS)
            return 0;
        int r = rows ? rows_info(o, &e->t[e->n]) : nmp_describe(&C.types, o, &e->t[e->n].desc);
        if (r != 1)
            return r;
        e->n++;
        return skel_tag(e, 'X', NULL, 0);
    }
    if (o == Py_None)
        return skel_tag(e, 'N', NULL, 0);
    if (o == Py_True)
        return skel_tag(e, 'T', NULL, 0);
    if (o == Py_False)
        return skel_tag(e, 'F', NULL, 0);
    if (tp == &PyLong_Type) {
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow)
            return 0;
        if (v == -1 && PyErr_Occurred())
            return -1;
        int64_t v64 = v;
        return skel_tag(e, 'i', &v64, 8);
    }
    if (tp == &PyFloat_Type) {
        double d = PyFloat_AS_DOUBLE(o);
        return skel_tag(e, 'd', &d, 8);
    }
    if (tp == &PyUnicode_Type || tp == &PyBytes_Type) {
        Py_ssize_t n;
        const char *s;
        if (tp == &PyBytes_Type) {
            s = PyBytes_AS_STRING(o);
            n = PyBytes_GET_SIZE(o);
        } else if (!(s = PyUnicode_AsUTF8AndSize(o, &n))) {
            PyErr_Clear(); /* lone surrogates: pickle copes */
            return 0;
        }
        if (n > SKEL_MAX)
            return 0;
        uint32_t n32 = (uint32_t)n;
        return skel_tag(e, tp == &PyBytes_Type ? 'b' : 's', &n32, 4) && skel_put(e, s, (size_t)n);
    }
    if (tp == &PyTuple_Type || tp == &PyList_Type) {
        Py_ssize_t n = Py_SIZE(o);
        uint32_t n32 = (uint32_t)n;
        if (!skel_tag(e, tp == &PyTuple_Type ? 't' : 'l', &n32, 4))
            return 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            /* a list may shrink under us only from another thread mid-call;
             * re-check the size rather than trust n */
            if (i >= Py_SIZE(o))
                return 0;
            PyObject *item = tp == &PyTuple_Type ? PyTuple_GET_ITEM(o, i) : PyList_GET_ITEM(o, i);
            Py_INCREF(item);
            int r = walk(e, item, depth + 1);
            Py_DECREF(item);
            if (r != 1)
                return r;
        }
        return 1;
    }
    return 0;
}

/* kind and skeleton: the all-tensor shapes keep the skeleton-free kinds */
int frame_kind(Enc *e, PyObject *obj)
{
    PyTypeObject *tp = Py_TYPE(obj);
    if (tp == (PyTypeObject *)C.tensor_type) {
        e->skel_len = 0;
        return K_TENSOR;
    }
    if ((tp == &PyTuple_Type || tp == &PyList_Type) && Py_SIZE(obj) == e->n) {
        /* as many tensors as items is not enough: (1, True, [t, t, t]) has three
         * of each; only a flat sequence of tensors drops its skeleton */
        for (Py_ssize_t i = 0; i < e->n; i++) {
            PyObject *item = tp == &PyTuple_Type ? PyTuple_GET_ITEM(obj, i) : PyList_GET_ITEM(obj, i);
            if (Py_TYPE(item) != (PyTypeObject *)C.tensor_type)
                return K_PACKED;
        }
        e->skel_len = 0;
        return tp == &PyTuple_Type ? K_TUPLE : K_LIST;
    }
    return K_PACKED;
}

size_t layout_frame(Enc *e)
{
    size_t off = REC_SIZE + e->skel_len;
    for (int i = 0; i < e->n; i++)
        off += 16 + 8 * (size_t)e->t[i].nd;
    off = align64(off);
    for (int i = 0; i < e->n; i++) {
        e->t[i].off = off;
        off = align64(off + e->t[i].nbytes);
    }
    return off;
}

void write_frame(char *rec, Enc *e, int kind, size_t length)
{
    uint32_t h[4] = {(uint32_t)length, (uint32_t)kind, (uint32_t)e->n, (uint32_t)e->skel_len};
    char *p = rec + REC_SIZE;
    size_t big = 0;
    for (int i = 0; i < e->n; i++) {
        TInfo *t = &e->t[i];
        uint64_t off = t->off;
        memset(p, 0, 16);
        p[0] = (char)t->code;
        p[1] = (char)t->nd;
        memcpy(p + 8, &off, 8);
        memcpy(p + 16, t->shape, 8 * (size_t)t->nd);
        p += 16 + 8 * t->nd;
        big += t->nbytes;
    }
    memcpy(p, e->skel, e->skel_len);
    if (big >= NOGIL_COPY) {
        Py_BEGIN_ALLOW_THREADS
        for (int i = 0; i < e->n; i++)
            bulk_copy(rec + e->t[i].off, e->t[i].ptr, e->t[i].nbytes);
        Py_END_ALLOW_THREADS
    } else {
        for (int i = 0; i < e->n; i++)
            if (e->t[i].nbytes)
                memcpy(rec + e->t[i].off, e->t[i].ptr, e->t[i].nbytes);
    }
    memcpy(rec, h, sizeof h);
}
