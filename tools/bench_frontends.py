"""Benchmark: the cheapest Python HTTP front ends, answering a fixed KServe v2 reply,
against mosec; to tell whether a Python front end can carry 1.5x mosec's throughput.

The project asks neuronmp-serve for 1.5x the best peer's throughput at 64 clients on a
2-CPU host; the best peer, mosec, has a Rust front end.  Every request costs the host
the HTTP process's CPU plus the model's compute per row, so a front end that alone
spends more CPU per request than 2 CPUs / (1.5 x mosec's req/s) rules the target out
whatever the rest of the server does.  bench_http.py measured aiohttp and starlette +
uvicorn; this measures the cheaper ones, each answering the same request with a FIXED
reply (no model, no batching, no thread hand-off):

    aiohttp          aiohttp.web on asyncio, as neuronmp-serve uses it
    aiohttp-uvloop   the same on uvloop
    uvicorn          a bare ASGI app (no framework) on uvicorn: httptools + uvloop,
                     no access log, no lifespan
    httptools        an asyncio.Protocol HTTP/1.1 keep-alive server on httptools'
                     parser, on uvloop: the floor of a Python front end
    granian-asgi     the bare ASGI app on granian (a Rust HTTP server calling Python),
                     1 worker, 1 runtime thread, uvloop
    granian-rsgi     the same on granian's own RSGI interface
    mosec-fixed      mosec (Rust front end) with a worker returning the fixed reply,
                     append_worker(num=2, max_batch_size=32, max_wait_time=2 ms) as
                     bench_http's mosec: its front end + IPC without a model
    mosec            bench_http's mosec peer serving the MLP (raw fp32), for the ratio
    neuronmp-front   neuronmp-serve's HTTP/1.1 front end (server/front.py) on asyncio,
                     its infer route answering the fixed reply

The request is KServe v2 with binary tensors: POST /v2/models/m/infer, a JSON header of
Inference-Header-Content-Length bytes then 512 fp32 (2 KiB).  Every server reads the
whole body, parses the JSON header and checks the 2 KiB after it, then answers a
small JSON header + 40 bytes (10 fp32).  Each is checked (two requests on one
keep-alive connection) before it is loaded.  The load client and the CPU accounting
are bench_http.py's: a separate client process, N closed-loop connections (asyncio +
aiohttp), server CPU = user + system of the server's process tree in the window.

The model's share comes from bench_dp's MLP traced with neuronmp.trace at batch 32
and called directly on one core (CPU of the caller and its core worker per call, / 32
rows), next to the plain torch module at 32 rows, one thread.

    python tools/bench_frontends.py [--seconds 3] [--rounds 3] [--clients 1 16 64]
        [--fronts aiohttp,aiohttp-uvloop,uvicorn,httptools,granian-asgi,...]

Rounds alternate the order of the servers (--reverse starts with the reverse order).
Tables (every round, then medians) go to stdout, progress to stderr.  --save FILE keeps
a run's raw results; --combine FILE... renders several saved runs as one.  A front end
whose library is not installed (granian is not among neuronmp's extras) is skipped.
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import List, Optional

import numpy as np

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)

import bench_http  # noqa: E402

FEATURES = bench_http.FEATURES
BATCH = bench_http.BATCH
HEADER_LEN = bench_http.HEADER_LEN
INFER = "/v2/models/m/infer"
READY = "/v2/health/ready"
INPUT_BYTES = FEATURES * 4

REPLY_OUT = np.arange(10, dtype=np.float32) * 0.5
REPLY_HEAD = json.dumps({"model_name": "m", "model_version": "1", "outputs": [
    {"name": "OUTPUT__0", "datatype": "FP32", "shape": [1, 10],
     "parameters": {"binary_data_size": 40}}]}, separators=(",", ":")).encode()
REPLY_BODY = REPLY_HEAD + REPLY_OUT.tobytes()
REPLY_HEADERS = {HEADER_LEN: str(len(REPLY_HEAD)), "Content-Type": "application/octet-stream"}


class BadRequest(Exception):
    pass


def check_request(body: bytes, header_len) -> None:
    """What every server does with a request: parse its JSON header, check its tensor."""
    try:
        n = int(header_len)
        json.loads(body[:n])
    except (TypeError, ValueError) as exc:
        raise BadRequest(str(exc)) from None
    if len(body) - n != INPUT_BYTES:
        raise BadRequest(f"{len(body) - n} bytes of tensor data, expected {INPUT_BYTES}")


# -- the servers (each runs in a process of its own: --serve KIND) -----------------------

def serve_aiohttp(port: int, uvloop_too: bool) -> None:
    from aiohttp import web

    if uvloop_too:
        import uvloop
        uvloop.install()

    async def infer(request):
        try:
            check_request(await request.read(), request.headers.get(HEADER_LEN))
        except BadRequest as exc:
            return web.Response(status=400, text=str(exc))
        return web.Response(body=REPLY_BODY, headers=REPLY_HEADERS)

    async def ready(request):
        return web.Response()

    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/v2/models/{model}/infer", infer)
    app.router.add_get(READY, ready)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


_ASGI_REPLY = [(k.lower().encode(), v.encode()) for k, v in REPLY_HEADERS.items()] + [
    (b"content-length", str(len(REPLY_BODY)).encode())]
_HLEN = HEADER_LEN.lower().encode()


async def asgi_app(scope, receive, send) -> None:
    """A bare ASGI app: the fixed reply on POST /v2/models/m/infer, 200 on ready."""
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    status, headers, body = 404, [], b""
    if scope["method"] == "POST" and scope["path"] == INFER:
        chunks = []
        while True:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        hlen = next((v for k, v in scope["headers"] if k == _HLEN), None)
        try:
            check_request(b"".join(chunks), hlen)
            status, headers, body = 200, _ASGI_REPLY, REPLY_BODY
        except BadRequest as exc:
            status, body = 400, str(exc).encode()
    elif scope["path"] == READY:
        status = 200
    if status != 200 or body is not REPLY_BODY:
        headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


_RSGI_REPLY = [(k, v) for k, v in REPLY_HEADERS.items()]


async def rsgi_app(scope, proto) -> None:
    """The same on granian's RSGI interface."""
    if scope.proto != "http":
        return
    if scope.method == "POST" and scope.path == INFER:
        body = await proto()
        try:
            check_request(body, scope.headers.get(HEADER_LEN))
        except BadRequest as exc:
            proto.response_bytes(400, [], str(exc).encode())
            return
        proto.response_bytes(200, _RSGI_REPLY, REPLY_BODY)
    elif scope.path == READY:
        proto.response_bytes(200, [], b"")
    else:
        proto.response_bytes(404, [], b"")


def serve_uvicorn(port: int) -> None:
    import uvicorn

    uvicorn.run(asgi_app, host="127.0.0.1", port=port, loop="uvloop", http="httptools",
                lifespan="off", access_log=False, log_level="warning")


def serve_granian(port: int, interface: str) -> None:
    from granian import Granian

    target = "bench_frontends:" + ("asgi_app" if interface == "asgi" else "rsgi_app")
    Granian(target, address="127.0.0.1", port=port, interface=interface, workers=1,
            runtime_threads=1, loop="uvloop", http="1", websockets=False,
            log_level="warning", log_access=False).serve()


def _http_reply(status: bytes, body: bytes, extra: bytes = b"", close: bool = False) -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\nContent-Length: " + str(len(body)).encode()
            + b"\r\n" + extra + (b"Connection: close\r\n" if close else b"") + b"\r\n"
            + body)


_RAW_OK = _http_reply(b"200 OK", REPLY_BODY, b"".join(
    f"{k}: {v}\r\n".encode() for k, v in REPLY_HEADERS.items()))


class RawHTTP(asyncio.Protocol):
    """HTTP/1.1 on httptools' parser: Content-Length (and chunked) bodies as the parser
    frames them, keep-alive unless the request says otherwise, pipelined requests
    answered in order.  Only what this benchmark sends is routed."""

    def connection_made(self, transport) -> None:
        import httptools

        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.hlen: Optional[bytes] = None
        self.body: List[bytes] = []

    def data_received(self, data: bytes) -> None:
        import httptools

        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.write(_http_reply(b"400 Bad Request", b"", close=True))
            self.transport.close()

    def on_message_begin(self) -> None:
        self.url, self.hlen, self.body = b"", None, []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == _HLEN:
            self.hlen = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method()
        keep = self.parser.should_keep_alive()
        if method == b"POST" and self.url == INFER.encode():
            try:
                check_request(b"".join(self.body), self.hlen)
                reply = _RAW_OK if keep else _http_reply(
                    b"200 OK", REPLY_BODY, b"".join(f"{k}: {v}\r\n".encode()
                                                    for k, v in REPLY_HEADERS.items()), True)
            except BadRequest as exc:
                reply = _http_reply(b"400 Bad Request", str(exc).encode(), close=not keep)
        elif method == b"GET" and self.url == READY.encode():
            reply = _http_reply(b"200 OK", b"", close=not keep)
        else:
            reply = _http_reply(b"404 Not Found", b"", close=not keep)
        self.transport.write(reply)
        if not keep:
            self.transport.close()


def serve_httptools(port: int) -> None:
    import signal

    import uvloop

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(RawHTTP, "127.0.0.1", port, backlog=1024)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        server.close()
        await server.wait_closed()

    uvloop.run(main())


def serve_neuronmp_front(port: int) -> None:
    """neuronmp-serve's own HTTP/1.1 front end (server/front.py, plain asyncio, as the
    server runs it) with its infer route answering the fixed reply: what the front end
    alone costs a request."""
    import signal

    from neuronmp.server import front, routes
    from neuronmp.server.infer import State
    from neuronmp.server.metrics import Metrics

    headers = {k: v for k, v in REPLY_HEADERS.items() if k.lower() != "content-type"}
    ctype = REPLY_HEADERS.get("Content-Type")

    async def fixed(state, r):
        try:
            check_request(r.body, r.header("Inference-Header-Content-Length"))
        except BadRequest as exc:
            return routes.Response(400, "text/plain", {}, [str(exc).encode()])
        return routes.Response(200, ctype, headers, [REPLY_BODY])

    async def ready(state, r):
        return routes.Response(200, None, {}, [])

    # the route table's dispatch, the parser and the writer stay the front end's
    table = routes.Table([("/v2/models/{model}[/versions/{version}]/infer", {"POST": fixed}),
                          ("/v2/health/ready", {"GET": ready})])

    async def main() -> None:
        state = State({}, Metrics())
        state.ready = True
        http = await front.start(state, "127.0.0.1", port, table=table)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await http.close()

    asyncio.run(main())


# mosec parses sys.argv when it is imported: it must not see this tool's arguments
_argv, sys.argv = sys.argv, sys.argv[:1]
try:
    import mosec as _mosec
except ImportError:
    _mosec = None
finally:
    sys.argv = _argv

if _mosec is not None:       # at module level: mosec starts its workers by spawn (pickle)
    class FixedWorker(_mosec.Worker):
        # mosec hands the worker the body only: the JSON header is all but the last 2 KiB
        def deserialize(self, data: bytes):
            check_request(data, len(data) - INPUT_BYTES)
            return None

        def serialize(self, data) -> bytes:
            return REPLY_BODY

        def forward(self, data):
            return data


def serve_mosec_fixed(port: int) -> None:
    sys.argv = [sys.argv[0], "--port", str(port), "--address", "127.0.0.1",
                "--log-level", "warning", "--timeout", "30000"]
    server = _mosec.Server()
    server.append_worker(FixedWorker, num=2, max_batch_size=BATCH, max_wait_time=2)
    server.run()


SERVE = {
    "aiohttp": lambda port: serve_aiohttp(port, False),
    "aiohttp-uvloop": lambda port: serve_aiohttp(port, True),
    "uvicorn": serve_uvicorn,
    "httptools": serve_httptools,
    "granian-asgi": lambda port: serve_granian(port, "asgi"),
    "granian-rsgi": lambda port: serve_granian(port, "rsgi"),
    "mosec-fixed": serve_mosec_fixed,
    "neuronmp-front": serve_neuronmp_front,
}
NEEDS = {"aiohttp": ["aiohttp"], "aiohttp-uvloop": ["aiohttp", "uvloop"],
         "uvicorn": ["uvicorn", "httptools", "uvloop"], "httptools": ["httptools", "uvloop"],
         "granian-asgi": ["granian", "uvloop"], "granian-rsgi": ["granian", "uvloop"],
         "mosec-fixed": ["mosec"], "mosec": ["mosec", "torch"],
         "neuronmp-front": ["httptools", "aiohttp"]}
LABELS = {
    "aiohttp": "aiohttp.web (asyncio)", "aiohttp-uvloop": "aiohttp.web on uvloop",
    "uvicorn": "bare ASGI on uvicorn (httptools, uvloop)",
    "httptools": "asyncio.Protocol + httptools on uvloop",
    "granian-asgi": "bare ASGI on granian (Rust), 1 worker",
    "granian-rsgi": "RSGI on granian (Rust), 1 worker",
    "mosec-fixed": "mosec, fixed-reply worker x2",
    "mosec": "mosec, the MLP (bench_http's peer)",
    "neuronmp-front": "neuronmp-serve's front end (server/front.py, asyncio)",
}


# -- the driver ----------------------------------------------------------------------------

def start(kind: str, weights: str) -> bench_http.Server:
    if kind == "mosec":
        return bench_http.start_peer("mosec", weights, 2, 2.0)
    env = bench_http._clean_env()
    # granian imports the app by name in its worker process
    env["PYTHONPATH"] = os.pathsep.join(x for x in (TOOLS, env.get("PYTHONPATH")) if x)
    ready = "/" if kind == "mosec-fixed" else READY
    return bench_http.Server(kind, [sys.executable, os.path.abspath(__file__), "--serve",
                                    kind, "--port", "{port}"], ready, env=env, startup=60)


def check_fixed(server: bench_http.Server, path: str) -> None:
    """Two requests on one keep-alive connection, each answered with the fixed reply."""
    c = bench_http.codec("fixed-kserve")
    x = np.random.default_rng(1).random((1, FEATURES), dtype=np.float32)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        for _ in range(2):
            conn.request("POST", path, body=c.body(x), headers=c.headers)
            r = conn.getresponse()
            data = r.read()
            if r.status != 200:
                raise AssertionError(f"{server.name}: {r.status} {data[:200]!r}")
            n = int(r.headers.get(HEADER_LEN, len(data) - 40))
            if data[:n] != REPLY_HEAD or not np.array_equal(
                    np.frombuffer(data, np.float32, offset=n), REPLY_OUT):
                raise AssertionError(f"{server.name} answered {data[:120]!r}...")
    finally:
        conn.close()


def available(kind: str) -> Optional[str]:
    from importlib.util import find_spec

    missing = [m for m in NEEDS[kind] if find_spec(m) is None]
    return f"{', '.join(missing)} not installed" if missing else None


_COMPUTE = """
import json, sys, time, psutil, torch, neuronmp
sys.path.insert(0, {tools!r})
from bench_dp import mlp
torch.manual_seed(0)
torch.set_num_threads(1)
net = mlp()
traced = neuronmp.trace(net, torch.rand({batch}, {features}))
x = torch.rand({batch}, {features})
me = psutil.Process()

def tree():
    t = 0.0
    for p in [me] + me.children(recursive=True):
        try:
            t += sum(p.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return t

def timed(fn, seconds):
    for _ in range(20):
        fn()
    n, t0, c0 = 0, time.perf_counter(), tree()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n, (tree() - c0) / n

wall, cpu = timed(lambda: traced(x), {seconds})
with torch.inference_mode():
    twall, tcpu = timed(lambda: net(x), {seconds})
print(json.dumps({{"neuronmp_wall_ms": 1e3 * wall, "neuronmp_cpu_ms": 1e3 * cpu,
                  "torch_wall_ms": 1e3 * twall, "torch_cpu_ms": 1e3 * tcpu,
                  "children": len(me.children(recursive=True))}}))
neuronmp.shutdown()
"""


def model_compute(seconds: float) -> dict:
    """The MLP at a full 32-row batch: traced, called directly on one core; plain torch."""
    env, rundir = bench_http.neuronmp_env()
    try:
        p = subprocess.run([sys.executable, "-c", _COMPUTE.format(
            tools=TOOLS, batch=BATCH, features=FEATURES, seconds=seconds)],
            env=env, capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(rundir, ignore_errors=True)
    if p.returncode:
        raise RuntimeError(f"model compute failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


_WEIGHTS = """
import sys, torch
sys.path.insert(0, {tools!r})
from bench_dp import mlp
torch.manual_seed(0)
torch.save(mlp().state_dict(), {path!r})
"""


def run(kinds: List[str], clients: List[int], seconds: float, warm: float, rounds: int,
        root: str) -> tuple:
    weights = os.path.join(root, "mlp_weights.pt")
    subprocess.run([sys.executable, "-c", _WEIGHTS.format(tools=TOOLS, path=weights)],
                   check=True, timeout=120)
    rows, compute = [], []
    for rnd in range(rounds):
        order = kinds if rnd % 2 == 0 else kinds[::-1]
        print(f"round {rnd + 1}/{rounds}: {', '.join(order)}", file=sys.stderr, flush=True)
        for kind in order:
            try:
                server = start(kind, weights)
            except RuntimeError as exc:
                lines = [x for x in str(exc).splitlines() if x.strip()]
                print(f"  skipped {kind}: {lines[0]} {lines[-1] if len(lines) > 1 else ''}",
                      file=sys.stderr, flush=True)
                continue
            try:
                if kind == "mosec":
                    cname = "mosec-raw"
                    bench_http.check_answer(server, cname,
                                            lambda x: bench_http.expected_mlp(weights, x))
                else:
                    cname = "fixed-mosec" if kind == "mosec-fixed" else "fixed-kserve"
                    check_fixed(server, bench_http.codec(cname).path)
                for n in clients:
                    r = bench_http.drive(server.url, cname, n, seconds, warm, server.proc.pid)
                    r.update(server=kind, codec=cname, clients=n, round=rnd)
                    rows.append(r)
                    print(f"  {kind:15} {n:3} clients: {r['rps']:7.0f} req/s  "
                          f"p50 {r.get('p50_ms', float('nan')):6.2f} ms  "
                          f"p99 {r.get('p99_ms', float('nan')):6.2f} ms  server "
                          f"{1e3 * r['server_cpu_s'] / max(r['requests'], 1):.3f} ms/req  "
                          f"errors {r['errors']}", file=sys.stderr, flush=True)
            finally:
                server.stop()
        c = model_compute(max(2.0, seconds))
        c["round"] = rnd
        compute.append(c)
        print(f"  MLP at {BATCH} rows: neuronmp {c['neuronmp_cpu_ms']:.2f} ms CPU / call "
              f"({c['neuronmp_wall_ms']:.2f} wall), torch {c['torch_cpu_ms']:.2f} ms CPU",
              file=sys.stderr, flush=True)
    return rows, compute


# -- tables --------------------------------------------------------------------------------

def _per_req(r: dict, key: str) -> float:
    return 1e3 * r[key] / max(r["requests"], 1)


def render_rows(rows: List[dict], kinds: List[str], clients: List[int]) -> str:
    lines = ["| front end | round | clients | req/s | p50 ms | p99 ms | server CPU ms/req | "
             "client CPU ms/req | server CPUs busy |", "|" + "---|" * 9]
    for n in clients:
        for kind in kinds:
            for r in sorted((r for r in rows if r["server"] == kind and r["clients"] == n),
                            key=lambda r: r["round"]):
                lines.append(
                    f"| {LABELS[kind]} | {r['round'] + 1} | {n} | {r['rps']:.0f} | "
                    f"{r.get('p50_ms', float('nan')):.2f} | {r.get('p99_ms', float('nan')):.2f}"
                    f" | {_per_req(r, 'server_cpu_s'):.3f} | {_per_req(r, 'client_cpu_s'):.3f} | "
                    f"{r['server_cpu_s'] / r['seconds']:.2f} |"
                    + (f" ({r['errors']} errors)" if r["errors"] else ""))
    return "\n".join(lines)


def render_medians(med: List[dict], kinds: List[str], clients: List[int]) -> str:
    lines = ["| front end | clients | req/s | p50 ms | p99 ms | server CPU ms/req | "
             "client CPU ms/req | rounds |", "|" + "---|" * 8]
    for n in clients:
        for kind in kinds:
            r = next((r for r in med if r["server"] == kind and r["clients"] == n), None)
            if r is None:
                continue
            lines.append(
                f"| {LABELS[kind]} | {n} | {r['rps']:.0f} | {r.get('p50_ms', float('nan')):.2f}"
                f" | {r.get('p99_ms', float('nan')):.2f} | "
                f"{1e3 * r['server_cpu_s_per_req']:.3f} | "
                f"{1e3 * r['client_cpu_s_per_req']:.3f} | {r['rounds']} |")
    return "\n".join(lines)


def render_bound(med: List[dict], compute: List[dict], kinds: List[str], n: int,
                 cpus: int) -> str:
    """neuronmp's best case with each front end.  Its server would spend per request the
    front end's CPU plus the model's CPU per row at a full batch (no padding, no thread
    hand-off: a lower bound); the load client spends its own on the same CPUs.  When the
    CPUs are the limit, throughput goes as 1 / CPU per request, so against mosec the
    best case is mosec's CPU per request / this one (1.5 needed), with and without the
    client's share; and, as absolute figures, cpus / CPU per request against 1.5 x
    mosec's req/s in this run (which a loaded host holds down), next to what the one
    load-client process can send at all."""
    per_row = statistics.median(c["neuronmp_cpu_ms"] for c in compute) / BATCH
    torch_row = statistics.median(c["torch_cpu_ms"] for c in compute) / BATCH
    at = {r["server"]: r for r in med if r["clients"] == n}
    mosec = at.get("mosec")
    lines = [
        f"MLP at a full {BATCH}-row batch (median of {len(compute)}): neuronmp, traced, "
        f"called directly on one core, {per_row:.4f} ms CPU per row (caller + core worker; "
        f"{statistics.median(c['neuronmp_wall_ms'] for c in compute):.2f} ms wall per call);"
        f" plain torch, 1 thread, {torch_row:.4f} ms per row."]
    if not mosec:
        return "\n".join(lines + ["mosec was not measured: no target."])
    m_server = 1e3 * mosec["server_cpu_s_per_req"]
    m_client = 1e3 * mosec["client_cpu_s_per_req"]
    target = 1.5 * mosec["rps"]
    lines += [
        f"mosec with the MLP at {n} clients: {mosec['rps']:.0f} req/s (target 1.5x = "
        f"{target:.0f}), {m_server:.3f} ms server CPU + {m_client:.3f} ms client CPU per "
        f"request ({mosec['rps'] * (m_server + m_client) / 1e3:.2f} of the {cpus} CPUs busy)."
        f" Its own CPU bound, {cpus} CPUs / (server + client), is "
        f"{1e3 * cpus / (m_server + m_client):.0f} req/s; 1.5x that is "
        f"{1.5e3 * cpus / (m_server + m_client):.0f}, to compare with the column 'with the "
        f"client' (on a loaded host mosec's measured req/s is far below its bound). The "
        f"load client is one process: it cannot send more than 1 CPU / its CPU per request,"
        f" {1e3 / m_client:.0f} req/s at mosec's.",
        "",
        f"| front end | front end ms/req ({n} clients) | + model ms/row = server ms/req | "
        f"mosec server / this | client ms/req | mosec (server + client) / (this + client) | "
        f"best case req/s, {cpus} CPUs, server only | with the client | the client's "
        f"own limit (1 CPU / its ms) | 1.5x mosec req/s |", "|" + "---|" * 10]
    fronts = [(LABELS[k], 1e3 * at[k]["server_cpu_s_per_req"],
               1e3 * at[k]["client_cpu_s_per_req"]) for k in kinds
              if k in at and k != "mosec"]
    fronts.append(("no front end at all (the model only)", 0.0, m_client))
    for label, front, client in fronts:
        server = front + per_row
        lines.append(
            f"| {label} | {front:.3f} | {server:.3f} | {m_server / server:.2f} | "
            f"{client:.3f} | {(m_server + m_client) / (server + client):.2f} | "
            f"{1e3 * cpus / server:.0f} | {1e3 * cpus / (server + client):.0f} | "
            f"{1e3 / client:.0f} | {target:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=3.0, help="measured seconds per point")
    p.add_argument("--warm", type=float, default=1.0, help="unmeasured seconds before each")
    p.add_argument("--rounds", type=int, default=3,
                   help="start every server this many times, the order reversed every "
                        "other round; medians over the rounds")
    p.add_argument("--clients", type=int, nargs="*", default=[1, 16, 64])
    p.add_argument("--fronts", default=",".join(list(SERVE) + ["mosec"]),
                   help="comma list of " + ", ".join(list(SERVE) + ["mosec"]))
    p.add_argument("--reverse", action="store_true",
                   help="start the first round in the reverse order")
    p.add_argument("--json", action="store_true", help="also print the raw results")
    p.add_argument("--save", help="write the raw results to this JSON file")
    p.add_argument("--combine", nargs="+", metavar="FILE",
                   help="measure nothing: render the tables of runs saved with --save")
    p.add_argument("--serve", choices=sorted(SERVE), help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        SERVE[args.serve](args.port)
        return 0

    kinds = []
    for kind in (k for k in args.fronts.split(",") if k):
        if kind not in NEEDS:
            p.error(f"unknown front end {kind!r}")
        why = available(kind)
        if why:
            print(f"skipped {kind}: {why}", file=sys.stderr)
        else:
            kinds.append(kind)
    cpus = len(os.sched_getaffinity(0))
    if args.combine:
        rows, compute, order = [], [], []
        for path in args.combine:
            with open(path) as f:
                saved = json.load(f)
            base = 1 + max((r["round"] for r in rows + compute), default=-1)
            for r in saved["rows"] + saved["compute"]:
                r["round"] += base
            rows += saved["rows"]
            compute += saved["compute"]
            order += [k for k in saved["kinds"] if k not in order]
        kinds = [k for k in order if k in kinds] + [k for k in order if k not in kinds]
        what = f"{len(args.combine)} saved run(s), {len(compute)} round(s) in all"
    else:
        root = tempfile.mkdtemp(prefix="bench-frontends-")
        try:
            rows, compute = run(kinds[::-1] if args.reverse else kinds, args.clients,
                                args.seconds, args.warm, args.rounds, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        what = (f"{args.seconds:g} s per point, {args.rounds} round(s), order reversed "
                "every other round")
        if args.save:
            with open(args.save, "w") as f:
                json.dump({"rows": rows, "compute": compute, "kinds": kinds}, f)
    clients = sorted({r["clients"] for r in rows})
    med = bench_http.median_rows(rows)
    print(f"\nFixed-reply HTTP front ends against mosec; KServe v2 binary request (JSON header"
          f" + 2 KiB), reply JSON header + 40 bytes; {what}; {cpus} CPUs; load: "
          f"bench_http's client process (asyncio + aiohttp, closed loop); server CPU = user "
          f"+ system of the server's process tree.\n")
    print(render_rows(rows, kinds, clients))
    print("\nMedians over the rounds (CPU per request: the median of the rounds' ratios):\n")
    print(render_medians(med, kinds, clients))
    if compute and clients:
        print()
        print(render_bound(med, compute, kinds, max(clients), cpus))
    if args.json:
        print(json.dumps({"rows": rows, "compute": compute}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
