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

With ``batch_buckets`` the function is traced once per bucket (the example's rows
repeated or cut to that size) and the runner holds the graphs as ``inner_b<size>``,
running the one whose size is its input's dim 0; the weights are stored once.

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
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from . import ops as _ops  # noqa: F401  (registers neuronmp::forward, used by the wrapper)
from .host import _torchscript
from .host import devicetime as _devicetime
from .session import chunking, pytree
from .session import model as _model
from .session import sdkargs as _sdkargs

FORMAT = 1
_classes: Dict[str, type] = {}
_RESERVED = {"self", "r", "b", "i", "n", "torch", "Tensor", "List", "Tuple"}


def trace(
    func: Any,
    example_inputs: Union[torch.Tensor, Sequence[torch.Tensor]],
    *_: Any,
    compiler_workdir: Optional[Union[str, os.PathLike]] = None,
    compiler_args: Optional[Union[str, Sequence[str]]] = None,
    device_time: _devicetime.Spec = None,
    batch_buckets: Optional[Sequence[int]] = None,
    input_output_aliases: Optional[Dict[Any, int]] = None,
    partitioner_config: Any = None,
    inline_weights_to_neff: bool = True,
    cpu_backend: bool = False,
    dynamic_batch_size: bool = False,
    fallback: bool = True,
    minimum_segment_size: Optional[int] = None,
    compiler_timeout: Optional[float] = None,
    optimizations: Optional[Sequence[Any]] = None,
    subgraph_builder_function: Optional[Any] = None,
    strict: bool = True,
    check_trace: bool = False,
    check_inputs: Optional[Sequence[Any]] = None,
    check_tolerance: float = 1e-5,
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
    ``metadata.json`` (input/output signature, compiler arguments, SDK keywords);
    ``compiler_args`` (a string or list of strings) is validated and recorded there;
    of them neuronmp acts on neuronx-cc's optimization level: ``--optlevel 3`` (or
    ``-O3``) stores each ``Linear``'s weight laid out for the core's matmul (a serving
    batch's forward costs about a fifth less; the outputs equal torch's up to fp32
    rounding instead of bit for bit), 1 and 2 (the default) keep torch's layout.
    ``device_time`` gives the model a latency model (microseconds, ``"FIXED,PER_ROW"``
    or a ``{batch size: us}`` table): its cores never answer sooner, and sleep
    rather than compute meanwhile (see :mod:`neuronmp.host.devicetime`).

    ``batch_buckets`` (e.g. ``(1, 4, 8, 16, 32)``, strictly increasing, holding the
    example's batch size) traces one graph per batch size into the one artifact, as
    NxD Inference compiles its batch buckets: a call with ``r`` rows runs the graph of
    the smallest bucket that holds them (padded, the padding stripped), a batch past
    the largest is split; any dim-0 size is accepted (:class:`BatchBucketsError` for a
    bad list).  See docs/guides/batch-buckets.md.

    The SDK keywords of both generations are accepted and checked (a wrong type or
    value raises TypeError/ValueError naming the keyword).  Honoured here:
    ``inline_weights_to_neff`` (False lets :func:`neuronmp.replace_weights` swap the
    weights), torch-neuron's ``dynamic_batch_size`` (True: :func:`dynamic_batch` on the
    result) and the keywords torch-neuron forwards to ``torch.jit.trace`` (``strict``,
    ``check_trace``, ``check_inputs``, ``check_tolerance``).  The others
    (``input_output_aliases``, ``partitioner_config``, ``cpu_backend``, ``fallback``,
    ``minimum_segment_size``, ``compiler_timeout``, ``optimizations``,
    ``subgraph_builder_function``, extra positional arguments) steer the Neuron
    compiler, which neuronmp does not have: given with a non-default value they are
    recorded and named in one warning.
    """
    inputs = _sdkargs.example_tuple(example_inputs)
    buckets = None if batch_buckets is None else chunking.check_buckets(
        batch_buckets, _common_batch(inputs))
    args = _compiler_args(compiler_args)
    layout = _optlevel(args) >= 3
    latency = _devicetime.parse(device_time)
    if not callable(func):
        raise TypeError(f"neuronmp.trace: func must be a torch.nn.Module or a callable, "
                        f"got {type(func).__name__}")
    sdk = _sdk_options(locals(), _)
    jit = {"strict": strict, "check_trace": check_trace, "check_inputs": check_inputs,
           "check_tolerance": check_tolerance}
    with torch.no_grad():
        spec = pytree.spec_of(func(*inputs))
    graph, any_batch = _compile(func, spec, inputs, jit, buckets, layout)
    meta = {
        "format": FORMAT,
        "inputs": [[list(x.shape), str(x.dtype).replace("torch.", "")] for x in inputs],
        "outputs": spec,
        "batch": _common_batch(inputs),
        "any_batch": any_batch,
        "names": _param_names(func, len(inputs)),
        "compiler_args": args,
        "torch": torch.__version__,
        "inline_weights_to_neff": inline_weights_to_neff,
        "sdk_options": sdk,
    }
    if latency is not None:
        meta["device_time"] = latency.to_meta()
    if buckets is not None:
        meta["batch_buckets"] = list(buckets)
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
    if dynamic_batch_size:
        dynamic_batch(module)
    return module


def _compile(func: Any, spec: Any, inputs: Tuple[torch.Tensor, ...],
             jit: Optional[Dict[str, Any]] = None,
             buckets: Optional[Sequence[int]] = None,
             matmul_layout: bool = False) -> Tuple[bytes, bool]:
    """The compiled graph a core loads (the traced function behind a scripted runner),
    and whether that graph takes any multiple of the traced batch in one call.
    ``jit``: the keywords torch-neuron forwards to ``torch.jit.trace``.  With
    ``buckets``, the runner holds one traced graph per bucket (the example's is
    ``inner``, as without buckets) and runs the one of its input's batch size.
    ``matmul_layout``: the Linear weights stored for the core's matmul (see
    ``_lay_out_linear_weights``)."""
    jit = dict(jit or {"check_trace": False})
    if jit.get("check_inputs") is not None:
        jit["check_inputs"] = [_sdkargs.example_tuple(x) for x in jit["check_inputs"]]
    flat = pytree.FlatOutputs(func, spec)
    with _torchscript.quiet():
        with torch.no_grad():
            inner = torch.jit.trace(flat, inputs, **jit)
            any_batch = _takes_any_batch(inner, inputs)
            if buckets:
                graphs = [inner if b == inputs[0].shape[0] else torch.jit.trace(
                    flat, _rows_of(inputs, b), check_trace=False) for b in buckets]
            if matmul_layout:
                _lay_out_linear_weights(graphs if buckets else [inner])
        if buckets:
            runner = torch.jit.script(_generated_bucket_runner(
                len(inputs), pytree.leaves(spec), buckets)(graphs))
        else:
            runner = torch.jit.script(
                _generated_runner(len(inputs), pytree.leaves(spec), any_batch)(inner))
        buf = io.BytesIO()
        torch.jit.save(runner, buf)
    return buf.getvalue(), any_batch


def _optlevel(args: Sequence[str]) -> int:
    """The optimization level neuronx-cc would take from ``args`` (``--optlevel N``,
    ``--optlevel=N`` or ``-ON``; its default is 2); the last one given wins."""
    level = 2
    for i, a in enumerate(args):
        if a == "--optlevel":
            value = args[i + 1] if i + 1 < len(args) else "(none)"
        elif a.startswith("--optlevel="):
            value = a.split("=", 1)[1]
        elif a.startswith("-O") and len(a) == 3:
            value = a[2]
        else:
            continue
        if value not in ("1", "2", "3"):
            raise ValueError(f"neuronmp.trace: compiler_args {list(args)!r} give optimization "
                             f"level {value!r}: expected 1, 2 or 3 (--optlevel N or -ON)")
        level = int(value)
    return level


def _lay_out_linear_weights(graphs: Sequence[torch.jit.ScriptModule]) -> None:
    """Store each Linear's weight column-major: the same values, its transpose contiguous.

    ``aten::linear`` multiplies by the weight's transpose.  Stored row-major (as
    torch makes it), that transpose is what MKL's sgemm must repack on every call,
    which for the few rows of a serving batch costs as much as the product itself;
    column-major, the transpose is already the matrix sgemm reads.  The graph is
    unchanged and every op sees the same values, so the outputs differ from torch's
    only by the rounding of another summation order (docs/guides/batch-buckets.md).
    The weights stay parameters (shared between cores as before), one copy for all
    the bucket graphs; the traced module's own parameters are left alone."""
    made: Dict[int, torch.Tensor] = {}
    for graph in graphs:
        for _, sub in graph.named_modules():
            weight = getattr(sub, "weight", None) \
                if getattr(sub, "original_name", "") == "Linear" else None
            if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or \
                    not weight.is_contiguous() or weight.is_sparse:
                continue
            key = (weight.data_ptr(), tuple(weight.shape))
            laid = made.get(key)
            if laid is None:
                laid = made[key] = torch.nn.Parameter(
                    weight.detach().t().contiguous().t(), requires_grad=weight.requires_grad)
            sub.weight = laid


def _rows_of(inputs: Tuple[torch.Tensor, ...], rows: int) -> Tuple[torch.Tensor, ...]:
    """The example inputs with ``rows`` rows: theirs repeated in order, or cut."""
    index = torch.arange(rows) % inputs[0].shape[0]
    return tuple(x.index_select(0, index) for x in inputs)


_SIGNED_TWIN = {torch.uint16: torch.int16, torch.uint32: torch.int32,
                torch.uint64: torch.int64}


def _takes_any_batch(inner: Any, inputs: Tuple[torch.Tensor, ...]) -> bool:
    """Whether one call of the traced graph on two stacked batches equals two calls.

    A trace may bake the batch size in (``x.view(1, -1)``, a reduction over dim 0):
    then a worker must run a chunk of several traced batches one batch at a time.
    Checked once, here, on the example inputs and a perturbed copy of them.
    """
    if _common_batch(inputs) is None:
        return False
    try:
        # torch has no flip for some dtypes (uint16/32/64): a failure is the check's
        other = tuple(x + torch.rand_like(x) if x.is_floating_point() else _rows_reversed(x)
                      for x in inputs)
        apart = [torch.cat(pair) for pair in zip(inner(*inputs), inner(*other))]
        together = inner(*(torch.cat(pair) for pair in zip(inputs, other)))
    except Exception:  # noqa: BLE001 - a graph that refuses the bigger batch is fixed-size
        return False
    return len(apart) == len(together) and all(
        a.shape == t.shape and a.dtype == t.dtype and
        (torch.allclose(a, t, rtol=1e-4, atol=1e-5) if a.is_floating_point() else
         torch.equal(a, t)) for a, t in zip(apart, together))


def _rows_reversed(x: torch.Tensor) -> torch.Tensor:
    """``x``'s rows in reverse order, for every dtype: torch has no flip kernel for
    the wide unsigned ones, so those are flipped as the signed dtype of their size."""
    signed = _SIGNED_TWIN.get(x.dtype)
    return x.flip(0) if signed is None else x.view(signed).flip(0).view(x.dtype)


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


def dynamic_batch(neuron_script: torch.nn.Module,
                  enable_dynamic_batch: bool = True) -> torch.nn.Module:
    """Let a traced model take any dim-0 batch size; modifies it in place and returns it.

    A batch is cut into chunks of the traced batch size (the last one padded), the
    chunks run on all the model's cores at once, and the padding is stripped from
    the outputs.  Every input must share its dim-0 size, and the other dimensions
    must match the trace, or the call raises ValueError.
    ``enable_dynamic_batch=False`` turns it off again (the SDK's second argument).

        neuron_net = neuronmp.dynamic_batch(neuronmp.trace(net, torch.rand(1, 1, 3, 3)))
        neuron_net(torch.rand(8, 1, 3, 3))
    """
    _sdkargs.check_bool("dynamic_batch", "enable_dynamic_batch", enable_dynamic_batch)
    wrappers = _model.wrappers_in(neuron_script)
    if not wrappers:
        raise ValueError(
            f"neuronmp.dynamic_batch expects a model made by neuronmp.trace (or containing "
            f"one), got {type(neuron_script).__name__} with no neuronmp subgraph"
        )
    models = [_model.model_of(w) for w in wrappers]
    for model in models:
        if enable_dynamic_batch and model.batch is None:
            raise ValueError(
                "dynamic batching needs every traced input to share its dim-0 size, but "
                f"this model was traced with inputs {model.describe_signature()}"
            )
    for wrapper, model in zip(wrappers, models):
        model.dynamic = enable_dynamic_batch
        setattr(wrapper, _model.DYNAMIC_ATTR, enable_dynamic_batch)
    return neuron_script


# -- the SDK's keywords -----------------------------------------------------------------

#: keyword -> (its SDK default, why it has no effect here)
_NO_EFFECT = {
    "input_output_aliases": (None, "no device memory to alias: inputs and outputs travel "
                             "through shared memory on every call"),
    "partitioner_config": (None, "nothing is partitioned: the whole graph runs on a core"),
    "cpu_backend": (False, "every model runs on CPU workers already"),
    "fallback": (True, "every operator runs on the core, none falls back"),
    "minimum_segment_size": (None, "nothing is partitioned"),
    "compiler_timeout": (None, "there is no compiler to time out"),
    "optimizations": (None, "there is no compiler to optimize"),
    "subgraph_builder_function": (None, "nothing is partitioned"),
}


def _sdk_options(given: Dict[str, Any], extra_positional: Tuple[Any, ...]) -> Dict[str, Any]:
    """Check every SDK keyword of trace(); warn once for those that do nothing here; the
    JSON-able record of all of them for the metadata."""
    _check_sdk_types(given)
    record = {name: _recordable(given[name]) for name in (
        *_NO_EFFECT, "inline_weights_to_neff", "dynamic_batch_size", "strict",
        "check_trace", "check_tolerance")}
    record["check_inputs"] = None if given["check_inputs"] is None else len(given["check_inputs"])
    ignored = [name for name, (default, _) in _NO_EFFECT.items() if given[name] != default
               and not (name == "input_output_aliases" and not given[name])]
    if extra_positional:
        record["extra_positional"] = len(extra_positional)
        ignored.append(f"{len(extra_positional)} extra positional argument(s)")
    if ignored:
        reasons = "; ".join(f"{n}: {_NO_EFFECT[n][1]}" if n in _NO_EFFECT else n
                            for n in ignored)
        warnings.warn(f"neuronmp.trace: {', '.join(ignored)} accepted and recorded, but "
                      f"they have no effect here ({reasons})",
                      stacklevel=_sdkargs.caller_stacklevel())
    return record


def _check_sdk_types(given: Dict[str, Any]) -> None:
    for name in ("inline_weights_to_neff", "cpu_backend", "dynamic_batch_size", "fallback",
                 "strict", "check_trace"):
        _sdkargs.check_bool("trace", name, given[name])
    aliases = given["input_output_aliases"]
    if aliases is not None:
        if not isinstance(aliases, dict):
            raise TypeError(f"neuronmp.trace: input_output_aliases must be a dict "
                            f"{{tensor: output index}}, got {type(aliases).__name__}")
        for key, index in aliases.items():
            if not isinstance(key, torch.Tensor) or not _is_int(index) or index < 0:
                raise TypeError(f"neuronmp.trace: input_output_aliases maps a tensor to an "
                                f"output index (int >= 0), got {_short(key)}: {index!r}")
    if isinstance(given["partitioner_config"], (bool, int, float, str, bytes)):
        raise TypeError("neuronmp.trace: partitioner_config must be a PartitionerConfig-like "
                        f"object or None, got {given['partitioner_config']!r}")
    segment = given["minimum_segment_size"]
    if segment is not None and (not _is_int(segment) or segment < 1):
        raise ValueError(f"neuronmp.trace: minimum_segment_size must be an int >= 1, "
                         f"got {segment!r}")
    timeout = given["compiler_timeout"]
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(
            timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"neuronmp.trace: compiler_timeout must be a number of seconds > 0 "
                         f"or None, got {timeout!r}")
    opts = given["optimizations"]
    if opts is not None and (isinstance(opts, (str, bytes)) or not isinstance(
            opts, (list, tuple, set))):
        raise TypeError(f"neuronmp.trace: optimizations must be a list, got {opts!r}")
    builder = given["subgraph_builder_function"]
    if builder is not None and not callable(builder):
        raise TypeError(f"neuronmp.trace: subgraph_builder_function must be callable, "
                        f"got {builder!r}")
    checks = given["check_inputs"]
    if checks is not None and not isinstance(checks, (list, tuple)):
        raise TypeError(f"neuronmp.trace: check_inputs must be a list of input tuples, "
                        f"got {type(checks).__name__}")
    tol = given["check_tolerance"]
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or tol < 0:
        raise ValueError(f"neuronmp.trace: check_tolerance must be a number >= 0, "
                         f"got {tol!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{list(value.shape)}"
    return repr(value)


def _recordable(value: Any) -> Any:
    """A JSON-able stand-in for a keyword's value in metadata.json."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return [[_short(k), _recordable(v)] for k, v in value.items()]
    if isinstance(value, (list, tuple, set)):
        return [_recordable(v) for v in value]
    if callable(value):
        return getattr(value, "__qualname__", repr(value))
    return repr(value)


# -- inputs, outputs, arguments -------------------------------------------------------


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


_BUCKET_RUNNER = '''\
import torch
from torch import Tensor
from typing import List


class {name}(torch.nn.Module):
    def __init__(self, graphs: List[torch.nn.Module]):
        super().__init__()
{assigns}

    def run(self, {params}) -> List[Tensor]:
        s = {first}.size(0)
{branches}
        raise RuntimeError("neuronmp: no graph traced for a batch of " + str(s) +
                           " rows; batch buckets: {bucket_list}")

    def forward(self, n: int, {params}) -> List[Tensor]:
        with torch.no_grad():
            if n == 1:
                return self.run({args})
            b = {first}.size(0) // n
{lists}
            for i in range(n):
                r = self.run({sliced})
{appends}
            return [{cats}]
'''


def _generated_bucket_runner(n_inputs: int, n_outputs: int, buckets: Sequence[int]) -> type:
    """A runner holding one traced graph per bucket; attribute ``inner_b<size>``."""
    xs = [f"x{i}" for i in range(n_inputs)]
    outs = ", ".join(f"r[{j}]" for j in range(n_outputs))
    source = _BUCKET_RUNNER.format(
        name="{name}",
        assigns="\n".join(f"        self.inner_b{b} = graphs[{i}]"
                          for i, b in enumerate(buckets)),
        params=", ".join(f"{x}: Tensor" for x in xs),
        args=", ".join(xs),
        first=xs[0],
        branches="\n".join(f"        if s == {b}:\n            r = self.inner_b{b}("
                           f"{', '.join(xs)})\n            return [{outs}]" for b in buckets),
        bucket_list=", ".join(map(str, buckets)),
        lists="\n".join(f"            o{j}: List[Tensor] = []" for j in range(n_outputs)),
        sliced=", ".join(f"{x}.narrow(0, i * b, b)" for x in xs),
        appends="\n".join(f"                o{j}.append(r[{j}])" for j in range(n_outputs)),
        cats=", ".join(f"torch.cat(o{j})" for j in range(n_outputs)),
    )
    return _compile_class("NeuronBucketRunner", source)


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
