"""Served models: a repository entry loaded on its cores behind a BatchingServer, and
the translation between KServe v2 tensors and torch tensors.

    config (checked) ─▶ torch.jit.load inside neuron_cores_context(start, count)
                        [and device_time_context] ─▶ BatchingServer (warmed)
    request JSON/binary/shm ─▶ decode (names, shapes, dtypes checked) ─▶ infer_async
                     output regions ─▶ destination (bounds checked) ─┘ (into=)
    outputs ─▶ encode: JSON data, binary_data, or written into a shm region (unless
               the core's answer was written there already)

load_models loads a repository's models, each on cores of its own.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .. import placement
from ..batching import BatchingServer, QueuePolicy
from ..batching.rowbytes import RowInput
from ..errors import BatchBucketsError
from ..host import devicetime
from ..pool.answer import Destination
from ..session import model as _model
from ..session import pytree
from ..shm import _guard as guarded_copies
from . import document
from .config import (
    DATATYPES,
    ModelConfig,
    QueuePolicyConfig,
    TensorConfig,
    check_preferred,
    load_repository,
)
from .errors import InferRequestError, ModelConfigError, SharedMemoryError
from .shm import Registry

TORCH_DTYPES = {
    "BOOL": torch.bool, "UINT8": torch.uint8, "UINT16": torch.uint16,
    "UINT32": torch.uint32, "UINT64": torch.uint64, "INT8": torch.int8,
    "INT16": torch.int16, "INT32": torch.int32, "INT64": torch.int64,
    "FP16": torch.float16, "FP32": torch.float32, "FP64": torch.float64,
    "BF16": torch.bfloat16,
}
_V2_OF = {v: k for k, v in TORCH_DTYPES.items()}
_CONFIG_TYPE = {v: k for k, v in DATATYPES.items()}


@dataclass
class Output:
    name: str
    tensor: torch.Tensor


class Prepared:
    """A request header already read, checked and decoded once: its document, its
    schedule and where each input lies in the binary data after it.

    HTTP clients send the same header with every request of a model (the tensors
    travel as binary data), so the JSON parse, the field checks and the schedule
    rules of a header seen before are not run again: the inputs are made straight on
    the new body's bytes.  Only headers whose inputs are all binary and that name no
    shared-memory region are prepared (shm regions are checked per request and per
    peer).  ``req`` is shared between requests: nothing may change it.
    """

    __slots__ = ("req", "schedule", "layout", "size", "_rows")

    def __init__(self, req: dict, schedule: Dict[str, Any],
                 layout: List[Tuple[int, int, int, torch.dtype, List[int]]], size: int):
        self.req = req
        self.schedule = schedule
        self.layout = layout        # (position, offset, nbytes, dtype, shape) per input
        self.size = size            # the binary data's length, every input's bytes
        self._rows: Any = None      # its RowInput, False when it has none; made on first use

    def inputs(self, binary: memoryview) -> Optional[List[torch.Tensor]]:
        """The inputs on ``binary``'s bytes, or None when its length is not the
        header's (the full checks then name what is wrong)."""
        if len(binary) != self.size:
            return None
        tensors: List[Any] = [None] * len(self.layout)
        for pos, at, nbytes, dtype, shape in self.layout:
            tensors[pos] = body_tensor(binary[at:at + nbytes], dtype).reshape(shape)
        return tensors

    def row_input(self, server: BatchingServer) -> Optional[RowInput]:
        """The request as one input's bytes, batched without a tensor per request
        (batching.rowbytes.RowInput), for a model of one input with a batch dimension;
        else None (the inputs are then made by :meth:`inputs`)."""
        if self._rows is None:
            self._rows = False
            if len(self.layout) == 1:
                _pos, _at, _n, dtype, shape = self.layout[0]
                try:
                    self._rows = RowInput(server, shape, dtype, self.schedule.get("priority"),
                                          self.schedule.get("timeout"),
                                          "timeout" in self.schedule)
                except (ValueError, TypeError):   # the general path names what is wrong
                    pass
        return self._rows or None


#: headers prepared per model at most (a client sends a few; past this, none is added)
_PREPARED_MAX = 256
#: longer headers are never prepared (their bytes are the cache's key)
_PREPARED_HEADER_MAX = 4096


class ServedModel:
    """One repository model: its config (derived from the trace where absent), its
    cores and its BatchingServer."""

    def __init__(self, cfg: ModelConfig, start_nc: int):
        self.cfg = cfg
        self.prepared: Dict[bytes, Prepared] = {}
        # the JSON header of an all-binary response, by the request's id and the
        # outputs' names, dtypes and shapes (it holds nothing else); at most
        # _PREPARED_MAX of them
        self.replies: Dict[tuple, bytes] = {}
        self.module = _load(cfg, start_nc)
        self.model = _model.model_of(self.module)
        if cfg.batch_buckets is not None:
            try:
                self.model.use_buckets(cfg.batch_buckets, f"{cfg.source}: parameters")
            except BatchBucketsError as exc:
                raise ModelConfigError(cfg.source, "parameters.batch_buckets",
                                       ",".join(map(str, cfg.batch_buckets)),
                                       f"batch sizes this trace can run ({exc.reason})"
                                       ) from exc
        _complete_config(cfg, self.model)
        self.input_order = _input_order(cfg, self.model)
        mbs = cfg.max_batch_size or self.model.batch or 1
        self.server = BatchingServer(
            self.module, max_batch_size=mbs, max_queue_delay_ms=cfg.max_queue_delay_us / 1000,
            max_queue_size=cfg.max_queue_size,
            timeout=cfg.default_timeout_us / 1e6 if cfg.default_timeout_us else None,
            warmup=True, preferred_batch_size=cfg.preferred_batch_size,
            priority_levels=cfg.priority_levels,
            default_priority_level=cfg.default_priority_level,
            wait_when_idle=True,   # Triton's max_queue_delay_microseconds
            priority_queue_policy={level: QueuePolicy(
                p.max_queue_size, p.default_timeout_us / 1e6 if p.default_timeout_us else None)
                for level, p in cfg.priority_queue_policy.items()})
        if not cfg.outputs:
            cfg.outputs = self._probe_outputs()

    def _probe_outputs(self) -> List[TensorConfig]:
        """Output names, datatypes and dims from one call on zeros (no config given)."""
        zeros = [torch.zeros(shape, dtype=dtype) for shape, dtype in self.model.signature.inputs]
        result = self.module(*zeros)
        flat = [result] if isinstance(result, torch.Tensor) else \
            pytree.flatten(result, self.model.spec)
        strip = 1 if self.cfg.max_batch_size else 0
        return [TensorConfig(f"OUTPUT__{i}", v2_datatype(t), tuple(t.shape[strip:]))
                for i, t in enumerate(flat)]

    @property
    def cores(self) -> Tuple[int, ...]:
        return self.model.cores

    # -- protocol documents ---------------------------------------------------------

    def metadata(self) -> dict:
        batch = [-1] if self.cfg.max_batch_size else []
        return {
            "name": self.cfg.name, "versions": [self.cfg.version],
            "platform": "pytorch_libtorch",
            "inputs": [{"name": t.name, "datatype": t.datatype, "shape": batch + list(t.dims)}
                       for t in self.cfg.inputs],
            "outputs": [{"name": t.name, "datatype": t.datatype,
                         "shape": batch + list(t.dims)} for t in self.cfg.outputs],
        }

    def config(self) -> dict:
        c = self.cfg
        out = {
            "name": c.name, "platform": "pytorch_libtorch", "backend": "neuronmp",
            "max_batch_size": c.max_batch_size,
            "input": [_tensor_doc(t) for t in c.inputs],
            "output": [_tensor_doc(t) for t in c.outputs],
            "dynamic_batching": {
                "max_queue_delay_microseconds": c.max_queue_delay_us,
                "preferred_batch_size": list(c.preferred_batch_size),
                "priority_levels": c.priority_levels,
                "default_priority_level": c.default_priority_level,
                "default_queue_policy": _policy_doc(QueuePolicyConfig(
                    c.max_queue_size, c.default_timeout_us, c.allow_timeout_override)),
                "priority_queue_policy": {str(level): _policy_doc(p) for level, p
                                          in sorted(c.priority_queue_policy.items())},
            },
            "instance_group": [{"count": c.count, "kind": "KIND_MODEL",
                                "neuron_cores": list(self.cores)}],
        }
        params = {}
        if c.device_time:
            params["device_time_us"] = {"string_value": c.device_time}
        if self.model.buckets:
            params["batch_buckets"] = {"string_value": ",".join(map(str, self.model.buckets))}
        if params:
            out["parameters"] = params
        return out

    # -- requests -------------------------------------------------------------------

    def schedule(self, params: dict) -> Dict[str, Any]:
        """The request parameters of Triton's schedule policy extension (``priority``,
        ``timeout`` in microseconds) as keyword arguments of ``infer_async``.

        As Triton: priority 0, or one past ``priority_levels``, means the default level;
        a timeout is refused when the level's policy does not allow overriding it.
        """
        out: Dict[str, Any] = {}
        level = self.cfg.default_priority_level
        if "priority" in params:
            p = params["priority"]
            if isinstance(p, bool) or not isinstance(p, int) or p < 0:
                raise InferRequestError(None, f"parameter priority {p!r} is not a whole "
                                        "number >= 0 (1 is the highest level, 0 the default)")
            if 1 <= p <= self.cfg.priority_levels:
                level = out["priority"] = p
        if "timeout" in params:
            us = params["timeout"]
            if isinstance(us, bool) or not isinstance(us, int) or us < 0:
                raise InferRequestError(None, f"parameter timeout {us!r} is not microseconds "
                                        ">= 0")
            policy = self.cfg.priority_queue_policy.get(level)
            allowed = policy.allow_timeout_override if policy else \
                self.cfg.allow_timeout_override
            if not allowed:
                raise InferRequestError(None, "this model's queue policy does not allow a "
                                        "per-request timeout (allow_timeout_override: false)")
            out["timeout"] = us / 1e6 if us else None
        return out

    def decode(self, req: dict, binary: memoryview, shm: Registry) -> List[torch.Tensor]:
        """The request's inputs, in the model's order; InferRequestError naming the
        tensor when one is missing, unknown or does not match the config."""
        given = req.get("inputs")
        if not isinstance(given, list) or not given:
            raise InferRequestError(None, "the request has no 'inputs' list")
        by_name: Dict[str, dict] = {}
        for t in given:
            if not isinstance(t, dict) or not isinstance(t.get("name"), str):
                raise InferRequestError(None, f"an input is not an object with a name: {t!r}")
            if t["name"] in by_name:
                raise InferRequestError(t["name"], "given twice")
            by_name[t["name"]] = t
        unknown = set(by_name) - {t.name for t in self.cfg.inputs}
        if unknown:
            raise InferRequestError(sorted(unknown)[0], "the model has no such input "
                                    f"(inputs: {[t.name for t in self.cfg.inputs]})")
        blobs = _split_binary(given, binary)
        tensors: List[Optional[torch.Tensor]] = [None] * len(self.cfg.inputs)
        for spec, pos in zip(self.cfg.inputs, self.input_order):
            if spec.name not in by_name:
                raise InferRequestError(spec.name, "missing from the request")
            tensors[pos] = self._one_input(spec, by_name[spec.name], blobs.get(spec.name),
                                           shm)
        return tensors  # type: ignore[return-value]

    def prepare(self, header: bytes, req: dict, schedule: Dict[str, Any],
                binary: memoryview) -> None:
        """Remember a header whose request was checked and decoded (see Prepared)."""
        if len(header) > _PREPARED_HEADER_MAX or len(self.prepared) >= _PREPARED_MAX:
            return
        if any("shared_memory_region" in (o.get("parameters") or {})
               for o in req.get("outputs") or ()):
            return
        by_name = {t["name"]: t for t in req["inputs"]}
        offsets, at = {}, 0
        for t in req["inputs"]:     # the binary data's order is the request's
            params = t.get("parameters") or {}
            if "shared_memory_region" in params or "binary_data_size" not in params:
                return
            offsets[t["name"]] = at
            at += params["binary_data_size"]
        layout = [(pos, offsets[spec.name], by_name[spec.name]["parameters"]["binary_data_size"],
                   TORCH_DTYPES[spec.datatype], list(by_name[spec.name]["shape"]))
                  for spec, pos in zip(self.cfg.inputs, self.input_order)]
        self.prepared[header] = Prepared(req, schedule, layout, len(binary))

    def _one_input(self, spec: TensorConfig, t: dict, blob: Optional[memoryview],
                   shm: Registry) -> torch.Tensor:
        name = spec.name
        dtype_name = t.get("datatype")
        if dtype_name != spec.datatype:
            raise InferRequestError(name, f"datatype {dtype_name!r}, but the model takes "
                                    f"{spec.datatype}")
        shape = t.get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise InferRequestError(name, f"shape {shape!r} is not a list of sizes >= 0")
        self._check_shape(spec, shape)
        dtype = TORCH_DTYPES[spec.datatype]
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        params = t.get("parameters") or {}
        if "shared_memory_region" in params:
            raw = _shm_bytes(name, params, nbytes, shm)   # a copy: see server/shm.py
            return (torch.frombuffer(raw, dtype=dtype) if nbytes else
                    torch.empty(0, dtype=dtype)).reshape(shape)
        if blob is not None:
            if len(blob) != nbytes:
                raise InferRequestError(name, f"binary_data_size {len(blob)} for shape "
                                        f"{shape} of {spec.datatype} ({nbytes} bytes)")
            return body_tensor(blob, dtype).reshape(shape)
        if "data" not in t:
            raise InferRequestError(name, "no data: give 'data', binary_data_size or "
                                    "shared_memory_region")
        return _from_json(name, t["data"], dtype, shape, numel)

    def destination(self, req: dict, inputs: Sequence[torch.Tensor],
                    shm: Registry) -> Optional[Destination]:
        """Views of the regions the request names for its outputs, shaped as the
        model's whole outputs for these rows, for the core's answer to be copied
        into through the SIGBUS guard (see ``BatchingServer.submit``'s ``into`` and
        server/shm.py); None unless every output of the model goes to a region that
        holds it (then the response copies them in, and refuses a region too small)."""
        asked = req.get("outputs")
        if not isinstance(asked, list) or len(asked) != len(self.cfg.outputs):
            return None
        params = {a.get("name"): a.get("parameters") for a in asked if isinstance(a, dict)}
        lead = [inputs[0].shape[0]] if self.cfg.max_batch_size and inputs[0].dim() else []
        views = []
        for spec in self.cfg.outputs:
            view = _output_view(params.get(spec.name), spec, lead, shm)
            if view is None:
                return None
            views.append(view)
        return Destination(views, copy=guarded_copies.copy)

    def _check_shape(self, spec: TensorConfig, shape: List[int]) -> None:
        mbs = self.cfg.max_batch_size
        dims = list(shape[1:]) if mbs else list(shape)
        want = list(spec.dims)
        if len(dims) != len(want) or any(w not in (-1, d) for w, d in zip(want, dims)):
            expected = ([f"1..{mbs}"] if mbs else []) + want
            raise InferRequestError(spec.name, f"shape {shape} does not match the model's "
                                    f"[{', '.join(map(str, expected))}]")
        if mbs and not 1 <= shape[0] <= mbs:
            raise InferRequestError(spec.name, f"batch of {shape[0]} rows in shape {shape}; "
                                    f"max_batch_size is {mbs}")

    def outputs(self, result: Any) -> List[Output]:
        flat = [result] if isinstance(result, torch.Tensor) else \
            pytree.flatten(result, self.model.spec)
        return [Output(t.name, flat[i]) for i, t in enumerate(self.cfg.outputs)]

    def close(self) -> None:
        self.server.close()


def load_models(root: str, configs: Optional[List[ModelConfig]] = None
                ) -> Dict[str, ServedModel]:
    """The models of the repository ``root`` (``configs``: its configs, already
    read), loaded on cores of their own (ModelConfigError when they need more cores
    than this process sees)."""
    import neuronmp

    if configs is None:
        configs = load_repository(root)
    visible = neuronmp.core_count()
    need = sum(c.count for c in configs)
    if need > visible:
        raise ModelConfigError(root, "instance_group.count (summed over models)", need,
                               f"at most the {visible} NeuronCore(s) this process sees "
                               "(each model gets cores of its own)")
    models, start = {}, 0
    try:
        for cfg in configs:
            models[cfg.name] = ServedModel(cfg, start)
            start += cfg.count
    except BaseException:
        for m in models.values():
            m.close()
        raise
    return models


def _load(cfg: ModelConfig, start_nc: int):
    latency = contextlib.nullcontext()
    if cfg.device_time is not None:
        latency = devicetime.device_time_context(
            devicetime.parse(cfg.device_time, f"{cfg.source}: parameters.device_time_us"))
    try:
        with latency, placement.neuron_cores_context(start_nc, cfg.count):
            module = torch.jit.load(cfg.path, map_location="cpu")
    except (RuntimeError, ValueError) as exc:
        raise ModelConfigError(cfg.path, "model file", str(exc).splitlines()[0],
                               "a neuronmp.trace saved with torch.jit.save, placed on "
                               "instance_group.count free cores") from exc
    if not _model.is_traced(module):
        raise ModelConfigError(cfg.path, "model file", type(module).__name__,
                               "a neuronmp.trace saved with torch.jit.save")
    return module


def _complete_config(cfg: ModelConfig, model: _model.Model) -> None:
    """Fill what the config leaves out from the trace; refuse what contradicts it."""
    traced = model.signature.inputs
    batch = model.batch
    if cfg.max_batch_size is None:
        cfg.max_batch_size = (model.buckets[-1] if model.buckets else batch) or 0
    strip = 1 if cfg.max_batch_size else 0
    if not cfg.inputs:
        cfg.inputs = [TensorConfig(f"INPUT__{i}", _V2_OF[dtype], tuple(shape[strip:]))
                      for i, (shape, dtype) in enumerate(traced)]
    if len(cfg.inputs) != len(traced):
        raise ModelConfigError(cfg.source, "input", [t.name for t in cfg.inputs],
                               f"{len(traced)} inputs, as traced")
    for (shape, dtype), t in zip(traced, _ordered(cfg, model)):
        want = _V2_OF[dtype]
        if t.datatype != want:
            raise ModelConfigError(cfg.source, f"input {t.name}.data_type",
                                   _CONFIG_TYPE[t.datatype], _CONFIG_TYPE[want] + " (as traced)")
        dims = list(shape[strip:])
        if len(t.dims) != len(dims) or any(a not in (-1, b) for a, b in zip(t.dims, dims)):
            raise ModelConfigError(cfg.source, f"input {t.name}.dims", list(t.dims),
                                   f"{dims} (the traced shape {list(shape)}"
                                   f"{' without its batch dimension' if strip else ''})")
    check_preferred(cfg)   # against the derived max_batch_size
    n_out = pytree.leaves(model.spec)
    if cfg.outputs and len(cfg.outputs) != n_out:
        raise ModelConfigError(cfg.source, "output", [t.name for t in cfg.outputs],
                               f"{n_out} outputs, as traced")


def _ordered(cfg: ModelConfig, model: _model.Model) -> List[TensorConfig]:
    order = _input_order(cfg, model)
    out: List[Optional[TensorConfig]] = [None] * len(order)
    for t, pos in zip(cfg.inputs, order):
        out[pos] = t
    return out  # type: ignore[return-value]


def _input_order(cfg: ModelConfig, model: _model.Model) -> List[int]:
    """The model argument each config input feeds: INPUT__k is argument k, a forward
    argument's name is that argument, else the config's order (Triton's PyTorch rules)."""
    names = list(model.meta.get("names") or [])
    order = []
    for i, t in enumerate(cfg.inputs):
        if t.name.startswith("INPUT__") and t.name[7:].isdigit():
            order.append(int(t.name[7:]))
        elif t.name in names:
            order.append(names.index(t.name))
        else:
            order.append(i)
    if sorted(order) != list(range(len(cfg.inputs))):
        raise ModelConfigError(cfg.source, "input names", [t.name for t in cfg.inputs],
                               "INPUT__0.. by position, or the forward's argument names "
                               f"{names}, each once")
    return order


def _policy_doc(p: QueuePolicyConfig) -> dict:
    return {"max_queue_size": p.max_queue_size or 0,
            "default_timeout_microseconds": p.default_timeout_us,
            "allow_timeout_override": p.allow_timeout_override, "timeout_action": "REJECT"}


def _tensor_doc(t: TensorConfig) -> dict:
    return {"name": t.name, "data_type": _CONFIG_TYPE[t.datatype], "dims": list(t.dims)}


def _split_binary(given: List[dict], binary: memoryview) -> Dict[str, memoryview]:
    """Each input's binary tensor data: the bytes after the header are the inputs'
    ``binary_data_size`` bytes one after another, in the request's input order."""
    blobs, start = {}, 0
    for t in given:
        size = (t.get("parameters") or {}).get("binary_data_size")
        if size is None:
            continue
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InferRequestError(t["name"], f"binary_data_size {size!r} is not a byte "
                                    "count")
        if start + size > len(binary):
            raise InferRequestError(t["name"], f"binary_data_size {size} is past the end "
                                    "of the binary data sent")
        blobs[t["name"]] = binary[start:start + size]
        start += size
    if start != len(binary):
        raise InferRequestError(None, f"{len(binary) - start} bytes of binary data are not "
                                "claimed by any input's binary_data_size")
    return blobs


def _shm_bytes(name: str, params: dict, nbytes: int, shm: Registry) -> memoryview:
    size = params.get("shared_memory_byte_size")
    offset = params.get("shared_memory_offset", 0)
    if size != nbytes:
        raise InferRequestError(name, f"shared_memory_byte_size {size!r}; the tensor has "
                                f"{nbytes} bytes")
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise InferRequestError(name, f"shared_memory_offset {offset!r} is not a whole number")
    try:
        return shm.get(params["shared_memory_region"]).read(offset, nbytes)
    except SharedMemoryError as exc:
        raise InferRequestError(name, str(exc)) from None


def _output_view(params: Any, spec: TensorConfig, lead: List[int],
                 shm: Registry) -> Optional[torch.Tensor]:
    """Output ``spec``'s place in the region ``params`` names, bounds and size checked;
    None if there is none, or it cannot hold the output (the response then says why)."""
    dtype = TORCH_DTYPES.get(spec.datatype)
    if not isinstance(params, dict) or "shared_memory_region" not in params or \
            dtype is None or any(d < 0 for d in spec.dims):
        return None
    shape = lead + list(spec.dims)
    nbytes = math.prod(shape) * dtype.itemsize
    size = params.get("shared_memory_byte_size")
    offset = params.get("shared_memory_offset", 0)
    if not nbytes or isinstance(size, bool) or not isinstance(size, int) or size < nbytes \
            or isinstance(offset, bool) or not isinstance(offset, int):
        return None
    try:
        view = shm.get(params["shared_memory_region"]).view(offset, nbytes)
    except (SharedMemoryError, TypeError):
        return None
    return torch.frombuffer(view, dtype=dtype).reshape(shape)


def _from_json(name: str, data: Any, dtype: torch.dtype, shape: Sequence[int],
               numel: int) -> torch.Tensor:
    return document.tensor_from_json(name, data, dtype, shape, numel)


def body_tensor(blob: memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A tensor on the request body's own bytes (no copy).

    The body is read-only and torch has no read-only tensors, so the rule is kept by
    the server instead: nothing writes into an input (a batch is stacked, padded or
    copied into the core's ring, never changed in place)."""
    if not len(blob):
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(blob, dtype=dtype)


def _spend_torch_warning() -> None:
    """torch warns once per process that a tensor on a read-only buffer could write
    into it; body_tensor's callers never do (see above), so the one warning is spent
    here, at import, rather than on a user's first request."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.frombuffer(b"\0", dtype=torch.uint8)


_spend_torch_warning()


def v2_datatype(t: torch.Tensor) -> str:
    return _V2_OF.get(t.dtype, str(t.dtype))
