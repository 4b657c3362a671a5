/*
 * neuronmp.ipc._frames: frames in and out of shared memory, in one C call each.
 *
 *   - put / get: encode a common frame straight into a ring and publish it;
 *     put_many: one frame into each of several rings, their readers woken once
 *     all are published;
 *     find the next frame of a ring and decode it (codec.py documents the
 *     record layout and which frames take this path);
 *   - decode: the same decoder on any mapping (a spill segment or an arena);
 *   - copy_in / copy_out / copy: memcpy into, out of or beside a mapping,
 *     cache-bypassing when big, with the GIL released for large copies.
 *
 * Counters are published as _shm.h does it; waiting is neuronmp.shm._waits'
 * business (ring.py calls it when put or get says "not yet").
 */
#include "_frames.h"

struct frames_state C;

int need_setup(void)
{
    if (!C.ready) {
        PyErr_SetString(PyExc_RuntimeError, "neuronmp.ipc._frames.setup() was not called");
        return -1;
    }
    return 0;
}

/*
 * setup(tensor_type, codes, itemsizes, dlpack_types, strided, from_dlpack,
 *       make, ring_layout, rows_type)
 * codes: {dtype: code}; itemsizes: {code: bytes}; dlpack_types: {code:
 * (dl code, bits, lanes)} for the dtypes DLPack carries; make(buf, off,
 * code, shape, copy) builds the others; ring_layout: (header, capacity,
 * head, tail, rsleep, wsleep) offsets; rows_type: codec.Rows, the row range.
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
    C.types.codes = C.codes;
    C.types.strided = C.strided;
    for (int c = 0; c < MAX_CODES; c++) {
        C.types.itemsize[c] = C.itemsize[c];
        C.types.ask_conj[c] = C.dl[c].code == 5 /* kDLComplex */ || !C.dl_ok[c];
    }
    C.ready = 1;
    Py_RETURN_NONE;
}


static PyMethodDef methods[] = {
    {"put", (PyCFunction)(void (*)(void))py_put, METH_FASTCALL,
     "encode a frame into a ring and publish it"},
    {"put_many", (PyCFunction)(void (*)(void))py_put_many, METH_FASTCALL,
     "put a frame into each of several rings, then wake their readers"},
    {"get", (PyCFunction)(void (*)(void))py_get, METH_FASTCALL,
     "decode the next frame of a ring"},
    {"decode", (PyCFunction)(void (*)(void))py_decode, METH_FASTCALL,
     "decode the record at an offset"},
    {"dl_dtype", (PyCFunction)py_dl_dtype, METH_O, "DLPack dtype of a capsule"},
    {"setup", (PyCFunction)(void (*)(void))py_setup, METH_FASTCALL,
     "give the codec torch's types and the ring layout"},
    {"copy", (PyCFunction)(void (*)(void))py_copy, METH_FASTCALL, "memcpy between addresses"},
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
    if (nmp_describe_init() < 0)
        return NULL;
    return PyModule_Create(&module);
}
