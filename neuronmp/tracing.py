"""``neuronmp.trace`` and ``neuronmp.dynamic_batch``: compiling a model into one fused op.

    func, example_inputs
        │ run once: output structure (tuple/list/dict tree of tensors)
        │ torch.jit.trace(func with outputs flattened to a tuple)      -> inner graph
        │ torch.jit.script(runner(inner)): forward(n_chunks, *inputs)   -> "compiled graph"
        │ torch.jit.save(runner) -> bytes (what each core's worker loads)
        ▼
    torch.jit.script(wrapper): attributes nmp_graph (uint8 tensor of those bytes),
        nmp_meta (JSON signature), nmp_handle, dynamic_batch;
        forward(x...) = rebuild_outputs(neuronmp::forward(nmp_handle, [x...]))
        __setstate__ = neuronmp::register(...)  -> each torch.jit.load is a new model

The wrapper and the runner are generated per input arity and output structure
(TorchScript has no varargs), compiled from source kept in ``linecache`` so that
TorchScript can read it.  Placement is not in the graph: it lives with the model
registered for the handle, so the placement API can change it after loading.
"""
from __future__ import annotations

import hashlib
import inspect
import io
import json
import keyword
import linecache
import os
import shlex
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from . import _torchscript, pytree
from . import devicetime as _devicetime
from . import model as _model
from . import ops as _ops  # noqa: F401  (registers neuronmp::forward, used by the wrapper)

FORMAT = 1
_classes: Dict[str, type] = {}
_RESERVED = {"self", "r", "b", "i", "n", "torch", "Tensor", "List", "Tuple"}


def trace(
    func: Any,
    example_inputs: Union[torch.Tensor, Sequence[torch.Tensor]],
    *,
    compiler_workdir: Optional[Union[str, os.PathLike]] = None,
    compiler_args: Optional[Union[str, Sequence[str]]] = None,
    device_time: _devicetime.Spec = None,
) -> torch.jit.ScriptModule:
    """Trace ``func`` on ``example_inputs`` into a ScriptModule that runs on a NeuronCore.

    The result's graph is a single ``neuronmp::forward`` op carrying the traced graph;
    it round-trips through ``torch.jit.save``/``torch.jit.load`` and takes CPU tensors
    of exactly the traced shapes and dtypes (see :func:`dynamic_batch`).  It is placed
    like a loaded model: on the least-used visible core, or as the active
    ``neuron_cores_context``/``multicore_context`` says.

        trace = neuronmp.trace(model, torch.rand(1, 3, 8, 8))
        torch.jit.save(trace, "model.pt")
        trace(torch.rand(1, 3, 8, 8))            # runs on a NeuronCore worker

    ``compiler_workdir`` receives ``graph.pt`` (the compiled graph a core loads) and
    ``metadata.json`` (input/output signature, compiler arguments);
    ``compiler_args`` (a string or list of strings) is validated and recorded there.
    ``device_time`` gives the model a latency model (microseconds, ``"FIXED,PER_ROW"``
    or a ``{batch size: us}`` table): its cores never answer sooner, and sleep
    rather than compute meanwhile (see :mod:`neuronmp.devicetime`).
    """
    inputs = _example_tuple(example_inputs)
    args = _compiler_args(compiler_args)
    latency = _devicetime.parse(device_time)
    if not callable(func):
        raise TypeError(f"neuronmp.trace: func must be a torch.nn.Module or a callable, "
                        f"got {type(func).__name__}")
    with torch.no_grad():
        spec = pytree.spec_of(func(*inputs))
    graph, any_batch = _compile(func, spec, inputs)
    meta = {
        "format": FORMAT,
        "inputs": [[list(x.shape), str(x.dtype).replace("torch.", "")] for x in inputs],
        "outputs": spec,
        "batch": _common_batch(inputs),
        "any_batch": any_batch,
        "names": _param_names(func, len(inputs)),
        "compiler_args": args,
        "torch": torch.__version__,
    }
    if latency is not None:
        meta["device_time"] = latency.to_meta()
    meta_json = json.dumps(meta, sort_keys=True)
    if compiler_workdir is not None:
        _write_workdir(compiler_workdir, graph, meta)
    wrapper_cls = _generated_wrapper(meta["names"], spec)
    graph_tensor = torch.frombuffer(bytearray(graph), dtype=torch.uint8)
    with _torchscript.quiet():
        module = torch.jit.script(wrapper_cls(graph_tensor, meta_json))
    handle = _model.attach(getattr(module, _model.GRAPH_ATTR), meta_json, False)
    setattr(module, _model.HANDLE_ATTR, handle)
    _python_forward(module, _model.get(handle), spec)
    return module


def _compile(func: Any, spec: Any, inputs: Tuple[torch.Tensor, ...]) -> Tuple[bytes, bool]:
    """The compiled graph a core loads (the traced function behind a scripted runner),
    and whether that graph takes any multiple of the traced batch in one call."""
    with _torchscript.quiet():
        with torch.no_grad():
            inner = torch.jit.trace(_Flat(func, spec), inputs, check_trace=False)
            any_batch = _takes_any_batch(inner, inputs)
        runner = torch.jit.script(
            _generated_runner(len(inputs), pytree.leaves(spec), any_batch)(inner))
        buf = io.BytesIO()
        torch.jit.save(runner, buf)
    return buf.getvalue(), any_batch


def _takes_any_batch(inner: Any, inputs: Tuple[torch.Tensor, ...]) -> bool:
    """Whether one call of the traced graph on two stacked batches equals two calls.

    A trace may bake the batch size in (``x.view(1, -1)``, a reduction over dim 0):
    then a worker must run a chunk of several traced batches one batch at a time.
    Checked once, here, on the example inputs and a perturbed copy of them.
    """
    if _common_batch(inputs) is None:
        return False
    other = tuple(x + torch.rand_like(x) if x.is_floating_point() else x.flip(0)
                  for x in inputs)
    try:
        apart = [torch.cat(pair) for pair in zip(inner(*inputs), inner(*other))]
        together = inner(*(torch.cat(pair) for pair in zip(inputs, other)))
    except Exception:  # noqa: BLE001 - a graph that refuses the bigger batch is fixed-size
        return False
    return len(apart) == len(together) and all(
        a.shape == t.shape and a.dtype == t.dtype and
        (torch.allclose(a, t, rtol=1e-4, atol=1e-5) if a.is_floating_point() else
         torch.equal(a, t)) for a, t in zip(apart, together))


def _python_forward(module: torch.jit.ScriptModule, model: _model.Model, spec: Any) -> None:
    """Call the model straight from Python on the object trace() returns.

    The TorchScript forward stays for torch.jit.save and for use inside other
    scripted modules; called from Python, this skips the interpreter (tens of
    microseconds) and lets input errors surface as the ValueError/TypeError they
    are, where the interpreter would turn them into RuntimeError.
    """
    module.__dict__["forward"] = _PythonForward(module.forward, model, spec)


class _PythonForward:
    """A traced module's forward when called from Python; TorchScript facts (code, graph,
    schema) are those of the scripted forward."""

    def __init__(self, script_forward: Any, model: _model.Model, spec: Any):
        self._script = script_forward
        self._model = model
        self._spec = spec
        self._single = spec if isinstance(spec, int) else None

    def __call__(self, *args, **kwargs):
        if kwargs:
            return self._script(*args, **kwargs)
        flat = self._model.run(args)
        if self._single is not None:
            return flat[self._single]
        return pytree.unflatten(flat, self._spec)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._script, name)


def dynamic_batch(neuron_script: torch.nn.Module) -> torch.nn.Module:
    """Let a traced model take any dim-0 batch size; modifies it in place and returns it.

    A batch is cut into chunks of the traced batch size (the last one padded), the
    chunks run on all the model's cores at once, and the padding is stripped from
    the outputs.  Every input must share its dim-0 size, and the other dimensions
    must match the trace, or the call raises ValueError.

        neuron_net = neuronmp.dynamic_batch(neuronmp.trace(net, torch.rand(1, 1, 3, 3)))
        neuron_net(torch.rand(8, 1, 3, 3))
    """
    wrappers = _model.wrappers_in(neuron_script)
    if not wrappers:
        raise ValueError(
            f"neuronmp.dynamic_batch expects a model made by neuronmp.trace (or containing "
            f"one), got {type(neuron_script).__name__} with no neuronmp subgraph"
        )
    models = [_model.model_of(w) for w in wrappers]
    for model in models:
        if model.batch is None:
            raise ValueError(
                "dynamic batching needs every traced input to share its dim-0 size, but "
                f"this model was traced with inputs {model.describe_signature()}"
            )
    for wrapper, model in zip(wrappers, models):
        model.dynamic = True
        setattr(wrapper, _model.DYNAMIC_ATTR, True)
    return neuron_script


# -- inputs, outputs, arguments -------------------------------------------------------


def _example_tuple(example_inputs: Any) -> Tuple[torch.Tensor, ...]:
    items = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else example_inputs
    if not isinstance(items, (tuple, list)) or not items:
        raise TypeError(
            "neuronmp.trace: example_inputs must be a tensor or a non-empty tuple of "
            f"tensors, got {type(example_inputs).__name__}"
        )
    for i, x in enumerate(items):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"neuronmp.trace: example input {i} must be a torch.Tensor, "
                            f"got {type(x).__name__}")
        if x.device.type != "cpu":
            raise ValueError(f"neuronmp.trace: example input {i} is on {x.device}; "
                             "traced models consume CPU tensors")
    return tuple(items)


def _compiler_args(compiler_args: Any) -> List[str]:
    if compiler_args is None:
        return []
    if isinstance(compiler_args, str):
        return shlex.split(compiler_args)
    if isinstance(compiler_args, (list, tuple)):
        for a in compiler_args:
            if not isinstance(a, str) or not a.strip() or "\0" in a:
                raise TypeError(
                    "neuronmp.trace: compiler_args must be a string or a list of non-empty "
                    f"strings, got element {a!r} in {compiler_args!r}"
                )
        return list(compiler_args)
    raise TypeError(
        "neuronmp.trace: compiler_args must be a string or a list of strings, "
        f"got {type(compiler_args).__name__}: {compiler_args!r}"
    )


def _common_batch(inputs: Sequence[torch.Tensor]) -> Optional[int]:
    sizes = {x.shape[0] if x.dim() else None for x in inputs}
    size = sizes.pop() if len(sizes) == 1 else None
    return size or None


def _param_names(func: Any, count: int) -> List[str]:
    target = func.forward if isinstance(func, torch.nn.Module) else func
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    ok = len(names) >= count and all(
        n.isidentifier() and not keyword.iskeyword(n) and n not in _RESERVED
        and not n.startswith("_") for n in names[:count]
    )
    return names[:count] if ok and len(set(names[:count])) == count else [
        f"x{i}" for i in range(count)]


def _write_workdir(workdir: Union[str, os.PathLike], graph: bytes, meta: Dict[str, Any]) -> None:
    try:
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "graph.pt"), "wb") as f:
            f.write(graph)
        with open(os.path.join(workdir, "metadata.json"), "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
    except OSError as exc:
        raise OSError(exc.errno, f"neuronmp.trace: cannot write compiler_workdir "
                      f"{os.fspath(workdir)!r}: {exc.strerror}") from exc


class _Flat(torch.nn.Module):
    """``func`` with its outputs flattened into a tuple, for torch.jit.trace."""

    def __init__(self, func: Any, spec: Any):
        super().__init__()
        self.func = func
        self.spec = spec

    def forward(self, *args):
        return tuple(pytree.flatten(self.func(*args), self.spec))


# -- generated TorchScript classes -------------------------------------------------------

_WRAPPER = '''\
import torch
from torch import Tensor
from typing import Tuple


class {name}(torch.nn.Module):
    nmp_handle: int
    nmp_meta: str
    dynamic_batch: bool

    def __init__(self, graph: Tensor, meta: str):
        super().__init__()
        self.nmp_graph = graph
        self.nmp_meta = meta
        self.nmp_handle = 0
        self.dynamic_batch = False

    def forward(self, {params}):
        r = torch.ops.neuronmp.forward(self.nmp_handle, [{args}])
        return {result}

    @torch.jit.export
    def __getstate__(self) -> Tuple[Tensor, str, bool, bool]:
        return (self.nmp_graph, self.nmp_meta, self.dynamic_batch, self.training)

    @torch.jit.export
    def __setstate__(self, state: Tuple[Tensor, str, bool, bool]) -> None:
        self.nmp_graph = state[0]
        self.nmp_meta = state[1]
        self.dynamic_batch = state[2]
        self.training = state[3]
        self.nmp_handle = torch.ops.neuronmp.register(state[0], state[1], state[2])
'''

_RUNNER = '''\
import torch
from torch import Tensor
from typing import List


class {name}(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, n: int, {params}) -> List[Tensor]:
        with torch.no_grad():
            if n == 1 or {any_batch}:
                r = self.inner({args})
                return [{outs}]
            b = {first}.size(0) // n
{lists}
            for i in range(n):
                r = self.inner({sliced})
{appends}
            return [{cats}]
'''


def _generated_wrapper(names: List[str], spec: Any) -> type:
    params = ", ".join(f"{n}: Tensor" for n in names)
    source = _WRAPPER.format(name="{name}", params=params, args=", ".join(names),
                             result=_expr(spec))
    return _compile_class("NeuronModule", source)


def _generated_runner(n_inputs: int, n_outputs: int, any_batch: bool = False) -> type:
    xs = [f"x{i}" for i in range(n_inputs)]
    source = _RUNNER.format(
        name="{name}",
        params=", ".join(f"{x}: Tensor" for x in xs),
        args=", ".join(xs),
        outs=", ".join(f"r[{j}]" for j in range(n_outputs)),
        first=xs[0],
        lists="\n".join(f"            o{j}: List[Tensor] = []" for j in range(n_outputs)),
        sliced=", ".join(f"{x}.narrow(0, i * b, b)" for x in xs),
        appends="\n".join(f"                o{j}.append(r[{j}])" for j in range(n_outputs)),
        cats=", ".join(f"torch.cat(o{j})" for j in range(n_outputs)),
        any_batch=str(bool(any_batch)),
    )
    return _compile_class("NeuronRunner", source)


def _expr(spec: Any) -> str:
    if isinstance(spec, int):
        return f"r[{spec}]"
    kind, children = spec
    if kind == "dict":
        return "{" + ", ".join(f"{json.dumps(k)}: {_expr(c)}" for k, c in children) + "}"
    inner = ", ".join(_expr(c) for c in children)
    return f"({inner},)" if kind == "tuple" else f"[{inner}]"


def _compile_class(prefix: str, template: str) -> type:
    """Exec generated source under a linecache filename, so TorchScript can read it."""
    digest = hashlib.sha1(template.encode()).hexdigest()[:12]
    name = f"{prefix}_{digest}"
    cls = _classes.get(name)
    if cls is None:
        source = template.replace("{name}", name)
        filename = f"<neuronmp-generated {name}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        namespace: Dict[str, Any] = {"__name__": "neuronmp.traced"}
        exec(compile(source, filename, "exec", dont_inherit=True), namespace)
        cls = _classes[name] = namespace[name]
    return cls
