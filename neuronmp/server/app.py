"""The HTTP/REST front end: KServe v2 (Triton's HTTP protocol) over aiohttp.

    GET  /v2/health/live | /v2/health/ready | /v2
    GET  /v2/models/{m}[/versions/{v}] | .../ready | .../config
    POST /v2/models/{m}[/versions/{v}]/infer     JSON, or JSON + binary tensors
         (Inference-Header-Content-Length), inputs/outputs in shm regions
    POST /v2/systemsharedmemory[/region/{r}]/register | unregister;  GET .../status
    GET  /metrics                                 Prometheus text (also on --metrics-port)

Every request runs on the one request path (BatchingServer.infer_async) through
server/infer.py, shared with the gRPC front end.  Errors are the protocol's
``{"error": "..."}`` with: 400 a request that cannot run as sent
(naming the tensor or the field), 403 the shared-memory extension asked for by a
client not on this host, 404 an unknown model or version, 503 not ready, draining or the
model's queue full, 504 the request's timeout passed before its batch ran, 500 the
model or its core failed (the server stays up).  A request head past the limits of
server/wire.py gets 414 or 431 and the connection ends, after the answers to the
requests before it (``runner``: aiohttp's parser keeps the target, field and count
limits, the handlers the head's total).
"""
from __future__ import annotations

import asyncio
import functools
import json
import socket
from typing import List, Optional, Tuple, Union

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

from .. import __version__
from . import document
from .errors import InferRequestError, SharedMemoryError
from .infer import (
    EXTENSIONS,
    Chosen,
    Failed,
    State,
    output_doc,
    serve_infer,
    tensor_view,
    write_shm_output,
)
from .models import ServedModel
from .shm import check_peer, unix_peer
from .wire import FIELD_MAX, FIELDS_MAX, HEAD_MAX, TARGET_MAX, head_refusal, head_size

__all__ = ["EXTENSIONS", "Reply", "State", "make_app", "reply", "runner"]

_HEADER_LEN = "Inference-Header-Content-Length"


def make_app(state: State) -> web.Application:
    app = web.Application(client_max_size=1 << 30)
    app["state"] = state
    r = _Routes(app.router)
    # the router tries the routes in the order added: infer, the hot one, first
    for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        r.add_post(base + "/infer", _infer)
    r.add_get("/v2/health/live", _live)
    r.add_get("/v2/health/ready", _ready)
    r.add_get("/v2", _server_metadata)
    for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        r.add_get(base, _model_metadata)
        r.add_get(base + "/ready", _model_ready)
        r.add_get(base + "/config", _model_config)
    for base in ("/v2/systemsharedmemory", "/v2/systemsharedmemory/region/{region}"):
        r.add_get(base + "/status", _shm_status)
        r.add_post(base + "/unregister", _shm_unregister)
    r.add_post("/v2/systemsharedmemory/region/{region}/register", _shm_register)
    r.add_get("/metrics", state.metrics.handler)
    return app


def runner(app: web.Application) -> web.AppRunner:
    """``app``'s runner, its connections keeping server/wire.py's head limits."""
    return _Runner(app, access_log=None, max_line_size=TARGET_MAX,
                   max_field_size=FIELD_MAX, max_headers=FIELDS_MAX)


class _Handler(web.RequestHandler):
    """aiohttp's connection, a head its parser refuses for a limit answered with the
    status the httptools front end gives it (aiohttp's own is 400), and every
    request before a refused one answered."""

    __slots__ = ()

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


class _Routes:
    """The app's router, each handler added wrapped by _kserve_errors."""

    def __init__(self, router: web.UrlDispatcher):
        self.router = router

    def add_get(self, path: str, handler) -> None:
        self.router.add_get(path, _kserve_errors(handler))

    def add_post(self, path: str, handler) -> None:
        self.router.add_post(path, _kserve_errors(handler))


def _kserve_errors(handler):
    """``handler`` such that whatever it failed with, the client gets the protocol's
    error body: a bug must not turn into aiohttp's plain-text 500.  (Each handler is
    wrapped rather than the app given a middleware: aiohttp's middleware chain costs
    every request more.)"""
    @functools.wraps(handler)
    async def handle(request: web.Request) -> web.StreamResponse:
        if head_size(request.raw_path, request.raw_headers) > HEAD_MAX:
            response = web.Response(status=431, text=str(head_refusal()))
            response.force_close()
            return response
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except Exception as exc:  # noqa: BLE001 - the server stays up, the client is told
            return _error(500, f"{type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}")
    return handle


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _model(request: web.Request) -> ServedModel:
    state: State = request.app["state"]
    name = request.match_info["model"]
    served = state.models.get(name)
    version = request.match_info.get("version")
    if served is None or (version is not None and version != served.cfg.version):
        raise web.HTTPNotFound(text=json.dumps({"error": f"model '{name}'"
                               f"{' version ' + version if version else ''} is not served; "
                               f"models: {sorted(state.models)}"}),
                               content_type="application/json")
    return served


async def _live(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _ready(request: web.Request) -> web.Response:
    state: State = request.app["state"]
    return web.Response(status=200 if state.serving else 503)


async def _server_metadata(request: web.Request) -> web.Response:
    return web.json_response({"name": "neuronmp", "version": __version__,
                              "extensions": EXTENSIONS})


async def _model_metadata(request: web.Request) -> web.Response:
    return web.json_response(_model(request).metadata())


async def _model_ready(request: web.Request) -> web.Response:
    state: State = request.app["state"]
    _model(request)
    return web.Response(status=200 if state.serving else 503)


async def _model_config(request: web.Request) -> web.Response:
    return web.json_response(_model(request).config())


# -- inference -----------------------------------------------------------------------


async def _infer(request: web.Request) -> web.StreamResponse:
    state: State = request.app["state"]
    served = _model(request)
    try:
        response = await serve_infer(state, served, lambda: _parse(request, served), _respond)
    except Failed as failed:
        return _error(failed.status, failed.message)
    if isinstance(response, _Stream):
        return await response.send(request)
    return response


async def _parse(request: web.Request, served: ServedModel
                 ) -> Tuple[dict, memoryview, Optional[bytes]]:
    """The JSON header, the binary tensor data after it (a view of the body: the
    input tensors are made on the body's bytes, see models.body_tensor) and the
    header's bytes (a header prepared before is not read again: models.Prepared)."""
    body = await request.read()
    length = request.headers.get(_HEADER_LEN)
    if length is None:   # all JSON: nothing to prepare (the data is in the header)
        return _read_header(request, body), memoryview(b""), None
    if not length.isascii() or not length.isdigit() or int(length) > len(body):
        raise InferRequestError(None, f"{_HEADER_LEN}: {length!r} is not a byte count "
                                f"within the {len(body)}-byte body")
    header, binary = body[:int(length)], memoryview(body)[int(length):]
    prepared = served.prepared.get(header)
    if prepared is not None:   # it names no shm region: no peer to check
        return prepared.req, binary, header
    return _read_header(request, header), binary, header


def _read_header(request: web.Request, header: bytes) -> dict:
    req = document.loads(header)
    if isinstance(req, dict):
        document.shm_peer(req, _peer(request))
    return req


#: binary responses up to this size are one buffer (the outputs copied in once, one
#: write); larger ones are written from the tensors' memory, piece by piece
_ONE_BUFFER_MAX = 1 << 20


class Reply:
    """An infer response as any HTTP front end writes it: its content type, the
    header fields beyond it, and the body's pieces (bytes, or the outputs' memory)."""

    __slots__ = ("content_type", "headers", "pieces", "size")

    def __init__(self, content_type: str, headers: dict, pieces: List[memoryview]):
        self.content_type = content_type
        self.headers = headers
        self.pieces = pieces
        self.size = sum(memoryview(p).nbytes for p in pieces)


def reply(state: State, req: dict, served: ServedModel, chosen: Chosen) -> Reply:
    """The response to a request that ran: the outputs it chose, as binary data, JSON
    values or written into their shm regions."""
    params = req.get("parameters") or {}
    all_binary = bool(params.get("binary_data_output", False))
    if chosen and all("shared_memory_region" not in p and p.get("binary_data", all_binary)
                      for _, p in chosen):
        return _binary_reply(req, served, chosen)
    docs, views = [], []
    for out, p in chosen:
        doc, t = output_doc(out)
        if "shared_memory_region" in p:
            doc["parameters"] = write_shm_output(state, out.name, p, t)
        elif p.get("binary_data", all_binary):
            view = tensor_view(t)
            doc["parameters"] = {"binary_data_size": view.nbytes}
            views.append(view)
        else:
            doc["data"] = document.json_values(t)
        docs.append(doc)
    header = _header_bytes(req, served, docs)
    if not views:
        return Reply("application/json", {}, [header])
    return _with_binary(header, views)


def _respond(state: State, req: dict, served: ServedModel, chosen: Chosen
             ) -> Union[web.Response, _Stream]:
    """aiohttp's response for ``reply``'s."""
    r = reply(state, req, served, chosen)
    if len(r.pieces) == 1 and not r.headers:
        return web.Response(body=r.pieces[0], content_type=r.content_type)
    headers = {**r.headers, "Content-Type": r.content_type}
    if r.size > _ONE_BUFFER_MAX:
        return _Stream(headers, r.size, r.pieces)
    return web.Response(body=b"".join(r.pieces), headers=headers)


def _binary_reply(req: dict, served: ServedModel, chosen: Chosen) -> Reply:
    """Every output as binary data: the header depends only on the request's id and
    the outputs' names, dtypes and shapes, so it is made once for each."""
    tensors = [out.tensor.contiguous() for out, _ in chosen]
    views = [tensor_view(t) for t in tensors]
    key = (req.get("id"), *((out.name, t.dtype, t.shape) for (out, _), t in zip(chosen, tensors)))
    header = served.replies.get(key)
    if header is None:
        docs = []
        for (out, _), view in zip(chosen, views):
            doc = output_doc(out)[0]
            doc["parameters"] = {"binary_data_size": view.nbytes}
            docs.append(doc)
        header = _header_bytes(req, served, docs)
        if len(served.replies) < _REPLIES_MAX:
            served.replies[key] = header
    return _with_binary(header, views)


#: all-binary response headers kept per model (see ServedModel.replies)
_REPLIES_MAX = 256


def _header_bytes(req: dict, served: ServedModel, docs: List[dict]) -> bytes:
    body = {"model_name": served.cfg.name, "model_version": served.cfg.version,
            "outputs": docs}
    if "id" in req:
        body["id"] = req["id"]
    return json.dumps(body, allow_nan=False).encode()   # strict JSON, always


def _with_binary(header: bytes, views: List[memoryview]) -> Reply:
    return Reply("application/octet-stream", {_HEADER_LEN: str(len(header))},
                 [header, *views])


class _Stream:
    """A large binary response: written from the header and the outputs' own memory."""

    def __init__(self, headers: dict, size: int, pieces: List[memoryview]):
        self.headers = headers
        self.size = size
        self.pieces = pieces

    async def send(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers=self.headers)
        response.content_length = self.size
        await response.prepare(request)
        for piece in self.pieces:
            await response.write(piece)
        await response.write_eof()
        return response


# -- system shared memory -------------------------------------------------------------


def _peer(request: web.Request) -> Optional[str]:
    """The client as shm.check_peer takes it: its address, or on the Unix socket its
    uid (peer credentials)."""
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is not None and sock.family == socket.AF_UNIX:
        return unix_peer(sock)
    return request.remote


def _local(request: web.Request) -> None:
    """Only clients on this host may use the shared-memory extension (403)."""
    try:
        check_peer(request.match_info.get("region", ""), _peer(request))
    except SharedMemoryError as exc:
        raise web.HTTPForbidden(text=json.dumps({"error": str(exc)}),
                                content_type="application/json") from None


async def _shm_register(request: web.Request) -> web.Response:
    state: State = request.app["state"]
    name = request.match_info["region"]
    _local(request)
    try:
        body = document.loads(await request.read(), "the register request")
    except InferRequestError as exc:
        return _error(400, str(exc))
    if not isinstance(body, dict):
        return _error(400, "the register request is not a JSON object")
    try:
        state.shm.register(name, body.get("key"), body.get("offset", 0), body.get("byte_size"))
    except SharedMemoryError as exc:
        return _error(400, str(exc))
    return web.Response(status=200)


async def _shm_unregister(request: web.Request) -> web.Response:
    _local(request)
    request.app["state"].shm.unregister(request.match_info.get("region", ""))
    return web.Response(status=200)


async def _shm_status(request: web.Request) -> web.Response:
    _local(request)
    try:
        regions = request.app["state"].shm.status(request.match_info.get("region", ""))
    except SharedMemoryError as exc:
        return _error(404, str(exc))
    return web.json_response(regions)

