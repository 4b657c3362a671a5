"""The KServe v2 HTTP/REST routes, defined once for every HTTP front end: the route
table, its handlers, and the protocol-neutral request and response they take and give.

    a front end (server/front.py: the C scanner, httptools; server/app.py: aiohttp)
        parses its bytes ─▶ Request (method, path, body, header fields, peer)
        ─▶ Table.dispatch ─▶ resolve: the route's handler and the path's parameters,
           or 404 / 405 (with Allow) ─▶ handler(state, request) ─▶ Response
           (status, content type, other header fields, body pieces) ─▶ the front end
           writes it (a body over ONE_BUFFER_MAX piece by piece from the outputs' memory)
        a fast path recognises an infer request early (Table.infer_model: this table
        routes it to the infer handler, and its model is served) and builds its answer
        with this module's reply, as the infer handler does

    GET  /v2/health/live | /v2/health/ready | /v2
    GET  /v2/models/{m}[/versions/{v}] | .../ready | .../config
    POST /v2/models/{m}[/versions/{v}]/infer     JSON, or JSON + binary tensors
         (Inference-Header-Content-Length), inputs/outputs in shm regions
    POST /v2/systemsharedmemory[/region/{r}]/register | unregister;  GET .../status
    GET  /metrics                                 Prometheus text (also on --metrics-port)

Every infer request runs on the one request path (BatchingServer.infer_async) through
server/infer.py, shared with the gRPC front end.  Errors are the protocol's
``{"error": "..."}`` with: 400 a request that cannot run as sent (naming the tensor
or the field), 403 the shared-memory extension asked for by a client not on this
host, 404 an unknown model or version, 503 not ready, draining or the model's queue
full, 504 the request's timeout passed before its batch ran, 500 the model or its
core failed, or a handler did (the server stays up).  An unknown path is a plain-text
404 and a known path asked with a method it does not take a 405 naming the methods
it does; HEAD is answered as GET.
"""
from __future__ import annotations

import json
import re
from typing import Awaitable, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

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
from .shm import check_peer

__all__ = ["HEADER_LEN", "METRICS", "ONE_BUFFER_MAX", "TABLE", "Request", "Response",
           "Table", "body_size", "json_error", "reply"]

#: the binary tensor extension's header field: the JSON header's length in the body
HEADER_LEN = "Inference-Header-Content-Length"
#: a body up to this size is written as one buffer (its pieces copied in once);
#: a larger one is written piece by piece from the outputs' own memory
ONE_BUFFER_MAX = 1 << 20
_JSON = "application/json; charset=utf-8"
_TEXT = "text/plain; charset=utf-8"


class Request:
    """One HTTP request as every front end hands it to a handler: the method, the
    path (percent-decoded, no query), the body, the header fields as they came
    (``raw``: name and value bytes), the client as shm.check_peer takes it (its
    address, or on the Unix socket its uid), and the path's parameters (``params``,
    set by the route table)."""

    __slots__ = ("method", "path", "body", "raw", "peer", "params", "_fields")

    def __init__(self, method: str = "GET", path: str = "/", body: bytes = b"",
                 raw: Optional[List[Tuple[bytes, bytes]]] = None, peer: Optional[str] = None):
        self.method = method
        self.path = path
        self.body = body
        self.raw = [] if raw is None else raw
        self.peer = peer
        self.params: Dict[str, str] = {}
        self._fields: Optional[Dict[str, str]] = None

    def header(self, name: str) -> Optional[str]:
        """The field ``name`` in any spelling (the last of a repeated one), or None;
        the fields are decoded when first asked for (the fast paths never ask)."""
        if self._fields is None:
            self._fields = {n.decode("latin-1").lower(): v.decode("latin-1")
                            for n, v in self.raw}
        return self._fields.get(name.lower())


class Response(NamedTuple):
    """A handler's answer: its status, content type (None: no Content-Type field),
    the header fields beyond it, and the body's pieces (bytes or memory views)."""

    status: int
    content_type: Optional[str]
    headers: Dict[str, str]
    pieces: List


Handler = Callable[[State, Request], Awaitable[Response]]


def json_error(status: int, message: str) -> Response:
    """The protocol's error body."""
    return Response(status, _JSON, {}, [json.dumps({"error": message}).encode()])


def body_size(pieces: Sequence) -> int:
    return sum(len(p) if isinstance(p, bytes) else memoryview(p).nbytes for p in pieces)


class _Answered(Exception):
    """A handler's answer given early (the model is not served, the peer not local)."""

    def __init__(self, response: Response):
        super().__init__(response.status)
        self.response = response


class Table:
    """Routes: a path pattern and the handler of each method it takes, tried in
    order.  A pattern's ``{name}`` is one path segment (a parameter), ``[...]`` an
    optional part; a pattern without either is matched by a dict look-up."""

    def __init__(self, routes: Sequence[Tuple[str, Dict[str, Handler]]]):
        self.exact: Dict[str, Dict[str, Handler]] = {}
        self.patterns: List[Tuple[re.Pattern, Dict[str, Handler]]] = []
        for pattern, methods in routes:
            for method in methods:
                if method not in ("GET", "POST"):
                    raise ValueError(f"route {pattern!r}: method {method!r}: GET or POST "
                                     "(HEAD is answered as GET)")
            if "{" in pattern or "[" in pattern:
                self.patterns.append((_compile(pattern), dict(methods)))
            elif pattern in self.exact:
                raise ValueError(f"route {pattern!r} is listed twice")
            else:
                self.exact[pattern] = dict(methods)

    def resolve(self, method: str, path: str
                ) -> Tuple[Optional[Handler], Dict[str, str], Optional[Response]]:
        """The handler of ``method`` on ``path`` and the path's parameters; or the 404
        or 405 answer when there is none."""
        method = "GET" if method == "HEAD" else method
        allowed: set = set()
        methods = self.exact.get(path)
        if methods is not None:
            if method in methods:
                return methods[method], {}, None
            allowed.update(methods)
        for pattern, methods in self.patterns:
            m = pattern.match(path)
            if m is None:
                continue
            if method in methods:
                return methods[method], {k: v for k, v in m.groupdict().items()
                                         if v is not None}, None
            allowed.update(methods)
        if allowed:
            allow = ",".join(sorted(allowed | ({"HEAD"} if "GET" in allowed else set())))
            return None, {}, Response(405, _TEXT, {"Allow": allow}, [b"405: Method Not Allowed"])
        return None, {}, Response(404, _TEXT, {}, [b"404: Not Found"])

    async def dispatch(self, state: State, request: Request) -> Response:
        """The answer of ``request``'s route; whatever a handler fails with, the
        client gets the protocol's error body (a bug is a 500, never a dropped
        connection)."""
        handler, params, refused = self.resolve(request.method, request.path)
        if handler is None:
            return refused
        request.params = params
        try:
            return await handler(state, request)
        except _Answered as answered:
            return answered.response
        except Exception as exc:  # noqa: BLE001 - the server stays up, the client is told
            return json_error(500, f"{type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}")

    def infer_model(self, state: State, path: str) -> Optional[ServedModel]:
        """The served model a POST to ``path`` runs on, when this table routes it to
        the infer handler and the model (and its version, if named) is served; else
        None (dispatch then answers the request)."""
        handler, params, _ = self.resolve("POST", path)
        if handler is not _infer:
            return None
        return _served(state, params)


def _compile(pattern: str) -> re.Pattern:
    optional = re.escape(pattern).replace(r"\[", "(?:").replace(r"\]", ")?")
    return re.compile("^" + re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", optional) + "$")


# -- the handlers ------------------------------------------------------------------------


def _served(state: State, params: Dict[str, str]) -> Optional[ServedModel]:
    served = state.models.get(params["model"])
    version = params.get("version")
    if served is None or (version is not None and version != served.cfg.version):
        return None
    return served


def _model(state: State, request: Request) -> ServedModel:
    served = _served(state, request.params)
    if served is None:
        name, version = request.params["model"], request.params.get("version")
        raise _Answered(json_error(404, f"model '{name}'"
                                   f"{' version ' + version if version else ''} is not "
                                   f"served; models: {sorted(state.models)}"))
    return served


def _empty(status: int) -> Response:
    return Response(status, None, {}, [])


def _document(doc) -> Response:
    return Response(200, _JSON, {}, [json.dumps(doc).encode()])


async def _live(state: State, request: Request) -> Response:
    return _empty(200)


async def _ready(state: State, request: Request) -> Response:
    return _empty(200 if state.serving else 503)


async def _server_metadata(state: State, request: Request) -> Response:
    return _document({"name": "neuronmp", "version": __version__, "extensions": EXTENSIONS})


async def _model_metadata(state: State, request: Request) -> Response:
    return _document(_model(state, request).metadata())


async def _model_ready(state: State, request: Request) -> Response:
    _model(state, request)
    return _empty(200 if state.serving else 503)


async def _model_config(state: State, request: Request) -> Response:
    return _document(_model(state, request).config())


async def _metrics(state: State, request: Request) -> Response:
    return Response(200, "text/plain; version=0.0.4", {}, [state.metrics.text()])


def _local(request: Request) -> None:
    """Only clients on this host may use the shared-memory extension (403)."""
    try:
        check_peer(request.params.get("region", ""), request.peer)
    except SharedMemoryError as exc:
        raise _Answered(json_error(403, str(exc))) from None


async def _shm_register(state: State, request: Request) -> Response:
    _local(request)
    try:
        body = document.loads(request.body, "the register request")
    except InferRequestError as exc:
        return json_error(400, str(exc))
    if not isinstance(body, dict):
        return json_error(400, "the register request is not a JSON object")
    try:
        state.shm.register(request.params["region"], body.get("key"), body.get("offset", 0),
                           body.get("byte_size"))
    except SharedMemoryError as exc:
        return json_error(400, str(exc))
    return _empty(200)


async def _shm_unregister(state: State, request: Request) -> Response:
    _local(request)
    state.shm.unregister(request.params.get("region", ""))
    return _empty(200)


async def _shm_status(state: State, request: Request) -> Response:
    _local(request)
    try:
        regions = state.shm.status(request.params.get("region", ""))
    except SharedMemoryError as exc:
        return json_error(404, str(exc))
    return _document(regions)


# -- inference ---------------------------------------------------------------------------


async def _infer(state: State, request: Request) -> Response:
    served = _model(state, request)
    try:
        return await serve_infer(state, served, lambda: _parse(request, served), reply)
    except Failed as failed:
        return json_error(failed.status, failed.message)


async def _parse(request: Request, served: ServedModel
                 ) -> Tuple[dict, memoryview, Optional[bytes]]:
    """The JSON header, the binary tensor data after it (a view of the body: the
    input tensors are made on the body's bytes, see models.body_tensor) and the
    header's bytes (a header prepared before is not read again: models.Prepared)."""
    body = request.body
    length = request.header(HEADER_LEN)
    if length is None:   # all JSON: nothing to prepare (the data is in the header)
        return _read_header(request, body), memoryview(b""), None
    if not length.isascii() or not length.isdigit() or int(length) > len(body):
        raise InferRequestError(None, f"{HEADER_LEN}: {length!r} is not a byte count "
                                f"within the {len(body)}-byte body")
    header, binary = body[:int(length)], memoryview(body)[int(length):]
    prepared = served.prepared.get(header)
    if prepared is not None:   # it names no shm region: no peer to check
        return prepared.req, binary, header
    return _read_header(request, header), binary, header


def _read_header(request: Request, header: bytes) -> dict:
    req = document.loads(header)
    if isinstance(req, dict):
        document.shm_peer(req, request.peer)
    return req


def reply(state: State, req: dict, served: ServedModel, chosen: Chosen) -> Response:
    """The 200 answer of an infer request that ran: the outputs it chose, as binary
    data, JSON values or written into their shm regions."""
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
        return Response(200, "application/json", {}, [header])
    return _with_binary(header, views)


#: all-binary response headers kept per model (see ServedModel.replies)
_REPLIES_MAX = 256


def _binary_reply(req: dict, served: ServedModel, chosen: Chosen) -> Response:
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


def _header_bytes(req: dict, served: ServedModel, docs: List[dict]) -> bytes:
    body = {"model_name": served.cfg.name, "model_version": served.cfg.version,
            "outputs": docs}
    if "id" in req:
        body["id"] = req["id"]
    return json.dumps(body, allow_nan=False).encode()   # strict JSON, always


def _with_binary(header: bytes, views: List[memoryview]) -> Response:
    return Response(200, "application/octet-stream", {HEADER_LEN: str(len(header))},
                    [header, *views])


_MODEL = "/v2/models/{model}[/versions/{version}]"
_REGION = "/v2/systemsharedmemory[/region/{region}]"

#: neuronmp-serve's HTTP routes, infer (the hot one) first
TABLE = Table([
    (_MODEL + "/infer", {"POST": _infer}),
    ("/v2/health/live", {"GET": _live}),
    ("/v2/health/ready", {"GET": _ready}),
    ("/v2", {"GET": _server_metadata}),
    (_MODEL, {"GET": _model_metadata}),
    (_MODEL + "/ready", {"GET": _model_ready}),
    (_MODEL + "/config", {"GET": _model_config}),
    (_REGION + "/status", {"GET": _shm_status}),
    (_REGION + "/unregister", {"POST": _shm_unregister}),
    ("/v2/systemsharedmemory/region/{region}/register", {"POST": _shm_register}),
    ("/metrics", {"GET": _metrics}),
])

#: the metrics port's one route
METRICS = Table([("/metrics", {"GET": _metrics})])
