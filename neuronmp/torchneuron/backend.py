"""``torch.compile(backend="neuron")``: a Dynamo graph run on its core's worker.

    torch.compile(model, backend="neuron")        (entry point "torch_dynamo_backends")
      neuron_backend(gm, example_inputs, mode=, options=)
        dynamic=True ─▶ CompileOptionError (TorchNeuron compiles per shape)
        mode other than default ─▶ a warning, the default mode
      CompiledGraph(*args)  per call
        CPU inputs ─▶ moved to the current device (TorchNeuron's CPU auto-copy;
                      TORCH_NEURONX_DYNAMO_DISABLE_CPU_AUTOCOPY=1: its RuntimeError)
        grad needed, the graph mutates a tensor (setitem, +=, x_()), draws random
        numbers or has no outputs ─▶ gm on the device, eagerly, in the caller
        else: per input shapes (and weight versions) one neuronmp.trace of the graph,
              weights baked in (shared weights; inference tensors, which keep no
              version, are sent with each call instead), placed on core i of neuron:i
              ─▶ Model.run: the one request path (device time, exec timeout,
                 the core's statistics) ─▶ outputs copied to neuron:i
        outputs stay on the device (TORCH_NEURONX_RETAIN_DEVICE_MODE=1: CPU inputs
        get CPU outputs); a graph's sdpa_kernel() calls never outlive the call

What the worker runs is the graph's CPU computation: the Neuron compiler's lowering
and numerics are not modelled (docs/guides/torchneuron.md).
"""
from __future__ import annotations

import contextlib
import copy
import operator
import threading
import warnings
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch._dynamo.exc import ShortenTraceback
from torch.utils import _pytree

from ..errors import CompileOptionError
from ..host import settings


class _CompileOptionRefused(CompileOptionError, ShortenTraceback):
    """The CompileOptionError the backend raises inside Dynamo.

    Dynamo wraps what a backend raises in its BackendCompilerFailed, except its own
    ShortenTraceback family, which it re-raises to the caller as it is: being one
    too lets ``except neuronmp.CompileOptionError`` catch the refusal."""

    def __init__(self, option: str, value: Any, accepted: str):
        CompileOptionError.__init__(self, option, value, accepted)
        # TorchDynamoException's fields (its __init__ is not on this MRO's chain)
        self.first_useful_frame = None
        self._torch_dynamo_tracer_output = None
        self.frame_exec_strategy = None


def neuron_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *,
                   options: Optional[Dict[str, Any]] = None,
                   mode: Optional[str] = None) -> CompiledGraph:
    """The ``neuron`` Dynamo backend (TorchNeuron's parameters: ``options``, ``mode``)."""
    _require_device()
    if options is not None and not isinstance(options, dict):
        raise _CompileOptionRefused("options", options, "a dict or None")
    if mode not in (None, "default"):
        warnings.warn(f"torch.compile(backend='neuron'): mode={mode!r} is not supported; "
                      "using the default mode", stacklevel=2)
    import torch._dynamo.config as dynamo_config

    if not dynamo_config.assume_static_by_default:
        raise _CompileOptionRefused("dynamic", True, "False or None: the neuron backend "
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
        # weights are baked into the trace and followed by the tensor itself and its
        # version counter (a Parameter swapped for another starts a counter of its
        # own, which may read as the old one's did); an inference tensor has no
        # counter, so it is sent with every call instead
        self.weights = tuple(i for i, x in enumerate(example_inputs)
                             if isinstance(x, torch.nn.Parameter) and not x.is_inference())
        # the tensors sent with each call: every tensor but the baked weights
        self._free = [i for i, x in enumerate(example_inputs)
                      if isinstance(x, torch.Tensor) and i not in self.weights]
        self._fixed = [i for i, x in enumerate(example_inputs)
                       if not isinstance(x, torch.Tensor)]
        why = _eager_reason(gm)
        self.eager_only = why is not None
        self.why_eager = why
        self.traces = 0   # how many times the graph was traced (shapes, weight updates)
        self._traced: Dict[Tuple, _Run] = {}
        self._hot: Optional[_Run] = None   # the last call's run, checked first
        self._cpu_gm: Optional[torch.fx.GraphModule] = None
        # CPU weights' device copies, by argument index (``_to_device``)
        self._moved: Dict[int, Tuple[Any, int, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def __call__(self, *args: Any) -> Any:
        # the common case first: a call like the last one (its shapes, devices and
        # weight versions), without autograd; everything else takes the general path
        hot = self._hot
        if hot is not None and not torch.is_grad_enabled():
            out = hot.call_if_same(args)
            if out is not _MISS:
                return out
        return self._call(args)

    def _call(self, args: Sequence[Any]) -> Any:
        # the general path: one pass over the arguments, then the worker's entry
        first = None
        grad = torch.is_grad_enabled()
        needs_grad = False
        for a in args:
            if isinstance(a, torch.Tensor):
                if a.is_cpu:   # CPU inputs: TorchNeuron's auto-copy
                    return self._from_cpu(args)
                if first is None:
                    first = a
                needs_grad = needs_grad or (grad and a.requires_grad)
        if self.eager_only or first is None or needs_grad:
            with sdp_flags_kept():
                return self.gm(*args)   # autograd and in-place updates need the eager graph
        run = self._for(args, first.device)
        if not self._fixed:   # non-tensor arguments are keys of the trace: no fast check
            self._hot = run
        return run(args)

    def _from_cpu(self, args: Sequence[Any]) -> Any:
        """A call with CPU tensors: they are copied to the device (to the device of
        the call's neuron tensors, else the current one) and the outputs stay there,
        as TorchNeuron's executor does; TORCH_NEURONX_RETAIN_DEVICE_MODE=1 brings a
        CPU-only call's outputs back to the CPU.  An in-place update of a CPU input
        is copied back to it."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        mixed = any(t.device.type == "neuron" for t in tensors)
        if settings.get("cpu_autocopy_disabled"):
            i = next(i for i, a in enumerate(args)
                     if isinstance(a, torch.Tensor) and a.device.type == "cpu")
            raise RuntimeError(
                f"Input tensor at index {i} is on cpu device, expected neuron. "
                "Move tensor to Neuron device first with tensor.to('neuron')")
        device = next((t.device for t in tensors if t.device.type == "neuron"), None) \
            or torch.device("neuron", torch.neuron.current_device())
        moved = [self._to_device(i, a, device)
                 if isinstance(a, torch.Tensor) and a.device.type == "cpu" else a
                 for i, a in enumerate(args)]
        before = [_version(m) if m is not a else None for m, a in zip(moved, args)]
        out = self(*moved)
        for a, m, v in zip(args, moved, before):
            if v is not None and _version(m) != v:
                with torch.no_grad():
                    a.copy_(m)
        if not mixed and settings.get("retain_device_mode"):
            return _pytree.tree_map(
                lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, out)
        return out

    def _to_device(self, i: int, a: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A CPU argument's copy on ``device``.  A weight's copy is kept while the
        weight is the same tensor at the same version: a fresh copy per call would
        be a new tensor to the trace's weight check, and a trace per call."""
        if i not in self.weights:
            return a.to(device)
        kept = self._moved.get(i)
        if kept is not None and kept[0]() is a and kept[1] == a._version \
                and kept[2].device == device:
            return kept[2]
        copy_ = a.to(device)
        self._moved[i] = (weakref.ref(a), a._version, copy_)
        return copy_

    def _for(self, args: Sequence[Any], device: torch.device) -> _Run:
        """The traced graph's run for these input shapes and weight versions."""
        key = (device.index, *[(args[i].shape, args[i].dtype) for i in self._free],
               *[args[i] for i in self._fixed])   # non-tensors are baked into the trace
        run = self._traced.get(key)
        if run is not None and run.same_weights(args):
            return run
        with self._lock:
            run = self._traced.get(key)
            if run is None or not run.same_weights(args):   # new shapes, or weights changed
                if run is not None:
                    _release(run.traced)
                run = _Run(self._trace(args, device), args, device, self._free,
                           self.weights)
                self.traces += 1
                self._traced[key] = run
            return run

    def _trace(self, args: Sequence[Any], device: torch.device) -> Any:
        from ..session import model as _model
        from ..tracing import trace

        bound = _Bound(self._cpu_graph(), args, self.weights)
        examples = tuple(args[i].detach().cpu() for i in bound.free)
        with sdp_flags_kept():
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
                if node.op == "call_function" and node.target is _sdpa_kernel:
                    node.target = _sdpa_kernel_on_cpu
            gm.recompile()
            self._cpu_gm = gm
        return self._cpu_gm


_MISS = object()   # a call unlike the run's trace: the general path decides


class _Run:
    """One trace of the graph (for one device, input shapes and weight versions) and
    its per-call path: the inputs copied to the CPU, the core's call, the outputs
    copied to the device.  What a call would recompute is fixed here once: where
    the inputs and weights are among the arguments, what they must match, whether
    the outputs are a flat tuple (as Dynamo's graphs return) that needs no pytree."""

    __slots__ = ("traced", "_model", "_forward", "_device", "_first",
                 "_inputs", "_weights", "_n", "_rows", "_flat")

    def __init__(self, traced: Any, args: Sequence[Any], device: torch.device,
                 free: Sequence[int], weights: Sequence[int]):
        from ..session import model as _model

        self.traced = traced
        self._model = _model.get(getattr(traced, _model.HANDLE_ATTR))
        self._forward = traced.forward
        self._device = device
        # the key's device is the first tensor's, a weight's or an input's
        self._first = next(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        self._inputs = tuple((i, args[i].shape, args[i].dtype) for i in free)
        # a weak reference: the trace holds its own copy of the weights, and a
        # swapped-out Parameter should be free to go
        self._weights = tuple((i, args[i]._version, weakref.ref(args[i])) for i in weights)
        self._n = len(args)
        # the inputs are those traced, so the model need not check them again
        self._rows = self._model.batch
        self._flat: Optional[bool] = None   # known after the first call's outputs

    def call_if_same(self, args: Sequence[Any]) -> Any:
        """The call's outputs if it matches this trace (devices, shapes, dtypes and
        weight versions, no CPU tensor), else _MISS."""
        device = self._device
        if len(args) != self._n or args[self._first].device != device:
            return _MISS
        xs = []
        for i, shape, dtype in self._inputs:
            x = args[i]
            if x.shape != shape or x.dtype != dtype or x.device != device:
                return _MISS
            xs.append(x.cpu())   # grad is off: nothing to detach from
        if not self.same_weights(args):
            return _MISS
        return self._outputs(xs)

    def same_weights(self, args: Sequence[Any]) -> bool:
        """Whether the weights among ``args`` are those traced, unchanged since."""
        for i, version, ref in self._weights:
            w = args[i]
            if ref() is not w or w._version != version or w.is_cpu:
                return False
        return True

    def __call__(self, args: Sequence[Any]) -> Any:
        return self._outputs([args[i].detach().cpu() for i, _, _ in self._inputs])

    def _outputs(self, xs: List[torch.Tensor]) -> Any:
        device = self._device
        if self._flat:
            flat = self._model.submit(xs, rows=self._rows, future=False).result()
            return tuple([t.to(device) for t in flat])
        out = self._forward(*xs)
        if self._flat is None:
            self._flat = type(out) is tuple and all(isinstance(t, torch.Tensor) for t in out)
        if isinstance(out, torch.Tensor):
            return out.to(device)
        if type(out) in (tuple, list):
            return type(out)(t.to(device) if isinstance(t, torch.Tensor) else t for t in out)
        return _pytree.tree_map(
            lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, out)


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


def _cpu_device(v: Any) -> Any:
    if isinstance(v, torch.device) and v.type == "neuron":
        return torch.device("cpu")
    return v


def _eager_reason(gm: torch.fx.GraphModule) -> Optional[str]:
    """Why the graph must run eagerly in the caller, or None: an in-place update of
    a tensor (a trace runs on copies and would lose it), a random draw (the caller's
    generators, as TorchNeuron draws its masks on the CPU generator), no output."""
    for node in gm.graph.nodes:
        if node.op == "output":
            if not _pytree.tree_leaves(node.args):
                return "no outputs"
            continue
        if node.op not in ("call_function", "call_method"):
            continue
        target = node.target
        name = target if isinstance(target, str) else getattr(target, "__name__", "")
        if target in _IN_PLACE or name in ("__setitem__", "__delitem__") or (
                name.endswith("_") and not name.endswith("__")) or \
                node.kwargs.get("out") is not None:
            return "in-place update"
        if target in _RANDOM or name in _RANDOM_NAMES or _dropout_in_sdpa(node):
            return "random numbers"
    return None


# what Dynamo records for `t[i] = v`, `t += v` and the like on a tensor
_IN_PLACE = frozenset({
    operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul,
    operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow,
    operator.imatmul, operator.iand, operator.ior, operator.ixor, operator.ilshift,
    operator.irshift})
_RANDOM_NAMES = frozenset({
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
    "feature_alpha_dropout", "rrelu", "rand", "randn", "randint", "rand_like",
    "randn_like", "randint_like", "randperm", "bernoulli", "multinomial", "normal",
    "poisson", "native_dropout", "gumbel_softmax"})
_RANDOM = frozenset({torch.nn.functional.dropout, torch.nn.functional.alpha_dropout,
                     torch.nn.functional.feature_alpha_dropout, torch.dropout,
                     torch.bernoulli, torch.rand, torch.randn, torch.randint,
                     torch.randperm, torch.normal, torch.multinomial})


def _dropout_in_sdpa(node: torch.fx.Node) -> bool:
    if getattr(node.target, "__name__", "") != "scaled_dot_product_attention":
        return False
    p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
    return not isinstance(p, (int, float)) or p > 0.0


def _version(t: torch.Tensor) -> Optional[int]:
    """A tensor's version counter; None for an inference tensor (it keeps none)."""
    try:
        return t._version
    except RuntimeError:
        return None


from torch.nn.attention import SDPBackend as _SDPBackend  # noqa: E402
from torch.nn.attention import _sdpa_kernel  # noqa: E402


def _sdpa_kernel_on_cpu(backends: Sequence[Any], set_priority: bool = False) -> None:
    """A graph's ``sdpa_kernel`` selection, on the CPU the emulation computes with:
    OVERRIDEABLE (a device's own attention kernel, TorchNeuron's) is the math kernel
    here, as the CPU has no overrideable one."""
    backends = list(backends)
    if _SDPBackend.OVERRIDEABLE in backends and _SDPBackend.MATH not in backends:
        backends.append(_SDPBackend.MATH)
    _sdpa_kernel(backends, set_priority)


@contextlib.contextmanager
def sdp_flags_kept() -> Iterator[None]:
    """Run a graph in the caller with its attention-backend flags restored after:
    a graph records ``sdpa_kernel`` blocks as flag calls, and one that raises
    between its set and its reset would leave them set for the caller."""
    from torch.nn.attention import _cur_sdpa_kernel_backends

    enabled = _cur_sdpa_kernel_backends()
    order = torch._C._get_sdp_priority_order()
    try:
        yield
    finally:
        _sdpa_kernel(enabled)
        torch._C._set_sdp_priority_order(order)


def _release(traced: Any) -> None:
    from ..session import model as _model

    try:
        _model.get(getattr(traced, _model.HANDLE_ATTR)).close()
    except (KeyError, AttributeError):
        pass
