"""One inference request, whatever protocol carried it (HTTP/REST or gRPC).

    protocol handler: its request as the KServe v2 JSON form + the binary tensor bytes
        ─▶ serve_infer: readiness, in-flight count, metrics, error -> status
             ─▶ document.check (every field's type, named)
             ─▶ ServedModel.schedule (priority, timeout) and decode (names, shapes,
                dtypes, binary and shm bytes checked; every output in a shm region:
                their views, checked, as a Destination)
             ─▶ BatchingServer.infer_async (the one request path), into the regions
                when the request runs alone; the Destination closed when it ends
             ─▶ chosen outputs (named, with their parameters) ─▶ respond (the protocol's;
                an output already in its region is not copied again)

Output regions: when every output of the model goes to a region, an idle server's
request has its answer copied from the core's response ring straight into them;
otherwise (batched with others, padded, an output bigger than its region) the
response copies each output in.  Every copy into a region goes through the SIGBUS
guard (server/shm.py): a region its client shrinks meanwhile fails the request
(400), it never kills the server.  After a failed request a region holds either
what it held before or that request's complete output (the core answered, then
the request failed: a timeout that fired meanwhile, an output of the wrong shape),
never part of one unless its client shrank it under the copy, and nothing is
written into it once the error response is made.

A protocol only translates its messages to and from this form; every check, the
priority and timeout rules and the status of each error are decided here once.
Statuses are HTTP's; the gRPC front end maps them to gRPC codes.
"""
from __future__ import annotations

import time
from typing import Any, Awaitable, Callable, Dict, List, Optional, Tuple, TypeVar

import torch

from ..errors import QueueFullError, RequestTimeoutError, ServerClosedError
from . import document
from .errors import InferRequestError, SharedMemoryError
from .metrics import Metrics
from .models import Output, ServedModel, v2_datatype
from .shm import Registry

EXTENSIONS = ["binary_tensor_data", "system_shared_memory", "model_configuration",
              "schedule_policy"]
T = TypeVar("T")
Chosen = List[Tuple[Output, dict]]   # an output and its request parameters


class State:
    """What the front ends share: the models, the shm regions, readiness, in-flight count."""

    def __init__(self, models: Dict[str, ServedModel], metrics: Metrics):
        self.models = models
        self.metrics = metrics
        self.shm = Registry()
        self.ready = False
        self.draining = False
        self.in_flight = 0

    @property
    def serving(self) -> bool:
        return self.ready and not self.draining


class Failed(Exception):
    """An inference request that failed: the HTTP status and the protocol's message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


# the status of each error a request may end with (first match; see docs/guides/serving.md)
_STATUS = (
    (InferRequestError, 400), (SharedMemoryError, 400), (QueueFullError, 503),
    (ServerClosedError, 503), (RequestTimeoutError, 504),
    ((ValueError, TypeError), 400),   # the one input check's words, naming the input
)


async def serve_infer(state: State, served: ServedModel,
                      parse: Callable[[], Awaitable[Tuple[dict, memoryview,
                                                          Optional[bytes]]]],
                      respond: Callable[[State, dict, ServedModel, Chosen], T]) -> T:
    """Run one request; its response from ``respond``, or :class:`Failed`.

    ``parse`` gives the request in the KServe v2 JSON form (``inputs``, ``outputs``,
    ``parameters``, ``id``), the binary bytes its inputs' ``binary_data_size``
    parameters claim, in input order, and the bytes of the header it was read from
    (None when there were none): a header seen before runs as prepared (see
    models.Prepared), and ``req`` may then be the one read from it the first time.
    """
    if not state.serving:
        raise Failed(503, "the server is not ready (starting or shutting down)")
    start = time.perf_counter()
    state.in_flight += 1
    try:
        req, binary, header = await parse()
        chosen = await _run(state, served, req, binary, header)
        response = respond(state, req, served, chosen)
    except Exception as exc:  # noqa: BLE001 - each error becomes its status
        raise failure(state, served, start, exc) from None
    finally:
        state.in_flight -= 1
    state.metrics.success(served, start)
    return response


def failure(state: State, served: ServedModel, start: float, exc: BaseException) -> Failed:
    """A request's error as its status and message, counted as the model's failure."""
    state.metrics.failure(served, start)
    status = next((s for kind, s in _STATUS if isinstance(exc, kind)), 500)
    message = str(exc) if status != 500 else str(exc).splitlines()[0]
    return Failed(status, message)


async def _run(state: State, served: ServedModel, req: dict, binary: memoryview,
               header: Optional[bytes]) -> Chosen:
    prepared = served.prepared.get(header) if header is not None else None
    inputs = prepared.inputs(binary) if prepared is not None else None
    into = None
    if inputs is not None:   # a header seen before: neither parsed nor checked again
        schedule = prepared.schedule
    else:
        document.check(req)
        schedule = served.schedule(req.get("parameters") or {})
        inputs = served.decode(req, binary, state.shm)
        into = served.destination(req, inputs, state.shm)
        if header is not None and into is None:
            served.prepare(header, req, schedule, binary)
    try:
        result = await served.server.infer_async(*inputs, into=into, **schedule)
    finally:
        if into is not None:  # failed or not, a late answer must not reach the regions
            into.close()
    return choose(req, served.outputs(result))


def choose(req: dict, outputs: List[Output]) -> Chosen:
    """The outputs the request names (all when it names none), with their parameters."""
    asked = req.get("outputs")
    if not asked:
        return [(o, {}) for o in outputs]
    wanted = {o.name: o for o in outputs}
    chosen = []
    for a in asked:
        name = a.get("name") if isinstance(a, dict) else None
        if name not in wanted:
            raise InferRequestError(name, f"the model has no such output "
                                    f"(outputs: {list(wanted)})")
        chosen.append((wanted[name], a.get("parameters") or {}))
    return chosen


def output_doc(out: Output) -> Tuple[dict, torch.Tensor]:
    """The output's protocol document (name, datatype, shape) and its contiguous tensor."""
    t = out.tensor.contiguous()
    return {"name": out.name, "datatype": v2_datatype(t), "shape": list(t.shape)}, t


def tensor_view(t: torch.Tensor) -> memoryview:
    """A contiguous tensor's memory as bytes, without a copy (the view keeps the
    tensor alive while the response is written from it)."""
    try:
        return memoryview(t.numpy().reshape(-1)).cast("B")
    except TypeError:   # a dtype numpy has not (bfloat16): its bytes as uint8
        return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else \
            memoryview(b"")


def write_shm_output(state: State, name: str, params: dict, t: torch.Tensor) -> Dict[str, Any]:
    """Copy a contiguous output into the region its parameters name (bounds and the
    file's size checked); the parameters of its response document.  One guarded
    copy, tensor to region (no bytes object in between, and not torch's copy_,
    which splits a large copy over intra-op threads that wait for CPUs on a loaded
    host).  An output the core's answer was written into (``ServedModel.destination``)
    is there already."""
    nbytes = t.numel() * t.element_size()
    size = params.get("shared_memory_byte_size")
    if isinstance(size, bool) or not isinstance(size, int) or size < nbytes:
        raise InferRequestError(name, f"shared_memory_byte_size {size!r} cannot hold "
                                f"the output's {nbytes} bytes")
    offset = params.get("shared_memory_offset", 0)
    region = state.shm.get(params["shared_memory_region"])
    if not nbytes or t.data_ptr() != region.address(offset):
        region.write(offset, t.reshape(-1).view(torch.uint8).numpy() if nbytes else b"")
    return {"shared_memory_region": params["shared_memory_region"],
            "shared_memory_byte_size": nbytes}
