"""The HTTP/REST front end: KServe v2 (Triton's HTTP protocol) over aiohttp.

    GET  /v2/health/live | /v2/health/ready | /v2
    GET  /v2/models/{m}[/versions/{v}] | .../ready | .../config
    POST /v2/models/{m}[/versions/{v}]/infer     JSON, or JSON + binary tensors
         (Inference-Header-Content-Length), inputs/outputs in shm regions
    POST /v2/systemsharedmemory[/region/{r}]/register | unregister;  GET .../status
    GET  /metrics                                 Prometheus text (also on --metrics-port)

Every request runs on the one request path (BatchingServer.infer_async).  Errors are
the protocol's ``{"error": "..."}`` with: 400 a request that cannot run as sent
(naming the tensor), 404 an unknown model or version, 503 not ready, draining or the
model's queue full, 504 the request's timeout passed before its batch ran, 500 the
model or its core failed (the server stays up).
"""
from __future__ import annotations

import json
import time
from typing import Dict, List

import torch
from aiohttp import web

from .. import __version__
from ..errors import (
    InferRequestError,
    QueueFullError,
    RequestTimeoutError,
    ServerClosedError,
    SharedMemoryError,
)
from .metrics import Metrics
from .models import Output, ServedModel, v2_datatype
from .shm import Registry

EXTENSIONS = ["binary_tensor_data", "system_shared_memory", "model_configuration",
              "schedule_policy"]
_HEADER_LEN = "Inference-Header-Content-Length"


class State:
    """What the handlers share: the models, the shm regions, readiness, in-flight count."""

    def __init__(self, models: Dict[str, ServedModel], metrics: Metrics):
        self.models = models
        self.metrics = metrics
        self.shm = Registry()
        self.ready = False
        self.draining = False
        self.in_flight = 0


def make_app(state: State) -> web.Application:
    app = web.Application(client_max_size=1 << 30)
    app["state"] = state
    r = app.router
    r.add_get("/v2/health/live", _live)
    r.add_get("/v2/health/ready", _ready)
    r.add_get("/v2", _server_metadata)
    for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        r.add_get(base, _model_metadata)
        r.add_get(base + "/ready", _model_ready)
        r.add_get(base + "/config", _model_config)
        r.add_post(base + "/infer", _infer)
    for base in ("/v2/systemsharedmemory", "/v2/systemsharedmemory/region/{region}"):
        r.add_get(base + "/status", _shm_status)
        r.add_post(base + "/unregister", _shm_unregister)
    r.add_post("/v2/systemsharedmemory/region/{region}/register", _shm_register)
    r.add_get("/metrics", state.metrics.handler)
    return app


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
    return web.Response(status=200 if state.ready and not state.draining else 503)


async def _server_metadata(request: web.Request) -> web.Response:
    return web.json_response({"name": "neuronmp", "version": __version__,
                              "extensions": EXTENSIONS})


async def _model_metadata(request: web.Request) -> web.Response:
    return web.json_response(_model(request).metadata())


async def _model_ready(request: web.Request) -> web.Response:
    state: State = request.app["state"]
    _model(request)
    return web.Response(status=200 if state.ready and not state.draining else 503)


async def _model_config(request: web.Request) -> web.Response:
    return web.json_response(_model(request).config())


# -- inference -----------------------------------------------------------------------


async def _infer(request: web.Request) -> web.Response:
    state: State = request.app["state"]
    served = _model(request)
    if not state.ready or state.draining:
        return _error(503, "the server is not ready (starting or shutting down)")
    start = time.perf_counter()
    state.in_flight += 1
    try:
        response = await _infer_one(request, served, state)
        state.metrics.success(served, start)
        return response
    except InferRequestError as exc:
        return _failed(state, served, start, 400, str(exc))
    except SharedMemoryError as exc:
        return _failed(state, served, start, 400, str(exc))
    except QueueFullError as exc:
        return _failed(state, served, start, 503, str(exc))
    except ServerClosedError as exc:
        return _failed(state, served, start, 503, str(exc))
    except RequestTimeoutError as exc:
        return _failed(state, served, start, 504, str(exc))
    except (ValueError, TypeError) as exc:   # the one input check's words, naming the input
        return _failed(state, served, start, 400, str(exc))
    except Exception as exc:  # noqa: BLE001 - the model or its core failed
        return _failed(state, served, start, 500, str(exc).splitlines()[0])
    finally:
        state.in_flight -= 1


def _failed(state: State, served: ServedModel, start: float, status: int,
            message: str) -> web.Response:
    state.metrics.failure(served, start)
    return _error(status, message)


async def _infer_one(request: web.Request, served: ServedModel, state: State) -> web.Response:
    body = await request.read()
    header, binary = _split_body(request, body)
    try:
        req = json.loads(header)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InferRequestError(None, f"the request is not JSON: {exc}") from None
    if not isinstance(req, dict):
        raise InferRequestError(None, "the request is not a JSON object")
    params = req.get("parameters") or {}
    if not isinstance(params, dict):
        raise InferRequestError(None, f"the request's parameters {params!r} are not an object")
    schedule = served.schedule(params)
    inputs = served.decode(req, binary, state.shm)
    result = await served.server.infer_async(*inputs, **schedule)
    outputs = served.outputs(result)
    return _respond(req, served, outputs, params, state)


def _split_body(request: web.Request, body: bytes):
    length = request.headers.get(_HEADER_LEN)
    if length is None:
        return body, memoryview(b"")
    if not length.isascii() or not length.isdigit() or int(length) > len(body):
        raise InferRequestError(None, f"{_HEADER_LEN}: {length!r} is not a byte count within "
                                f"the {len(body)}-byte body")
    n = int(length)
    return body[:n], memoryview(body)[n:]


def _respond(req: dict, served: ServedModel, outputs: List[Output], params: dict,
             state: State) -> web.Response:
    asked = req.get("outputs")
    wanted = {o.name: o for o in outputs}
    if asked:
        chosen = []
        for a in asked:
            name = a.get("name") if isinstance(a, dict) else None
            if name not in wanted:
                raise InferRequestError(name, f"the model has no such output "
                                        f"(outputs: {list(wanted)})")
            chosen.append((wanted[name], a.get("parameters") or {}))
    else:
        chosen = [(o, {}) for o in outputs]
    all_binary = bool(params.get("binary_data_output", False))
    docs, blobs = [], []
    for out, p in chosen:
        doc, blob = _output_doc(out, p, all_binary, state)
        docs.append(doc)
        if blob is not None:
            blobs.append(blob)
    body = {"model_name": served.cfg.name, "model_version": served.cfg.version,
            "outputs": docs}
    if "id" in req:
        body["id"] = req["id"]
    header = json.dumps(body).encode()
    if not blobs:
        return web.Response(body=header, content_type="application/json")
    return web.Response(body=b"".join([header, *blobs]),
                        headers={_HEADER_LEN: str(len(header)),
                                 "Content-Type": "application/octet-stream"})


def _output_doc(out: Output, p: dict, all_binary: bool, state: State):
    t = out.tensor.contiguous()
    doc = {"name": out.name, "datatype": v2_datatype(t), "shape": list(t.shape)}
    raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    if "shared_memory_region" in p:
        size = p.get("shared_memory_byte_size")
        if not isinstance(size, int) or size < len(raw):
            raise InferRequestError(out.name, f"shared_memory_byte_size {size!r} cannot hold "
                                    f"the output's {len(raw)} bytes")
        offset = p.get("shared_memory_offset", 0)
        state.shm.get(p["shared_memory_region"]).view(offset, len(raw))[:] = raw
        doc["parameters"] = {"shared_memory_region": p["shared_memory_region"],
                             "shared_memory_byte_size": len(raw)}
        return doc, None
    if p.get("binary_data", all_binary):
        doc["parameters"] = {"binary_data_size": len(raw)}
        return doc, raw
    doc["data"] = t.flatten().tolist() if t.dtype != torch.bfloat16 else \
        t.float().flatten().tolist()
    return doc, None


# -- system shared memory -------------------------------------------------------------


async def _shm_register(request: web.Request) -> web.Response:
    state: State = request.app["state"]
    name = request.match_info["region"]
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _error(400, "the register request is not JSON")
    if not isinstance(body, dict):
        return _error(400, "the register request is not a JSON object")
    try:
        state.shm.register(name, body.get("key"), body.get("offset", 0), body.get("byte_size"))
    except SharedMemoryError as exc:
        return _error(400, str(exc))
    return web.Response(status=200)


async def _shm_unregister(request: web.Request) -> web.Response:
    request.app["state"].shm.unregister(request.match_info.get("region", ""))
    return web.Response(status=200)


async def _shm_status(request: web.Request) -> web.Response:
    try:
        regions = request.app["state"].shm.status(request.match_info.get("region", ""))
    except SharedMemoryError as exc:
        return _error(404, str(exc))
    return web.json_response(regions)

