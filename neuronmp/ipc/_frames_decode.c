/* neuronmp.ipc._frames: the decoder (DLPack tensors, copied or viewing a mapping). */
#include "_frames.h"

typedef struct {
    DLManagedTensor m;
    PyObject *owner;           /* the mapping's buffer object, for a view */
    int64_t dims[2 * MAX_NDIM];
} Managed;

#if PY_VERSION_HEX >= 0x030D0000
#define IS_FINALIZING() Py_IsFinalizing()
#else
#define IS_FINALIZING() _Py_IsFinalizing()
#endif

static void view_deleter(DLManagedTensor *m)
{
    /* torch may free a storage on a thread without the GIL; after the
     * interpreter is gone (C++ static destructors) leaking the reference is
     * the only safe thing to do */
    if (!IS_FINALIZING()) {
        PyGILState_STATE g = PyGILState_Ensure();
        Py_XDECREF(((Managed *)m)->owner);
        PyGILState_Release(g);
    }
    free(m);
}

static void copy_deleter(DLManagedTensor *m)
{
    free(m);
}

static void capsule_destructor(PyObject *cap)
{
    /* only an unconsumed capsule still owns its tensor */
    if (PyCapsule_IsValid(cap, "dltensor")) {
        DLManagedTensor *m = PyCapsule_GetPointer(cap, "dltensor");
        m->deleter(m);
    }
}

/* A tensor of `code` and `shape` whose bytes are at `src` (copied, or viewed
 * with `owner` kept alive). */
static PyObject *make_tensor(PyObject *owner, const char *src, int code, int nd,
                             const int64_t *shape, size_t nbytes, int copy, Py_ssize_t off)
{
    if (!C.dl_ok[code]) {
        PyObject *shp = PyTuple_New(nd);
        if (!shp)
            return NULL;
        for (int i = 0; i < nd; i++) {
            PyObject *d = PyLong_FromLongLong(shape[i]);
            if (!d) {
                Py_DECREF(shp);
                return NULL;
            }
            PyTuple_SET_ITEM(shp, i, d);
        }
        PyObject *a[5] = {owner, PyLong_FromSsize_t(off), PyLong_FromLong(code), shp,
                          copy ? Py_True : Py_False};
        PyObject *t = a[1] && a[2] ? PyObject_Vectorcall(C.make, a, 5, NULL) : NULL;
        Py_XDECREF(a[1]);
        Py_XDECREF(a[2]);
        Py_DECREF(shp);
        return t;
    }
    size_t head = align64(sizeof(Managed));
    Managed *m;
    if (copy) {
        if (posix_memalign((void **)&m, 64, head + (nbytes ? nbytes : 1)))
            return PyErr_NoMemory();
        if (nbytes >= NOGIL_COPY) {
            Py_BEGIN_ALLOW_THREADS
            bulk_copy((char *)m + head, src, nbytes);
            Py_END_ALLOW_THREADS
        } else {
            memcpy((char *)m + head, src, nbytes);
        }
        m->m.dl_tensor.data = (char *)m + head;
        m->owner = NULL;
        m->m.deleter = copy_deleter;
    } else {
        if (!(m = malloc(sizeof(Managed))))
            return PyErr_NoMemory();
        m->m.dl_tensor.data = (void *)src;
        Py_INCREF(owner);
        m->owner = owner;
        m->m.deleter = view_deleter;
    }
    m->m.manager_ctx = NULL;
    DLTensor *d = &m->m.dl_tensor;
    d->device.device_type = 1; /* kDLCPU */
    d->device.device_id = 0;
    d->ndim = nd;
    d->dtype = C.dl[code];
    d->shape = m->dims;
    d->strides = m->dims + MAX_NDIM;
    d->byte_offset = 0;
    int64_t stride = 1;
    for (int i = nd - 1; i >= 0; i--) {
        m->dims[i] = shape[i];
        m->dims[MAX_NDIM + i] = stride;
        stride *= shape[i] > 1 ? shape[i] : 1;
    }
    PyObject *cap = PyCapsule_New(m, "dltensor", capsule_destructor);
    if (!cap) {
        m->m.deleter(&m->m);
        return NULL;
    }
    PyObject *t = PyObject_CallOneArg(C.from_dlpack, cap);
    Py_DECREF(cap);
    return t;
}

PyObject *bad_record(const char *why)
{
    PyErr_Format(PyExc_ValueError, "corrupt ring record: %s", why);
    return NULL;
}

typedef struct {
    const unsigned char *p, *end;
    PyObject *tensors;
    Py_ssize_t next;
} Skel;

static PyObject *unskel(Skel *s, int depth)
{
    if (s->p >= s->end || depth > MAX_DEPTH)
        return bad_record("skeleton");
    unsigned char tag = *s->p++;
    uint32_t n32;
    switch (tag) {
    case 'N': Py_RETURN_NONE;
    case 'T': Py_RETURN_TRUE;
    case 'F': Py_RETURN_FALSE;
    case 'X':
        if (s->next >= PyList_GET_SIZE(s->tensors))
            return bad_record("tensor count");
        return Py_NewRef(PyList_GET_ITEM(s->tensors, s->next++));
    case 'i': case 'd': {
        if (s->end - s->p < 8)
            return bad_record("skeleton");
        unsigned char b[8];
        memcpy(b, s->p, 8);
        s->p += 8;
        if (tag == 'i') {
            int64_t v;
            memcpy(&v, b, 8);
            return PyLong_FromLongLong(v);
        }
        double d;
        memcpy(&d, b, 8);
        return PyFloat_FromDouble(d);
    }
    }
    if (s->end - s->p < 4)
        return bad_record("skeleton");
    memcpy(&n32, s->p, 4);
    s->p += 4;
    if (tag == 's' || tag == 'b') {
        if ((size_t)(s->end - s->p) < n32)
            return bad_record("skeleton");
        const char *str = (const char *)s->p;
        s->p += n32;
        return tag == 's' ? PyUnicode_DecodeUTF8(str, n32, "strict")
                          : PyBytes_FromStringAndSize(str, n32);
    }
    if (tag != 't' && tag != 'l')
        return bad_record("skeleton tag");
    if ((size_t)(s->end - s->p) < n32) /* every item takes at least one byte */
        return bad_record("skeleton");
    PyObject *seq = tag == 't' ? PyTuple_New(n32) : PyList_New(n32);
    if (!seq)
        return NULL;
    for (uint32_t i = 0; i < n32; i++) {
        PyObject *item = unskel(s, depth + 1);
        if (!item) {
            Py_DECREF(seq);
            return NULL;
        }
        if (tag == 't')
            PyTuple_SET_ITEM(seq, i, item);
        else
            PyList_SET_ITEM(seq, i, item);
    }
    return seq;
}

/* Decode the record at rec (length bytes, already checked to lie in the
 * mapping; `off` is its offset in owner's buffer).  NotImplemented for the
 * kinds codec.py decodes. */
PyObject *decode_record(PyObject *owner, const char *rec, Py_ssize_t off, size_t length,
                               int copy)
{
    uint32_t h[4];
    if (length < REC_SIZE)
        return bad_record("short");
    memcpy(h, rec, sizeof h);
    uint32_t kind = h[1], n = h[2], skel_len = h[3];
    if (kind != K_TENSOR && kind != K_TUPLE && kind != K_LIST && kind != K_PACKED)
        Py_RETURN_NOTIMPLEMENTED;
    if (h[0] > length || (kind == K_TENSOR && n != 1))
        return bad_record("header");
    length = h[0];
    PyObject *tensors = PyList_New(n);
    if (!tensors)
        return NULL;
    size_t pos = REC_SIZE;
    for (uint32_t i = 0; i < n; i++) {
        if (pos + 16 > length)
            goto bad;
        int code = (unsigned char)rec[pos], nd = (unsigned char)rec[pos + 1];
        uint64_t data_off;
        memcpy(&data_off, rec + pos + 8, 8);
        if (nd > MAX_NDIM || code >= MAX_CODES || !C.itemsize[code] ||
            pos + 16 + 8 * (size_t)nd > length)
            goto bad;
        int64_t shape[MAX_NDIM];
        memcpy(shape, rec + pos + 16, 8 * (size_t)nd);
        pos += 16 + 8 * (size_t)nd;
        uint64_t numel = 1;
        for (int k = 0; k < nd; k++) {
            if (shape[k] < 0 || (shape[k] && numel > UINT64_MAX / (uint64_t)shape[k]))
                goto bad;
            numel *= (uint64_t)shape[k];
        }
        if (numel > UINT64_MAX / (uint64_t)C.itemsize[code])
            goto bad;
        uint64_t nbytes = numel * (uint64_t)C.itemsize[code];
        if (data_off > length || nbytes > length - data_off)
            goto bad;
        PyObject *t = make_tensor(owner, rec + data_off, code, nd, shape, (size_t)nbytes, copy,
                                  off + (Py_ssize_t)data_off);
        if (!t) {
            Py_DECREF(tensors);
            return NULL;
        }
        PyList_SET_ITEM(tensors, i, t);
    }
    if (kind == K_LIST)
        return tensors;
    PyObject *value;
    if (kind == K_TENSOR) {
        value = Py_NewRef(PyList_GET_ITEM(tensors, 0));
    } else if (kind == K_TUPLE) {
        value = PyList_AsTuple(tensors);
    } else {
        if (skel_len > length - pos)
            goto bad;
        Skel s = {(const unsigned char *)rec + pos, (const unsigned char *)rec + pos + skel_len,
                  tensors, 0};
        value = unskel(&s, 0);
        if (value && (s.p != s.end || s.next != (Py_ssize_t)n)) {
            Py_DECREF(value);
            value = bad_record("skeleton length");
        }
    }
    Py_DECREF(tensors);
    return value;
bad:
    Py_DECREF(tensors);
    return bad_record("tensor descriptor");
}

/* decode(buf, off, copy) -> value: the record at byte off of any mapping
 * (a one-off segment); NotImplemented for kinds codec.py decodes */
PyObject *py_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    if (check_nargs(nargs, 3, "decode") < 0 || need_setup() < 0)
        return NULL;
    Py_ssize_t off = PyLong_AsSsize_t(args[1]);
    int copy = PyObject_IsTrue(args[2]);
    if (PyErr_Occurred())
        return NULL;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *r = off < 0 || off > view.len
        ? bad_record("offset outside the mapping")
        : decode_record(args[0], (char *)view.buf + off, off, (size_t)(view.len - off), copy);
    PyBuffer_Release(&view);
    return r;
}

/* dl_dtype(capsule) -> (code, bits, lanes) of a DLPack capsule, not consuming it */
PyObject *py_dl_dtype(PyObject *self, PyObject *cap)
{
    DLManagedTensor *m = PyCapsule_GetPointer(cap, "dltensor");
    if (!m)
        return NULL;
    DLDataType d = m->dl_tensor.dtype;
    return Py_BuildValue("iii", d.code, d.bits, d.lanes);
}
