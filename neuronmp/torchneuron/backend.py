"""``torch.compile(backend="neuron")``: a Dynamo graph run on its core's worker.

    torch.compile(model, backend="neuron")        (entry point "torch_dynamo_backends")
      neuron_backend(gm, example_inputs, mode=, options=)
        dynamic=True ─▶ CompileOptionError (TorchNeuron compiles per shape)
        mode other than default ─▶ a warning, the default mode
      CompiledGraph(*args)  per call
        grad needed, or the graph mutates its inputs ─▶ gm on the device, eagerly
        else: per input shapes (and weight versions) one neuronmp.trace of the graph,
              weights baked in (shared weights), placed on core i of neuron:i
              ─▶ Model.run: the one request path (device time, exec timeout,
                 the core's statistics) ─▶ outputs copied to neuron:i (CPU inputs
                 only: on the current device's core, outputs left on the CPU)

What the worker runs is the graph's CPU computation: the Neuron compiler's lowering
and numerics are not modelled (docs/guides/torchneuron.md).
"""
from __future__ import annotations

import copy
import threading
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils import _pytree

from ..errors import CompileOptionError


def neuron_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *,
                   options: Optional[Dict[str, Any]] = None,
                   mode: Optional[str] = None) -> CompiledGraph:
    """The ``neuron`` Dynamo backend (TorchNeuron's parameters: ``options``, ``mode``)."""
    _require_device()
    if options is not None and not isinstance(options, dict):
        raise CompileOptionError("options", options, "a dict or None")
    if mode not in (None, "default"):
        warnings.warn(f"torch.compile(backend='neuron'): mode={mode!r} is not supported; "
                      "using the default mode", stacklevel=2)
    import torch._dynamo.config as dynamo_config

    if not dynamo_config.assume_static_by_default:
        raise CompileOptionError("dynamic", True, "False or None: the neuron backend "
                                 "compiles one graph per input shape")
    return CompiledGraph(gm, example_inputs)


def _require_device() -> None:
    import _neuronmp_provide

    from . import is_registered, register

    if is_registered():
        return
    if not _neuronmp_provide.wants_native():
        raise CompileOptionError(
            "backend", "neuron", "set NEURONMP_PROVIDE=torchneuron to emulate TorchNeuron's "
            "neuron device and its compile backend")
    register()


class CompiledGraph:
    """One Dynamo graph; called with the graph's inputs, returns its outputs."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]):
        self.gm = gm
        self.weights = tuple(i for i, x in enumerate(example_inputs)
                             if isinstance(x, torch.nn.Parameter))
        self.mutates = _mutates_inputs(gm)
        self._traced: Dict[Tuple, Tuple[Tuple[int, ...], Any]] = {}
        self._cpu_gm: Optional[torch.fx.GraphModule] = None
        self._lock = threading.Lock()

    def __call__(self, *args: Any) -> Any:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if self.mutates or not tensors or (
                torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
            return self.gm(*args)   # autograd and in-place updates need the eager graph
        device = _device_of(tensors)
        traced = self._for(args, device)
        inputs = [a.detach().cpu() for i, a in enumerate(args)
                  if isinstance(a, torch.Tensor) and i not in self.weights]
        out = traced(*inputs)
        if not any(t.device.type == "neuron" for t in tensors):
            return out   # CPU inputs get CPU outputs (TorchNeuron's CPU auto-copy)
        return _pytree.tree_map(
            lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, out)

    def _for(self, args: Sequence[Any], device: torch.device) -> Any:
        key = (device.index, *(_key(a) for a in args))
        versions = tuple(args[i]._version for i in self.weights)
        with self._lock:
            entry = self._traced.get(key)
            if entry is None or entry[0] != versions:   # new shapes, or weights changed
                if entry is not None:
                    _release(entry[1])
                entry = (versions, self._trace(args, device))
                self._traced[key] = entry
            return entry[1]

    def _trace(self, args: Sequence[Any], device: torch.device) -> Any:
        from .. import model as _model
        from ..tracing import trace

        bound = _Bound(self._cpu_graph(), args, self.weights)
        examples = tuple(args[i].detach().cpu() for i in bound.free)
        traced = trace(bound, examples)
        from .device import core_index

        core = core_index(device.index or 0)
        _model.get(getattr(traced, _model.HANDLE_ATTR)).place(core, 1)
        return traced

    def _cpu_graph(self) -> torch.fx.GraphModule:
        if self._cpu_gm is None:
            gm = copy.deepcopy(self.gm).to("cpu")
            for node in gm.graph.nodes:
                node.args = _pytree.tree_map(_cpu_device, node.args)
                node.kwargs = _pytree.tree_map(_cpu_device, node.kwargs)
            gm.recompile()
            self._cpu_gm = gm
        return self._cpu_gm


class _Bound(torch.nn.Module):
    """The graph with its weights (and int inputs) bound: traced, the weights become
    the compiled graph's own, shared by every process that loads it."""

    def __init__(self, gm: torch.fx.GraphModule, args: Sequence[Any], weights: Sequence[int]):
        super().__init__()
        self.gm = gm
        self.n = len(args)
        self.fixed = {i: a for i, a in enumerate(args) if not isinstance(a, torch.Tensor)}
        self.free = [i for i, a in enumerate(args)
                     if isinstance(a, torch.Tensor) and i not in weights]
        self.weight_at = {}
        for k, i in enumerate(weights):
            self.register_buffer(f"w{k}", args[i].detach().cpu().clone())
            self.weight_at[i] = f"w{k}"

    def forward(self, *xs: torch.Tensor) -> Any:
        given = dict(zip(self.free, xs))
        full: List[Any] = []
        for i in range(self.n):
            if i in given:
                full.append(given[i])
            elif i in self.weight_at:
                full.append(getattr(self, self.weight_at[i]))
            else:
                full.append(self.fixed[i])
        return self.gm(*full)


def _device_of(tensors: Sequence[torch.Tensor]) -> torch.device:
    for t in tensors:
        if t.device.type == "neuron":
            return t.device
    return torch.device("neuron", torch.neuron.current_device())


def _key(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return (tuple(a.shape), a.dtype, a.device.type)
    return ("value", a)


def _cpu_device(v: Any) -> Any:
    if isinstance(v, torch.device) and v.type == "neuron":
        return torch.device("cpu")
    return v


def _mutates_inputs(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph updates a tensor in place (a trace on copies would lose it)."""
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        name = node.target if isinstance(node.target, str) else \
            getattr(node.target, "__name__", "")
        if name.endswith("_") and not name.endswith("__"):
            return True
        if node.kwargs.get("out") is not None:
            return True
    return False


def _release(traced: Any) -> None:
    from .. import model as _model

    try:
        _model.get(getattr(traced, _model.HANDLE_ATTR)).close()
    except (KeyError, AttributeError):
        pass
