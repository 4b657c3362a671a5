/*
 * neuronmp.torchneuron.collectives._pieces: an all_reduce's pieces, claimed by
 * whichever rank is running.
 *
 * Every rank of the group has mapped every rank's tensor (the group's mapped
 * path, shm.py); the tensors are split into pieces, and each rank in its loop
 * claims the next piece with one fetch-and-add on a shared counter, reduces it
 * across all the tensors in rank order and writes the result into every one of
 * them, in one pass: each element of each tensor is read once and written once,
 * the least any all_reduce can move, and a rank that the scheduler runs while
 * its peer waits for a CPU does the peer's share too (a fixed split would make
 * it wait for the peer).  The pieces done are counted on a second counter; the
 * rank whose piece completes the call wakes the ranks sleeping on it.
 *
 * The kernels go through a tile of the piece at a time kept in L1 (read every
 * operand into it, then copy it into every tensor): plain loops the compiler
 * vectorises, built for AVX-512 and AVX2 besides the baseline where the
 * compiler can (target_clones picks one when the module loads).
 */
#include "../../shm/_shm.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KERNEL __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KERNEL
#endif

#define TILE 1024   /* elements a tile holds: 8 KiB of doubles, in L1 */
#define MAX_RANKS 64

typedef void (*kernel_fn)(char *const *p, int n, size_t lo, size_t hi);

/* One (dtype, op): out[i] = p0[i] op p1[i] op ... in rank order, into every p_r.
 * OP(x, y) sees the accumulator as x. */
#define DEFINE(NAME, T, OP)                                                        \
    KERNEL static void NAME(char *const *p, int n, size_t lo, size_t hi)           \
    {                                                                              \
        T tmp[TILE];                                                               \
        for (size_t a = lo; a < hi; a += TILE) {                                   \
            size_t m = hi - a < TILE ? hi - a : TILE;                              \
            const T *restrict x0 = (const T *)p[0] + a;                            \
            const T *restrict x1 = (const T *)p[1] + a;                            \
            for (size_t j = 0; j < m; j++) {                                       \
                T x = x0[j], y = x1[j];                                            \
                tmp[j] = OP(x, y);                                                 \
            }                                                                      \
            for (int r = 2; r < n; r++) {                                          \
                const T *restrict xr = (const T *)p[r] + a;                        \
                for (size_t j = 0; j < m; j++) {                                   \
                    T x = tmp[j], y = xr[j];                                       \
                    tmp[j] = OP(x, y);                                             \
                }                                                                  \
            }                                                                      \
            for (int r = 0; r < n; r++)                                            \
                memcpy((T *)p[r] + a, tmp, m * sizeof(T));                         \
        }                                                                          \
    }

/* floats: torch.minimum / maximum return a NaN operand */
#define F_ADD(x, y) ((x) + (y))
#define F_MUL(x, y) ((x) * (y))
#define F_MIN(x, y) (((x) != (x) || (x) < (y)) ? (x) : (y))
#define F_MAX(x, y) (((x) != (x) || (x) > (y)) ? (x) : (y))
/* integers wrap as torch's do: the arithmetic in an unsigned type at least as wide
 * (never promoted to int, whose overflow is undefined) */
#define I_MIN(x, y) ((x) < (y) ? (x) : (y))
#define I_MAX(x, y) ((x) > (y) ? (x) : (y))
#define I_AND(x, y) ((x) & (y))
#define I_OR(x, y) ((x) | (y))
#define I_XOR(x, y) ((x) ^ (y))

#define FLOATS(S, T)                                                               \
    DEFINE(sum_##S, T, F_ADD)                                                      \
    DEFINE(prod_##S, T, F_MUL)                                                     \
    DEFINE(min_##S, T, F_MIN)                                                      \
    DEFINE(max_##S, T, F_MAX)

#define INTS(S, T, U)                                                              \
    static inline T add_##S(T x, T y) { return (T)((U)x + (U)y); }                 \
    static inline T mul_##S(T x, T y) { return (T)((U)x * (U)y); }                 \
    DEFINE(sum_##S, T, add_##S)                                                    \
    DEFINE(prod_##S, T, mul_##S)                                                   \
    DEFINE(min_##S, T, I_MIN)                                                      \
    DEFINE(max_##S, T, I_MAX)                                                      \
    DEFINE(and_##S, T, I_AND)                                                      \
    DEFINE(or_##S, T, I_OR)                                                        \
    DEFINE(xor_##S, T, I_XOR)

FLOATS(f32, float)
FLOATS(f64, double)

/* bfloat16 as torch's CPU ops reduce it: each op in float, its result rounded to
 * the nearest even bfloat16 (so four ranks round after each of their three ops) */
static inline float bf16_in(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float bf16_round(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        u |= 0x00400000u;   /* a NaN stays a (quiet) NaN */
    else
        u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

#define DEFINE_BF16(NAME, OP)                                                      \
    KERNEL static void NAME(char *const *p, int n, size_t lo, size_t hi)           \
    {                                                                              \
        float tmp[TILE];                                                           \
        uint16_t out[TILE];                                                        \
        for (size_t a = lo; a < hi; a += TILE) {                                   \
            size_t m = hi - a < TILE ? hi - a : TILE;                              \
            const uint16_t *restrict x0 = (const uint16_t *)p[0] + a;              \
            const uint16_t *restrict x1 = (const uint16_t *)p[1] + a;              \
            for (size_t j = 0; j < m; j++) {                                       \
                float x = bf16_in(x0[j]), y = bf16_in(x1[j]);                      \
                tmp[j] = bf16_round(OP(x, y));                                     \
            }                                                                      \
            for (int r = 2; r < n; r++) {                                          \
                const uint16_t *restrict xr = (const uint16_t *)p[r] + a;          \
                for (size_t j = 0; j < m; j++) {                                   \
                    float x = tmp[j], y = bf16_in(xr[j]);                          \
                    tmp[j] = bf16_round(OP(x, y));                                 \
                }                                                                  \
            }                                                                      \
            for (size_t j = 0; j < m; j++) {                                       \
                uint32_t u;                                                        \
                memcpy(&u, &tmp[j], 4);                                            \
                out[j] = (uint16_t)(u >> 16);                                      \
            }                                                                      \
            for (int r = 0; r < n; r++)                                            \
                memcpy((uint16_t *)p[r] + a, out, m * 2);                          \
        }                                                                          \
    }

DEFINE_BF16(sum_bf16, F_ADD)
DEFINE_BF16(prod_bf16, F_MUL)
DEFINE_BF16(min_bf16, F_MIN)
DEFINE_BF16(max_bf16, F_MAX)
INTS(i8, int8_t, uint32_t)
INTS(u8, uint8_t, uint32_t)
INTS(i16, int16_t, uint32_t)
INTS(i32, int32_t, uint32_t)
INTS(i64, int64_t, uint64_t)

/* [dtype][op]: the codes pieces.py gives (dtypes f32 f64 i8 u8 i16 i32 i64 bf16;
 * ops sum prod min max and or xor) */
#define N_DTYPES 8
#define N_OPS 7
#define ROW_F(S) {sum_##S, prod_##S, min_##S, max_##S, NULL, NULL, NULL}
#define ROW_I(S) {sum_##S, prod_##S, min_##S, max_##S, and_##S, or_##S, xor_##S}
static const kernel_fn KERNELS[N_DTYPES][N_OPS] = {
    ROW_F(f32), ROW_F(f64), ROW_I(i8), ROW_I(u8), ROW_I(i16), ROW_I(i32), ROW_I(i64),
    ROW_F(bf16)};
static const size_t ELEM[N_DTYPES] = {4, 8, 1, 1, 2, 4, 8, 2};

/*
 * reduce(buf, off_claims, off_done, off_flags, nflags, base, target, addrs, nelem,
 *        piece, dtype, op) -> int
 * Check in (one count on the done counter: no rank returns before every rank has
 * read where its peers' tensors are), then claim pieces of `piece` elements of
 * the `nelem` at each address of `addrs` (every rank's tensor, in rank order) at
 * the claims counter until none is left (a claim numbered `base` + k is piece k),
 * reducing each and counting it done.  The rank whose count brings the done
 * counter to `target` wakes the sleepers if any of the nflags u32 flags at
 * off_flags is raised.  GIL released.  The pieces this rank reduced.
 */
static PyObject *py_reduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs(nargs, 12, "reduce") < 0)
        return NULL;
    Py_ssize_t nflags = PyLong_AsSsize_t(args[4]);
    unsigned long long base = PyLong_AsUnsignedLongLong(args[5]);
    unsigned long long target = PyLong_AsUnsignedLongLong(args[6]);
    Py_ssize_t nelem = PyLong_AsSsize_t(args[8]);
    Py_ssize_t piece = PyLong_AsSsize_t(args[9]);
    long dtype = PyLong_AsLong(args[10]), op = PyLong_AsLong(args[11]);
    if (PyErr_Occurred())
        return NULL;
    if (dtype < 0 || dtype >= N_DTYPES || op < 0 || op >= N_OPS || !KERNELS[dtype][op]) {
        PyErr_Format(PyExc_ValueError, "reduce: no kernel for dtype code %ld, op code %ld",
                     dtype, op);
        return NULL;
    }
    if (nelem < 0 || piece <= 0 || nflags < 0) {
        PyErr_Format(PyExc_ValueError, "reduce: nelem %zd, piece %zd, nflags %zd: "
                     "nelem and nflags must be >= 0, piece > 0", nelem, piece, nflags);
        return NULL;
    }
    if (!PyTuple_Check(args[7]) || PyTuple_GET_SIZE(args[7]) < 2 ||
            PyTuple_GET_SIZE(args[7]) > MAX_RANKS) {
        PyErr_Format(PyExc_TypeError, "reduce: addrs must be a tuple of 2 to %d addresses",
                     MAX_RANKS);
        return NULL;
    }
    int n = (int)PyTuple_GET_SIZE(args[7]);
    char *p[MAX_RANKS];
    for (int r = 0; r < n; r++) {
        p[r] = (char *)PyLong_AsVoidPtr(PyTuple_GET_ITEM(args[7], r));
        if (!p[r] && PyErr_Occurred())
            return NULL;
        if ((uintptr_t)p[r] % ELEM[dtype]) {
            PyErr_Format(PyExc_ValueError, "reduce: address %d is not aligned to its "
                         "elements of %zu bytes", r, ELEM[dtype]);
            return NULL;
        }
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) < 0)
        return NULL;
    char *claims = counter_at(&view, args[1]);
    char *done = claims ? counter_at(&view, args[2]) : NULL;
    char *flags = done ? at(&view, args[3], 4 * nflags) : NULL;
    if (!flags) {
        PyBuffer_Release(&view);
        return NULL;
    }
    kernel_fn fn = KERNELS[dtype][op];
    uint64_t pieces = (uint64_t)((nelem + piece - 1) / piece), mine = 0;
    Py_BEGIN_ALLOW_THREADS
    uint64_t d = __atomic_add_fetch((uint64_t *)done, 1, __ATOMIC_SEQ_CST);
    for (;;) {
        if (d == target) {   /* this count completed the call: wake whoever sleeps */
            for (Py_ssize_t i = 0; i < nflags; i++)
                if (__atomic_load_n((uint32_t *)flags + i, __ATOMIC_SEQ_CST)) {
                    futex_wake((uint32_t *)(done + LOW_WORD_OFFSET));
                    break;
                }
        }
        uint64_t k = __atomic_fetch_add((uint64_t *)claims, 1, __ATOMIC_SEQ_CST) - base;
        if (k >= pieces)
            break;
        size_t lo = (size_t)(k * (uint64_t)piece);
        size_t hi = lo + (size_t)piece < (size_t)nelem ? lo + (size_t)piece : (size_t)nelem;
        fn(p, n, lo, hi);
        mine++;
        /* seq_cst: the piece's stores are visible to whoever sees the count */
        d = __atomic_add_fetch((uint64_t *)done, 1, __ATOMIC_SEQ_CST);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(mine);
}

static PyMethodDef methods[] = {
    {"reduce", (PyCFunction)(void (*)(void))py_reduce, METH_FASTCALL,
     "claim and reduce an all_reduce's pieces across every rank's tensor (GIL released)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "neuronmp.torchneuron.collectives._pieces",
    "An all_reduce's pieces, claimed and reduced by whichever rank is running.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__pieces(void)
{
    return PyModule_Create(&module);
}
