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


# every CompiledGraph the script makes, in ``made`` (its traces counted)
_MADE = """
from neuronmp.torchneuron import backend
made = []
init = backend.CompiledGraph.__init__
def counting_init(self, *a, **k):
    init(self, *a, **k)
    made.append(self)
backend.CompiledGraph.__init__ = counting_init
"""


def graphs_counted(body: str) -> str:
    return MLP + _MADE + textwrap.dedent(body)


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
            "cpu_in": [str(on_cpu.device), torch.equal(on_cpu.cpu(), x.relu() * 2)],
        }))
        """), tmp_path, NEURON_RT_VISIBLE_CORES="4-5"))
    assert out["device"] == "neuron:1" and out["equal"] == [True, True] and out["listed"]
    assert out["after_update"] and out["worker"] and out["done"] >= 2
    assert out["cpu_in"] == ["neuron:1", True]   # TorchNeuron moves CPU inputs to the device


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

        def settled():   # the first call's load may run the graph too: wait it out
            last, deadline = counted(1), time.monotonic() + 60
            while time.monotonic() < deadline:
                time.sleep(0.3)
                now = read_all()[core]
                if now.done == last.done:
                    return now
                last = now
            return last

        with torch.no_grad():
            compiled(x.to("neuron:1"))               # traced, loaded and run
            before = settled()
            for _ in range(3):
                compiled(x.to("neuron:1"))
        after = counted(before.done + 3)
        print(json.dumps({"calls": after.done - before.done,
                          "busy_ms": (after.busy_ns - before.busy_ns) / 1e6}))
        """), tmp_path, NEURONMP_DEVICE_TIME_US="4000"))
    assert out["calls"] == 3 and out["busy_ms"] == 12.0


def test_an_in_place_update_of_an_argument_reaches_the_callers_tensor(tmp_path):
    """A KV cache written by slice assignment inside the compiled step is the
    caller's tensor afterwards, as in eager; so are += and copy_ updates."""
    out = facts(run(mlp("""
        proj = torch.nn.Linear(16, 4).to("neuron:1")
        def step(cache, x, pos):
            cache[0, pos:pos + 1] = proj(x)
            return cache.sum()
        def bump(acc, x):
            acc += x
            return acc * 2
        with torch.no_grad():
            compiled = torch.compile(step, backend="neuron")
            eager_cache = torch.zeros(1, 8, 4, device="neuron:1")
            cache = torch.zeros(1, 8, 4, device="neuron:1")
            xs = [torch.randn(1, 16, device="neuron:1") for _ in range(3)]
            for pos, x in enumerate(xs):
                total = compiled(cache, x, pos)
                step(eager_cache, x, pos)
            acc = torch.zeros(4, device="neuron:1")
            torch.compile(bump, backend="neuron")(acc, torch.ones(4, device="neuron:1"))
        print(json.dumps({"cache": torch.equal(cache.cpu(), eager_cache.cpu()),
                          "written": bool(cache[0, :3].abs().sum() > 0),
                          "total": torch.allclose(total.cpu(), eager_cache.sum().cpu()),
                          "acc": acc.cpu().tolist()}))
        """), tmp_path))
    assert out == {"cache": True, "written": True, "total": True, "acc": [1.0] * 4}


def test_an_overrideable_sdpa_graph_runs_and_leaves_the_callers_flags_alone(tmp_path):
    out = facts(run(mlp("""
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        def attend(q, k, v):
            with sdpa_kernel(SDPBackend.OVERRIDEABLE):
                return F.scaled_dot_product_attention(q, k, v)
        q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
        want = F.scaled_dot_product_attention(q, k, v)
        with torch.no_grad():
            got = torch.compile(attend, backend="neuron")(*(t.to("neuron:1") for t in (q, k, v)))
        flags = [torch.backends.cuda.math_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()]
        later = F.scaled_dot_product_attention(q, k, v)   # the caller's next attention
        print(json.dumps({"equal": torch.allclose(got.cpu(), want, atol=1e-5),
                          "flags": flags, "later": torch.allclose(later, want)}))
        """), tmp_path))
    assert out == {"equal": True, "flags": [True, True], "later": True}


def test_a_module_moved_inside_inference_mode_compiles_and_follows_its_weights(tmp_path):
    out = facts(run(mlp("""
        with torch.inference_mode():
            m = torch.nn.Linear(16, 4).to("neuron:1")
            compiled = torch.compile(m, backend="neuron")
            y = compiled(x.to("neuron:1"))
            want = m(x.to("neuron:1")).cpu()
            m.weight.mul_(2)   # inference tensors keep no version: the change is still seen
            y2 = compiled(x.to("neuron:1"))
            want2 = m(x.to("neuron:1")).cpu()
        print(json.dumps([torch.allclose(y.cpu(), want, atol=1e-6),
                          torch.allclose(y2.cpu(), want2, atol=1e-6)]))
        """), tmp_path))
    assert out == [True, True]


def test_a_graph_without_outputs_runs(tmp_path):
    out = facts(run(mlp("""
        def fill(buf, x):
            buf.copy_(x * 3)
        def nothing(x):
            x.relu()
        buf = torch.zeros(8, 16, device="neuron:1")
        with torch.no_grad():
            r1 = torch.compile(fill, backend="neuron", fullgraph=True)(buf, x.to("neuron:1"))
            r2 = torch.compile(nothing, backend="neuron", fullgraph=True)(x.to("neuron:1"))
        print(json.dumps({"returns": [r1, r2], "filled": torch.equal(buf.cpu(), x * 3)}))
        """), tmp_path))
    assert out == {"returns": [None, None], "filled": True}


def test_dynamic_true_is_caught_as_compile_option_error(tmp_path):
    out = facts(run(mlp("""
        import pickle
        try:
            with torch.no_grad():
                torch.compile(model, backend="neuron", dynamic=True)(x.to("neuron:1"))
            caught = None
        except neuronmp.CompileOptionError as exc:
            back = pickle.loads(pickle.dumps(exc))
            caught = [exc.option, exc.value, [back.option, back.value],
                      "dynamic=True is not supported" in str(exc)]
        print(json.dumps(caught))
        """), tmp_path))
    assert out == ["dynamic", True, ["dynamic", True], True]


def test_cpu_inputs_are_moved_to_the_device_as_torchneuron_does(tmp_path):
    """CPU-only inputs give outputs on the current device; RETAIN_DEVICE_MODE=1
    brings them back; DISABLE_CPU_AUTOCOPY=1 refuses them with TorchNeuron's error."""
    out = facts(run(mlp("""
        double = lambda a: a * 2
        with torch.no_grad():
            torch.neuron.set_device(1)
            moved = torch.compile(double, backend="neuron")(x)
            os.environ["TORCH_NEURONX_RETAIN_DEVICE_MODE"] = "1"
            kept = torch.compile(double, backend="neuron")(x)
            os.environ["TORCH_NEURONX_RETAIN_DEVICE_MODE"] = "0"
            os.environ["TORCH_NEURONX_DYNAMO_DISABLE_CPU_AUTOCOPY"] = "1"
            try:
                torch.compile(double, backend="neuron")(x)
                refused = None
            except RuntimeError as exc:
                refused = str(exc)
        print(json.dumps({"moved": [str(moved.device), torch.equal(moved.cpu(), x * 2)],
                          "kept": str(kept.device), "refused": refused}))
        """), tmp_path))
    assert out["moved"] == ["neuron:1", True] and out["kept"] == "cpu"
    assert out["refused"].startswith("Input tensor at index 0 is on cpu device, expected neuron")


def test_dropout_in_a_compiled_graph_draws_what_the_seeded_cpu_draws(tmp_path):
    out = facts(run(mlp("""
        import torch.nn.functional as F
        def drop(a):
            return F.dropout(a.relu(), p=0.5, training=True) * 3
        torch.manual_seed(7)
        want = drop(x)
        with torch.no_grad():
            compiled = torch.compile(drop, backend="neuron")
            torch.manual_seed(7)
            got = compiled(x.to("neuron:1"))
        print(json.dumps(torch.allclose(got.cpu(), want)))
        """), tmp_path))
    assert out is True


def test_flex_attention_decomposition_matches_sdpa_and_masks_whole_rows(tmp_path):
    out = facts(run("""
        import json, torch
        import torch.nn.functional as F
        from torch_neuronx.neuron_dynamo_backend.decompositions import \\
            flex_attention_decomposition as flex
        torch.manual_seed(0)
        q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
        causal = lambda s, b, h, qi, ki: torch.where(qi >= ki, s, float("-inf"))
        none = lambda s, b, h, qi, ki: torch.where(qi < 0, s, float("-inf"))
        out, lse = flex(q, k, v, score_mod=causal, return_lse=True)
        gqa = flex(q, k[:, :2], v[:, :2], enable_gqa=True)
        blank, blank_lse = flex(q, k, v, score_mod=none, return_lse=True)
        try:
            flex(q, k[:, :3], v[:, :3], enable_gqa=True)
            refused = None
        except ValueError as exc:
            refused = str(exc)
        print(json.dumps({
            "causal": torch.allclose(out, F.scaled_dot_product_attention(
                q, k, v, is_causal=True), atol=1e-5),
            "lse": torch.allclose(lse, torch.logsumexp(causal(
                q @ k.transpose(-2, -1) / 8 ** 0.5, 0, 0, torch.arange(6).view(6, 1),
                torch.arange(6)), -1), atol=1e-5),
            "gqa": torch.allclose(gqa, F.scaled_dot_product_attention(
                q, k[:, :2], v[:, :2], enable_gqa=True), atol=1e-5),
            "blank": [bool((blank == 0).all()), bool(torch.isinf(blank_lse).all())],
            "refused": refused}))
        """, tmp_path))
    assert out["causal"] and out["lse"] and out["gqa"] and out["blank"] == [True, True]
    assert "4 heads and key/value 3" in out["refused"]


def test_a_compiled_call_does_a_bounded_amount_of_python_work(tmp_path):
    """Counted, not timed: the graph is traced once for many calls, and a warm
    compiled call runs a bounded number of Python functions (sys.setprofile): the
    backend's own (beneath CompiledGraph.__call__, a call into the runtime's
    request path counted as one: how often that path's wait loops depends on the
    host's timing), and Dynamo's frame and guards around it."""
    out = facts(run(graphs_counted("""
        import sys
        entry = backend.CompiledGraph.__call__.__code__
        runtime = tuple(os.path.join(os.path.dirname(neuronmp.__file__), p)
                        for p in ("pool", "ipc", "shm", os.path.join("session", "model.py")))
        # AOT autograd's per-call wrappers (what a backend built on aot_autograd runs)
        aot = (os.path.join("_aot_autograd", "runtime_wrappers.py"),
               os.path.join("_functorch", "aot_autograd.py"))
        aot_frames = set()

        def calls(fn, n=20):
            # per call of fn: [all calls, the backend's own (the runtime's as one),
            # the runtime's]
            count, inside = [0, 0, 0], [None, None]   # the entry's frame, a runtime frame
            def prof(frame, event, arg):
                if event in ("call", "c_call"):
                    count[0] += 1
                    if event == "call" and frame.f_code.co_filename.endswith(aot):
                        aot_frames.add(frame.f_code.co_name)
                    if inside[0] is None:
                        if event == "call" and frame.f_code is entry:
                            inside[0] = frame
                    elif inside[1] is not None:
                        count[2] += 1
                    else:
                        count[1] += 1
                        if event == "call" and frame.f_code.co_filename.startswith(runtime):
                            inside[1] = frame
                elif event == "return":
                    if frame is inside[1]:
                        inside[1] = None
                    elif frame is inside[0]:
                        inside[0] = None
            sys.setprofile(prof)
            for _ in range(n):
                fn()
            sys.setprofile(None)
            return [c / n for c in count]

        with torch.no_grad():
            xd = x.to("neuron:1")
            compiled = torch.compile(model, backend="neuron", fullgraph=True)
            for _ in range(30):
                compiled(xd)
            total, ours, runtime = calls(lambda: compiled(xd))
        print(json.dumps({"traces": [g.traces for g in made], "ours": ours,
                          "dynamo": total - ours - runtime, "aot": sorted(aot_frames)}))
        """), tmp_path))
    assert out["traces"] == [1]
    # inference needs no joint graph: Dynamo calls the backend's callable itself
    assert out["aot"] == [], f"a compiled call ran AOT autograd's wrappers {out['aot']}"
    # the grad check, the argument check, the copies in and out, the runtime's send
    # and its wait (10 in all; the general path's 27)
    assert out["ours"] <= 12, f"a warm compiled call runs {out['ours']} Python " \
        "functions of the backend's own (budget 12; the fast path is missed?)"
    # torch 2.13's own: 107 (its frame, guards, the current stream)
    assert out["dynamo"] <= 115, f"Dynamo's frame around the graph ran " \
        f"{out['dynamo']} Python functions (torch 2.13 runs 107)"


def test_dynamos_frame_runs_the_same_python_on_neuron_tensors_as_on_cpu_tensors(tmp_path):
    """Counted, not timed: around a backend that returns its input at once, a warm
    compiled call makes the same Python calls, in the same order, on neuron tensors
    as on CPU tensors, and none of them is neuronmp's: the device adds no Python
    guard and no call into its device module to Dynamo's frame (what that frame
    costs more around a call that waits for the core is not work of ours:
    docs/performance.md, "The compile backend's call")."""
    out = facts(run(mlp("""
        import sys
        package = os.path.dirname(neuronmp.__file__)

        def returning_input(gm, example_inputs):
            at = next(i for i, a in enumerate(example_inputs)
                      if not isinstance(a, torch.nn.Parameter))
            return lambda *args: (args[at],)

        def sequence(device):
            m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 4)).to(device)
            xs = x.to(device)
            compiled = torch.compile(m, backend=returning_input, fullgraph=True)
            for _ in range(5):
                compiled(xs)
            seen = []
            def prof(frame, event, arg):
                if event == "call":
                    seen.append((frame.f_code.co_filename, frame.f_code.co_name))
                elif event == "c_call":
                    seen.append(("C", getattr(arg, "__qualname__", repr(arg))))
            sys.setprofile(prof)
            compiled(xs)
            sys.setprofile(None)
            return seen[:-1]   # the setprofile(None) call itself

        with torch.no_grad():
            on_neuron, on_cpu = sequence("neuron:1"), sequence("cpu")
        ours = sorted({f"{name} ({path})" for path, name in on_neuron
                       if path.startswith(package)})
        print(json.dumps({"neuron": len(on_neuron), "cpu": len(on_cpu),
                          "same": on_neuron == on_cpu, "ours": ours}))
        """), tmp_path))
    assert out["ours"] == [], f"Dynamo's frame called into neuronmp: {out['ours']}"
    assert out["same"], f"Dynamo's frame made {out['neuron']} Python calls on neuron " \
        f"tensors and {out['cpu']} on CPU tensors"
    assert 50 <= out["neuron"] <= 115   # torch 2.13's own: 107


def test_a_parameter_replaced_by_another_of_the_same_shape_is_used_at_the_next_call(tmp_path):
    """A new Parameter has its own version counter, which may read as the old one's did:
    the weights baked into a trace are matched by the tensor itself, not by its version."""
    out = facts(run(mlp("""
        with torch.no_grad():
            compiled = torch.compile(model, backend="neuron")
            xs = x.to("neuron:1")
            before = compiled(xs).cpu()
            fresh = torch.nn.Linear(32, 4).to("neuron:1")
            model[2].weight = fresh.weight
            model[2].bias = fresh.bias
            after = compiled(xs).cpu()
            want = model(xs).cpu()
        print(json.dumps({"followed": torch.allclose(after, want, atol=1e-6),
                          "changed": not torch.allclose(before, after)}))
        """), tmp_path))
    assert out == {"followed": True, "changed": True}


def test_a_cpu_models_weights_are_traced_once_and_followed_when_they_change(tmp_path):
    """A model left on the CPU: its weights are copied to the device as TorchNeuron's
    executor copies them, one trace serves every call while they stay the same
    tensors at the same versions, and a change to one is seen at the next call."""
    out = facts(run(graphs_counted("""
        with torch.no_grad():
            torch.neuron.set_device(1)
            compiled = torch.compile(ref, backend="neuron")
            first = [compiled(x).cpu() for _ in range(3)]
            traced = [g.traces for g in made]
            ref[0].weight.mul_(2)
            changed = compiled(x).cpu()
        print(json.dumps({"traces": traced,
                          "right": all(torch.allclose(y, first[0]) for y in first),
                          "follows": torch.allclose(changed, ref(x), atol=1e-6)}))
        """), tmp_path))
    assert out == {"traces": [1], "right": True, "follows": True}
