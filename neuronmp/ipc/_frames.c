/*
 * neuronmp.ipc._frames: frames in and out of shared memory, in one C call each.
 *
 *   - put / get: encode a common frame straight into a ring and publish it;
 *     find the next frame of a ring and decode it (codec.py documents the
 *     record layout and which frames take this path);
 *   - decode: the same decoder on any mapping (a spill segment or an arena);
 *   - copy_in / copy_out / copy: memcpy into, out of or beside a mapping,
 *     cache-bypassing when big, with the GIL released for large copies.
 *
 * Counters are published as _shm.h does it; waiting is neuronmp.ipc._waits'
 * business (ring.py calls it when put or get says "not yet").
 */
#include "_shm.h"

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

/* copies at least this big run with the GIL released */
#define NOGIL_COPY 65536
/* copies at least this big bypass the cache (see bulk_copy) */
#define NT_COPY (4 << 20)

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
 * bandwidth (measured: 14 -> 20 GB/s for 16 MiB).  SSE2 is baseline on
 * x86-64; other machines keep memcpy.
 */
static void bulk_copy(void *dst_, const void *src_, size_t n)
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

static void big_copy(void *dst, const void *src, Py_ssize_t n)
{
    if (n >= NOGIL_COPY) {
        Py_BEGIN_ALLOW_THREADS
        bulk_copy(dst, src, (size_t)n);
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


/* ===================================================================== *
 * Frame codec fast path.
 *
 * The common frames -- a lone tensor, a tuple/list of tensors, or a small
 * tuple/list tree of ints, floats, bools, None, short strings and tensors
 * (the pool's (op, id, model, (tensor, ...)) and (id, ok, result)) -- are
 * encoded and decoded here in one call each, because the same work done
 * with struct packs and torch calls from Python costs several microseconds
 * per message, which is most of a small message's round trip.  Anything
 * else (dicts, other objects, odd tensors) returns "not mine" and travels on
 * codec.py's pickle path; the record layout is the one codec.py documents.
 *
 * Tensors are made with DLPack (torch._C._from_dlpack of a capsule built
 * here): one torch call gives dtype, shape and memory, about half the cost
 * of torch.frombuffer and without the extra .view(shape).  A copy owns one
 * malloc'ed block (freed by the deleter), a view points into the mapping and
 * holds a reference to the buffer object, as torch.frombuffer's would.
 * ===================================================================== */

typedef struct { int32_t device_type, device_id; } DLDevice;
typedef struct { uint8_t code, bits; uint16_t lanes; } DLDataType;
typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape, *strides;
    uint64_t byte_offset;
} DLTensor;
typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

enum { K_PAD, K_TENSOR, K_TUPLE, K_LIST, K_PICKLED, K_SPILL, K_PACKED };
#define REC_SIZE 16
#define MAX_CODES 64
#define FAST_NDIM 16       /* tensors with more dims take the Python path */
#define FAST_TENSORS 32    /* so do frames with more tensors */
#define SKEL_MAX 4096      /* and trees whose skeleton is longer */
#define MAX_DEPTH 16
#define MAX_NDIM 64        /* what a record may declare (codec._MAX_NDIM) */
/* An idle ring restarts at its first byte once the writer is this far in:
 * request/answer traffic then cycles through a few hot, cache-resident pages
 * instead of walking the whole (cold) ring -- a 64 KiB frame written to cold
 * memory costs twice as much. */
#define WRAP_MIN (256 << 10)

static struct {
    int ready;
    PyObject *tensor_type, *codes, *strided, *from_dlpack, *make, *rows_type;
    Py_ssize_t itemsize[MAX_CODES];
    int dl_ok[MAX_CODES];
    DLDataType dl[MAX_CODES];
    /* ring header layout, from ring.py */
    Py_ssize_t header, off_cap, off_head, off_tail, off_rsleep, off_wsleep;
} C;

static PyObject *S_dtype, *S_shape, *S_layout, *S_is_cpu, *S_is_contiguous, *S_is_conj,
    *S_is_neg, *S_data_ptr;

static inline size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

/* -- encoding ----------------------------------------------------------- */

typedef struct {
    int code, nd;
    int64_t shape[FAST_NDIM];
    const void *ptr;
    size_t nbytes, off;
} TInfo;

typedef struct {
    int n;                     /* tensors found */
    TInfo t[FAST_TENSORS];
    size_t skel_len;
    unsigned char skel[SKEL_MAX];
} Enc;

static int is_true_call(PyObject *o, PyObject *name)
{
    PyObject *r = PyObject_CallMethodNoArgs(o, name);
    if (!r)
        return -1;
    int v = r == Py_True;
    Py_DECREF(r);
    return v;
}

/* 1: described in *ti; 0: not for the fast path (Python decides, and raises
 * the clear error if there is one); -1: exception. */
static int tensor_info(PyObject *t, TInfo *ti)
{
    PyObject *o = PyObject_GetAttr(t, S_dtype);
    if (!o)
        return -1;
    PyObject *code = PyDict_GetItemWithError(C.codes, o);
    Py_DECREF(o);
    if (!code)
        return PyErr_Occurred() ? -1 : 0;
    ti->code = (int)PyLong_AsLong(code);
    if (ti->code < 0 || ti->code >= MAX_CODES || !C.itemsize[ti->code])
        return 0;
    if (!(o = PyObject_GetAttr(t, S_layout)))
        return -1;
    int ok = o == C.strided;
    Py_DECREF(o);
    if (!ok)
        return 0;
    if (!(o = PyObject_GetAttr(t, S_is_cpu)))
        return -1;
    ok = o == Py_True;
    Py_DECREF(o);
    /* a neg-bit view can be contiguous (conj().imag of a 1-element tensor),
     * and its memory does not hold its values: leave it to _prepare */
    int r;
    if (!ok || (r = is_true_call(t, S_is_contiguous)) != 1 || (r = is_true_call(t, S_is_neg)) != 0)
        return ok ? (r < 0 ? -1 : 0) : 0;
    if (C.dl[ti->code].code == 5 /* kDLComplex */ || !C.dl_ok[ti->code]) {
        if ((r = is_true_call(t, S_is_conj)) != 0)
            return r < 0 ? -1 : 0;
    }
    if (!(o = PyObject_GetAttr(t, S_shape)))
        return -1;
    if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) > FAST_NDIM) {
        Py_DECREF(o);
        return 0;
    }
    ti->nd = (int)PyTuple_GET_SIZE(o);
    size_t numel = 1;
    for (int i = 0; i < ti->nd; i++) {
        long long d = PyLong_AsLongLong(PyTuple_GET_ITEM(o, i));
        if (d < 0) {
            Py_DECREF(o);
            return PyErr_Occurred() ? -1 : 0;
        }
        ti->shape[i] = d;
        numel *= (size_t)d;
    }
    Py_DECREF(o);
    ti->nbytes = numel * (size_t)C.itemsize[ti->code];
    if (!(o = PyObject_CallMethodNoArgs(t, S_data_ptr)))
        return -1;
    ti->ptr = PyLong_AsVoidPtr(o);
    Py_DECREF(o);
    return PyErr_Occurred() ? -1 : 1;
}

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

#define ROWS_CAPSULE "neuronmp.ipc._frames.rows"

static void rows_capsule_free(PyObject *cap)
{
    PyMem_Free(PyCapsule_GetPointer(cap, ROWS_CAPSULE));
}

/* A codec.Rows (description, tensor, start, count), made by rows(): the
 * tensor's description is copied, not asked of torch again, and narrowed to
 * the rows.  1 described, 0 not for the fast path, -1 exception. */
static int rows_info(PyObject *o, TInfo *ti)
{
    if (PyTuple_GET_SIZE(o) != 4)
        return 0;
    /* a capsule only rows() makes: a description cannot be forged from Python */
    const TInfo *info = PyCapsule_GetPointer(PyTuple_GET_ITEM(o, 0), ROWS_CAPSULE);
    if (!info) {
        PyErr_Clear();
        return 0;
    }
    *ti = *info;
    long long start = PyLong_AsLongLong(PyTuple_GET_ITEM(o, 2));
    long long count = PyLong_AsLongLong(PyTuple_GET_ITEM(o, 3));
    if (PyErr_Occurred())
        return -1;
    if (ti->nd < 1 || start < 0 || count < 0 || start + count > ti->shape[0])
        return 0;
    size_t row = ti->shape[0] ? ti->nbytes / (size_t)ti->shape[0] : 0;
    ti->ptr = (const char *)ti->ptr + (size_t)start * row;
    ti->shape[0] = count;
    ti->nbytes = (size_t)count * row;
    return 1;
}

/* Walk obj, collecting tensors and writing the skeleton: 1 ok, 0 not for
 * the fast path, -1 exception. */
static int walk(Enc *e, PyObject *o, int depth)
{
    if (depth > MAX_DEPTH)
        return 0;
    PyTypeObject *tp = Py_TYPE(o);
    int rows = tp == (PyTypeObject *)C.rows_type;
    if (rows || tp == (PyTypeObject *)C.tensor_type) {
        if (e->n >= FAST_TENSORS)
            return 0;
        int r = rows ? rows_info(o, &e->t[e->n]) : tensor_info(o, &e->t[e->n]);
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
static int frame_kind(Enc *e, PyObject *obj)
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

static size_t layout_frame(Enc *e)
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

static void write_frame(char *rec, Enc *e, int kind, size_t length)
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

static int need_setup(void)
{
    if (!C.ready) {
        PyErr_SetString(PyExc_RuntimeError, "neuronmp.ipc._frames.setup() was not called");
        return -1;
    }
    return 0;
}

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
static PyObject *py_put(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
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

/* -- decoding ----------------------------------------------------------- */

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

static PyObject *bad_record(const char *why)
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
static PyObject *decode_record(PyObject *owner, const char *rec, Py_ssize_t off, size_t length,
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
static PyObject *py_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
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

/*
 * get(ring_buf, read, copy, release) -> int | (start, end, value)
 * The reader's side of put: skip PAD records from byte counter `read`; if
 * no frame is published there, return the counter reached (wait for the
 * head to move past it).  Otherwise decode the frame (value is
 * NotImplemented for kinds codec.py decodes) and, with `release` (no
 * frame still viewed), publish the tail past it, waking a sleeping writer.
 */
static PyObject *py_get(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
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

/* dl_dtype(capsule) -> (code, bits, lanes) of a DLPack capsule, not consuming it */
static PyObject *py_dl_dtype(PyObject *self, PyObject *cap)
{
    DLManagedTensor *m = PyCapsule_GetPointer(cap, "dltensor");
    if (!m)
        return NULL;
    DLDataType d = m->dl_tensor.dtype;
    return Py_BuildValue("iii", d.code, d.bits, d.lanes);
}

/*
 * setup(tensor_type, codes, itemsizes, dlpack_types, strided, from_dlpack,
 *       make, ring_layout)
 * codes: {dtype: code}; itemsizes: {code: bytes}; dlpack_types: {code:
 * (dl code, bits, lanes)} for the dtypes DLPack carries; make(buf, off,
 * code, shape, copy) builds the others; ring_layout: (header, capacity,
 * head, tail, rsleep, wsleep) offsets.
 */
static PyObject *py_setup(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs(nargs, 9, "setup") < 0)
        return NULL;
    if (!PyDict_Check(args[1]) || !PyDict_Check(args[2]) || !PyDict_Check(args[3]) ||
        !PyTuple_Check(args[7]) || PyTuple_GET_SIZE(args[7]) != 6 ||
        !PyType_Check(args[8]) || !PyType_IsSubtype((PyTypeObject *)args[8], &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "setup(): bad argument types");
        return NULL;
    }
    memset(C.itemsize, 0, sizeof C.itemsize);
    memset(C.dl_ok, 0, sizeof C.dl_ok);
    PyObject *k, *v;
    Py_ssize_t i = 0;
    while (PyDict_Next(args[2], &i, &k, &v)) {
        long code = PyLong_AsLong(k);
        if (code < 0 || code >= MAX_CODES) {
            PyErr_Format(PyExc_ValueError, "setup(): dtype code %ld out of range", code);
            return NULL;
        }
        C.itemsize[code] = PyLong_AsSsize_t(v);
    }
    i = 0;
    while (PyDict_Next(args[3], &i, &k, &v)) {
        long code = PyLong_AsLong(k);
        int dc, bits, lanes;
        if (code < 0 || code >= MAX_CODES || !PyArg_ParseTuple(v, "iii", &dc, &bits, &lanes)) {
            PyErr_SetString(PyExc_ValueError, "setup(): bad DLPack type");
            return NULL;
        }
        C.dl[code] = (DLDataType){(uint8_t)dc, (uint8_t)bits, (uint16_t)lanes};
        C.dl_ok[code] = 1;
    }
    Py_ssize_t *lay[6] = {&C.header, &C.off_cap, &C.off_head, &C.off_tail, &C.off_rsleep,
                          &C.off_wsleep};
    for (int j = 0; j < 6; j++)
        *lay[j] = PyLong_AsSsize_t(PyTuple_GET_ITEM(args[7], j));
    if (PyErr_Occurred())
        return NULL;
    PyObject **keep[7] = {&C.tensor_type, &C.codes, &C.strided, &C.from_dlpack, &C.make,
                          &C.rows_type, NULL};
    PyObject *vals[6] = {args[0], args[1], args[4], args[5], args[6], args[8]};
    for (int j = 0; keep[j]; j++) {
        Py_INCREF(vals[j]);
        Py_XSETREF(*keep[j], vals[j]);
    }
    C.ready = 1;
    Py_RETURN_NONE;
}

/* whether ti is of dtype `code` and of `shape` but for dim 0 */
static int fits(TInfo *ti, PyObject *code, PyObject *shape)
{
    if (!PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) != ti->nd ||
        PyLong_AsLong(code) != ti->code)
        return 0;
    for (int i = 1; i < ti->nd; i++)
        if (PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i)) != ti->shape[i])
            return 0;
    return !PyErr_Occurred();
}

/* rows(tensor, sizes, code, shape) -> [codec.Rows, ...] or None
 * The tensor cut into consecutive row ranges of dim 0 (sizes summing to its
 * first dimension), each sent as that tensor's rows without a view being made
 * or torch being asked about it again; None when the tensor is not a
 * contiguous CPU tensor of dtype `code` and of `shape` but for dim 0, or not
 * for the fast path (the caller then checks and splits it with torch). */
static PyObject *py_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs(nargs, 4, "rows") < 0 || need_setup() < 0)
        return NULL;
    PyObject *t = args[0], *sizes = args[1];
    if (Py_TYPE(t) != (PyTypeObject *)C.tensor_type || !PyList_Check(sizes))
        Py_RETURN_NONE;
    TInfo ti;
    int r = tensor_info(t, &ti);
    if (r < 0)
        return NULL;
    if (r == 0 || ti.nd < 1 || !fits(&ti, args[2], args[3])) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PyList_GET_SIZE(sizes);
    long long total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long k = PyLong_AsLongLong(PyList_GET_ITEM(sizes, i));
        if (k < 0) {
            if (PyErr_Occurred())
                return NULL;
            Py_RETURN_NONE;
        }
        total += k;
    }
    if (total != ti.shape[0])
        Py_RETURN_NONE;
    TInfo *copy = PyMem_Malloc(sizeof ti);
    if (!copy)
        return PyErr_NoMemory();
    *copy = ti;
    PyObject *info = PyCapsule_New(copy, ROWS_CAPSULE, rows_capsule_free);
    if (!info) {
        PyMem_Free(copy);
        return NULL;
    }
    PyObject *out = PyList_New(n);
    if (!out) {
        Py_DECREF(info);
        return NULL;
    }
    PyTypeObject *tp = (PyTypeObject *)C.rows_type;
    long long start = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(sizes, i);
        PyObject *at = PyLong_FromLongLong(start);
        PyObject *rows = at ? tp->tp_alloc(tp, 4) : NULL;
        if (!rows) {
            Py_XDECREF(at);
            Py_DECREF(info);
            Py_DECREF(out);
            return NULL;
        }
        Py_INCREF(info);
        Py_INCREF(t);
        Py_INCREF(item);
        PyTuple_SET_ITEM(rows, 0, info);
        PyTuple_SET_ITEM(rows, 1, t);
        PyTuple_SET_ITEM(rows, 2, at);
        PyTuple_SET_ITEM(rows, 3, item);
        PyList_SET_ITEM(out, i, rows);
        start += PyLong_AsLongLong(item);
    }
    Py_DECREF(info);
    return out;
}

/* copy(dst_address, src_address, n): process memory to process memory (a
 * received view into a caller's tensor), cache-bypassing when big, GIL
 * released for big copies */
static PyObject *py_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
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


static PyMethodDef methods[] = {
    {"put", (PyCFunction)(void (*)(void))py_put, METH_FASTCALL,
     "encode a frame into a ring and publish it"},
    {"get", (PyCFunction)(void (*)(void))py_get, METH_FASTCALL,
     "decode the next frame of a ring"},
    {"decode", (PyCFunction)(void (*)(void))py_decode, METH_FASTCALL,
     "decode the record at an offset"},
    {"dl_dtype", (PyCFunction)py_dl_dtype, METH_O, "DLPack dtype of a capsule"},
    {"setup", (PyCFunction)(void (*)(void))py_setup, METH_FASTCALL,
     "give the codec torch's types and the ring layout"},
    {"copy", (PyCFunction)(void (*)(void))py_copy, METH_FASTCALL, "memcpy between addresses"},
    {"rows", (PyCFunction)(void (*)(void))py_rows, METH_FASTCALL,
     "a tensor's row ranges, to send without views"},
    {"copy_in", (PyCFunction)(void (*)(void))py_copy_in, METH_FASTCALL, "memcpy into mapping"},
    {"copy_out", (PyCFunction)(void (*)(void))py_copy_out, METH_FASTCALL, "memcpy from mapping"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "neuronmp.ipc._frames",
    "Frame encode/decode and GIL-free copies on shared mappings.", -1, methods,
};

PyMODINIT_FUNC PyInit__frames(void)
{
    PyObject **names[] = {&S_dtype, &S_shape, &S_layout, &S_is_cpu, &S_is_contiguous,
                          &S_is_conj, &S_is_neg, &S_data_ptr};
    const char *strs[] = {"dtype", "shape", "layout", "is_cpu", "is_contiguous", "is_conj",
                          "is_neg", "data_ptr"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)
        if (!(*names[i] = PyUnicode_InternFromString(strs[i])))
            return NULL;
    return PyModule_Create(&module);
}
