"""The HTTP/1.1 front end: an ``asyncio.Protocol`` on httptools' C parser.

    socket ─▶ data_received ─▶ httptools parser (headers, Content-Length or chunked
              body, pipelined requests) ─▶ the connection's queue of whole requests
           ─▶ one task per connection, a request at a time, answers in order:
              POST .../infer ─▶ serve_infer (server/infer.py) ─▶ app.reply ─▶ write
              any other route ─▶ the aiohttp handler of server/app.py, on a request
                                 that carries what they read ─▶ its Response ─▶ write

The same routes, statuses, headers and error bodies as the aiohttp application of
server/app.py (which stays: the metrics port, and the server when httptools is not
installed); what it saves is aiohttp's per-request machinery (its request and
response objects, router, payload writer and stream reader) on the hot route
(docs/performance.md, serving section).  Keep-alive as HTTP/1.1 says (HTTP/1.0 only
when asked); ``Expect: 100-continue`` is answered; a malformed request gets 400 and
the connection is closed; a body past the size limit gets 413.
"""
from __future__ import annotations

import asyncio
import collections
import email.utils
import json
import re
import socket
import time
from typing import Callable, Deque, Dict, List, Optional, Tuple
from urllib.parse import unquote

import httptools
from aiohttp import web

from . import app as _app
from .infer import Failed, State, serve_infer

__all__ = ["start"]

#: the largest request body accepted (aiohttp's client_max_size in server/app.py)
MAX_BODY = 1 << 30
#: requests parsed ahead of the one being answered before the socket stops being read
_PIPELINE_MAX = 16
#: bytes queued for a client before the writer waits for the socket to drain
_WRITE_HIGH = 1 << 20

_M = "([^/]+)"
_V = f"(?:/versions/{_M})?"
#: (pattern, {method: handler}) in aiohttp's order (infer first); None is the infer fast path
_ROUTES: List[Tuple[re.Pattern[str], Dict[str, Optional[Callable]], Tuple[str, ...]]] = [
    (re.compile(f"^/v2/models/{_M}{_V}/infer$"), {"POST": None}, ("model", "version")),
    (re.compile("^/v2/health/live$"), {"GET": _app._live}, ()),
    (re.compile("^/v2/health/ready$"), {"GET": _app._ready}, ()),
    (re.compile("^/v2$"), {"GET": _app._server_metadata}, ()),
    (re.compile(f"^/v2/models/{_M}{_V}$"), {"GET": _app._model_metadata}, ("model", "version")),
    (re.compile(f"^/v2/models/{_M}{_V}/ready$"), {"GET": _app._model_ready},
     ("model", "version")),
    (re.compile(f"^/v2/models/{_M}{_V}/config$"), {"GET": _app._model_config},
     ("model", "version")),
    (re.compile(f"^/v2/systemsharedmemory(?:/region/{_M})?/status$"),
     {"GET": _app._shm_status}, ("region",)),
    (re.compile(f"^/v2/systemsharedmemory(?:/region/{_M})?/unregister$"),
     {"POST": _app._shm_unregister}, ("region",)),
    (re.compile(f"^/v2/systemsharedmemory/region/{_M}/register$"),
     {"POST": _app._shm_register}, ("region",)),
    (re.compile("^/metrics$"), {"GET": "metrics"}, ()),
]

_REASONS = {100: "Continue", 200: "OK", 400: "Bad Request", 403: "Forbidden",
            404: "Not Found", 405: "Method Not Allowed", 411: "Length Required",
            413: "Request Entity Too Large", 500: "Internal Server Error",
            503: "Service Unavailable", 504: "Gateway Timeout"}


async def start(state: State, host: str, port: int, unix_path: Optional[str] = None
                ) -> Front:
    """Listen on ``host:port`` (and on ``unix_path``, created by the caller's umask)."""
    front = Front(state)
    loop = asyncio.get_running_loop()
    front.servers.append(await loop.create_server(front.connection, host, port,
                                                  reuse_address=True, backlog=1024))
    if unix_path:
        front.servers.append(await loop.create_unix_server(front.connection, unix_path,
                                                           backlog=1024))
    return front


class Front:
    """The listening sockets and the open connections of one front end."""

    def __init__(self, state: State):
        self.state = state
        self.app = {"state": state}
        self.servers: List[asyncio.AbstractServer] = []
        self.connections: set = set()
        self._date = (0, b"")

    def connection(self) -> _Connection:
        return _Connection(self)

    def date(self) -> bytes:
        """The Date header field, made once a second."""
        now = int(time.time())
        if now != self._date[0]:
            self._date = (now, b"Date: " + email.utils.formatdate(now, usegmt=True).encode()
                          + b"\r\n")
        return self._date[1]

    async def close(self) -> None:
        """Stop listening, close every connection (requests in flight were drained)."""
        for s in self.servers:
            s.close()
        for c in list(self.connections):
            c.close()
        for s in self.servers:
            await s.wait_closed()


class _Request:
    """One parsed request, with what the handlers of server/app.py read of aiohttp's."""

    __slots__ = ("method", "path", "headers", "body", "keep_alive", "match_info", "app",
                 "transport", "remote")

    async def read(self) -> bytes:
        return self.body


class _Connection(asyncio.Protocol):
    def __init__(self, front: Front):
        self.front = front
        self.transport: Optional[asyncio.Transport] = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: Deque[_Request] = collections.deque()
        self.task: Optional[asyncio.Task] = None
        self.req: Optional[_Request] = None
        self.url = b""
        self.body: List[bytes] = []
        self.size = 0
        self.remote: Optional[str] = None
        self.paused = False
        self.drained: Optional[asyncio.Future] = None
        self.closing = False

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.front.connections.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            peer = transport.get_extra_info("peername")
            self.remote = peer[0] if peer else None

    def connection_lost(self, exc) -> None:
        self.front.connections.discard(self)
        # a request in flight runs to its end (as under aiohttp), unanswered
        self.closing = True
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # no other protocol is served: the request is answered in HTTP/1.1, then
            # the connection closed (what the client sends after it is not HTTP/1.1)
            if self.queue and not self.closing:
                self.queue[-1].keep_alive = False
                self.transport.pause_reading()
            else:
                self._fail(400, "protocol upgrades are not served")
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, _TooLarge):
                self._fail(413, f"the request body is larger than the limit of {MAX_BODY} "
                           "bytes")
            else:
                self._fail(400, f"malformed request: {exc}")

    def pause_writing(self) -> None:
        self.drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)
        self.drained = None

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    # -- httptools callbacks ------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.req = r = _Request()
        r.headers = {}
        self.url = b""
        self.body = []
        self.size = 0

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        # the title-case name aiohttp's CIMultiDict would match any spelling of
        self.req.headers[name.decode("latin-1").title()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        # an interim answer must not overtake the answers of requests before it: with
        # those outstanding none is sent (the client then sends its body unasked)
        if self.req.headers.get("Expect", "").lower() == "100-continue" and not self.queue \
                and (self.task is None or self.task.done()):
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > MAX_BODY:
            raise _TooLarge()
        self.body.append(body)

    def on_message_complete(self) -> None:
        r, p = self.req, self.parser
        r.method = p.get_method().decode("ascii", "replace")
        r.path = unquote(httptools.parse_url(self.url).path.decode("latin-1")) \
            if b"%" in self.url else httptools.parse_url(self.url).path.decode("latin-1")
        r.body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        r.keep_alive = p.should_keep_alive()
        r.transport, r.remote, r.app = self.transport, self.remote, self.front.app
        self.queue.append(r)
        if len(self.queue) > _PIPELINE_MAX and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        if self.task is None or self.task.done():
            self.task = asyncio.ensure_future(self._answer())

    # -- answering ----------------------------------------------------------------------

    async def _answer(self) -> None:
        """Answer the queued requests in their order (pipelining)."""
        while self.queue and not self.closing:
            r = self.queue.popleft()
            if self.paused and len(self.queue) <= _PIPELINE_MAX // 2:
                self.paused = False
                self.transport.resume_reading()
            try:
                status, ctype, headers, pieces = await _dispatch(self.front.state, r)
            except Exception as exc:  # noqa: BLE001 - the server stays up, the client is told
                status, ctype, headers, pieces = _json_error(
                    500, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            if self.closing:
                return
            size = _size(pieces)
            head = self._head(r, status, ctype, headers, size)
            if r.method == "HEAD":
                self.transport.write(head)
            elif size <= _app._ONE_BUFFER_MAX:
                self.transport.write(b"".join([head, *pieces]))
            else:
                await self._stream(head, pieces)
            if not r.keep_alive:
                self.closing = True
                self.transport.close()

    def _head(self, r: _Request, status: int, ctype: Optional[str], headers: dict,
              size: int) -> bytes:
        """The response's status line and header fields."""
        head = [_STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status, self.front.date(),
                b"Server: neuronmp\r\nContent-Length: %d\r\n" % size]
        if ctype is not None:
            head.append(b"Content-Type: %s\r\n" % ctype.encode("latin-1"))
        for k, v in headers.items():
            head.append(b"%s: %s\r\n" % (k.encode("latin-1"), str(v).encode("latin-1")))
        if not r.keep_alive:
            head.append(b"Connection: close\r\n")
        head.append(b"\r\n")
        return b"".join(head)

    async def _stream(self, head: bytes, pieces: List) -> None:
        """A large body from the outputs' own memory, the socket drained as it goes."""
        self.transport.write(head)
        for p in pieces:
            self.transport.write(p)
            if self.drained is not None:
                await self.drained

    def _fail(self, status: int, message: str) -> None:
        """A request that could not be parsed: answered, then the connection closed
        (what follows it on the connection cannot be told apart)."""
        if self.closing:
            return
        self.closing = True
        body = f"{status}: {message}".encode()
        self.transport.write(b"HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\n"
                             b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                             % (status, _REASONS[status].encode(), len(body), body))
        self.transport.close()


class _TooLarge(Exception):
    pass


_STATUS_LINES = {code: b"HTTP/1.1 %d %s\r\n" % (code, reason.encode())
                 for code, reason in _REASONS.items()}


def _size(pieces: List) -> int:
    return sum(len(p) if isinstance(p, bytes) else memoryview(p).nbytes for p in pieces)


_Answer = Tuple[int, Optional[str], dict, List]


def _json_error(status: int, message: str) -> _Answer:
    return status, "application/json", {}, [json.dumps({"error": message}).encode()]


async def _dispatch(state: State, r: _Request) -> _Answer:
    """The route's answer: (status, content type, other header fields, body pieces)."""
    method = "GET" if r.method == "HEAD" else r.method
    allowed = None
    for pattern, methods, names in _ROUTES:
        m = pattern.match(r.path)
        if m is None:
            continue
        if method not in methods:
            allowed = (allowed or set()) | set(methods)
            continue
        r.match_info = {k: v for k, v in zip(names, m.groups()) if v is not None}
        handler = methods[method]
        if handler is None:
            return await _infer(state, r)
        if handler == "metrics":
            handler = state.metrics.handler
        try:
            return _from_aiohttp(await handler(r))
        except web.HTTPException as exc:
            return _from_aiohttp(exc)
    if allowed:
        return 405, "text/plain; charset=utf-8", {"Allow": ",".join(sorted(
            allowed | ({"HEAD"} if "GET" in allowed else set())))}, \
            [b"405: Method Not Allowed"]
    return 404, "text/plain; charset=utf-8", {}, [b"404: Not Found"]


async def _infer(state: State, r: _Request) -> _Answer:
    try:
        served = _app._model(r)
    except web.HTTPException as exc:
        return _from_aiohttp(exc)
    try:
        rep = await serve_infer(state, served, lambda: _app._parse(r, served), _app.reply)
    except Failed as failed:
        return _json_error(failed.status, failed.message)
    return 200, rep.content_type, rep.headers, rep.pieces


def _from_aiohttp(resp: web.Response) -> _Answer:
    """A response the aiohttp handlers made, as this front end writes it."""
    headers = {k: v for k, v in resp.headers.items()
               if k.lower() not in ("content-type", "content-length")}
    body = resp.body if resp.body is not None else b""
    ctype = resp.headers.get("Content-Type")
    if ctype is None and body:
        ctype = resp.content_type + (f"; charset={resp.charset}" if resp.charset else "")
    return resp.status, ctype, headers, [bytes(body)]
