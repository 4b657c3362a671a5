"""``neuronmp.DataParallel``: one traced model, replicated on several cores, fed by slices.

    DataParallel(traced)(batch)
        │ split along `dim` into one chunk per core (remainder spread over the first
        │ chunks; a batch smaller than the core count uses one row per core)
        ├─ chunk 0 ──▶ replica on nc:0 ── model.submit ─┐   all chunks are in flight
        ├─ chunk 1 ──▶ replica on nc:1 ── model.submit ─┤   at once: one message per
        │   ...                                         │   core, no Python threads
        ▼                                               ▼
    outputs of each chunk, concatenated along `dim` in order (pytree structure kept)

A model that *is* a traced module (the usual case) takes that direct path.  A module
that only *contains* traced submodules is deep-copied once per core (its traced
submodules re-registered on that core) and the copies run on ``num_workers`` threads,
with torch.nn.DataParallel's scatter/gather rules for tuples, lists, dicts and
non-tensor arguments.

Dynamic batching (on by default for dim 0) lets a chunk have any number of rows
(the model's one request path pads it to whole traced batches, and the worker runs
them in one call when the traced graph takes any batch); without it every chunk
must have exactly the traced size along ``dim``.  The split follows session/chunking.py.
"""
from __future__ import annotations

import concurrent.futures
import copy
import logging
import threading
import warnings
import weakref
from typing import Any, List, Optional, Sequence

import torch

from . import placement as _placement
from .host import visibility as _visibility
from .session import chunking, pytree
from .session import model as _model
from .session import sdkargs as _sdkargs
from .session import session as _session
from .tracing import dynamic_batch as _dynamic_batch

_log = logging.getLogger(__name__)


class DataParallel(torch.nn.Module):
    """Data parallelism for a model traced with :func:`neuronmp.trace`.

    ``device_ids`` are this process's zero-based cores (ints or ``'nc:#'``), all of
    them by default.  Dynamic batching is enabled for ``dim=0`` unless
    ``set_dynamic_batching=False`` or :meth:`disable_dynamic_batching`; without it,
    ``input.shape[dim] / len(device_ids)`` must equal the traced size.

        model_parallel = neuronmp.DataParallel(neuronmp.trace(model, torch.rand(1, 3, 8, 8)))
        output = model_parallel(torch.rand(5, 3, 8, 8))       # rows 3+2 on nc:0, nc:1

    Attributes: ``num_workers`` (threads for modules that merely contain traced
    submodules; default twice the core count) and ``split_size`` (rows per chunk;
    None = ``max(1, input.shape[dim] // len(device_ids))`` with the remainder spread).
    """

    def __init__(self, model: torch.nn.Module, device_ids: Optional[Sequence[Any]] = None,
                 dim: int = 0, set_dynamic_batching: bool = True):
        super().__init__()
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise TypeError(f"DataParallel: dim must be an int, got {dim!r}")
        wrappers = _model.wrappers_in(model)
        if not wrappers:
            raise TypeError(
                "DataParallel expects a model made by neuronmp.trace (or a module containing "
                f"one), got {type(model).__name__} with no neuronmp subgraph"
            )
        self.module = model
        self.dim = dim
        self.device_ids: List[int] = _device_ids(device_ids)
        self.num_workers = 2 * len(self.device_ids)
        self.split_size: Optional[int] = None
        self.dynamic_batching = False
        self._last_plan: tuple = (None, None)    # (key, sizes): see _chunk_sizes
        self._direct = _model.is_traced(model)
        self._join_in_place = False   # see below
        self._executors: List[concurrent.futures.ThreadPoolExecutor] = []   # 0 or 1, lazily
        self._executor_lock = threading.Lock()
        if self._direct:
            self._base = _model.model_of(model)
            self._spec = self._base.meta["outputs"]
            self._single = self._spec if isinstance(self._spec, int) else None
            self._row_specs = chunking.row_specs(self._base.signature.inputs,
                                                 self._base.batch)
            self._replicas = [
                _model.new_model(self._base.graph, self._base.meta, where=(i, 1))
                for i in self.device_ids
            ]
            for m in self._replicas:
                m.count_runs_in(self._base)
            self._copies: List[torch.nn.Module] = []
            models = self._replicas
            # chunks joined where they are read pay only when read before they are
            # due: on device-time cores (model.run_chunks).  Elsewhere an answer is
            # read as it arrives, and copying it out in Python costs more than one
            # concatenation (docs/performance.md, "DataParallel (CPU-bound)")
            self._join_in_place = self._replicas[0].device_time is not None
        else:
            self._base = _model.model_of(wrappers[0])
            self._copies = [_copy_on_core(model, i) for i in self.device_ids]
            self._replicas = []
            models = [m for c in self._copies for m in _model.models_in(c)]
        weakref.finalize(self, _close_all, list(self._replicas), self._executors)
        if set_dynamic_batching:
            self._enable_dynamic_batching()
        for m in models:
            m.load()

    # -- configuration ----------------------------------------------------------------

    def _enable_dynamic_batching(self) -> None:
        if self.dim != 0:
            _log.info("DataParallel: dynamic batching disabled because dim=%d is not 0",
                      self.dim)
            return
        try:
            for m in self._replicas:
                if m.batch is None:
                    raise ValueError(f"traced inputs {m.describe_signature()} differ in dim 0")
                m.dynamic = True
            for c in self._copies:
                _dynamic_batch(c)
        except ValueError as exc:
            warnings.warn(f"DataParallel: dynamic batching cannot be enabled for this model "
                          f"({exc}); every chunk must have the traced size",
                          stacklevel=_sdkargs.caller_stacklevel())
            return
        self.dynamic_batching = True

    def disable_dynamic_batching(self) -> None:
        """Turn dynamic batching off: each core's chunk must then have the traced size."""
        self.dynamic_batching = False
        for m in self._replicas:
            m.dynamic = False
        for c in self._copies:
            for m in _model.models_in(c):
                m.dynamic = False
            for w in _model.wrappers_in(c):
                setattr(w, _model.DYNAMIC_ATTR, False)

    # -- execution -----------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._direct and not kwargs:
            return self._forward_direct(inputs)
        return self._forward_copies(inputs, kwargs)

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        # the per-call path is a few microseconds of Python: skip nn.Module's hook machinery
        # unless hooks were registered on this module
        if self._direct and not kwargs and not (self._forward_hooks or self._forward_pre_hooks):
            return self._forward_direct(inputs)
        return super().__call__(*inputs, **kwargs)

    def _forward_direct(self, inputs: Sequence[Any]) -> Any:
        x = inputs[0] if inputs else None
        if not isinstance(x, torch.Tensor):
            raise TypeError("DataParallel: the traced model takes tensors; got "
                            f"{[type(x).__name__ for x in inputs]}")
        size = x.shape[self.dim] if -x.dim() <= self.dim < x.dim() else _size_along(x, self.dim)
        if size == 1 and self.dynamic_batching and self.split_size is None:
            flat = self._replicas[0].run(inputs)    # one row: one core, nothing to split
            return flat[self._single] if self._single is not None else pytree.unflatten(
                flat, self._spec)
        sizes = self._chunk_sizes(size)
        replicas = self._replicas
        try:
            if len(sizes) == 1:
                flat = replicas[0].run(inputs)
            else:
                pieces = self._rows(inputs, sizes)
                whole = pieces is not None or (
                    self.dim == 0 and self._base.signature.rows(inputs) is not None)
                if pieces is None:
                    pieces = [x.split_with_sizes(sizes, self.dim) for x in inputs]
                flat = _model.run_chunks(replicas, pieces, sizes, whole=whole, dim=self.dim,
                                         in_place=self._join_in_place)
        except ValueError as exc:
            # a chunk's check names the chunk's shape; the caller knows only its input's
            self._raise_for_shapes(inputs, exc)
            raise
        return flat[self._single] if self._single is not None else pytree.unflatten(
            flat, self._spec)

    def _rows(self, inputs: Sequence[Any], sizes: List[int]) -> Optional[list]:
        """Per input, its chunks as row ranges (``chunking.row_ranges``), when the call
        is cut into whole traced batches (the even plan, dim 0) and every input is a
        contiguous CPU tensor of its traced dtype and shape but for dim 0 (checked
        there, in C, along with taking its description); else None.  Views and the
        per-chunk questions to torch would delay the last chunk's start."""
        specs = self._row_specs
        if specs is None or self.dim != 0 or sizes is not self._last_plan[1] or \
                sizes[0] != self._base.batch:
            return None
        return chunking.row_ranges(inputs, sizes, specs)

    def _raise_for_shapes(self, inputs: Sequence[Any], cause: BaseException) -> None:
        """Raise the shape error as the user's inputs show it, if one explains ``cause``."""
        traced = self._base.signature.inputs
        for i, (x, (shape, _)) in enumerate(zip(inputs, traced)):
            if not isinstance(x, torch.Tensor) or x.dim() == 0:
                continue
            dim = self.dim % x.dim()
            want = [x.shape[d] if d == dim else n for d, n in enumerate(shape)]
            if x.dim() != len(shape) or list(x.shape) != want:
                raise ValueError(
                    f"DataParallel: input {i} has shape {list(x.shape)}, but the model was "
                    f"traced with {list(shape)}: expected {want} (dimension {dim} is split "
                    f"across the {len(self.device_ids)} NeuronCores; the others are fixed)"
                ) from cause

    def _chunk_sizes(self, size: int) -> List[int]:
        """Rows per chunk, in order; chunk k runs on device_ids[k % len(device_ids)]."""
        # the last even plan is kept: this runs before every call's first chunk is sent
        key = (size, self.split_size, self.dynamic_batching, len(self.device_ids))
        last = self._last_plan    # one read: calling threads may replace it meanwhile
        if last[0] == key:
            return last[1]
        sizes = self._plan_sizes(size)
        if len(set(sizes)) == 1:
            self._last_plan = (key, sizes)
        return sizes

    def _plan_sizes(self, size: int) -> List[int]:
        n = len(self.device_ids)
        if self.split_size is not None:
            step = self.split_size
            if not isinstance(step, int) or step < 1:
                raise ValueError(f"DataParallel.split_size must be a positive int, got {step!r}")
            return [step] * (size // step) + ([size % step] if size % step else [])
        if not self.dynamic_batching:
            traced = self._traced_size()
            if size != n * traced:
                raise ValueError(
                    f"DataParallel without dynamic batching needs input.shape[{self.dim}] / "
                    f"len(device_ids) == the traced size {traced}, but got {size} / {n}; "
                    f"use a batch of {n * traced} or enable dynamic batching"
                )
            return [traced] * n
        sizes, uneven = chunking.split_sizes(size, n)
        if uneven:
            warnings.warn(
                f"DataParallel: batch size {size} is not divisible by the {n} NeuronCores; "
                "the cores are not fully utilized", stacklevel=_sdkargs.caller_stacklevel())
        return sizes

    def _traced_size(self) -> int:
        shape = self._base.signature.inputs[0][0]
        if not -len(shape) <= self.dim < len(shape):
            raise ValueError(f"DataParallel: dim={self.dim} is out of range for the traced "
                             f"input shape {list(shape)}")
        return shape[self.dim]

    def _forward_copies(self, inputs: Sequence[Any], kwargs: dict) -> Any:
        size = _first_size(inputs, kwargs, self.dim)
        sizes = self._chunk_sizes(size) if size is not None else [0]
        if len(sizes) == 1:
            return self._copies[0](*inputs, **kwargs)
        scattered = [pytree.scatter(list(inputs), sizes, self.dim),
                     pytree.scatter(dict(kwargs), sizes, self.dim)]
        copies = self._copies
        pool = self._pool()
        futures = [pool.submit(copies[k % len(copies)], *scattered[0][k], **scattered[1][k])
                   for k in range(len(sizes))]
        return pytree.gather([f.result() for f in futures], self.dim)

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._executor_lock:
            if not self._executors:
                self._executors.append(concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.num_workers, thread_name_prefix="neuronmp-dp"))
            return self._executors[0]

    def extra_repr(self) -> str:
        return (f"device_ids={self.device_ids}, dim={self.dim}, "
                f"dynamic_batching={self.dynamic_batching}")


# -- helpers ---------------------------------------------------------------------------


def _device_ids(device_ids: Optional[Sequence[Any]]) -> List[int]:
    visible = _session.current().cores
    if device_ids is None:
        return list(range(len(visible)))
    if isinstance(device_ids, (str, int)) or not isinstance(device_ids, Sequence):
        raise TypeError(f"DataParallel: device_ids must be a list of ints or 'nc:#' strings, "
                        f"got {device_ids!r}")
    if not device_ids:
        raise ValueError("DataParallel: device_ids is empty; give at least one NeuronCore")
    ids = []
    for d in device_ids:
        _visibility.local_to_global(d, visible)    # raises DeviceIdError naming d
        ids.append(_visibility.parse_device_id(d))
    return ids


def _size_along(x: torch.Tensor, dim: int) -> int:
    if not -x.dim() <= dim < max(x.dim(), 1):
        raise ValueError(f"DataParallel: dim={dim} is out of range for an input of shape "
                         f"{list(x.shape)}")
    return x.shape[dim]


def _copy_on_core(module: torch.nn.Module, index: int) -> torch.nn.Module:
    """A deep copy whose traced submodules are new models placed on core ``index``."""
    clone = copy.deepcopy(module)
    # the copy's wrappers come in the original's order; a deep copy registers each
    # again, so the user's model (whose counts model_of shows) is the original's
    for original, wrapper in zip(_model.wrappers_in(module), _model.wrappers_in(clone)):
        old = _model.model_of(wrapper)
        graph = getattr(wrapper, _model.GRAPH_ATTR)
        with _placement.neuron_cores_context(index, 1):
            handle = _model.attach(graph, getattr(wrapper, _model.META_ATTR), old.dynamic)
        _model.get(handle).count_runs_in(_model.model_of(original))
        setattr(wrapper, _model.HANDLE_ATTR, handle)
    return clone


def _first_size(inputs: Sequence[Any], kwargs: dict, dim: int) -> Optional[int]:
    for obj in list(inputs) + list(kwargs.values()):
        found = pytree.first_tensor(obj)
        if found is not None:
            return _size_along(found, dim)
    return None


def _close_all(replicas: List[_model.Model], executors: list) -> None:
    for m in replicas:
        m.close()
    for ex in executors:
        ex.shutdown(wait=False)
