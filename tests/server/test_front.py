"""neuronmp-serve's HTTP/1.1 front end (server/front.py) against a real server: every
route answers as the aiohttp application does (status, content type, body), and the
wire behaviours a client may rely on: pipelined requests answered in order, HTTP/1.0
closing, chunked request bodies, ``Expect: 100-continue``, HEAD, and a malformed
request refused with 400 and the connection closed, the server still serving.
"""
from __future__ import annotations

import http.client
import json
import socket
import struct
import threading
import time

import psutil
import pytest
from server.test_server import Server

pytest.importorskip("httptools")
from neuronmp.server._front import scan  # noqa: E402 - after the skip

_DOC = json.dumps({"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 16],
                               "data": [0.5] * 16}]}).encode()
_CALLS = [
    ("GET", "/v2/health/live", b""), ("GET", "/v2/health/ready", b""), ("GET", "/v2", b""),
    ("GET", "/v2/models/mlp", b""), ("GET", "/v2/models/mlp/versions/1", b""),
    ("GET", "/v2/models/mlp/versions/9", b""), ("GET", "/v2/models/nope", b""),
    ("GET", "/v2/models/mlp/ready", b""), ("GET", "/v2/models/named/config", b""),
    ("GET", "/v2/models/nope/config", b""),
    ("GET", "/v2/systemsharedmemory/status", b""),
    ("GET", "/v2/systemsharedmemory/region/nope/status", b""),
    ("POST", "/v2/systemsharedmemory/region/nope/unregister", b""),
    ("POST", "/v2/systemsharedmemory/region/r/register", b"{nope"),
    ("POST", "/v2/models/mlp/infer", _DOC), ("POST", "/v2/models/mlp/versions/1/infer", _DOC),
    ("POST", "/v2/models/mlp/versions/2/infer", _DOC),
    ("POST", "/v2/models/mlp/infer", b'{"inputs": 3}'),
    ("POST", "/v2/models/mlp/infer", b"not json"),
    ("GET", "/v2/models/mlp/infer", b""), ("POST", "/v2/health/live", b""),
    ("GET", "/no/such/route", b""), ("DELETE", "/v2", b""),
]


@pytest.fixture(scope="module")
def servers(repo, shared_server):
    # the shared server runs the default front end: httptools, installed (see above)
    aiohttp = Server(repo, args=("--http-frontend", "aiohttp"))
    try:
        yield {"httptools": shared_server, "aiohttp": aiohttp}
    finally:
        assert aiohttp.stop() == 0


def _call(port: int, method: str, path: str, body: bytes):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body or None,
                     headers={"Content-Type": "application/json"} if body else {})
        r = conn.getresponse()
        raw = r.read()
        ctype = (r.getheader("Content-Type") or "").split(";")[0]
        return r.status, ctype, r.getheader("Allow"), raw
    finally:
        conn.close()


def _comparable(answer):
    status, ctype, allow, raw = answer
    body = json.loads(raw) if ctype == "application/json" else raw
    return status, ctype, set((allow or "").split(",")) - {""}, body


@pytest.mark.parametrize("method,path,body", _CALLS)
def test_every_route_answers_as_the_aiohttp_application(servers, method, path, body):
    ours = _call(servers["httptools"].port, method, path, body)
    theirs = _call(servers["aiohttp"].port, method, path, body)
    assert _comparable(ours) == _comparable(theirs)


def _read_responses(sock: socket.socket, count: int):
    """``count`` HTTP responses read off ``sock`` (Content-Length bodies)."""
    f = sock.makefile("rb")
    out = []
    for _ in range(count):
        status = f.readline()
        headers = {}
        while (line := f.readline()) not in (b"\r\n", b""):
            k, v = line.decode().split(":", 1)
            headers[k.strip().lower()] = v.strip()
        body = f.read(int(headers.get("content-length", 0)))
        out.append((int(status.split()[1]), headers, body))
    return out, f


def test_pipelined_requests_are_answered_in_order(servers):
    port = servers["httptools"].port
    infer = (b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
             % (len(_DOC), _DOC))
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET /v2/models/mlp HTTP/1.1\r\nHost: x\r\n\r\n" + infer
                     + b"GET /v2/models/nope HTTP/1.1\r\nHost: x\r\n\r\n" + infer)
        answers, _ = _read_responses(sock, 4)
    assert [a[0] for a in answers] == [200, 200, 404, 200]
    assert json.loads(answers[0][2])["name"] == "mlp"
    assert json.loads(answers[1][2])["outputs"][0]["shape"] == [1, 3]
    assert answers[1][2] == answers[3][2]


def test_http_1_0_is_answered_then_closed(servers):
    with socket.create_connection(("127.0.0.1", servers["httptools"].port), timeout=30) as s:
        s.sendall(b"GET /v2/health/live HTTP/1.0\r\n\r\n")
        (answer,), f = _read_responses(s, 1)
        assert answer[0] == 200 and answer[1]["connection"] == "close"
        assert f.read() == b""   # the server closed its end


def test_a_chunked_body_and_expect_continue_are_served(servers):
    port = servers["httptools"].port
    plain = _call(port, "POST", "/v2/models/mlp/infer", _DOC)
    half = len(_DOC) // 2
    chunked = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (half, _DOC[:half], len(_DOC) - half,
                                                      _DOC[half:])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\n"
                     b"Transfer-Encoding: chunked\r\nExpect: 100-continue\r\n\r\n")
        f = sock.makefile("rb")
        assert f.readline().startswith(b"HTTP/1.1 100")
        assert f.readline() == b"\r\n"
        sock.sendall(chunked)
        (answer,), _ = _read_responses(sock, 1)
    assert answer[0] == 200 and answer[2] == plain[3]


def test_a_chunked_body_with_trailer_fields_is_served(servers):
    port = servers["httptools"].port
    plain = _call(port, "POST", "/v2/models/mlp/infer", _DOC)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n"
                     b"X-Trailer: t\r\n\r\n" % (len(_DOC), _DOC))
        (answer,), _ = _read_responses(sock, 1)
    assert answer[0] == 200 and answer[2] == plain[3]


def test_head_has_the_get_headers_and_no_body(servers):
    port = servers["httptools"].port
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/v2")
        got = conn.getresponse()
        body = got.read()
        conn.request("HEAD", "/v2")
        head = conn.getresponse()
        assert head.status == 200 and head.read() == b""
        assert int(head.getheader("Content-Length")) == len(body) > 0
    finally:
        conn.close()


def test_a_malformed_request_gets_400_and_the_server_goes_on(servers):
    port = servers["httptools"].port
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET /v2 HTTP/1.1\r\nContent-Length: nope\r\n\r\n")
        (answer,), f = _read_responses(sock, 1)
        assert answer[0] == 400 and b"malformed" in answer[2]
        assert f.read() == b""
    assert _call(port, "GET", "/v2/health/ready", b"")[0] == 200


def test_an_upgrade_request_is_answered_in_http_1_1_then_closed(servers):
    for front in ("httptools", "aiohttp"):
        with socket.create_connection(("127.0.0.1", servers[front].port), timeout=30) as s:
            s.sendall(b"GET /v2/models/mlp HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, "
                      b"HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n")
            (answer,), f = _read_responses(s, 1)
            assert answer[0] == 200 and json.loads(answer[2])["name"] == "mlp", front
            if front == "httptools":
                assert f.read() == b""   # closed: what follows is not HTTP/1.1


def _binary_infer(x: bytes, close: bool = False) -> bytes:
    """A KServe v2 binary-data infer request of mlp for 16 fp32 in ``x``."""
    header = json.dumps({"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 16],
                                     "parameters": {"binary_data_size": len(x)}}],
                         "outputs": [{"name": "OUTPUT__0",
                                      "parameters": {"binary_data": True}}]}).encode()
    return (b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
            b"Inference-Header-Content-Length: %d\r\n%s\r\n%s%s"
            % (len(header) + len(x), len(header),
               b"Connection: close\r\n" if close else b"", header, x))


def _samples(n: int):
    return [struct.pack("16f", *[(i + 1) * 0.1 * (k % 5) for k in range(16)]) for i in range(n)]


def _metric(port: int, name: str) -> float:
    text = _call(port, "GET", "/metrics", b"")[3].decode()
    line = next(x for x in text.splitlines() if x.startswith(name + '{model="mlp"'))
    return float(line.rsplit(" ", 1)[1])


def test_repeated_binary_requests_answer_as_the_aiohttp_application(servers):
    """A header seen before runs on the fast path (server/front.py): its answers are
    the general path's and the aiohttp application's, byte for byte, and counted."""
    ours, theirs = servers["httptools"].port, servers["aiohttp"].port
    before = _metric(ours, "nv_inference_request_success")
    xs = _samples(4)
    got = {}
    for name, port in (("ours", ours), ("theirs", theirs)):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            answers = []
            for x in xs + xs:   # the first request of a header prepares it
                sock.sendall(_binary_infer(x))
                answers += _read_responses(sock, 1)[0]
        got[name] = answers
    for a, b in zip(got["ours"], got["theirs"]):
        assert a[0] == b[0] == 200
        assert a[1]["inference-header-content-length"] == \
            b[1]["inference-header-content-length"]
        assert a[1]["content-type"] == b[1]["content-type"] == "application/octet-stream"
        assert a[2] == b[2]
    assert [a[2] for a in got["ours"][:4]] == [a[2] for a in got["ours"][4:]]
    assert len({a[2] for a in got["ours"][:4]}) == 4   # each its own rows
    assert _metric(ours, "nv_inference_request_success") == before + 8


def test_pipelined_binary_requests_keep_their_order_and_close_when_asked(servers):
    """Requests behind one on the fast path wait for its answer; a request that asks
    to close gets Connection: close and the connection ends after its answer."""
    port = servers["httptools"].port
    xs = _samples(3)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(_binary_infer(xs[0]))   # prepares the header
        (first,), _ = _read_responses(sock, 1)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(_binary_infer(xs[1]) + b"GET /v2/models/nope HTTP/1.1\r\nHost: x\r\n\r\n"
                     + _binary_infer(xs[0]) + _binary_infer(xs[2], close=True))
        answers, f = _read_responses(sock, 4)
        assert f.read() == b""   # closed after the last
    assert [a[0] for a in answers] == [200, 404, 200, 200]
    assert answers[2][2] == first[2] and answers[0][2] != first[2] != answers[3][2]
    assert answers[3][1]["connection"] == "close"
    assert "connection" not in answers[0][1]


# -- the request scanner (server/_front.c) ------------------------------------------------

_HEAD = b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\n"


def _raw(fields: bytes = b"Content-Length: 5\r\nInference-Header-Content-Length: 2\r\n",
         body: bytes = b"{}abc", head: bytes = _HEAD) -> bytes:
    return head + fields + b"\r\n" + body


def test_the_scanner_reads_whole_requests_of_the_common_shape():
    one = _raw()
    assert scan(one, 0) == (len(one), b"/v2/models/mlp/infer", True, 2, len(one) - 5)
    assert scan(one + one, len(one)) == (2 * len(one), b"/v2/models/mlp/infer", True, 2,
                                         2 * len(one) - 5)
    assert scan(one + b"GET", 0)[0] == len(one)   # what follows is the next request's
    close = _raw(b"Content-Length: 5\r\nconnection:  Close \r\n")
    assert scan(close, 0)[2:4] == (False, -1)
    assert scan(_raw(b"Content-Length: 5\r\nConnection: keep-alive\r\n"), 0)[2] is True
    with pytest.raises(ValueError, match=f"offset {len(one) + 1} is outside"):
        scan(one, len(one) + 1)


@pytest.mark.parametrize("request_bytes", [
    _raw()[:-1],                                            # the body not whole yet
    _raw()[:30],                                            # nor the head
    _raw(head=b"POST /v2/models/mlp/infer HTTP/1.0\r\n"),   # HTTP/1.0
    _raw(head=b"post /v2/models/mlp/infer HTTP/1.1\r\n"),   # a method llhttp refuses
    _raw(head=b"PUT /v2/models/mlp/infer HTTP/1.1\r\n"),
    _raw(head=b"POST /v2/models/m%6Cp/infer HTTP/1.1\r\n"),  # percent-encoded
    _raw(head=b"POST /v2/models/mlp/infer?x=1 HTTP/1.1\r\n"),
    _raw(head=b"POST /v2/models/mlp/infer HTTP/1.1\nHost: x\n"),   # bare LF
    _raw(b"Inference-Header-Content-Length: 2\r\n"),        # no Content-Length
    _raw(b"Content-Length: 5x\r\n"),                        # not a number
    _raw(b"Content-Length: -5\r\n"),
    _raw(b"Content-Length: 5\r\nContent-Length: 5\r\n"),    # repeated
    _raw(b"Content-Length: 2000000000\r\n"),                # over the size limit
    _raw(b"Content-Length: 5\r\nInference-Header-Content-Length: 1e3\r\n"),
    _raw(b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n"),
    _raw(b"Content-Length: 5\r\nExpect: 100-continue\r\n"),
    _raw(b"Content-Length: 5\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n"),
    _raw(b"Content-Length: 5\r\nX-Folded: a\r\n b\r\n"),   # obsolete line folding
    _raw(b"Content-Length: 5\r\nBad Name: a\r\n"),
    _raw(b"Content-Length: 5\r\nX: \x01\r\n"),
    _raw(b"Content-Length: 5\r\nX: " + b"v" * 8192 + b"\r\n"),   # past a limit
    _raw(b"Content-Length: 5\r\n" + b"X: v\r\n" * 127),
    _raw(b"Content-Length: 5\r\n" + b"X: %s\r\n" % (b"v" * 8000) * 9),
    _raw(head=b"POST /v2/models/mlp/infer/" + b"x" * (16 << 10) + b" HTTP/1.1\r\n"),
])
def test_the_scanner_leaves_everything_else_to_httptools(request_bytes):
    assert scan(request_bytes, 0) is None


def test_the_scanner_keeps_the_head_limits_of_the_front_end():
    from neuronmp.server import _front, wire
    assert (_front.TARGET_MAX, _front.FIELD_MAX, _front.FIELDS_MAX, _front.HEAD_MAX) == \
        (wire.TARGET_MAX, wire.FIELD_MAX, wire.FIELDS_MAX, wire.HEAD_MAX)
    assert scan(_raw(b"Content-Length: 5\r\nX: " + b"v" * 8191 + b"\r\n"), 0) is not None


def _prepared(port: int, xs) -> None:
    """The mlp's binary header prepared (its first request runs the general path)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(_binary_infer(xs[0]))
        assert _read_responses(sock, 1)[0][0][0] == 200


def test_pipelined_requests_split_at_every_byte_give_the_answers_of_the_whole(servers):
    """Two scanned requests around a general one, sent whole (the scanner reads both
    infers) and split at every byte (httptools then reads a request cut in two, and
    the scanner takes over again after it): the same answers, in order."""
    port = servers["httptools"].port
    xs = _samples(2)
    _prepared(port, xs)
    seq = _binary_infer(xs[0]) + b"GET /v2/health/ready HTTP/1.1\r\n\r\n" + _binary_infer(xs[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(seq)
        whole, f = _read_responses(sock, 3)
        assert [a[0] for a in whole] == [200, 200, 200] and whole[0][2] != whole[2][2]
        for k in range(1, len(seq)):
            sock.sendall(seq[:k])
            time.sleep(0.0002)   # most cuts arrive as two reads (either way: same answers)
            sock.sendall(seq[k:])
            got = [_read_one(f) for _ in range(3)]
            assert [(a[0], a[2]) for a in got] == [(a[0], a[2]) for a in whole], k


def _read_one(f):
    status = f.readline()
    headers = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        k, v = line.decode().split(":", 1)
        headers[k.strip().lower()] = v.strip()
    return int(status.split()[1]), headers, f.read(int(headers.get("content-length", 0)))


@pytest.mark.parametrize("case", ["bad length", "two lengths", "header past the body"])
def test_malformed_binary_requests_get_the_statuses_of_the_general_path(servers, case):
    """Requests of nearly the common shape, after their header was prepared: each
    gets what httptools and the general path give it (the aiohttp front end's status
    where that front end reads it alike), and a refused one closes the connection."""
    port = servers["httptools"].port
    xs = _samples(1)
    _prepared(port, xs)
    good = _binary_infer(xs[0])
    head, _, body = good.partition(b"\r\n\r\n")
    n = len(body)
    bad = {"bad length": good.replace(b"Content-Length: %d" % n, b"Content-Length: %dx" % n),
           "two lengths": head + b"\r\nContent-Length: %d\r\n\r\n" % (n + 1) + body,
           "header past the body": good.replace(
               b"Inference-Header-Content-Length: %d" % (n - 64),
               b"Inference-Header-Content-Length: %d" % (n + 5))}[case]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(bad)
        (answer,), f = _read_responses(sock, 1)
        assert answer[0] == 400, answer
        if case != "header past the body":
            assert f.read() == b""   # refused by the parser: closed after the answer
    if case == "header past the body":
        with socket.create_connection(("127.0.0.1", servers["aiohttp"].port),
                                      timeout=30) as sock:
            sock.sendall(bad)
            assert _read_responses(sock, 1)[0][0][0] == 400


def test_a_truncated_body_is_never_answered(servers):
    """A body shorter than its Content-Length, its sender done sending: no answer (the
    request never ends), the connection closed; the server goes on."""
    port = servers["httptools"].port
    xs = _samples(1)
    _prepared(port, xs)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(_binary_infer(xs[0])[:-10])
        sock.shutdown(socket.SHUT_WR)
        assert sock.makefile("rb").read() == b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(_binary_infer(xs[0]))
        assert _read_responses(sock, 1)[0][0][0] == 200


# -- pipelining around a refused request, and the request head's limits ------------------

_BAD = b"GET /v2 HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n"
_GET = b"GET /v2/models/mlp HTTP/1.1\r\nHost: x\r\n\r\n"


def _queried(x: bytes) -> bytes:
    """A binary infer the scanner declines (a query in its path) and httptools' fast
    path takes."""
    return _binary_infer(x).replace(b"/infer HTTP", b"/infer?q=1 HTTP", 1)


#: the three ways into the front end: the C scanner, httptools and its fast infer
#: path, the connection's queue (the general path)
_ENTRANCES = {"scanner": _binary_infer, "httptools fast path": _queried,
              "queue": lambda x: _GET}


def _until_closed(f):
    """The bytes the server sends before closing its end (EOF or a reset)."""
    try:
        return f.read()
    except ConnectionResetError:
        return b"reset"


@pytest.mark.parametrize("entrance", sorted(_ENTRANCES))
def test_a_refused_request_is_answered_after_the_requests_before_it(servers, entrance):
    """Two requests, then one the parser refuses, in one write: the two answers come
    first, in order, then the 400, then the connection closes."""
    port = servers["httptools"].port
    xs = _samples(2)
    _prepared(port, xs)
    make = _ENTRANCES[entrance]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(make(xs[0]) + make(xs[1]) + _BAD)
        answers, f = _read_responses(sock, 3)
        assert [a[0] for a in answers] == [200, 200, 400], answers
        assert b"malformed" in answers[2][2] and answers[2][1]["connection"] == "close"
        assert _until_closed(f) == b""
    if entrance != "queue":   # each its own answer
        assert answers[0][2] != answers[1][2]


@pytest.mark.parametrize("after", ["a refused request", "a request that closes"])
def test_the_aiohttp_front_end_answers_the_requests_before(servers, after):
    first = _GET if after == "a refused request" else \
        _GET.replace(b"Host: x\r\n", b"Host: x\r\nConnection: close\r\n")
    with socket.create_connection(("127.0.0.1", servers["aiohttp"].port), timeout=30) as s:
        s.sendall(first + _GET + _BAD)
        answers, f = _read_responses(s, 1 if after == "a request that closes" else 3)
        assert [a[0] for a in answers] in ([200, 200, 400], [200])
        assert _until_closed(f) == b""


@pytest.mark.parametrize("ending", ["Connection: close", "HTTP/1.0"])
@pytest.mark.parametrize("entrance", sorted(_ENTRANCES))
def test_nothing_after_a_request_that_closes_is_read(servers, entrance, ending):
    """A request that ends the connection (RFC 9112 9.6), followed in the same write
    by a request and by bytes that are not HTTP: the first is answered, with
    Connection: close, and the connection ends; what followed is neither answered
    nor refused."""
    port = servers["httptools"].port
    xs = _samples(1)
    _prepared(port, xs)
    first = _ENTRANCES[entrance](xs[0])
    if ending == "HTTP/1.0":
        first = first.replace(b" HTTP/1.1\r\n", b" HTTP/1.0\r\n", 1)
    else:
        first = first.replace(b"Host: x\r\n", b"Host: x\r\nConnection: close\r\n", 1)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(first + _GET + b"NOT HTTP AT ALL\r\n\r\n")
        (answer,), f = _read_responses(s, 1)
        assert answer[0] == 200 and answer[1]["connection"] == "close", answer
        assert _until_closed(f) == b""


def _head_cases():
    return {
        "a field over 8 KiB": (b"X-Big: " + b"v" * 8200 + b"\r\n", 431),
        "129 fields": (b"".join(b"X-%d: v\r\n" % i for i in range(129)), 431),
        "over 64 KiB in all": (b"".join(b"X-%d: %s\r\n" % (i, b"v" * 8000)
                                        for i in range(9)), 431),
        "many short fields over 64 KiB": (b"".join(b"X%d: %s\r\n" % (i, b"v" * 600)
                                                  for i in range(110)), 431),
    }


@pytest.mark.parametrize("case", sorted(_head_cases()))
@pytest.mark.parametrize("entrance", ["scanner", "queue"])
def test_a_request_head_over_the_limits_gets_431_and_the_connection_closes(
        servers, case, entrance):
    """A request head past a limit (8 KiB a field, 128 fields, 64 KiB in all), after a
    request that is answered first: 431 Request Header Fields Too Large, then the
    connection closes; the aiohttp front end gives the same; a head within the
    limits is served."""
    fields, status = _head_cases()[case]
    xs = _samples(1)
    _prepared(servers["httptools"].port, xs)
    good = _binary_infer(xs[0]) if entrance == "scanner" else _GET
    big = good.replace(b"Host: x\r\n", b"Host: x\r\n" + fields, 1)
    for front in ("httptools", "aiohttp"):
        with socket.create_connection(("127.0.0.1", servers[front].port), timeout=30) as s:
            s.sendall(good + big)
            answers, f = _read_responses(s, 2)
            assert [a[0] for a in answers] == [200, status], (front, answers[1])
            if front == "httptools":   # aiohttp says it with an HTTP/1.0 status line
                assert answers[1][1]["connection"] == "close"
            assert _until_closed(f) == b"", front


@pytest.mark.parametrize("front", ["httptools", "aiohttp"])
def test_a_head_within_the_limits_is_served(servers, front):
    fields = b"".join(b"X-%d: %s\r\n" % (i, b"v" * 7000) for i in range(8)) + \
        b"".join(b"Y-%d: v\r\n" % i for i in range(100))   # 56 KiB, 109 fields with Host
    with socket.create_connection(("127.0.0.1", servers[front].port), timeout=30) as s:
        s.sendall(_GET.replace(b"Host: x\r\n", b"Host: x\r\n" + fields, 1))
        (answer,), _ = _read_responses(s, 1)
        assert answer[0] == 200 and json.loads(answer[2])["name"] == "mlp"


def test_a_long_request_target_gets_414(servers):
    path = b"/v2/models/mlp?" + b"q" * (17 << 10)
    for front in ("httptools", "aiohttp"):
        with socket.create_connection(("127.0.0.1", servers[front].port), timeout=30) as s:
            s.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path)
            (answer,), f = _read_responses(s, 1)
            assert answer[0] == 414, (front, answer)
            assert _until_closed(f) == b""


def _flood(port: int, head: bytes, piece: bytes, total: int, stop) -> bytes:
    """``head`` then ``piece`` over and over, up to ``total`` bytes or until the server
    closes or ``stop`` is set, on one connection; the answer read meanwhile."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    got = []

    def read():
        f = sock.makefile("rb")
        try:
            got.append(f.readline())
            got.append(f.read())
        except OSError:
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        sock.sendall(head)
        block = piece * max(1, (1 << 20) // len(piece))
        sent = 0
        while sent < total and not stop.is_set():
            sock.sendall(block)
            sent += len(block)
    except OSError:
        pass   # the server closed its end: what the test waits for
    finally:
        reader.join(30)
        sock.close()
    return b"".join(got)


@pytest.mark.parametrize("shape", ["one endless field", "endless fields"])
def test_a_header_flood_is_refused_with_the_server_memory_bounded(servers, shape):
    """200 MiB of header bytes on one connection: the server answers 431 and ends
    the connection, its memory stays within 50 MiB of where it was, and it serves on."""
    port = servers["httptools"].port
    proc = psutil.Process(servers["httptools"].proc.pid)
    head = b"GET /v2/models/mlp HTTP/1.1\r\nHost: x\r\n"
    head, piece = (head + b"X-Flood: ", b"v" * 4096) if shape == "one endless field" \
        else (head, b"X-Flood: %s\r\n" % (b"v" * 100))
    base = proc.memory_info().rss
    peak, stop = [base], threading.Event()

    def watch():
        while not stop.is_set():
            peak.append(proc.memory_info().rss)
            if peak[-1] - base > 50 << 20:
                stop.set()   # over the bound: no need to push the host further
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        answer = _flood(port, head, piece, 200 << 20, stop)
    finally:
        stop.set()
        watcher.join(10)
    assert max(peak) - base < 50 << 20, f"the server grew by {(max(peak) - base) >> 20} MiB"
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert _call(port, "GET", "/v2/health/ready", b"")[0] == 200
