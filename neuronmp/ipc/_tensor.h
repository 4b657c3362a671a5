/*
 * A tensor as the codec describes it, and the wire contract of a row range.
 *
 * The transport owns both.  Two extensions compile them in, each its own copy
 * (every name below is static or hidden: no symbol is shared at run time):
 *
 *   neuronmp.ipc._frames   the encoder: sends tensors, and row ranges it is handed
 *   neuronmp.session._rowcut       DataParallel's cutter, on the request path: makes them
 *
 *   cutter:  tensor ──nmp_describe──▶ nmp_desc (whole tensor) in a capsule
 *            [codec.Rows(capsule, tensor, start, count), ...]  one per chunk
 *   encoder: codec.Rows ──capsule checked──▶ nmp_desc narrowed to the rows ─▶ frame
 *
 * A row range is a codec.Rows ``(description, tensor, start, count)``.  Its
 * description is a capsule named NMP_ROWS_CAPSULE holding an nmp_desc of the
 * whole tensor; the capsule's context is a strong reference to that tensor, so
 * the memory it points at lives as long as the capsule.  The encoder trusts a
 * description only when the capsule's name, the struct's size and the tensor
 * (the context is the Rows' own tensor) all match, and it checks the rows
 * against the described dim 0; anything else travels as ``Rows.tensor()`` on
 * the pickle path.  Python code cannot make such a capsule (short of ctypes).
 */
#ifndef NEURONMP_IPC_TENSOR_H
#define NEURONMP_IPC_TENSOR_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define NMP_HIDDEN __attribute__((visibility("hidden")))

#define NMP_ROWS_CAPSULE "neuronmp.ipc.rows"
#define NMP_MAX_CODES 64   /* dtype codes (codec.CODE) are below this */
#define NMP_DESC_NDIM 16   /* tensors with more dims are not described */

/* the fields of a description, also spliced into the encoder's TInfo */
#define NMP_DESC_FIELDS                                                        \
    uint32_t size;        /* sizeof(nmp_desc) where it was made */              \
    int32_t code, nd;     /* codec dtype code, number of dims */                \
    int64_t shape[NMP_DESC_NDIM];                                              \
    const void *ptr;      /* the first byte */                                  \
    size_t nbytes;        /* of the whole tensor */

typedef struct { NMP_DESC_FIELDS } nmp_desc;

/* what describing needs of torch, handed over by each extension's setup() */
typedef struct {
    PyObject *codes;                 /* {dtype: code} (borrowed from the owner) */
    PyObject *strided;               /* torch.strided */
    Py_ssize_t itemsize[NMP_MAX_CODES];
    char ask_conj[NMP_MAX_CODES];    /* 1: is_conj() must be asked (complex, or no
                                        DLPack type to carry the bit) */
} nmp_types;

/* once per extension, before nmp_describe: the attribute names, interned */
NMP_HIDDEN int nmp_describe_init(void);
/* 1: ``t`` (a torch.Tensor) described in *d; 0: not for the fast path (a
 * non-contiguous, non-CPU, neg/conj-bit tensor, an unknown dtype: Python then
 * decides, and raises the clear error if there is one); -1: exception. */
NMP_HIDDEN int nmp_describe(const nmp_types *tt, PyObject *t, nmp_desc *d);

#endif
