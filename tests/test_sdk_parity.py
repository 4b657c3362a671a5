"""The SDK's keywords and loading API on neuronmp.trace'd models (parity with the SDK).

trace's keywords of both generations (checked, recorded in metadata.json, honoured or
named in one warning), dynamic_batch's switch, lazy_load / async_load (when a loaded
model reaches its core), move_trace_to_device (which core serves it), replace_weights
(the workers' outputs change) and analyze's report.  Real workers throughout.
"""
from __future__ import annotations

import json
import threading
import warnings

import pytest
import torch
from api_support import Net, ran_on

import neuronmp
from neuronmp.session import model as nmp_model
from neuronmp.session import session


@pytest.fixture
def four_cores(emulated):
    return emulated("1x4")


class Layers(torch.nn.Module):
    """The replace_weights page's network: three linear layers."""

    def __init__(self, hidden: int = 4):
        super().__init__()
        self.layers = torch.nn.Sequential(*(torch.nn.Linear(hidden, hidden) for _ in range(3)))

    def forward(self, x):
        return self.layers(x)


def _loaded(module) -> bool:
    """Whether the module's model is loaded on cores of the live session."""
    s = session.active()
    return s is not None and nmp_model.model_of(module).handle in s.loaded


# -- trace's keywords -------------------------------------------------------------------


def test_sdk_keywords_are_recorded_and_the_ignored_ones_named_in_one_warning(
        four_cores, tmp_path):
    net, x = Net().eval(), torch.rand(1, 1, 3, 3)
    weight = next(net.parameters())
    with pytest.warns(UserWarning) as caught:
        trace = neuronmp.trace(
            net, x, compiler_workdir=tmp_path, input_output_aliases={weight: 0},
            partitioner_config=object(), cpu_backend=True, fallback=False,
            minimum_segment_size=3, compiler_timeout=60, optimizations=["fast"],
            subgraph_builder_function=lambda node: True, inline_weights_to_neff=False)
    assert len(caught) == 1
    message = str(caught[0].message)
    for name in ("input_output_aliases", "partitioner_config", "cpu_backend", "fallback",
                 "minimum_segment_size", "compiler_timeout", "optimizations",
                 "subgraph_builder_function"):
        assert name in message
    assert "inline_weights_to_neff" not in message   # honoured: not in the warning
    assert caught[0].filename == __file__             # points at the caller's line
    sdk = json.loads((tmp_path / "metadata.json").read_text())["sdk_options"]
    assert sdk["input_output_aliases"] == [["tensor[1, 1, 3, 3]", 0]]
    assert sdk["minimum_segment_size"] == 3 and sdk["optimizations"] == ["fast"]
    assert sdk["inline_weights_to_neff"] is False and sdk["fallback"] is False
    assert torch.allclose(trace(x), net(x).detach(), atol=1e-5)


def test_defaults_warn_nothing_and_dynamic_batch_size_is_honoured(four_cores):
    net = Net().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain = neuronmp.trace(net, torch.rand(1, 1, 3, 3), input_output_aliases={},
                               fallback=True, cpu_backend=False, strict=True)
        dyn = neuronmp.trace(net, torch.rand(1, 1, 3, 3), dynamic_batch_size=True)
    batch = torch.rand(5, 1, 3, 3)
    assert torch.allclose(dyn(batch), net(batch).detach(), atol=1e-5)
    with pytest.raises(ValueError, match="traced with"):
        plain(batch)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"inline_weights_to_neff": "no"}, TypeError, "inline_weights_to_neff must be True or False"),
    ({"cpu_backend": 1}, TypeError, "cpu_backend must be True or False, got 1"),
    ({"input_output_aliases": [0]}, TypeError, "input_output_aliases must be a dict"),
    ({"input_output_aliases": {"w": 0}}, TypeError, r"tensor to an output index.*'w': 0"),
    ({"partitioner_config": "auto"}, TypeError, "partitioner_config must be"),
    ({"minimum_segment_size": 0}, ValueError, "minimum_segment_size must be an int >= 1, got 0"),
    ({"compiler_timeout": -5}, ValueError, "compiler_timeout must be .* got -5"),
    ({"optimizations": "O2"}, TypeError, "optimizations must be a list, got 'O2'"),
    ({"subgraph_builder_function": 3}, TypeError, "subgraph_builder_function must be callable"),
    ({"check_tolerance": -1.0}, ValueError, "check_tolerance must be a number >= 0"),
    ({"no_such_keyword": 1}, TypeError, "no_such_keyword"),
])
def test_bad_sdk_keywords_name_themselves(four_cores, kwargs, error, match):
    with pytest.raises(error, match=match):
        neuronmp.trace(Net().eval(), torch.rand(1, 1, 3, 3), **kwargs)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_jit_trace_keywords_are_forwarded(four_cores):
    def branchy(x):
        return x * 2 if float(x.sum()) > 0 else x - 1

    # check_trace re-runs the trace on check_inputs: a data-dependent branch is caught
    with pytest.raises(Exception, match="(?i)graph|trace|diverge"):
        neuronmp.trace(branchy, torch.ones(2), check_trace=True,
                       check_inputs=[(-torch.ones(2),)])
    # strict=False lets a traced function return a list
    trace = neuronmp.trace(lambda x: [x + 1, x * 3], torch.ones(2), strict=False)
    assert [t.tolist() for t in trace(torch.ones(2))] == [[2.0, 2.0], [3.0, 3.0]]


def test_dynamic_batch_can_be_turned_off_again(four_cores):
    trace = neuronmp.dynamic_batch(neuronmp.trace(Net().eval(), torch.rand(1, 1, 3, 3)))
    assert trace(torch.rand(3, 1, 3, 3)).shape == (3, 1, 1, 1)
    assert neuronmp.dynamic_batch(trace, enable_dynamic_batch=False) is trace
    with pytest.raises(ValueError, match="traced with"):
        trace(torch.rand(3, 1, 3, 3))
    with pytest.raises(TypeError, match="enable_dynamic_batch must be True or False"):
        neuronmp.dynamic_batch(trace, "yes")


# -- loading: when, where, which weights ---------------------------------------------------


def test_lazy_load_waits_for_the_first_call(four_cores, tmp_path):
    net, x = Net().eval(), torch.rand(1, 1, 3, 3)
    trace = neuronmp.trace(net, x)
    neuronmp.lazy_load(trace)
    torch.jit.save(trace, tmp_path / "lazy.pt")
    model = torch.jit.load(tmp_path / "lazy.pt")
    assert not _loaded(model)
    assert torch.allclose(model(x), net(x).detach(), atol=1e-5)
    assert _loaded(model)
    neuronmp.lazy_load(trace, enable_lazy_load=False)
    torch.jit.save(trace, tmp_path / "eager.pt")
    assert _loaded(torch.jit.load(tmp_path / "eager.pt"))
    with pytest.raises(TypeError, match="enable_lazy_load must be True or False"):
        neuronmp.lazy_load(trace, 1)


def test_async_load_returns_before_the_model_is_on_its_core(four_cores, tmp_path):
    net, x = Net().eval(), torch.rand(1, 1, 3, 3)
    trace = neuronmp.trace(net, x)
    neuronmp.async_load(trace)
    torch.jit.save(trace, tmp_path / "async.pt")
    neuronmp.shutdown()   # the load below starts a runtime and its workers: not instant
    model = torch.jit.load(tmp_path / "async.pt")
    loading = [t for t in threading.enumerate() if t.name.startswith("neuronmp-load-")]
    assert loading and not _loaded(model)
    assert torch.allclose(model(x), net(x).detach(), atol=1e-5)   # waits for the load
    assert _loaded(model)


def test_move_trace_to_device_places_it_on_that_core(four_cores):
    x = torch.rand(1, 1, 3, 3)
    trace = neuronmp.trace(Net().eval(), x)
    for core in (2, 0, 3):
        neuronmp.move_trace_to_device(trace, core)
        assert ran_on(lambda: trace(x))[0] == core
    with pytest.raises(ValueError, match="start_nc=4"):
        neuronmp.move_trace_to_device(trace, 4)
    with pytest.raises(TypeError, match="device_id must be an int"):
        neuronmp.move_trace_to_device(trace, "nc:1")
    with pytest.raises(ValueError, match="no neuronmp subgraph"):
        neuronmp.move_trace_to_device(torch.nn.Linear(1, 1), 0)


def test_replace_weights_changes_what_the_workers_compute(four_cores, tmp_path):
    first, second = Layers().eval(), Layers().eval()
    inp = torch.rand(2, 4)
    trace = neuronmp.trace(first, inp, inline_weights_to_neff=False)
    neuronmp.set_neuron_cores(trace, start_nc=1, nc_count=2)   # two copies, round robin
    assert torch.allclose(trace(inp), first(inp).detach(), atol=1e-5)
    parallel = neuronmp.DataParallel(trace, device_ids=[0, 3])
    neuronmp.replace_weights(trace, second.state_dict())
    want = second(inp).detach()
    for _ in range(4):                         # both cores' copies have the new weights
        assert torch.allclose(trace(inp), want, atol=1e-5)
    neuronmp.replace_weights(parallel, second.state_dict())   # a DataParallel's copies too
    batch = torch.rand(6, 4)
    assert torch.allclose(parallel(batch), second(batch).detach(), atol=1e-5)
    assert nmp_model.model_of(trace).placement == (1, 2)
    neuronmp.replace_weights(trace, first)     # a module works as well as a state_dict
    assert torch.allclose(trace(inp), first(inp).detach(), atol=1e-5)
    neuronmp.replace_weights(trace, second)
    torch.jit.save(trace, tmp_path / "swapped.pt")   # the saved model has the new weights
    assert torch.allclose(torch.jit.load(tmp_path / "swapped.pt")(inp), want, atol=1e-5)


def test_replace_weights_refusals(four_cores):
    net, inp = Layers().eval(), torch.rand(2, 4)
    trace = neuronmp.trace(net, inp, inline_weights_to_neff=False)
    with pytest.raises(KeyError, match="layers.9.weight name.*no weight"):
        neuronmp.replace_weights(trace, {"layers.9.weight": torch.zeros(4, 4)})
    with pytest.raises(ValueError, match=r"layers.0.bias is \[3\] float32.*\[4\] float32"):
        neuronmp.replace_weights(trace, {"layers.0.bias": torch.zeros(3)})
    with pytest.raises(TypeError, match="torch.nn.Module or a state_dict"):
        neuronmp.replace_weights(trace, [torch.zeros(4)])
    assert torch.allclose(trace(inp), net(inp).detach(), atol=1e-5)   # nothing changed
    inline = neuronmp.trace(net, inp)    # inline weights (the default), as in the SDK
    with pytest.warns(UserWarning, match="no separated weights"):
        neuronmp.replace_weights(inline, Layers().state_dict())
    assert torch.allclose(inline(inp), net(inp).detach(), atol=1e-5)


def test_analyze_reports_in_the_sdk_shape(four_cores, tmp_path):
    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(8, 6), torch.nn.Linear(6, 3)

        def forward(self, x):
            return torch.log_softmax(self.fc2(torch.relu(self.fc1(x))), dim=1)

    report = neuronmp.analyze(MLP(), torch.rand(4, 8), compiler_workdir=tmp_path / "a")
    assert set(report) == {"torch_neuronx_version", "neuronx_cc_version", "support_percentage",
                           "supported_operators", "unsupported_operators"}
    assert report["supported_operators"] == {"aten::linear": 2, "aten::relu": 1,
                                             "aten::log_softmax": 1}
    assert report["support_percentage"] == "100.00%" and report["unsupported_operators"] == []
    assert json.loads((tmp_path / "a" / "analyze.json").read_text()) == report
    fewer = neuronmp.analyze(MLP(), torch.rand(4, 8), additional_ignored_ops={"aten::relu"},
                             compiler_workdir=tmp_path / "b", cleanup=True)
    assert "aten::relu" not in fewer["supported_operators"]
    assert not (tmp_path / "b").exists()
    with pytest.warns(UserWarning, match="max_workers accepted, but no effect"):
        neuronmp.analyze(MLP(), torch.rand(4, 8), max_workers=8)
    with pytest.raises(TypeError, match="additional_ignored_ops must be a set"):
        neuronmp.analyze(MLP(), torch.rand(4, 8), additional_ignored_ops="aten::relu")
    with pytest.raises(ValueError, match="max_workers must be an int >= 1, got 0"):
        neuronmp.analyze(MLP(), torch.rand(4, 8), max_workers=0)
