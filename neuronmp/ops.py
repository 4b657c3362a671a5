"""The ``neuronmp::forward`` custom op and the loaded models it runs.

A traced model (see :mod:`neuronmp.tracing`) is a scripted wrapper whose forward is one
call of ``neuronmp::forward(handle, inputs)``.  ``handle`` names a :class:`Model` in this
process: the compiled graph's bytes, its input signature, its placement (local core
indexes) and the pool model ids it has on those cores.  The wrapper's TorchScript
``__setstate__`` calls ``neuronmp::register``, so every ``torch.jit.load`` builds a fresh
:class:`Model` placed by the active placement context (or the least-used default).

    model(x) ── TorchScript ── neuronmp::forward(handle, [x]) ── Python kernel
                                    │  check shapes/dtypes against the trace
                                    │  pick the next core of the model (round robin)
                                    ▼
                 pool.submit(core, mid, (n_chunks, x)) ──▶ worker: runner(n, x)
                                    ◀── list of CPU tensors ──┘

The runner loaded on a core (built by trace) takes a chunk count first: with dynamic
batching a padded batch travels as one request per core and the worker loops over
the traced-size chunks, instead of paying one round trip per chunk.

A model is loaded onto its cores when it is created (trace, torch.jit.load) or placed
(set_neuron_cores), as the SDK does.  Models are released (usage counts dropped, pool
copies unloaded at the next load)
when the tensor holding their graph dies, i.e. with the module that owns them.

``import neuronmp`` registers these ops as soon as torch is imported, so a saved
traced model loads in a fresh process after ``import neuronmp``.
"""
from __future__ import annotations

import collections
import itertools
import json
import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import coreuse as _coreuse
from . import runtime as _runtime
from .errors import PoolClosedError
from .pool import get_pool

#: attribute names on the scripted wrapper (see tracing.py's generated source)
HANDLE_ATTR = "nmp_handle"
GRAPH_ATTR = "nmp_graph"
META_ATTR = "nmp_meta"
DYNAMIC_ATTR = "dynamic_batch"

_lib = torch.library.Library("neuronmp", "DEF")
_lib.define("forward(int handle, Tensor[] inputs) -> Tensor[]")
_lib.define("register(Tensor graph, str meta, bool dynamic) -> int")

_models: Dict[int, Model] = {}
_ids = itertools.count(1)
# (pool, core, mid) of released models; unloaded at the next load, never from a GC callback
_unloads: collections.deque[Tuple[Any, int, int]] = collections.deque()


class Model:
    """One loaded instance of a traced graph: signature, placement, pool copies."""

    def __init__(self, graph: bytes, meta: Dict[str, Any], dynamic: bool = False):
        self.handle = next(_ids)
        self.graph = graph
        self.meta = meta
        self.signature: Tuple[Tuple[torch.Size, torch.dtype], ...] = tuple(
            (torch.Size(shape), getattr(torch, dtype)) for shape, dtype in meta["inputs"]
        )
        self.batch: Optional[int] = meta.get("batch")
        self.dynamic = bool(dynamic)
        self.placement: Tuple[int, ...] = ()      # local core indexes
        self.closed = False
        self._targets: Tuple[Tuple[int, int], ...] = ()   # (global core, pool mid)
        self._pool = None
        self._rr = itertools.count()
        self._lock = threading.Lock()

    # -- placement --------------------------------------------------------------

    @property
    def cores(self) -> Tuple[int, ...]:
        """Global ids of the cores this model runs on (resolved now)."""
        cores = _runtime.get_runtime().cores
        return tuple(cores[i] for i in self.placement)

    def place(self, start_nc: int = -1, nc_count: int = -1) -> None:
        """Move or replicate onto new cores: unload from the old ones first."""
        _coreuse.validate(start_nc, nc_count)
        with self._lock:
            old, self._targets = self._targets, ()
            _coreuse.release(self.placement)
            self.placement = ()
            self.placement = _coreuse.choose(start_nc, nc_count)
            pool = self._pool
        for core, mid in old:
            _unload(pool, core, mid)
        self.load()

    def load(self) -> Tuple[Tuple[int, int], ...]:
        """Load onto every core of the placement (idempotent); returns (core, mid) pairs."""
        with self._lock:
            if self._targets:
                return self._targets
            if self.closed:
                raise RuntimeError(f"neuronmp model {self.handle} was released")
            rt = _runtime.get_runtime()
            pool = get_pool(rt)
            _drain_unloads()
            targets = []
            try:
                for index in self.placement:
                    core = rt.cores[index]
                    targets.append((core, pool.load(core, self.graph)))
            except BaseException:
                for core, mid in targets:
                    _unload(pool, core, mid)
                raise
            self._pool = pool
            self._targets = tuple(targets)
            return self._targets

    def close(self) -> None:
        """Release the cores; pool copies are unloaded at the next load (GC-safe)."""
        if self.closed:
            return
        self.closed = True
        _models.pop(self.handle, None)
        _coreuse.release(self.placement)
        targets, self._targets = self._targets, ()
        for core, mid in targets:
            _unloads.append((self._pool, core, mid))

    # -- execution --------------------------------------------------------------

    def submit(self, args: Sequence[torch.Tensor]):
        """Start one call; returns an object with ``result()`` -> list of output tensors."""
        dynamic_rows = self._check(args)
        targets = self._targets or self.load()
        try:
            if dynamic_rows is not None:
                return self._submit_chunks(args, dynamic_rows, targets)
            return self._pool.submit(*self._plain_call(targets, args))
        except PoolClosedError:
            # the runtime was shut down and started again: load on the new pool once
            with self._lock:
                self._targets = ()
            targets = self.load()
            if dynamic_rows is not None:
                return self._submit_chunks(args, dynamic_rows, targets)
            return self._pool.submit(*self._plain_call(targets, args))

    def run(self, args: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Run one call to completion."""
        call = self.request(args)
        if call is None:
            return self.submit(args).result()
        return self._pool.run(*call)

    def request(self, args: Sequence[torch.Tensor]) -> Optional[Tuple[int, int, tuple]]:
        """``(core, mid, payload)`` of one plain call on the model's next core.

        None when ``args`` need more than that (dynamic batching, an input to
        reject) or the model is not loaded on a live pool: ``submit`` handles
        those cases.  The synchronous paths use it to skip the Future.
        """
        targets = self._targets
        if not targets or self._pool.closed or not self._as_traced(args):
            return None
        return self._plain_call(targets, args)

    def _plain_call(self, targets, args) -> Tuple[int, int, tuple]:
        """(core, mid, payload) of one call on the next of ``targets`` (round robin)."""
        core, mid = targets[next(self._rr) % len(targets)]
        return core, mid, payload(1, args)

    def _as_traced(self, args: Sequence[torch.Tensor]) -> bool:
        """Whether ``args`` are tensors of exactly the traced shapes and dtypes."""
        if len(args) != len(self.signature):
            return False
        for x, (shape, dtype) in zip(args, self.signature):
            if not isinstance(x, torch.Tensor) or x.dtype != dtype or x.shape != shape:
                return False
        return True

    def _check(self, args: Sequence[torch.Tensor]) -> Optional[int]:
        """Validate inputs; returns the batch size when it needs dynamic batching."""
        if len(args) != len(self.signature):
            raise TypeError(
                f"neuronmp traced model takes {len(self.signature)} input tensor(s) "
                f"({self.describe_signature()}), but got {len(args)}"
            )
        return None if self._as_traced(args) else self._check_slow(args)

    def _check_slow(self, args: Sequence[torch.Tensor]) -> Optional[int]:
        for i, (x, (_, dtype)) in enumerate(zip(args, self.signature)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(
                    f"neuronmp traced model input {i} must be a torch.Tensor, "
                    f"got {type(x).__name__}"
                )
            if x.device.type != "cpu":
                raise ValueError(
                    f"neuronmp traced model input {i} is on {x.device}; traced models "
                    "consume CPU tensors"
                )
            if x.dtype != dtype:
                raise ValueError(
                    f"neuronmp traced model input {i} has dtype {_dt(x.dtype)}, but the "
                    f"model was traced with {_dt(dtype)}; a traced model's data types are fixed"
                )
        if not self.dynamic:
            for i, (x, (shape, _)) in enumerate(zip(args, self.signature)):
                if x.shape != shape:
                    raise ValueError(
                        f"neuronmp traced model input {i} has shape {list(x.shape)}, but "
                        f"the model was traced with {list(shape)}; a traced model's input "
                        "shapes are fixed (neuronmp.dynamic_batch() lets dim 0 vary)"
                    )
            return None
        rows = args[0].shape[0] if args[0].dim() else None
        for i, (x, (shape, _)) in enumerate(zip(args, self.signature)):
            if x.dim() != len(shape) or x.shape[1:] != shape[1:]:
                raise ValueError(
                    f"dynamic batching: input {i} has shape {list(x.shape)}, but the model "
                    f"was traced with {list(shape)}; only dimension 0 may differ"
                )
            if x.shape[0] != rows:
                raise ValueError(
                    "dynamic batching needs the same dim-0 size for every input, got "
                    f"{[a.shape[0] for a in args]}"
                )
        if not rows:
            raise ValueError(f"dynamic batching: the batch is empty (shape {list(args[0].shape)})")
        return rows

    def _submit_chunks(self, args, rows: int, targets):
        """Pad to whole traced-size chunks, send one request per core, strip the padding."""
        b = self.batch
        chunks = -(-rows // b)
        pad = chunks * b - rows
        if pad:
            args = [torch.cat([x, x.new_zeros((pad, *x.shape[1:]))]) for x in args]
        used = min(len(targets), chunks)
        per, extra = divmod(chunks, used)
        first = next(self._rr)
        futures, start = [], 0
        for j in range(used):
            n = per + (1 if j < extra else 0)
            core, mid = targets[(first + j) % len(targets)]
            part = [x.narrow(0, start * b, n * b) for x in args] if used > 1 else args
            futures.append(self._pool.submit(core, mid, payload(n, part)))
            start += n
        return _Joined(futures, rows if pad else None)

    def describe_signature(self) -> str:
        """The traced inputs, as error messages name them: ``[1, 4] float32, ...``."""
        return ", ".join(f"{list(s)} {_dt(d)}" for s, d in self.signature)

    def __repr__(self) -> str:
        return (f"<neuronmp Model {self.handle} inputs=({self.describe_signature()}) "
                f"placement={list(self.placement)} dynamic_batch={self.dynamic}>")


def payload(chunks: int, args: Sequence[torch.Tensor]) -> tuple:
    """A request for a core's compiled graph (its runner's ``forward(n_chunks, *inputs)``):
    ``args`` hold ``chunks`` traced-size batches stacked along dim 0."""
    return (chunks, *args)


def run_parallel(models: Sequence[Model], chunks: Sequence[Sequence[torch.Tensor]]
                 ) -> List[List[torch.Tensor]]:
    """Outputs of ``models[k % len(models)]`` run on ``chunks[k]``, all in flight at once."""
    used = [models[k % len(models)] for k in range(len(chunks))]
    calls = [m.request(c) for m, c in zip(used, chunks)]
    if None not in calls:   # every model is loaded on the live pool: there is one
        return used[0]._pool.run_all(calls)
    pending = [m.submit(c) for m, c in zip(used, chunks)]
    return [p.result() for p in pending]


class _Joined:
    """Results of the per-core pieces of one dynamically batched call, joined in order."""

    __slots__ = ("futures", "rows")

    def __init__(self, futures, rows: Optional[int]):
        self.futures = futures
        self.rows = rows

    def result(self) -> List[torch.Tensor]:
        parts = [f.result() for f in self.futures]
        outs = parts[0] if len(parts) == 1 else [torch.cat(group) for group in zip(*parts)]
        if self.rows is not None:
            outs = [o[: self.rows] for o in outs]
        return list(outs)


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _unload(pool, core: int, mid: int) -> None:
    if pool is None:
        return
    try:
        pool.unload(core, mid)
    except Exception:  # a closed pool or a dead worker has already dropped it
        pass


def _drain_unloads() -> None:
    while _unloads:
        try:
            pool, core, mid = _unloads.popleft()
        except IndexError:
            return
        _unload(pool, core, mid)


# -- registry -------------------------------------------------------------------


def new_model(graph: bytes, meta: Dict[str, Any], dynamic: bool = False,
              where: Optional[Tuple[int, int]] = None) -> Model:
    """Register a model placed at ``where`` = (start_nc, nc_count), else by the active
    context or the least-used default."""
    model = Model(graph, meta, dynamic)
    start_nc, nc_count = where if where is not None else _coreuse.current_request()
    model.placement = _coreuse.choose(start_nc, nc_count)
    _models[model.handle] = model
    try:
        model.load()   # the SDK loads a model onto its cores at trace / torch.jit.load time
    except BaseException:
        model.close()
        raise
    return model


def get(handle: int) -> Model:
    """The model behind a wrapper's handle."""
    try:
        return _models[handle]
    except KeyError:
        raise RuntimeError(
            f"neuronmp model handle {handle} is not registered in this process "
            "(load traced models with torch.jit.load after `import neuronmp`)"
        ) from None


def is_traced(module: Any) -> bool:
    """True for a neuronmp traced wrapper (a scripted module carrying a handle)."""
    return isinstance(module, torch.jit.ScriptModule) and hasattr(module, HANDLE_ATTR)


def wrappers_in(module: Any) -> List[torch.jit.ScriptModule]:
    """Every neuronmp traced wrapper inside ``module`` (itself included)."""
    if not isinstance(module, torch.nn.Module):
        return []
    return [m for m in module.modules() if is_traced(m)]


def model_of(wrapper: torch.jit.ScriptModule) -> Model:
    """The :class:`Model` of one traced wrapper."""
    return get(getattr(wrapper, HANDLE_ATTR))


def models_in(module: Any) -> List[Model]:
    """The :class:`Model` of every traced wrapper inside ``module``."""
    return [model_of(w) for w in wrappers_in(module)]


def attach(graph: torch.Tensor, meta: str, dynamic: bool) -> int:
    """Register the graph held by a wrapper; the model lives as long as that tensor."""
    model = new_model(graph.numpy().tobytes(), json.loads(meta), dynamic)
    weakref.finalize(graph, model.close)
    return model.handle


def _forward_kernel(handle: int, inputs: List[torch.Tensor]) -> List[torch.Tensor]:
    return get(handle).run(inputs)


def _register_kernel(graph: torch.Tensor, meta: str, dynamic: bool) -> int:
    return attach(graph, meta, dynamic)


# CompositeExplicitAutograd: one Python kernel for every backend key, autograd included
# (traced models are inference-only, like the SDK's)
_lib.impl("forward", _forward_kernel, "CompositeExplicitAutograd")
_lib.impl("register", _register_kernel, "CompositeExplicitAutograd")
