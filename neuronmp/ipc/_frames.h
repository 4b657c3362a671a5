/*
 * The private header of neuronmp.ipc._frames, whose sources are:
 *
 *   _frames.c          the module: its state (torch's types, the dtype tables,
 *                      the ring header layout), setup() and the method table
 *   _frames_encode.c   a frame's encoder: tensors and the skeleton of the tree
 *   _frames_decode.c   its decoder: DLPack tensors, copied or viewing a mapping
 *   _frames_ring.c     put / get: frames into and out of a ring, published
 *   _frames_copy.c     copies: cache-bypassing when big, GIL released
 *   _tensor.c          a tensor described (shared with neuronmp.session._rowcut, the
 *                      request path's row cutter: see _tensor.h)
 *
 *        obj ──walk/frame_kind (encode)──▶ write_frame ──put (ring)──▶ ring
 *        ring ──get (ring)──▶ decode_record (decode) ──make_tensor──▶ tensors
 *
 * Everything declared here is internal to the one extension (hidden symbols).
 * The encoder sends row ranges (DataParallel's chunks, made by neuronmp.session._rowcut)
 * under the contract _tensor.h declares; it makes none itself.
 */
#ifndef NEURONMP_FRAMES_H
#define NEURONMP_FRAMES_H

#include "../shm/_shm.h"
#include "_tensor.h"

#define FR_INTERNAL __attribute__((visibility("hidden")))

/* copies at least this big run with the GIL released */
#define NOGIL_COPY 65536
/* copies at least this big bypass the cache (see bulk_copy) */
#define NT_COPY (4 << 20)

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
#define MAX_CODES NMP_MAX_CODES
#define FAST_NDIM NMP_DESC_NDIM  /* tensors with more dims take the Python path */
#define FAST_TENSORS 32    /* so do frames with more tensors */
#define SKEL_MAX 4096      /* and trees whose skeleton is longer */
#define MAX_DEPTH 16
#define MAX_NDIM 64        /* what a record may declare (codec._MAX_NDIM) */
/* An idle ring restarts at its first byte once the writer is this far in:
 * request/answer traffic then cycles through a few hot, cache-resident pages
 * instead of walking the whole (cold) ring -- a 64 KiB frame written to cold
 * memory costs twice as much. */
#define WRAP_MIN (256 << 10)


struct frames_state {
    int ready;
    PyObject *tensor_type, *codes, *strided, *from_dlpack, *make, *rows_type;
    nmp_types types;   /* what describing a tensor needs (_tensor.h) */
    Py_ssize_t itemsize[MAX_CODES];
    int dl_ok[MAX_CODES];
    DLDataType dl[MAX_CODES];
    /* ring header layout, from ring.py */
    Py_ssize_t header, off_cap, off_head, off_tail, off_rsleep, off_wsleep;
};
extern FR_INTERNAL struct frames_state C;

static inline size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

/* a tensor to encode: its description (or a row range's, narrowed), and where
 * its bytes go in the frame */
typedef struct {
    union {
        nmp_desc desc;
        struct { NMP_DESC_FIELDS };
    };
    size_t off;
} TInfo;

typedef struct {
    int n;                     /* tensors found */
    TInfo t[FAST_TENSORS];
    size_t skel_len;
    unsigned char skel[SKEL_MAX];
} Enc;

FR_INTERNAL int need_setup(void);
/* copies (_frames_copy.c) */
FR_INTERNAL void bulk_copy(void *dst, const void *src, size_t n);
FR_INTERNAL void big_copy(void *dst, const void *src, Py_ssize_t n);
/* encoding (_frames_encode.c) */
FR_INTERNAL int walk(Enc *e, PyObject *o, int depth);
FR_INTERNAL int frame_kind(Enc *e, PyObject *obj);
FR_INTERNAL size_t layout_frame(Enc *e);
FR_INTERNAL void write_frame(char *rec, Enc *e, int kind, size_t length);
/* decoding (_frames_decode.c) */
FR_INTERNAL PyObject *bad_record(const char *why);
FR_INTERNAL PyObject *decode_record(PyObject *owner, const char *rec, Py_ssize_t off,
                                    size_t length, int copy);

/* the module's methods, by source */
FR_INTERNAL PyObject *py_put(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
FR_INTERNAL PyObject *py_put_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
FR_INTERNAL PyObject *py_get(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
FR_INTERNAL PyObject *py_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
FR_INTERNAL PyObject *py_dl_dtype(PyObject *self, PyObject *cap);
FR_INTERNAL PyObject *py_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
FR_INTERNAL PyObject *py_copy_in(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
FR_INTERNAL PyObject *py_copy_out(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif
