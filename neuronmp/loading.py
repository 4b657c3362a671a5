"""When, where and with which weights a traced model is loaded: the SDK's loading API.

    lazy_load(trace)              the saved model loads at its first call, not at torch.jit.load
    async_load(trace)             ... loads in a background thread; the first call waits for it
    move_trace_to_device(trace, i)  the model moves to nc:i (the placement API's set_neuron_cores)
    replace_weights(trace, w)     new weights: the graph is rewritten and loaded again on the
                                  cores the model holds ("load this model again", no new
                                  worker message)

The two load flags live in the wrapper's metadata string, so they travel with
``torch.jit.save`` and act when the saved model is loaded (model.new_model reads them).
"""
from __future__ import annotations

import io
import json
import re
import warnings
from typing import Any, Dict, List, Mapping, Union

import torch

from . import placement as _placement
from .host import _torchscript
from .session import model as _model
from .session import sdkargs as _sdkargs

__all__ = ["lazy_load", "async_load", "move_trace_to_device", "replace_weights"]

#: where a traced function's parameters sit inside the graph a core loads:
#: runner.inner (torch.jit.trace of pytree.FlatOutputs) .func (the user's module)
#: (a bucketed trace's runner holds one such graph per bucket: inner_b<size>)
_WEIGHT = re.compile(r"inner(?:_b\d+)?\.func\.(.+)")


def lazy_load(trace: torch.nn.Module, enable_lazy_load: bool = True) -> None:
    """Load the model onto its cores at its first call instead of at ``torch.jit.load``.

    Recorded in the model (saved with ``torch.jit.save``); the copy in this process is
    already loaded and stays so.

        torch_neuronx.lazy_load(trace); torch.jit.save(trace, "model.pt")
        model = torch.jit.load("model.pt")      # no core used yet
        model(x)                                # loads, then runs
    """
    _sdkargs.check_bool("lazy_load", "enable_lazy_load", enable_lazy_load)
    _set_flag(trace, "lazy_load", enable_lazy_load, "lazy_load")


def async_load(trace: torch.nn.Module, enable_async_load: bool = True) -> None:
    """Load the model in a background thread at ``torch.jit.load``, which returns at once;
    its first call waits for the load.  Recorded in the model like :func:`lazy_load`."""
    _sdkargs.check_bool("async_load", "enable_async_load", enable_async_load)
    _set_flag(trace, "async_load", enable_async_load, "async_load")


def move_trace_to_device(trace: torch.nn.Module, device_id: int) -> None:
    """Place every neuronmp subgraph of ``trace`` on NeuronCore ``nc:device_id`` (an index
    among this process's visible cores), unloading it from where it was."""
    if not isinstance(device_id, int) or isinstance(device_id, bool):
        raise TypeError(f"neuronmp.move_trace_to_device: device_id must be an int (a visible "
                        f"NeuronCore index), got {device_id!r}")
    _traced_models(trace, "move_trace_to_device")
    _placement.set_neuron_cores(trace, start_nc=device_id, nc_count=1)


def replace_weights(neuron_model: torch.nn.Module,
                    weights: Union[torch.nn.Module, Mapping[str, torch.Tensor]]) -> None:
    """Swap the weights of a model traced with ``inline_weights_to_neff=False``.

    ``weights`` is the original module with new weights, or its ``state_dict``.  Every
    key must name a parameter or buffer of the traced module, with its shape and dtype
    (a missing key keeps the old tensor).  The cores holding the model load the new
    weights before this returns; later calls see them.  A model traced with inline
    weights (the default) keeps its weights, with a warning, as in the SDK.

        trace = torch_neuronx.trace(network, inp, inline_weights_to_neff=False)
        torch_neuronx.replace_weights(trace, network2.state_dict())
        trace(inp)                              # network2's outputs
    """
    state = _state_dict(weights)
    wrappers = _model.wrappers_in(neuron_model)
    models = _traced_models(neuron_model, "replace_weights")
    # a DataParallel holds one copy of the model per core: they change too
    models += list(getattr(neuron_model, "_replicas", []))
    separated = [m for m in models if m.meta.get("inline_weights_to_neff") is False]
    if not separated:
        warnings.warn("neuronmp.replace_weights: the model has no separated weights (trace it "
                      "with inline_weights_to_neff=False); its weights are unchanged",
                      stacklevel=_sdkargs.caller_stacklevel())
        return
    # by the graph object: a DataParallel's replicas share their model's (one rewrite,
    # and one shared-weight segment on the cores); a graph is a read-only buffer, not
    # always hashable bytes
    graphs: Dict[int, bytes] = {}
    for m in separated:
        if id(m.graph) not in graphs:
            graphs[id(m.graph)] = _with_weights(m.graph, state)
    for m in separated:
        m.replace_graph(graphs[id(m.graph)])
    for wrapper in wrappers:
        m = _model.model_of(wrapper)
        if m in separated:   # torch.jit.save of the wrapper saves the new weights
            graph = getattr(wrapper, _model.GRAPH_ATTR)
            graph.set_(torch.frombuffer(bytearray(m.graph), dtype=torch.uint8))


# -- helpers -------------------------------------------------------------------------


def _traced_models(trace: Any, who: str) -> List[_model.Model]:
    models = _model.models_in(trace)
    if not models:
        raise ValueError(f"neuronmp.{who} expects a model made by neuronmp.trace (or "
                         f"containing one), got {type(trace).__name__} with no neuronmp subgraph")
    return models


def _set_flag(trace: torch.nn.Module, flag: str, on: bool, who: str) -> None:
    _traced_models(trace, who)
    for wrapper in _model.wrappers_in(trace):
        m = _model.model_of(wrapper)
        m.meta[flag] = on
        setattr(wrapper, _model.META_ATTR, json.dumps(m.meta, sort_keys=True))


def _state_dict(weights: Any) -> Dict[str, torch.Tensor]:
    if isinstance(weights, torch.nn.Module):
        return dict(weights.state_dict())
    if isinstance(weights, Mapping):
        for key, value in weights.items():
            if not isinstance(key, str) or not isinstance(value, torch.Tensor):
                raise TypeError(f"neuronmp.replace_weights: weights must map names to tensors, "
                                f"got {key!r}: {type(value).__name__}")
        return dict(weights)
    raise TypeError(f"neuronmp.replace_weights: weights must be a torch.nn.Module or a "
                    f"state_dict, got {type(weights).__name__}")


def _with_weights(graph: bytes, state: Dict[str, torch.Tensor]) -> bytes:
    """The compiled graph with ``state``'s tensors in place of its weights."""
    with _torchscript.quiet():
        runner = torch.jit.load(io.BytesIO(graph), map_location="cpu")
    own: Dict[str, List[torch.Tensor]] = {}   # a bucketed trace: one graph per bucket
    for key, value in runner.state_dict().items():
        match = _WEIGHT.match(key)
        if match:
            own.setdefault(match.group(1), []).append(value)
    unknown = sorted(set(state) - set(own))
    if unknown:
        raise KeyError(f"neuronmp.replace_weights: {', '.join(unknown)} name(s) no weight of "
                       f"the traced model; its weights are {', '.join(sorted(own)) or 'none'}")
    with torch.no_grad():
        for name, value in state.items():
            target = own[name][0]
            if value.shape != target.shape or value.dtype != target.dtype:
                raise ValueError(
                    f"neuronmp.replace_weights: {name} is {list(value.shape)} "
                    f"{str(value.dtype).replace('torch.', '')}, but the traced model's is "
                    f"{list(target.shape)} {str(target.dtype).replace('torch.', '')}")
            for each in own[name]:      # the graphs share storage: a copy each is cheap
                each.copy_(value)
    buf = io.BytesIO()
    with _torchscript.quiet():
        torch.jit.save(runner, buf)
    return buf.getvalue()
