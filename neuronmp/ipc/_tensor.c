/* A tensor described for the codec (see _tensor.h): compiled into neuronmp.ipc._frames
 * and neuronmp.session._rowcut, each with its own copy of the names below. */
#include "_tensor.h"

static PyObject *S_dtype, *S_shape, *S_layout, *S_is_cpu, *S_is_contiguous, *S_is_conj,
    *S_is_neg, *S_data_ptr;

int nmp_describe_init(void)
{
    PyObject **names[] = {&S_dtype, &S_shape, &S_layout, &S_is_cpu, &S_is_contiguous,
                          &S_is_conj, &S_is_neg, &S_data_ptr};
    const char *strs[] = {"dtype", "shape", "layout", "is_cpu", "is_contiguous", "is_conj",
                          "is_neg", "data_ptr"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)
        if (!*names[i] && !(*names[i] = PyUnicode_InternFromString(strs[i])))
            return -1;
    return 0;
}

static int is_true_call(PyObject *o, PyObject *name)
{
    PyObject *r = PyObject_CallMethodNoArgs(o, name);
    if (!r)
        return -1;
    int v = r == Py_True;
    Py_DECREF(r);
    return v;
}

int nmp_describe(const nmp_types *tt, PyObject *t, nmp_desc *d)
{
    PyObject *o = PyObject_GetAttr(t, S_dtype);
    if (!o)
        return -1;
    PyObject *code = PyDict_GetItemWithError(tt->codes, o);
    Py_DECREF(o);
    if (!code)
        return PyErr_Occurred() ? -1 : 0;
    d->size = sizeof *d;
    d->code = (int32_t)PyLong_AsLong(code);
    if (d->code < 0 || d->code >= NMP_MAX_CODES || !tt->itemsize[d->code])
        return PyErr_Occurred() ? -1 : 0;
    if (!(o = PyObject_GetAttr(t, S_layout)))
        return -1;
    int ok = o == tt->strided;
    Py_DECREF(o);
    if (!ok)
        return 0;
    if (!(o = PyObject_GetAttr(t, S_is_cpu)))
        return -1;
    ok = o == Py_True;
    Py_DECREF(o);
    /* a neg-bit view can be contiguous (conj().imag of a 1-element tensor),
     * and its memory does not hold its values: leave it to codec._prepare */
    int r;
    if (!ok || (r = is_true_call(t, S_is_contiguous)) != 1 || (r = is_true_call(t, S_is_neg)) != 0)
        return ok ? (r < 0 ? -1 : 0) : 0;
    if (tt->ask_conj[d->code] && (r = is_true_call(t, S_is_conj)) != 0)
        return r < 0 ? -1 : 0;
    if (!(o = PyObject_GetAttr(t, S_shape)))
        return -1;
    if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) > NMP_DESC_NDIM) {
        Py_DECREF(o);
        return 0;
    }
    d->nd = (int32_t)PyTuple_GET_SIZE(o);
    size_t numel = 1;
    for (int i = 0; i < d->nd; i++) {
        long long n = PyLong_AsLongLong(PyTuple_GET_ITEM(o, i));
        if (n < 0) {
            Py_DECREF(o);
            return PyErr_Occurred() ? -1 : 0;
        }
        d->shape[i] = n;
        numel *= (size_t)n;
    }
    Py_DECREF(o);
    d->nbytes = numel * (size_t)tt->itemsize[d->code];
    if (!(o = PyObject_CallMethodNoArgs(t, S_data_ptr)))
        return -1;
    d->ptr = PyLong_AsVoidPtr(o);
    Py_DECREF(o);
    return PyErr_Occurred() ? -1 : 1;
}
