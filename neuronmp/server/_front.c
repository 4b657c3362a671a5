/* The HTTP front end's request scanner (server/front.py): one whole request of the
 * common shape at an offset of the received bytes, or None.
 *
 *     scan(data, offset) -> (end, path, keep_alive, header_length, body_start) | None
 *
 * The common shape is what HTTP clients send for a binary inference request:
 *
 *     POST <path> HTTP/1.1 CRLF
 *     (<token>: <value> CRLF)*        Content-Length (once, digits), optionally
 *     CRLF                            Inference-Header-Content-Length (once, digits)
 *     <Content-Length bytes>          and Connection (keep-alive or close)
 *
 * with the whole body already received.  Anything else gives None and the caller
 * hands the bytes from ``offset`` on to httptools, which parses them, answers what
 * is malformed and serves what is unusual (HTTP/1.0, chunked bodies, Expect,
 * Upgrade, Transfer-Encoding, a percent-encoded or queried path, a repeated field,
 * a body not yet whole, a body over the size limit, a head past the limits of
 * server/wire.py, which httptools' callbacks then refuse).  So the scanner only has to
 * accept a strict subset of what llhttp accepts, and read it as llhttp does: it
 * never decides a status itself.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* the body size limit of server/front.py (MAX_BODY): larger bodies go to httptools,
   which refuses them with 413 */
#define MAX_BODY ((long long)1 << 30)
/* digits of a length field accepted here (more: httptools reads it) */
#define MAX_DIGITS 12
/* the request head's limits of server/wire.py (test_front checks they agree): the
   target, a field's name and value, the fields, and the target with every field's
   name and value */
#define TARGET_MAX (16 << 10)
#define FIELD_MAX (8 << 10)
#define FIELDS_MAX 128
#define HEAD_MAX (64 << 10)

/* RFC 9110 tchar */
static int is_tchar(unsigned char c)
{
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'))
        return 1;
    return c != 0 && strchr("!#$&'*+-.^_`|~%", c) != NULL;
}

/* the path characters taken here: unreserved, sub-delims, ':', '@', '/' (no '%',
   '?' or '#': those paths go to httptools, whose URL parser the caller then uses) */
static int is_pchar(unsigned char c)
{
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'))
        return 1;
    return c != 0 && strchr("-._~!$&'()*+,;=:@/", c) != NULL;
}

static int name_is(const unsigned char *p, Py_ssize_t n, const char *lower)
{
    Py_ssize_t k = (Py_ssize_t)strlen(lower);
    if (n != k)
        return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = p[i];
        if (c >= 'A' && c <= 'Z')
            c = (unsigned char)(c + 32);
        if (c != (unsigned char)lower[i])
            return 0;
    }
    return 1;
}

/* a decimal of 1..MAX_DIGITS digits, else -1 */
static long long digits(const unsigned char *p, Py_ssize_t n)
{
    if (n < 1 || n > MAX_DIGITS)
        return -1;
    long long v = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (p[i] < '0' || p[i] > '9')
            return -1;
        v = v * 10 + (p[i] - '0');
    }
    return v;
}

/* the request at buf[at:], or 0 (not of the common shape, or not whole yet) */
static int scan_one(const unsigned char *buf, Py_ssize_t len, Py_ssize_t at,
                    Py_ssize_t *path_at, Py_ssize_t *path_len, int *keep_alive,
                    long long *header_len, Py_ssize_t *body_at, Py_ssize_t *end)
{
    const unsigned char *p = buf + at, *stop = buf + len;
    if (stop - p < 5 || memcmp(p, "POST ", 5) != 0)
        return 0;
    p += 5;
    const unsigned char *path = p;
    if (p >= stop || *p != '/')
        return 0;
    while (p < stop && is_pchar(*p))
        p++;
    if (stop - p < 11 || memcmp(p, " HTTP/1.1\r\n", 11) != 0)
        return 0;
    *path_at = path - buf;
    *path_len = p - path;
    if (*path_len > TARGET_MAX)
        return 0;
    Py_ssize_t head = *path_len, fields = 0;
    p += 11;
    long long length = -1;
    *header_len = -1;
    *keep_alive = 1;
    int connection = 0;
    for (;;) {
        if (stop - p < 2)
            return 0;
        if (p[0] == '\r' && p[1] == '\n') {
            p += 2;
            break;
        }
        const unsigned char *name = p;
        while (p < stop && is_tchar(*p))
            p++;
        if (p == name || p >= stop || *p != ':')
            return 0;
        Py_ssize_t name_len = p - name;
        p++;
        while (p < stop && (*p == ' ' || *p == '\t'))
            p++;
        const unsigned char *value = p;
        while (p < stop && ((*p >= 0x20 && *p < 0x7f) || *p == '\t'))
            p++;
        if (stop - p < 2 || p[0] != '\r' || p[1] != '\n')
            return 0;
        const unsigned char *value_end = p;
        while (value_end > value && (value_end[-1] == ' ' || value_end[-1] == '\t'))
            value_end--;
        Py_ssize_t value_len = value_end - value;
        p += 2;
        head += name_len + value_len;
        if (name_len + value_len > FIELD_MAX || ++fields > FIELDS_MAX || head > HEAD_MAX)
            return 0;
        switch (name_len) {
        case 14:
            if (name_is(name, name_len, "content-length")) {
                if (length >= 0)
                    return 0;
                length = digits(value, value_len);
                if (length < 0)
                    return 0;
            }
            break;
        case 31:
            if (name_is(name, name_len, "inference-header-content-length")) {
                if (*header_len >= 0)
                    return 0;
                *header_len = digits(value, value_len);
                if (*header_len < 0)
                    return 0;
            }
            break;
        case 10:
            if (name_is(name, name_len, "connection")) {
                if (connection++)
                    return 0;
                if (name_is(value, value_len, "close"))
                    *keep_alive = 0;
                else if (!name_is(value, value_len, "keep-alive"))
                    return 0;
            }
            break;
        case 6:
            if (name_is(name, name_len, "expect"))
                return 0;
            break;
        case 7:
            if (name_is(name, name_len, "upgrade"))
                return 0;
            break;
        case 17:
            if (name_is(name, name_len, "transfer-encoding"))
                return 0;
            break;
        default:
            break;
        }
    }
    if (length < 0 || length > MAX_BODY || length > stop - p)
        return 0;
    *body_at = p - buf;
    *end = *body_at + (Py_ssize_t)length;
    return 1;
}

static PyObject *py_scan(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t at;
    if (!PyArg_ParseTuple(args, "y*n:scan", &view, &at))
        return NULL;
    Py_ssize_t path_at = 0, path_len = 0, body_at = 0, end = 0;
    int keep_alive = 1;
    long long header_len = -1;
    PyObject *out = NULL;
    if (at < 0 || at > view.len) {
        PyErr_Format(PyExc_ValueError, "offset %zd is outside the %zd bytes", at, view.len);
    } else if (scan_one((const unsigned char *)view.buf, view.len, at, &path_at, &path_len,
                        &keep_alive, &header_len, &body_at, &end)) {
        out = Py_BuildValue("(ny#OLn)", end, (const char *)view.buf + path_at, path_len,
                            keep_alive ? Py_True : Py_False, header_len, body_at);
    } else {
        out = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef methods[] = {
    {"scan", py_scan, METH_VARARGS,
     "scan(data, offset) -> (end, path, keep_alive, header_length, body_start) or None:\n"
     "the request of the common binary-inference shape at data[offset:], whole, or\n"
     "None (anything else: httptools parses it).  header_length is the\n"
     "Inference-Header-Content-Length field, -1 when absent; the body is\n"
     "data[body_start:end]."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_front",
                                    "The HTTP front end's request scanner (see _front.c).",
                                    -1, methods};

PyMODINIT_FUNC PyInit__front(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "TARGET_MAX", TARGET_MAX) < 0 ||
        PyModule_AddIntConstant(m, "FIELD_MAX", FIELD_MAX) < 0 ||
        PyModule_AddIntConstant(m, "FIELDS_MAX", FIELDS_MAX) < 0 ||
        PyModule_AddIntConstant(m, "HEAD_MAX", HEAD_MAX) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
