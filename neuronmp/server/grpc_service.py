"""The gRPC front end: KServe v2's ``inference.GRPCInferenceService`` (Triton's gRPC
protocol) on grpc.aio, in the event loop the HTTP front end runs in.

    ServerLive | ServerReady | ServerMetadata | ModelReady | ModelMetadata | ModelConfig
    ModelInfer, ModelStreamInfer ─▶ the request in the KServe v2 JSON form
                                 ─▶ infer.serve_infer
    SystemSharedMemoryStatus | Register | Unregister  (the HTTP front end's registry)

It only translates messages: ``raw_input_contents`` become binary tensor data, typed
``contents`` become JSON data, and every check, the priority and timeout parameters
and each error's status are decided by server/infer.py as for HTTP.  Statuses map to
gRPC codes: 400 INVALID_ARGUMENT, 403 PERMISSION_DENIED (the shared-memory
extension from a peer not on this host), 404 NOT_FOUND, 503 UNAVAILABLE, 504
DEADLINE_EXCEEDED, 500 INTERNAL.  ModelStreamInfer runs a stream's requests as
ModelInfer does, concurrently.  The messages are the ones tritonclient ships
(``tritonclient[grpc]``); the other methods (statistics, repository, CUDA shared
memory, trace, log) answer UNIMPLEMENTED.
"""
from __future__ import annotations

import asyncio
from typing import Any, Dict, Tuple

import grpc
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

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

CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 403: grpc.StatusCode.PERMISSION_DENIED,
         404: grpc.StatusCode.NOT_FOUND,
         503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED,
         500: grpc.StatusCode.INTERNAL}
_MAX_MESSAGE = 1 << 30   # as the HTTP front end's client_max_size

# the typed contents field of each datatype (FP16 and BF16 travel as raw bytes only)
_CONTENTS = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
    "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
    "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}


async def start(state: State, host: str, port: int) -> grpc.aio.Server:
    """Listen on ``host:port`` (OSError when that fails) and serve ``state``'s models."""
    # grpc sets SO_REUSEPORT by default: a second server on the same port then binds
    # too and the kernel splits the clients' connections between the two, silently
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", _MAX_MESSAGE),
                                      ("grpc.max_send_message_length", _MAX_MESSAGE),
                                      ("grpc.so_reuseport", 0)])
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Service(state), server)
    address = f"{'[::]' if host in ('0.0.0.0', '::') else host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"gRPC cannot listen on {address}: {exc}") from None
    if not bound:
        raise OSError(f"gRPC cannot listen on {address}")
    await server.start()
    return server


class Service(service_pb2_grpc.GRPCInferenceServiceServicer):
    """GRPCInferenceService over the models the HTTP front end serves."""

    def __init__(self, state: State):
        self.state = state

    async def _model(self, name: str, version: str, context) -> ServedModel:
        served = self.state.models.get(name)
        if served is None or (version and version != served.cfg.version):
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"model '{name}'{' version ' + version if version else ''} "
                                f"is not served; models: {sorted(self.state.models)}")
        return served

    # -- health and metadata --------------------------------------------------------

    async def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=self.state.serving)

    async def ModelReady(self, request, context):
        served = self.state.models.get(request.name)   # not served: not ready (as Triton)
        known = served is not None and request.version in ("", served.cfg.version)
        return service_pb2.ModelReadyResponse(ready=known and self.state.serving)

    async def ServerMetadata(self, request, context):
        return service_pb2.ServerMetadataResponse(name="neuronmp", version=__version__,
                                                  extensions=EXTENSIONS)

    async def ModelMetadata(self, request, context):
        served = await self._model(request.name, request.version, context)
        return json_format.ParseDict(served.metadata(), service_pb2.ModelMetadataResponse())

    async def ModelConfig(self, request, context):
        served = await self._model(request.name, request.version, context)
        # fields Triton's message does not have (the cores placed) are left out
        config = json_format.ParseDict(served.config(), model_config_pb2.ModelConfig(),
                                       ignore_unknown_fields=True)
        return service_pb2.ModelConfigResponse(config=config)

    # -- inference --------------------------------------------------------------------

    async def ModelInfer(self, request, context):
        served = await self._model(request.model_name, request.model_version, context)

        async def parse() -> Tuple[dict, memoryview, None]:
            return (*_as_v2(request, context.peer()), None)

        try:
            return await serve_infer(self.state, served, parse, _respond)
        except Failed as failed:
            await context.abort(CODES.get(failed.status, grpc.StatusCode.INTERNAL),
                                failed.message)

    async def ModelStreamInfer(self, request_iterator, context):
        """Each request of the stream runs as ModelInfer does, concurrently with the
        others; its response (or error_message: a failed request does not end the
        stream) is sent when it is done, so responses may come out of order (clients
        match them by request id)."""
        done: asyncio.Queue = asyncio.Queue()

        async def one(request) -> None:
            try:
                served = self.state.models.get(request.model_name)
                version = request.model_version
                if served is None or (version and version != served.cfg.version):
                    raise Failed(404, f"model '{request.model_name}' is not served; "
                                 f"models: {sorted(self.state.models)}")

                async def parse() -> Tuple[dict, memoryview, None]:
                    return (*_as_v2(request, context.peer()), None)

                response = await serve_infer(self.state, served, parse, _respond)
                await done.put(service_pb2.ModelStreamInferResponse(infer_response=response))
            except Failed as failed:
                await done.put(service_pb2.ModelStreamInferResponse(
                    error_message=failed.message, infer_response=service_pb2.ModelInferResponse(
                        model_name=request.model_name, id=request.id)))

        async def read() -> None:
            running = set()
            async for request in request_iterator:
                task = asyncio.ensure_future(one(request))
                running.add(task)
                task.add_done_callback(running.discard)
            while running:
                await asyncio.wait(set(running))
            await done.put(None)   # the client closed its side and every answer is out

        reader = asyncio.ensure_future(read())
        try:
            while True:
                item = await done.get()
                if item is None:
                    return
                yield item
        finally:
            reader.cancel()

    # -- system shared memory ---------------------------------------------------------

    async def _local(self, name: str, context) -> None:
        try:
            check_peer(name, context.peer())
        except SharedMemoryError as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))

    async def SystemSharedMemoryStatus(self, request, context):
        await self._local(request.name, context)
        try:
            regions = self.state.shm.status(request.name)
        except SharedMemoryError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        response = service_pb2.SystemSharedMemoryStatusResponse()
        for r in regions:
            response.regions[r["name"]].CopyFrom(
                service_pb2.SystemSharedMemoryStatusResponse.RegionStatus(**r))
        return response

    async def SystemSharedMemoryRegister(self, request, context):
        await self._local(request.name, context)
        try:
            self.state.shm.register(request.name, request.key, request.offset,
                                    request.byte_size)
        except SharedMemoryError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return service_pb2.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request, context):
        await self._local(request.name, context)
        self.state.shm.unregister(request.name)
        return service_pb2.SystemSharedMemoryUnregisterResponse()


def _params(message_map) -> Dict[str, Any]:
    return {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in message_map.items()
            if v.WhichOneof("parameter_choice")}


def _as_v2(request, peer: str) -> Tuple[dict, memoryview]:
    """The request in the KServe v2 JSON form and its binary tensor data: inputs take
    ``raw_input_contents`` in order (those in shared memory take none), else their
    typed ``contents`` (non-finite floats by their JSON-form names).  A region named
    by a peer not on this host is refused."""
    raw = request.raw_input_contents
    inputs, blobs = [], []
    for t in request.inputs:
        params = _params(t.parameters)
        doc: Dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape),
                               "parameters": params}
        if "shared_memory_region" not in params:
            if len(blobs) < len(raw):
                blobs.append(raw[len(blobs)])
                params["binary_data_size"] = len(blobs[-1])
            else:
                field = _CONTENTS.get(t.datatype)
                doc["data"] = list(getattr(t.contents, field)) if field else []
                if field in ("fp32_contents", "fp64_contents"):
                    doc["data"] = document.named(doc["data"])
        inputs.append(doc)
    if len(blobs) != len(raw):
        raise InferRequestError(None, f"{len(raw)} raw_input_contents for the {len(blobs)} "
                                "inputs not in shared memory")
    req: Dict[str, Any] = {"inputs": inputs, "parameters": _params(request.parameters)}
    if request.id:
        req["id"] = request.id
    if request.outputs:
        req["outputs"] = [{"name": o.name, "parameters": _params(o.parameters)}
                          for o in request.outputs]
    document.shm_peer(req, peer)
    return req, memoryview(b"".join(blobs))


def _respond(state: State, req: dict, served: ServedModel, chosen: Chosen):
    response = service_pb2.ModelInferResponse(
        model_name=served.cfg.name, model_version=served.cfg.version, id=req.get("id", ""))
    for out, p in chosen:
        doc, t = output_doc(out)
        o = response.outputs.add(name=doc["name"], datatype=doc["datatype"],
                                 shape=doc["shape"])
        if "shared_memory_region" in p:
            for key, value in write_shm_output(state, out.name, p, t).items():
                _set(o.parameters[key], value)
            raw = b""   # an entry all the same: clients index raw contents by output
        else:
            raw = bytes(tensor_view(t))   # a protobuf bytes field owns its copy
        response.raw_output_contents.append(raw)
    return response


def _set(param, value: Any) -> None:
    if isinstance(value, bool):
        param.bool_param = value
    elif isinstance(value, int):
        param.int64_param = value
    elif isinstance(value, float):
        param.double_param = value
    else:
        param.string_param = str(value)
