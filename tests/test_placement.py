"""NeuronCore placement: the SDK page's examples (set_ and context forms), round robin,
least-used default placement, replicated models under many threads, and the ValueErrors.

Which core ran each call is read from the pool's per-core counters.
"""
from __future__ import annotations

import concurrent.futures
import gc

import pytest
import torch
from api_support import Net, ran_on, served

import neuronmp
from neuronmp import experimental
from neuronmp.session import model as nmp_model
from neuronmp.session import session


@pytest.fixture
def saved(emulated, tmp_path):
    """'example_neuron_model.pt' on a 4-core host, and the example input."""
    emulated("1x4")
    path = tmp_path / "example_neuron_model.pt"
    torch.jit.save(neuronmp.trace(_NET, torch.rand(1, 1, 3, 3)), path)
    gc.collect()
    return str(path), torch.rand(1, 1, 3, 3)


_NET = Net().eval()


def _cores_of_calls(model, example, calls):
    return [ran_on(lambda: model(example))[0] for _ in range(calls)]


def test_set_neuron_cores_sdk_examples(saved):
    path, example = saved
    # Single Load
    model = torch.jit.load(path)
    experimental.set_neuron_cores(model, start_nc=0, nc_count=1)
    assert _cores_of_calls(model, example, 3) == [0, 0, 0]
    # Multiple Core Replication
    model = torch.jit.load(path)
    experimental.set_neuron_cores(model, start_nc=2, nc_count=2)
    assert _cores_of_calls(model, example, 3) == [2, 3, 2]
    # Multiple Model Load
    model1 = torch.jit.load(path)
    experimental.set_neuron_cores(model1, start_nc=2)
    model2 = torch.jit.load(path)
    experimental.set_neuron_cores(model2, start_nc=0)
    assert _cores_of_calls(model1, example, 2) == [2, 2]
    assert _cores_of_calls(model2, example, 2) == [0, 0]


def test_neuron_cores_context_sdk_examples(saved):
    path, example = saved
    with neuronmp.neuron_cores_context(start_nc=0, nc_count=1):
        model = torch.jit.load(path)
    assert _cores_of_calls(model, example, 3) == [0, 0, 0]

    with experimental.neuron_cores_context(start_nc=2, nc_count=2):
        model = torch.jit.load(path)
    assert _cores_of_calls(model, example, 3) == [2, 3, 2]

    with neuronmp.neuron_cores_context(start_nc=2):
        model1 = torch.jit.load(path)
    with neuronmp.neuron_cores_context(start_nc=0):
        model2 = torch.jit.load(path)
    assert _cores_of_calls(model1, example, 2) == [2, 2]
    assert _cores_of_calls(model2, example, 2) == [0, 0]
    # the context is over: the next load goes to the least-used core again
    assert nmp_model.models_in(torch.jit.load(path))[0].placement == (1,)


def test_multicore_round_robin_over_all_cores(saved):
    path, example = saved
    model = torch.jit.load(path)
    neuronmp.set_multicore(model)
    assert _cores_of_calls(model, example, 5) == [0, 1, 2, 3, 0]
    with experimental.multicore_context():
        model = torch.jit.load(path)
        traced_inside = neuronmp.trace(Net().eval(), example)
    assert _cores_of_calls(model, example, 4) == [0, 1, 2, 3]
    assert nmp_model.models_in(traced_inside)[0].placement == (0, 1, 2, 3)


def test_default_placement_is_least_used_round_robin(saved):
    path, example = saved
    # the fixture's trace (since released) took nc:0, so the scan resumes at nc:1
    models = [torch.jit.load(path) for _ in range(5)]
    assert [nmp_model.models_in(m)[0].placement for m in models] == [(1,), (2,), (3,), (0,), (1,)]
    assert session.current().book.usage() == (1, 2, 1, 1)
    del models[1]                              # nc:2 is now the least used
    gc.collect()
    assert session.current().book.usage() == (1, 2, 0, 1)
    models.append(torch.jit.load(path))
    assert nmp_model.models_in(models[-1])[0].placement == (2,)
    # moving a model releases its old core
    neuronmp.set_neuron_cores(models[0], start_nc=3)
    assert session.current().book.usage() == (1, 1, 1, 2)


def test_replicated_model_is_thread_safe_and_uses_its_cores(saved):
    path, _ = saved
    with neuronmp.neuron_cores_context(start_nc=0, nc_count=4):
        model = torch.jit.load(path)
    inputs = [torch.rand(1, 1, 3, 3) for _ in range(64)]

    def many():
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            return list(ex.map(model, inputs))

    outs, cores = served(many)
    for x, y in zip(inputs, outs):
        assert torch.allclose(y, _NET(x).detach(), atol=1e-5)
    assert len(cores) == 4 and sum(cores.values()) == 64


def test_placement_value_errors(saved):
    path, _ = saved
    model = torch.jit.load(path)
    where = nmp_model.models_in(model)[0].placement
    with pytest.raises(ValueError, match="Invalid NeuronCore count nc_count=0. Cannot be set to 0"):
        neuronmp.set_neuron_cores(model, nc_count=0)
    with pytest.raises(ValueError, match="nc_count=-2"):
        neuronmp.set_neuron_cores(model, nc_count=-2)
    with pytest.raises(ValueError, match=r"nc_count=5.*visible NeuronCores \(4\)"):
        neuronmp.set_neuron_cores(model, nc_count=5)
    with pytest.raises(ValueError, match="start_nc=-2"):
        neuronmp.set_neuron_cores(model, start_nc=-2)
    with pytest.raises(ValueError, match="start_nc=4"):
        neuronmp.set_neuron_cores(model, start_nc=4)
    with pytest.raises(ValueError, match="nc:3-nc:4"):
        neuronmp.set_neuron_cores(model, start_nc=3, nc_count=2)
    with pytest.raises(ValueError, match="nc_count=0"):
        with neuronmp.neuron_cores_context(nc_count=0):
            pass
    with pytest.raises(ValueError, match="nc_count=9"):
        with experimental.neuron_cores_context(start_nc=0, nc_count=9):
            pass
    # a refused request leaves the model where it was
    assert nmp_model.models_in(model)[0].placement == where


def test_plain_modules_are_left_alone_and_names_match(saved):
    plain = Net()
    neuronmp.set_neuron_cores(plain, start_nc=1)      # nothing to place: no effect, no error
    neuronmp.set_multicore(plain)
    assert session.current().book.usage() == (0, 0, 0, 0)
    for name in ("set_neuron_cores", "set_multicore", "neuron_cores_context",
                 "multicore_context"):
        assert getattr(experimental, name) is getattr(neuronmp, name)
