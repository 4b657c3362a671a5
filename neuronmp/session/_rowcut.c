/*
 * neuronmp.session._rowcut: DataParallel's row cutter, on the request path.
 *
 *   chunking.row_ranges(inputs, sizes, specs)
 *     └─ rows(tensor, sizes, code, shape): the tensor checked against its traced
 *        dtype and trailing shape and described once, here; one codec.Rows per chunk
 *          ─▶ Model.submit ─▶ the transport's encoder sends each as a tensor of its
 *             rows, no view made and torch not asked again per chunk
 *
 * What a row range is on the way to the encoder (the capsule's name, the
 * description it holds, the tensor as its context) is the transport's contract,
 * declared in ipc/_tensor.h.  Describing a tensor is ipc/_tensor.c, compiled
 * into this extension as well (included below: its own copy and its own object
 * file, so this module shares no symbol and no build step with the transport's).
 * Where the cut is decided -- even whole traced batches, dim 0 -- stays in
 * chunking.py and parallel.py.
 */
#include "../ipc/_tensor.h"
#include "../ipc/_tensor.c"

static struct {
    int ready;
    PyObject *tensor_type, *rows_type, *codes, *strided;
    nmp_types types;
} S;

/*
 * setup(tensor_type, codes, itemsizes, ask_conj, strided, rows_type): the
 * codec's terms (codec.row_range_contract()): {dtype: code}, {code: bytes},
 * the codes whose conj bit must be asked, torch.strided, codec.Rows.
 */
static PyObject *py_setup(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "setup() takes 6 arguments (%zd given)", nargs);
        return NULL;
    }
    if (!PyType_Check(args[0]) || !PyDict_Check(args[1]) || !PyDict_Check(args[2]) ||
        !PyTuple_Check(args[3]) || !PyType_Check(args[5]) ||
        !PyType_IsSubtype((PyTypeObject *)args[5], &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "setup(): bad argument types");
        return NULL;
    }
    nmp_types tt;
    memset(&tt, 0, sizeof tt);
    PyObject *k, *v;
    Py_ssize_t i = 0;
    while (PyDict_Next(args[2], &i, &k, &v)) {
        long code = PyLong_AsLong(k);
        if (code < 0 || code >= NMP_MAX_CODES) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "setup(): dtype code %ld out of range", code);
            return NULL;
        }
        if ((tt.itemsize[code] = PyLong_AsSsize_t(v)) < 0)
            return NULL;
    }
    for (i = 0; i < PyTuple_GET_SIZE(args[3]); i++) {
        long code = PyLong_AsLong(PyTuple_GET_ITEM(args[3], i));
        if (code < 0 || code >= NMP_MAX_CODES) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "setup(): dtype code %ld out of range", code);
            return NULL;
        }
        tt.ask_conj[code] = 1;
    }
    PyObject **keep[] = {&S.tensor_type, &S.codes, &S.strided, &S.rows_type};
    PyObject *vals[] = {args[0], args[1], args[4], args[5]};
    for (size_t j = 0; j < sizeof keep / sizeof *keep; j++) {
        Py_INCREF(vals[j]);
        Py_XSETREF(*keep[j], vals[j]);
    }
    tt.codes = S.codes;
    tt.strided = S.strided;
    S.types = tt;
    S.ready = 1;
    Py_RETURN_NONE;
}

/* the description's capsule owns it and a reference to its tensor (the context) */
static void desc_free(PyObject *cap)
{
    PyObject *t = PyCapsule_GetContext(cap);
    PyMem_Free(PyCapsule_GetPointer(cap, NMP_ROWS_CAPSULE));
    Py_XDECREF(t);
}

/* whether d is of dtype `code` and of `shape` but for dim 0 */
static int fits(const nmp_desc *d, PyObject *code, PyObject *shape)
{
    if (!PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) != d->nd ||
        PyLong_AsLong(code) != d->code)
        return 0;
    for (int i = 1; i < d->nd; i++)
        if (PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i)) != d->shape[i])
            return 0;
    return !PyErr_Occurred();
}

/* the sizes' sum, or -1 when one is negative (-2: an exception) */
static long long total_rows(PyObject *sizes)
{
    long long total = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(sizes); i++) {
        long long k = PyLong_AsLongLong(PyList_GET_ITEM(sizes, i));
        if (k < 0)
            return PyErr_Occurred() ? -2 : -1;
        total += k;
    }
    return total;
}

/* the capsule of t's description, t its context */
static PyObject *describe_capsule(const nmp_desc *d, PyObject *t)
{
    nmp_desc *copy = PyMem_Malloc(sizeof *copy);
    if (!copy)
        return PyErr_NoMemory();
    *copy = *d;
    PyObject *cap = PyCapsule_New(copy, NMP_ROWS_CAPSULE, NULL);
    if (!cap) {
        PyMem_Free(copy);
        return NULL;
    }
    Py_INCREF(t);
    if (PyCapsule_SetContext(cap, t) < 0 || PyCapsule_SetDestructor(cap, desc_free) < 0) {
        Py_DECREF(t);
        PyMem_Free(copy);
        Py_DECREF(cap);
        return NULL;
    }
    return cap;
}

/* rows(tensor, sizes, code, shape) -> [codec.Rows, ...] or None
 * The tensor cut into consecutive row ranges of dim 0 (sizes, a list summing to
 * its first dimension); None when it is not a contiguous CPU tensor of dtype
 * `code` and of `shape` but for dim 0, or not for the fast path (the caller
 * then checks and splits it with torch). */
static PyObject *py_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "rows() takes 4 arguments (%zd given)", nargs);
        return NULL;
    }
    if (!S.ready) {
        PyErr_SetString(PyExc_RuntimeError, "neuronmp.session._rowcut.setup() was not called");
        return NULL;
    }
    PyObject *t = args[0], *sizes = args[1];
    if (Py_TYPE(t) != (PyTypeObject *)S.tensor_type || !PyList_Check(sizes))
        Py_RETURN_NONE;
    nmp_desc d;
    int r = nmp_describe(&S.types, t, &d);
    if (r < 0)
        return NULL;
    if (r == 0 || d.nd < 1 || !fits(&d, args[2], args[3])) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    long long total = total_rows(sizes);
    if (total == -2)
        return NULL;
    if (total != d.shape[0])
        Py_RETURN_NONE;
    PyObject *cap = describe_capsule(&d, t);
    if (!cap)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(sizes);
    PyObject *out = PyList_New(n);
    if (!out) {
        Py_DECREF(cap);
        return NULL;
    }
    PyTypeObject *tp = (PyTypeObject *)S.rows_type;
    long long start = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(sizes, i);
        PyObject *at = PyLong_FromLongLong(start);
        PyObject *rows = at ? tp->tp_alloc(tp, 4) : NULL;
        if (!rows) {
            Py_XDECREF(at);
            Py_DECREF(cap);
            Py_DECREF(out);
            return NULL;
        }
        Py_INCREF(cap);
        Py_INCREF(t);
        Py_INCREF(item);
        PyTuple_SET_ITEM(rows, 0, cap);
        PyTuple_SET_ITEM(rows, 1, t);
        PyTuple_SET_ITEM(rows, 2, at);
        PyTuple_SET_ITEM(rows, 3, item);
        PyList_SET_ITEM(out, i, rows);
        start += PyLong_AsLongLong(item);
    }
    Py_DECREF(cap);
    return out;
}

static PyMethodDef methods[] = {
    {"setup", (PyCFunction)(void (*)(void))py_setup, METH_FASTCALL,
     "give the cutter the codec's terms (codec.row_range_contract())"},
    {"rows", (PyCFunction)(void (*)(void))py_rows, METH_FASTCALL,
     "a tensor's row ranges, to send without views"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "neuronmp.session._rowcut",
    "DataParallel's row cutter: a tensor's chunks as row ranges the transport sends "
    "without views.", -1, methods,
};

PyMODINIT_FUNC PyInit__rowcut(void)
{
    if (nmp_describe_init() < 0)
        return NULL;
    return PyModule_Create(&module);
}
