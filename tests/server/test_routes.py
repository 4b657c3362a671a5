"""The HTTP route table (server/routes.py) and its front ends as adapters: every
front end answers a route with the route's one handler, so an unknown path, a
method a route does not take and a route's answer are the same whichever front end
(and whichever of its entrances: the C scanner, httptools' fast path, the queue)
read the request.

Two kinds of server: the real neuronmp-serve (the shared server's httptools front
end beside one with --http-frontend aiohttp), and, in this process, both front ends
listening on a table of test routes whose handlers echo what they were handed.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading

import pytest
from server.test_front import _binary_infer, _prepared, _queried, _read_responses, _samples
from server.test_server import Server

pytest.importorskip("httptools")
pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402 - after the skips

from neuronmp.server import app, front, routes  # noqa: E402
from neuronmp.server.infer import State  # noqa: E402
from neuronmp.server.metrics import Metrics  # noqa: E402


@pytest.fixture(scope="module")
def servers(repo, shared_server):
    aiohttp_server = Server(repo, args=("--http-frontend", "aiohttp"))
    try:
        yield {"httptools": shared_server.port, "aiohttp": aiohttp_server.port}
    finally:
        assert aiohttp_server.stop() == 0


def _exchange(port: int, raw: bytes, count: int = 1):
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(raw)
        return _read_responses(sock, count)[0]


def _get(path: str, method: str = "GET") -> bytes:
    return b"%s %s HTTP/1.1\r\nHost: x\r\n\r\n" % (method.encode(), path.encode())


def _entrances(path: bytes, x: bytes):
    """One request for ``path`` by each way into the httptools front end: the scanner's
    shape, a query (httptools' fast path), and behind a request still unanswered
    (the connection's queue)."""
    scanned = _binary_infer(x).replace(b"/v2/models/mlp/infer", path, 1)
    return {"scanner": (scanned, 0), "httptools fast path": (_queried(x).replace(
        b"/v2/models/mlp/infer", path, 1), 0),
        "queue": (_get("/v2/models/mlp") + scanned, 1)}


def _without_date(answer):
    status, headers, body = answer
    return status, {k: v for k, v in headers.items() if k not in ("date", "server")}, body


@pytest.mark.parametrize("path", [b"/v2/models/mlp/infer/more", b"/v3/models/mlp/infer",
                                  b"/no/such/route"])
def test_an_unknown_route_is_the_same_404_from_every_front_end(servers, path):
    xs = _samples(1)
    _prepared(servers["httptools"], xs)
    got = {}
    for entrance, (raw, skip) in _entrances(path, xs[0]).items():
        got[entrance] = _exchange(servers["httptools"], raw, skip + 1)[skip]
    got["aiohttp"] = _exchange(servers["aiohttp"], _binary_infer(xs[0]).replace(
        b"/v2/models/mlp/infer", path, 1))[0]
    for where, (status, headers, body) in got.items():
        assert (status, body) == (404, b"404: Not Found"), where
        assert headers["content-type"] == "text/plain; charset=utf-8", where


@pytest.mark.parametrize("method,path,allow", [
    ("GET", "/v2/models/mlp/infer", "POST"), ("POST", "/v2/health/live", "GET,HEAD"),
    ("DELETE", "/v2", "GET,HEAD"), ("PUT", "/v2/systemsharedmemory/region/r/register", "POST"),
    ("POST", "/metrics", "GET,HEAD"),
])
def test_a_method_a_route_does_not_take_is_405_with_allow(servers, method, path, allow):
    for name, port in servers.items():
        (status, headers, body), = _exchange(port, _get(path, method))
        assert (status, headers.get("allow"), body) == (405, allow, b"405: Method Not Allowed"), \
            name


def test_an_infer_route_is_answered_alike_through_every_adapter(servers):
    """A binary infer request whose header is prepared, by each entrance of the
    httptools front end and through aiohttp: the same status, fields and bytes."""
    xs = _samples(2)
    _prepared(servers["httptools"], xs)
    _prepared(servers["aiohttp"], xs)
    path = b"/v2/models/mlp/infer"
    got = {entrance: _exchange(servers["httptools"], raw, skip + 1)[skip]
           for entrance, (raw, skip) in _entrances(path, xs[1]).items()}
    got["aiohttp"] = _exchange(servers["aiohttp"], _binary_infer(xs[1]))[0]
    first = _without_date(got["scanner"])
    assert first[0] == 200 and first[1]["content-type"] == "application/octet-stream"
    for where, answer in got.items():
        status, headers, body = _without_date(answer)
        assert (status, headers["content-type"], headers["inference-header-content-length"],
                body) == (first[0], first[1]["content-type"],
                          first[1]["inference-header-content-length"], first[2]), where


# -- both adapters on one table of test routes, in this process -----------------------


async def _echo(state, request: routes.Request) -> routes.Response:
    doc = {"method": request.method, "path": request.path, "params": request.params,
           "x_thing": request.header("X-THING"), "body": request.body.decode(),
           "peer": request.peer}
    return routes.Response(200, "application/json", {"X-Echo": "1"}, [json.dumps(doc).encode()])


async def _boom(state, request):
    raise RuntimeError("the handler failed\nand this line is not shown")


_BIG = bytes(range(256)) * (8 << 10)   # 2 MiB: past the one-buffer size


async def _big(state, request):
    view = memoryview(_BIG)
    return routes.Response(200, "application/octet-stream", {}, [view[:1000], view[1000:]])


_TABLE = routes.Table([
    ("/echo/{a}[/b/{b}]", {"GET": _echo, "POST": _echo}),
    ("/echo", {"POST": _echo}),
    ("/boom", {"GET": _boom}),
    ("/big", {"GET": _big}),
])


@pytest.fixture(scope="module")
def adapters():
    """The httptools front end and the aiohttp application on _TABLE, on a loop in a
    thread of this process: their ports."""
    loop = asyncio.new_event_loop()
    state = State({}, Metrics())
    state.ready = True
    ports = {}

    async def start():
        http = await front.start(state, "127.0.0.1", 0, table=_TABLE)
        ports["httptools"] = http.servers[0].sockets[0].getsockname()[1]
        runner = app.runner(app.make_app(state, _TABLE))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        ports["aiohttp"] = site._server.sockets[0].getsockname()[1]
        return http, runner

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    http, runner = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield ports
    finally:
        async def stop():
            await http.close()
            await runner.cleanup()
        asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def _request(port: int, method: str, path: str, body: bytes = b"", headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body or None, headers=headers or {})
        r = conn.getresponse()
        fields = {k.lower(): v for k, v in r.getheaders() if k.lower() not in ("date", "server")}
        return r.status, fields, r.read()
    finally:
        conn.close()


_CASES = [
    ("GET", "/echo/one", b"", {}),
    ("GET", "/echo/one/b/two", b"", {"x-Thing": "seen"}),
    ("POST", "/echo/a%20b?q=1", b"the body", {"X-Thing": "a", "x-thing": "last"}),
    ("POST", "/echo", b"{}", {}),
    ("HEAD", "/echo/one", b"", {}),
    ("GET", "/echo", b"", {}),
    ("GET", "/echo/one/two", b"", {}),
    ("GET", "/boom", b"", {}),
    ("GET", "/big", b"", {}),
]


@pytest.mark.parametrize("method,path,body,headers", _CASES)
def test_both_adapters_hand_a_handler_the_same_request_and_write_its_answer_alike(
        adapters, method, path, body, headers):
    ours = _request(adapters["httptools"], method, path, body, headers)
    theirs = _request(adapters["aiohttp"], method, path, body, headers)
    assert ours == theirs


def test_what_the_adapters_hand_the_handlers(adapters):
    status, fields, body = _request(adapters["httptools"], "POST", "/echo/a%20b/b/c?q=1",
                                    b"xyz", {"X-Thing": "a", "x-thing": "last"})
    assert status == 200 and fields["x-echo"] == "1"
    assert json.loads(body) == {"method": "POST", "path": "/echo/a b/b/c",
                                "params": {"a": "a b", "b": "c"}, "x_thing": "last",
                                "body": "xyz", "peer": "127.0.0.1"}
    status, fields, body = _request(adapters["httptools"], "GET", "/boom")
    assert (status, json.loads(body)) == (500, {"error": "RuntimeError: the handler failed"})
    status, fields, body = _request(adapters["httptools"], "GET", "/echo")
    assert (status, fields["allow"]) == (405, "POST")
    assert _request(adapters["httptools"], "GET", "/big")[2] == _BIG


def test_a_table_refuses_a_method_it_cannot_route_and_a_path_listed_twice():
    with pytest.raises(ValueError, match="method 'PUT': GET or POST"):
        routes.Table([("/x", {"PUT": _echo})])
    with pytest.raises(ValueError, match="'/x' is listed twice"):
        routes.Table([("/x", {"GET": _echo}), ("/x", {"POST": _echo})])


def test_the_table_resolves_parameters_and_optional_parts():
    handler, params, refused = routes.TABLE.resolve("POST", "/v2/models/m/versions/2/infer")
    assert refused is None and params == {"model": "m", "version": "2"}
    assert routes.TABLE.resolve("POST", "/v2/models/m/infer")[1] == {"model": "m"}
    assert routes.TABLE.resolve("HEAD", "/v2/systemsharedmemory/status")[0] is \
        routes.TABLE.resolve("GET", "/v2/systemsharedmemory/region/r/status")[0]
    assert routes.TABLE.resolve("GET", "/v2/models/m/infer")[2].headers == {"Allow": "POST"}
    assert routes.TABLE.resolve("GET", "/v2/models/a/b/c")[2].status == 404
