/* neuronmp.ipc._frames: rows(), a tensor cut into row ranges sent without views. */
#include "_frames.h"

static void rows_capsule_free(PyObject *cap)
{
    PyMem_Free(PyCapsule_GetPointer(cap, ROWS_CAPSULE));
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
PyObject *py_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
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
