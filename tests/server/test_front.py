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

import pytest
from server.test_server import Server

pytest.importorskip("httptools")

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
