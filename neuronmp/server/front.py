"""The HTTP/1.1 front end: an ``asyncio.Protocol`` on httptools' C parser, an adapter
to the route table of server/routes.py.

    socket ─▶ data_received ─▶ the scanner (server/_front.c): a whole request of the
              common shape (POST, HTTP/1.1, Content-Length, the binary header's
              length) whose path the table routes to the infer handler
              (Table.infer_model) ─▶ its model's header prepared and one input
              (models.Prepared, batching.rowbytes.RowInput): the body's bytes join the
              batch as they are ─▶ the batch's answer calls the request's _Pending
              ─▶ one write (a response head kept per header, dtype and shape, made
              from routes.reply's answer, and the rows' bytes)
           ─▶ anything else, from its first byte: httptools (headers, Content-Length
              or chunked body, pipelined requests) ─▶ a whole request (wire.Parsed,
              a routes.Request)
           ─▶ fast path (nothing before it unanswered, routed to the infer handler,
              its model's header prepared): as above, or for a model of several
              inputs BatchingServer.loop_future ─▶ its done callback ─▶ routes.reply
              ─▶ write
           ─▶ otherwise the connection's queue, one task answering it in order:
              Table.dispatch ─▶ the route's handler ─▶ routes.Response ─▶ write

Every route is answered by its one handler in server/routes.py, as under the aiohttp
front end of server/app.py (which stays: the metrics port, and the server when
httptools is not installed); what this front end saves is aiohttp's per-request
machinery (its request and response objects, router, payload writer and stream
reader) on the hot route (docs/performance.md, "neuronmp-serve against mosec"); the fast path saves
the task and the general request path on a model's repeated requests, declining
whatever the infer handler would answer otherwise (a model not served, not ready,
a header not prepared), with the answers, statuses and metrics serve_infer gives;
the scanner saves httptools' callbacks (one Python call per header field) on the
requests the fast path takes, and only ever accepts a strict subset of what
httptools accepts, read alike: whatever it declines, httptools parses and answers.
Keep-alive as HTTP/1.1
says (HTTP/1.0 only when asked); ``Expect: 100-continue`` is answered.  A request
the parser refuses (400 malformed, 413 a body past the size limit, 414 and 431 a
head past server/wire.py's limits) is answered after the requests before it, in
their order, and nothing after it is read; so is a request that closes the
connection (RFC 9112 9.6: answered, then the connection ends).  A head is fed to
httptools in slices, so that what it holds of a field not yet handed over stays
within a slice of the field limit.  An ending connection closes its write side, then
drops what the client still sends until it closes too or LINGER passes.
"""
from __future__ import annotations

import asyncio
import collections
import email.utils
import functools
import socket
import time
from typing import Deque, Dict, List, Optional, Tuple
from urllib.parse import unquote

import httptools
import torch

from ..batching.rowbytes import RowInput, RowsWaiter
from ._front import scan as _scan
from .infer import State, choose, failure, tensor_view
from .routes import ONE_BUFFER_MAX, TABLE, Response, Table, body_size, json_error, reply
from .shm import unix_peer
from .wire import (
    LINGER,
    MAX_BODY,
    STATUS_LINES,
    Head,
    Parsed,
    Refusal,
    Refused,
    Scanned,
    TooLarge,
    fields,
    unseen_field,
)

__all__ = ["Front", "start"]

#: requests parsed ahead of the one being answered before the socket stops being read
_PIPELINE_MAX = 16
#: bytes queued for a client before the writer waits for the socket to drain
_WRITE_HIGH = 1 << 20
#: response heads kept for the fast infer path (by prepared header, dtype and shape)
_HEADS_MAX = 1024
#: paths remembered for the scanner's requests
_PATHS_MAX = 256
#: the bytes of a request head given to httptools at once
_SLICE = 4 << 10
#: the binary extension's header field, as the parser's names are compared (lower case)
_HEADER_LEN = b"inference-header-content-length"


async def start(state: State, host: str, port: int, unix_path: Optional[str] = None,
                table: Table = TABLE) -> Front:
    """Listen on ``host:port`` (and on ``unix_path``, created by the caller's umask),
    answering ``table``'s routes on ``state``."""
    loop = asyncio.get_running_loop()
    front = Front(state, loop, table)
    front.servers.append(await loop.create_server(front.connection, host, port,
                                                  reuse_address=True, backlog=1024))
    if unix_path:
        front.servers.append(await loop.create_unix_server(front.connection, unix_path,
                                                           backlog=1024))
    return front


class Front:
    """The listening sockets and the open connections of one front end."""

    def __init__(self, state: State, loop: asyncio.AbstractEventLoop, table: Table = TABLE):
        self.state = state
        self.loop = loop
        self.table = table
        self.servers: List[asyncio.AbstractServer] = []
        self.connections: set = set()
        self._date = (0, b"")
        # a prepared request's all-binary response after its Date field: the fields,
        # the blank line and the JSON header, by (Prepared, dtype, shape)
        self.heads: Dict[tuple, bytes] = {}
        # paths the scanner read -> their ServedModel, None when not an infer route's
        # (the models served do not change once the front end listens)
        self.paths: Dict[bytes, object] = {}

    def infer_path(self, path: bytes):
        """The model the route table runs a POST to ``path`` on (routes.Table.infer_model),
        else None; remembered for the scanner's requests."""
        served = self.table.infer_model(self.state, path.decode("latin-1"))
        if len(self.paths) < _PATHS_MAX:
            self.paths[path] = served
        return served

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


class _Connection(asyncio.Protocol):
    def __init__(self, front: Front):
        self.front = front
        self.transport: Optional[asyncio.Transport] = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: Deque[Parsed] = collections.deque()
        self.task: Optional[asyncio.Task] = None
        self.req: Optional[Parsed] = None
        self.url = b""
        self.body: List[bytes] = []
        self.size = 0
        self.peer: Optional[str] = None   # the client, as shm.check_peer takes it
        self.paused = False
        self.drained: Optional[asyncio.Future] = None
        self.closing = False
        self.busy = False   # a request on the fast path is running (its callback answers)
        self.mid = False    # httptools holds part of a request
        self.head = Head()     # the request's head (and trailer fields) so far
        self.heading = False   # httptools is reading a head
        self.seen = False   # httptools handed over part of the head in the last slice
        self.unseen = 0     # bytes given since then, all of one field it holds
        self.last = False   # nothing more is read: the requests read are the last
        self.latest: Optional[Parsed] = None   # the last request read
        self.linger: Optional[asyncio.TimerHandle] = None

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.front.connections.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            peer = transport.get_extra_info("peername")
            self.peer = peer[0] if peer else None
        elif sock is not None and sock.family == socket.AF_UNIX:
            self.peer = unix_peer(sock)

    def connection_lost(self, exc) -> None:
        self.front.connections.discard(self)
        # a request in flight runs to its end (as under aiohttp), unanswered
        self.closing = True
        if self.linger is not None:
            self.linger.cancel()
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self.last:   # past the last request: dropped (RFC 9112 9.6)
            return
        if not self.mid:
            at = self._scanned(data)
            if at:
                if at >= len(data) or self.last:
                    return
                data = data[at:]
        view, at, n = memoryview(data), 0, len(data)
        while at < n and not self.last:
            # a head in slices (see the module's docstring), a body's bytes at once
            piece = view[at:at + _SLICE] if self.heading or not self.mid else view[at:]
            self.seen = False
            if not self._feed(piece):
                return
            at += len(piece)
            if self.heading:
                self.unseen = 0 if self.seen else self.unseen + len(piece)
                refused = unseen_field(self.unseen)
                if refused is not None:
                    self._refuse(refused)

    def _feed(self, data: memoryview) -> bool:
        """httptools given ``data``; False when it refused it or stopped."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # no other protocol is served: the request is answered in HTTP/1.1, then
            # the connection closed (what the client sends after it is not HTTP/1.1)
            self._stop_reading()
            if self._idle():
                self._end()
            else:
                self.latest.keep_alive = False
            return False
        except httptools.HttpParserError as exc:
            if self.last:   # the bytes after a request that closes: not read
                return False
            refused = exc.__context__
            if isinstance(refused, TooLarge):
                refused = Refusal(413, f"the request body is larger than the limit of "
                                  f"{MAX_BODY} bytes")
            elif not isinstance(refused, Refusal):
                refused = Refusal(400, f"malformed request: {exc}")
            self._refuse(refused)
            return False
        return True

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
        self.mid = self.seen = True
        self.head, self.heading, self.unseen = Head(), True, 0
        self.req = Parsed()
        self.url = b""
        self.body = []
        self.size = 0

    def on_url(self, url: bytes) -> None:
        self.seen = True
        self.head.url(url)
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.seen = True
        self.head.field(name, value)
        self.req.raw.append((name, value))

    def on_headers_complete(self) -> None:
        self.heading = False
        # an interim answer must not overtake the answers of requests before it: with
        # those outstanding none is sent (the client then sends its body unasked)
        r, expect = self.req, None
        for name, value in r.raw:   # the two fields read here, in any spelling; the last
            n = len(name)
            if n == 31 and name.lower() == _HEADER_LEN:
                r.binary_len = value
            elif n == 6 and name.lower() == b"expect":
                expect = value
        if expect is not None and expect.lower() == b"100-continue" and self._idle():
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > MAX_BODY:
            raise TooLarge()
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.mid = False
        r, p = self.req, self.parser
        r.method = p.get_method().decode("ascii", "replace")
        r.path = unquote(httptools.parse_url(self.url).path.decode("latin-1")) \
            if b"%" in self.url else httptools.parse_url(self.url).path.decode("latin-1")
        r.body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        r.keep_alive = p.should_keep_alive()
        r.peer = self.peer
        self.latest = r
        if not r.keep_alive:
            self._stop_reading()
        if r.method == "POST" and self._idle() and self._fast(r):
            return
        self.queue.append(r)
        if len(self.queue) > _PIPELINE_MAX and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        if not self.busy and (self.task is None or self.task.done()):
            self.task = asyncio.ensure_future(self._answer())

    def _idle(self) -> bool:
        """Nothing received before is still unanswered."""
        return not self.queue and not self.busy and (self.task is None or self.task.done())

    # -- the fast infer path --------------------------------------------------------------

    def _scanned(self, data: bytes) -> int:
        """Start the whole requests at the start of ``data`` that the scanner reads
        (server/_front.c) and the fast path takes; the offset of the rest, which
        httptools parses (from the first request that is not of the common shape,
        not whole, or not for the fast path: the general path then reads it again)."""
        at, front = 0, self.front
        while self._idle():
            got = _scan(data, at)
            if got is None:
                return at
            end, path, keep_alive, n, body_at = got
            served = front.paths.get(path, False)
            if served is False:
                served = front.infer_path(path)
            if served is None or n < 0 or body_at + n > end or not front.state.serving:
                return at
            prepared = served.prepared.get(data[body_at:body_at + n])
            rows = prepared.row_input(served.server) if prepared is not None else None
            if rows is None or not self._fast_rows(
                    Scanned(keep_alive), served, prepared, rows,
                    memoryview(data)[body_at + n:end]):
                return at
            at = end
            if not keep_alive and not self.closing:   # (closing: answered, and ending)
                self._stop_reading()
            if at >= len(data) or self.closing or self.last:
                return len(data)
        return at

    def _fast(self, r: Parsed) -> bool:
        """Start the common infer request (its model's header seen before: a prepared
        header, binary input data) with its answer written from its future's done
        callback: no task or general request path, its answer the infer route's
        (routes.reply).  False, with nothing done, sends it the general way (which
        also says what is wrong with it)."""
        state = self.front.state
        if not state.serving:
            return False
        served = self.front.table.infer_model(state, r.path)
        if served is None:
            return False
        length = r.binary_len
        if length is None or not length.isdigit() or int(length) > len(r.body):
            return False
        n, body = int(length), r.body
        prepared = served.prepared.get(body[:n])
        if prepared is None:
            return False
        rows = prepared.row_input(served.server)
        if rows is not None:
            return self._fast_rows(r, served, prepared, rows, memoryview(body)[n:])
        inputs = prepared.inputs(memoryview(body)[n:])
        if inputs is None:
            return False
        start = time.perf_counter()
        state.in_flight += 1
        try:
            fut = served.server.loop_future(self.front.loop, *inputs, **prepared.schedule)
        except Exception as exc:  # noqa: BLE001 - each error becomes its status
            state.in_flight -= 1
            failed = failure(state, served, start, exc)
            self._write(r, json_error(failed.status, failed.message))
            return True
        if fut is None:   # threads serve the model: the general path's infer_async
            state.in_flight -= 1
            return False
        self.busy = True
        fut.add_done_callback(functools.partial(self._fast_done, r, served, prepared,
                                                start))
        return True

    def _fast_rows(self, r: Parsed, served, prepared, rows: RowInput,
                   data: memoryview) -> bool:
        """The fast path of a one-input model: the body's bytes go to the batch as
        they are, and the batch's answer calls a _Pending (no future per request)."""
        if len(data) != rows.nbytes:
            return False
        state = self.front.state
        waiter = _Pending(self, r, served, prepared)
        state.in_flight += 1
        try:
            sent = rows.submit(self.front.loop, data, waiter)
        except Exception as exc:  # noqa: BLE001 - each error becomes its status
            state.in_flight -= 1
            failed = failure(state, served, waiter.start, exc)
            self._write(r, json_error(failed.status, failed.message))
            return True
        if not sent:   # threads serve the model: the general path's infer_async
            state.in_flight -= 1
            return False
        self.busy = True
        return True

    def _rows_done(self, p: _Pending, view: memoryview, out: torch.Tensor, start: int,
                   rows: int) -> None:
        """A _Pending's rows: the kept head and the rows' bytes, in one write."""
        r = p.r
        head = self.front.heads.get((p.prepared, out.dtype, rows, out.shape[1:])) \
            if r.keep_alive else None
        if head is None:
            self._finish(r, p.served, p.prepared, p.start, out[start:start + rows], None)
            return
        state = self.front.state
        state.in_flight -= 1
        self.busy = False
        state.metrics.success(p.served, p.start)
        if self.closing:
            return
        self.transport.write(b"".join([STATUS_LINES[200], self.front.date(), head, view]))
        if self.queue:
            self.task = asyncio.ensure_future(self._answer())

    def _fast_done(self, r: Parsed, served, prepared, start: float,
                   fut: asyncio.Future) -> None:
        if fut.cancelled():
            self._finish(r, served, prepared, start, None,
                         RuntimeError("the request was cancelled"))
        else:
            exc = fut.exception()
            self._finish(r, served, prepared, start, None if exc else fut.result(), exc)

    def _finish(self, r: Parsed, served, prepared, start: float, result,
                exc: Optional[BaseException]) -> None:
        """A fast-path request's answer (``result``) or error (``exc``), written."""
        state = self.front.state
        state.in_flight -= 1
        self.busy = False
        head = None
        try:
            if exc is not None:
                raise exc
            key = (prepared, result.dtype, result.shape[0], result.shape[1:]) \
                if type(result) is torch.Tensor and result.dim() and r.keep_alive else None
            head = self.front.heads.get(key) if key is not None else None
            if head is None or not result.is_contiguous():
                head = None
                req = prepared.req
                rep = reply(state, req, served, choose(req, served.outputs(result)))
                if key is not None:
                    self._remember(key, rep, result)
        except Exception as exc:  # noqa: BLE001 - each error becomes its status
            failed = failure(state, served, start, exc)
            answer = json_error(failed.status, failed.message)
        else:
            state.metrics.success(served, start)
            answer = rep if head is None else None
        if self.closing:
            return
        if head is not None:   # the response head made for this header, dtype and shape
            self.transport.write(b"".join([STATUS_LINES[200], self.front.date(), head,
                                           tensor_view(result)]))
            large = None
        else:
            large = self._write(r, answer)
        if large is not None or self.queue:
            self.task = asyncio.ensure_future(self._answer(r, large))

    def _remember(self, key: tuple, rep: Response, result: torch.Tensor) -> None:
        """Keep an answer's head when its body is the JSON header and ``result``'s
        own bytes (an all-binary reply of one output): the next answer to the same
        header with an output of the same dtype and shape is that head and its bytes."""
        heads = self.front.heads
        if rep.content_type != "application/octet-stream" or len(rep.pieces) != 2 or \
                not result.is_contiguous() or len(heads) >= _HEADS_MAX or \
                memoryview(rep.pieces[1]).nbytes != result.numel() * result.element_size():
            return
        heads[key] = fields(rep.content_type, rep.headers, body_size(rep.pieces), True) + \
            bytes(rep.pieces[0])

    # -- answering ----------------------------------------------------------------------

    async def _answer(self, r: Optional[Parsed] = None,
                      large: Optional[Tuple[bytes, List]] = None) -> None:
        """Answer the queued requests in their order (pipelining), after streaming
        ``r``'s ``large`` answer if one is given."""
        if large is not None:
            await self._stream(*large)
            self._ended(r)
        while self.queue and not self.closing:
            r = self.queue.popleft()
            if self.paused and len(self.queue) <= _PIPELINE_MAX // 2 and not self.last:
                self.paused = False
                self.transport.resume_reading()
            if type(r) is Refused:
                self._write(r, r.answer)
                return
            answer = await self.front.table.dispatch(self.front.state, r)
            if self.closing:
                return
            large = self._write(r, answer)
            if large is not None:
                await self._stream(*large)
                self._ended(r)

    def _write(self, r: Parsed, answer: Response) -> Optional[Tuple[bytes, List]]:
        """Write an answer whole; (head, pieces) left to stream when it is large."""
        status, ctype, headers, pieces = answer
        size = body_size(pieces)
        head = self._head(r, status, ctype, headers, size)
        if r.method == "HEAD":
            self.transport.write(head)
        elif size <= ONE_BUFFER_MAX:
            self.transport.write(b"".join([head, *pieces]))
        else:
            return head, pieces
        self._ended(r)
        return None

    def _ended(self, r: Parsed) -> None:
        if not r.keep_alive:
            self._end()

    def _end(self) -> None:
        """The connection ends after the answers written: its write side closed once
        they are sent, then what the client still sends dropped until it closes its
        end too (eof_received) or LINGER passes (RFC 9112 9.6: a full close with
        the client's bytes unread would reset the connection, and a reset can
        overtake the answers)."""
        self.closing = self.last = True
        t = self.transport
        if not t.can_write_eof():
            t.close()
            return
        t.write_eof()
        if not t.is_reading():
            t.resume_reading()
        self.linger = self.front.loop.call_later(LINGER, t.close)

    def _stop_reading(self) -> None:
        """The requests read are the last (the one just read closes the connection,
        or a refused one is next): nothing more is read until the answers are out."""
        self.last = True
        if self.transport.is_reading():
            self.transport.pause_reading()

    def _refuse(self, refused: Refusal) -> None:
        """A request that cannot be read further: answered after the requests read
        before it, then the connection ends (what follows it cannot be told apart)."""
        self._stop_reading()
        self.queue.append(Refused(refused))
        if not self.busy and (self.task is None or self.task.done()):
            self.task = asyncio.ensure_future(self._answer())

    def _head(self, r: Parsed, status: int, ctype: Optional[str], headers: dict,
              size: int) -> bytes:
        """The response's status line and header fields."""
        return b"".join([STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status,
                         self.front.date(), fields(ctype, headers, size, r.keep_alive)])

    async def _stream(self, head: bytes, pieces: List) -> None:
        """A large body from the outputs' own memory, the socket drained as it goes."""
        self.transport.write(head)
        for p in pieces:
            self.transport.write(p)
            if self.drained is not None:
                await self.drained


class _Pending(RowsWaiter):
    """A fast-path request of a one-input model, waiting in its batch (see
    batching.rowbytes.RowsWaiter): the batch's answer writes its response through it."""

    __slots__ = ("conn", "r", "served", "prepared", "start", "_done")

    def __init__(self, conn: _Connection, r: Parsed, served, prepared):
        self.conn = conn
        self.r = r
        self.served = served
        self.prepared = prepared
        self.start = time.perf_counter()
        self._done = False

    def done(self) -> bool:
        return self._done

    def set_rows(self, view: memoryview, out: torch.Tensor, start: int, rows: int) -> None:
        self._done = True
        self.conn._rows_done(self, view, out, start, rows)

    def set_result(self, value) -> None:
        self._done = True
        self.conn._finish(self.r, self.served, self.prepared, self.start, value, None)

    def set_exception(self, exc: BaseException) -> None:
        self._done = True
        self.conn._finish(self.r, self.served, self.prepared, self.start, None, exc)
