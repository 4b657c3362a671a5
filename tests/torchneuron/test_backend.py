"""``torch.compile(backend="neuron")``: the graph runs on its core's worker process."""
from __future__ import annotations

import textwrap

import pytest
from torchneuron_support import facts, run

# the first test of a session waits for the extension's one compile (the session
# fixture, a minute or more on a loaded host) inside its own timeout
pytestmark = pytest.mark.timeout(900)

MLP = """
import json, os, warnings, torch
import neuronmp
from neuronmp.pool.stats import read_all
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
ref.load_state_dict(model.state_dict())
model = model.to("neuron:1")
x = torch.randn(8, 16)
"""


def mlp(body: str) -> str:
    return MLP + textwrap.dedent(body)


def test_compiled_graph_runs_on_the_cores_worker_and_returns_neuron_tensors(tmp_path):
    out = facts(run(mlp("""
        compiled = torch.compile(model, backend="neuron", fullgraph=True)
        with torch.no_grad():
            y = compiled(x.to("neuron:1"))
            y2 = compiled(x.to("neuron:1") * 2)
            core = neuronmp.visible_cores()[1]
            stats = read_all()[core]
            equal = [torch.allclose(y.cpu(), ref(x), atol=1e-6),
                     torch.allclose(y2.cpu(), ref(x * 2), atol=1e-6)]
            # new weights (an optimizer step, say) are seen by the next call
            model[0].weight.mul_(0.5)
            ref[0].weight.mul_(0.5)
            y3 = compiled(x.to("neuron:1"))
            torch.neuron.set_device(1)
            on_cpu = torch.compile(lambda a: a.relu() * 2, backend="neuron")(x)
        print(json.dumps({
            "device": str(y.device), "equal": equal,
            "after_update": torch.allclose(y3.cpu(), ref(x), atol=1e-6),
            "done": stats.done, "worker": stats.pid not in (0, os.getpid()),
            "listed": "neuron" in torch._dynamo.list_backends(exclude_tags=()),
            "cpu_in": [str(on_cpu.device), torch.equal(on_cpu, x.relu() * 2)],
        }))
        """), tmp_path, NEURON_RT_VISIBLE_CORES="4-5"))
    assert out["device"] == "neuron:1" and out["equal"] == [True, True] and out["listed"]
    assert out["after_update"] and out["worker"] and out["done"] >= 2
    assert out["cpu_in"] == ["cpu", True]


def test_training_through_the_compiled_module_matches_cpu(tmp_path):
    out = facts(run(mlp("""
        compiled = torch.compile(model, backend="neuron")
        loss = compiled(x.to("neuron:1")).square().mean()
        loss.backward()
        ref(x).square().mean().backward()
        print(json.dumps({"grads": all(torch.allclose(p.grad.cpu(), q.grad, atol=1e-6)
                                       for p, q in zip(model.parameters(), ref.parameters())),
                          "device": str(next(model.parameters()).grad.device)}))
        """), tmp_path))
    assert out == {"grads": True, "device": "neuron:1"}


def test_dynamic_is_refused_and_other_modes_warn_and_fall_back(tmp_path):
    out = facts(run(mlp("""
        try:
            with torch.no_grad():
                torch.compile(model, backend="neuron", dynamic=True)(x.to("neuron:1"))
            refused = None
        except Exception as exc:
            refused = str(exc)
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            y = torch.compile(model, backend="neuron", mode="max-autotune")(x.to("neuron:1"))
        def broken(a):
            b = a.relu() + 1
            print("graph break", file=__import__("sys").stderr)
            return (b * 2).sum(0)
        torch._dynamo.reset()
        with torch.no_grad():
            split = torch.compile(broken, backend="neuron")(x.to("neuron:1"))
        print(json.dumps({"split": [str(split.device), torch.allclose(split.cpu(), broken(x))],
                          "refused": refused, "warned": [str(w.message) for w in caught
                                                        if "mode=" in str(w.message)],
                          "equal": torch.allclose(y.cpu(), ref(x), atol=1e-6)}))
        """), tmp_path))
    assert "dynamic=True is not supported" in out["refused"]
    assert out["warned"] == ["torch.compile(backend='neuron'): mode='max-autotune' is not "
                             "supported; using the default mode"]
    assert out["equal"] and out["split"] == ["neuron:1", True]   # two graphs, one break


def test_the_backend_without_the_variable_says_what_to_set(tmp_path):
    out = facts(run("""
        import json, torch
        try:
            torch.compile(lambda a: a + 1, backend="neuron")(torch.ones(2))
            print(json.dumps(None))
        except Exception as exc:
            print(json.dumps(str(exc)))
        """, tmp_path, provide=None))
    assert "NEURONMP_PROVIDE=torchneuron" in out


def test_device_time_applies_to_compiled_graphs(tmp_path):
    """The core's counters carry the modelled time of each compiled call (a counter of
    the configured latency model, not a clock reading)."""
    out = facts(run(mlp("""
        import time
        compiled = torch.compile(model, backend="neuron", fullgraph=True)
        core = neuronmp.visible_cores()[1]
        def counted(n):   # a timed call is counted when its modelled time is over
            deadline = time.monotonic() + 60
            while read_all()[core].done < n and time.monotonic() < deadline:
                time.sleep(0.01)
            return read_all()[core]

        with torch.no_grad():
            compiled(x.to("neuron:1"))               # traced and loaded: one call
            before = counted(1)
            for _ in range(3):
                compiled(x.to("neuron:1"))
        after = counted(before.done + 3)
        print(json.dumps({"calls": after.done - before.done,
                          "busy_ms": (after.busy_ns - before.busy_ns) / 1e6}))
        """), tmp_path, NEURONMP_DEVICE_TIME_US="4000"))
    assert out["calls"] == 3 and out["busy_ms"] == 12.0
