"""The aiohttp front end: an adapter from aiohttp's requests to the route table of
server/routes.py and from its responses back (the metrics port, and the HTTP port
when httptools is not installed or ``--http-frontend aiohttp`` asks for it).

    aiohttp's connection (_Handler: its parser's head limits, the refusals' statuses)
        ─▶ one catch-all route ─▶ _handle: the head's total checked (431), the body
           read ─▶ routes.Request ─▶ Table.dispatch ─▶ routes.Response
        ─▶ web.Response (a body over routes.ONE_BUFFER_MAX: a StreamResponse written
           piece by piece from the outputs' memory)

A request head past the limits of server/wire.py gets 414 or 431 and the connection
ends, after the answers to the requests before it (``runner``: aiohttp's parser keeps
the target, field and count limits, the handler the head's total).
"""
from __future__ import annotations

import asyncio
import functools
import socket
from typing import Optional

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

from .infer import State
from .routes import ONE_BUFFER_MAX, TABLE, Request, Response, Table, body_size
from .shm import unix_peer
from .wire import FIELD_MAX, FIELDS_MAX, HEAD_MAX, MAX_BODY, TARGET_MAX, head_refusal, head_size

__all__ = ["make_app", "runner"]


def make_app(state: State, table: Table = TABLE) -> web.Application:
    """An aiohttp application answering ``table``'s routes on ``state``."""
    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_route("*", "/{path:.*}", functools.partial(_handle, state, table))
    return app


def runner(app: web.Application) -> web.AppRunner:
    """``app``'s runner, its connections keeping server/wire.py's head limits."""
    return _Runner(app, access_log=None, max_line_size=TARGET_MAX,
                   max_field_size=FIELD_MAX, max_headers=FIELDS_MAX)


async def _handle(state: State, table: Table, request: web.Request) -> web.StreamResponse:
    if head_size(request.raw_path, request.raw_headers) > HEAD_MAX:
        response = web.Response(status=431, text=str(head_refusal()))
        response.force_close()
        return response
    body = await request.read() if request.can_read_body else b""
    answer = await table.dispatch(state, Request(request.method, request.path, body,
                                                 request.raw_headers, _peer(request)))
    return await _send(request, answer)


async def _send(request: web.Request, answer: Response) -> web.StreamResponse:
    status, ctype, fields, pieces = answer
    headers = {**fields, "Content-Type": ctype} if ctype is not None else fields
    size = body_size(pieces)
    if size <= ONE_BUFFER_MAX:
        body = pieces[0] if len(pieces) == 1 else b"".join(pieces) if pieces else None
        return web.Response(status=status, body=body, headers=headers)
    response = web.StreamResponse(status=status, headers=headers)
    response.content_length = size
    await response.prepare(request)
    for piece in pieces:
        await response.write(piece)
    await response.write_eof()
    return response


def _peer(request: web.Request) -> Optional[str]:
    """The client as shm.check_peer takes it: its address, or on the Unix socket its
    uid (peer credentials), read once a connection."""
    handler = request.protocol
    peer = getattr(handler, "peer", None)
    if peer is None:
        sock = request.transport.get_extra_info("socket") if request.transport else None
        peer = unix_peer(sock) if sock is not None and sock.family == socket.AF_UNIX \
            else request.remote
        if isinstance(handler, _Handler):
            handler.peer = peer
    return peer


class _Handler(web.RequestHandler):
    """aiohttp's connection, a head its parser refuses for a limit answered with the
    status the httptools front end gives it (aiohttp's own is 400), and every
    request before a refused one answered."""

    __slots__ = ("peer",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.peer: Optional[str] = None

    def data_received(self, data: bytes) -> None:
        # aiohttp keeps only the refusal of a read in which its parser refused a
        # request (the requests read before it in that read are dropped): each head
        # is given to it on its own, so the requests before a refused one (or
        # before the bytes after a request that closes) are queued first
        at, n = 0, len(data)
        while (end := data.find(b"\r\n\r\n", at)) >= 0 and end + 4 < n:
            super().data_received(memoryview(data)[at:end + 4])
            at = end + 4
        super().data_received(memoryview(data)[at:] if at else data)

    def handle_error(self, request, status: int = 500, exc: Optional[BaseException] = None,
                     message: Optional[str] = None) -> web.StreamResponse:
        if status == 400 and isinstance(exc, LineTooLong):
            # the limit it names tells the target (414) from a field (431)
            status = 414 if exc.args[1] == TARGET_MAX else 431
        elif status == 400 and isinstance(exc, BadHttpMessage) and \
                exc.message.startswith("Too many headers"):
            status = 431
        return super().handle_error(request, status, exc, message)


class _Runner(web.AppRunner):
    """An AppRunner whose sites make _Handler connections (on its server, which
    keeps their count and drains them at shutdown)."""

    __slots__ = ()

    @property
    def server(self):
        server = super().server
        if server is None:
            return None
        kwargs = self._kwargs
        return lambda: _Handler(server, loop=asyncio.get_running_loop(), **kwargs)
