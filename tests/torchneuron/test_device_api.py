"""The ``neuron`` device's API as TorchNeuron defines it: math-bit views, storage
resizes, module moves, threads, streams, memory statistics and random numbers.

Each script runs in a fresh interpreter (see torchneuron_support), so a crash is a
failed test with its exit status, not a dead pytest.
"""
from __future__ import annotations

import pytest
from torchneuron_support import facts, run

# the first test of a session waits for the extension's one compile
pytestmark = pytest.mark.timeout(900)


def test_conj_and_neg_views_materialise_as_on_cpu(tmp_path):
    # complex arithmetic (the `+ 1`, the matmul) is refused by default as on Trainium
    # (test_fidelity.py); relaxed, the views must give the CPU's values, not a crash
    out = facts(run("""
        import json, torch
        c = torch.tensor([1 + 2j, 3 - 1j, -2 + 0.5j])
        r = torch.tensor([1.5, -2.0, 4.0])
        x, y = c.to("neuron"), r.to("neuron")
        got = {
            "clone": x.conj().clone().cpu(),
            "cpu": x.conj().cpu(),
            "plus1": (x.conj() + 1).cpu(),
            "resolve": x.conj().resolve_conj().cpu(),
            "mm": (x.reshape(3, 1).conj() @ x.reshape(1, 3)).cpu(),
            "t": x.reshape(3, 1).conj().t().cpu(),
            "neg_clone": torch._neg_view(y).clone().cpu(),
            "neg_plus1": (torch._neg_view(y) + 1).cpu(),
        }
        want = {
            "clone": c.conj().clone(), "cpu": c.conj().resolve_conj(),
            "plus1": c.conj() + 1, "resolve": c.conj().resolve_conj(),
            "mm": c.reshape(3, 1).conj() @ c.reshape(1, 3),
            "t": c.reshape(3, 1).conj().t().resolve_conj(),
            "neg_clone": torch._neg_view(r).clone(), "neg_plus1": torch._neg_view(r) + 1,
        }
        print(json.dumps({k: torch.equal(got[k].resolve_conj().resolve_neg(), want[k])
                          for k in got}))
        """, tmp_path, NEURONMP_TORCHNEURON_RELAXED="1"))
    assert out == dict.fromkeys(out, True) and len(out) == 8


def test_storage_resized_to_zero_keeps_its_device(tmp_path):
    out = facts(run("""
        import json, torch
        res = {}
        for i in (0, 1):
            x = torch.randn(5, 3, device=f"neuron:{i}")
            x.untyped_storage().resize_(0)
            y = torch.randn(4, device=f"neuron:{i}")
            y._typed_storage()._resize_(0)
            y.untyped_storage().resize_(8)
            res[i] = [str(x.untyped_storage().device), str(y.untyped_storage().device),
                      y.untyped_storage().nbytes()]
        print(json.dumps(res))
        """, tmp_path, NEURON_RT_NUM_CORES="2"))
    assert out == {"0": ["neuron:0", "neuron:0", 8], "1": ["neuron:1", "neuron:1", 8]}


def test_module_to_device_keeps_its_parameters(tmp_path):
    out = facts(run("""
        import json, torch
        model = torch.nn.Linear(4, 2)
        before = [id(p) for p in model.parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model.to("neuron")
        w0 = model.weight.detach().cpu().clone()
        model(torch.ones(3, 4, device="neuron")).sum().backward()
        opt.step()
        print(json.dumps({
            "same": before == [id(p) for p in model.parameters()],
            "device": str(model.weight.device),
            "trained": not torch.equal(model.weight.detach().cpu(), w0),
            "is_param": isinstance(model.weight, torch.nn.Parameter),
        }))
        """, tmp_path))
    assert out == {"same": True, "device": "neuron:0", "trained": True, "is_param": True}


def test_threads_inherit_the_first_device_set_in_the_process(tmp_path):
    out = facts(run("""
        import json, threading, torch
        seen = {}
        def look(key, then=None):
            if then is not None:
                torch.neuron.set_device(then)
            seen[key] = torch.neuron.current_device()
        def in_thread(key, then=None):
            t = threading.Thread(target=look, args=(key, then)); t.start(); t.join()
        in_thread("before")            # nothing set yet: neuron:0
        torch.neuron.set_device(2)
        in_thread("after_first")       # the first set_device is the process default
        torch.neuron.set_device(1)
        in_thread("after_second")      # later ones are the calling thread's own
        in_thread("own", then=3)       # a thread's own set_device stays its own
        seen["main"] = torch.neuron.current_device()
        print(json.dumps(seen))
        """, tmp_path, NEURON_RT_NUM_CORES="4"))
    assert out == {"before": 0, "after_first": 2, "after_second": 2, "own": 3, "main": 1}


def test_record_stream_accepts_the_device_streams(tmp_path):
    out = facts(run("""
        import json, torch
        t = torch.randn(4, 4, device="neuron")
        for s in (torch.neuron.Stream(), torch.neuron.current_stream(),
                  torch.neuron.default_stream()):
            t.record_stream(s)
        torch.empty(0, device="neuron").record_stream(torch.neuron.Stream())
        try:
            torch.ones(2).record_stream(torch.neuron.Stream())
            cpu = None
        except NotImplementedError as exc:
            cpu = "CPU" in str(exc)
        print(json.dumps({"ok": t.sum().item() == t.cpu().sum().item(), "cpu_refused": cpu}))
        """, tmp_path))
    assert out == {"ok": True, "cpu_refused": True}


_STREAMS = """
    import json, os, threading, torch, torch_neuronx
    made = [torch.neuron.Stream() for _ in range(4)]
    default = torch.neuron.default_stream()
    outer = torch.neuron.current_stream()
    with torch.neuron.stream(made[1]):
        inside = torch.neuron.current_stream()
        with torch.neuron.stream(made[2]):
            nested = torch.neuron.current_stream()
        back = torch.neuron.current_stream()
        seen = {}
        t = threading.Thread(target=lambda: seen.update(s=torch.neuron.current_stream()))
        t.start(); t.join()
    with made[3]:                      # torch.Stream's own context: the device guard's
        guarded = torch.accelerator.current_stream()
    os.environ["NEURON_RT_ENABLE_HOST_CC"] = "0"   # read once, at the first stream
    late = torch.neuron.Stream()
    print(json.dumps({
        "distinct": len(set(made)), "all_default": all(s == default for s in made),
        "default_id": default.stream_id, "outer_is_default": outer == default,
        "inside": inside == made[1], "nested": nested == made[2], "back": back == made[1],
        "other_thread_default": seen["s"] == default,
        "after": torch.neuron.current_stream() == outer, "guarded": guarded == made[3],
        "late_is_new": late not in made and late != default,
    }))
    """


def test_streams_are_the_default_stream_without_host_cc(tmp_path):
    out = facts(run(_STREAMS, tmp_path, NEURON_RT_ENABLE_HOST_CC="0"))
    assert out["distinct"] == 1 and out["all_default"] and out["default_id"] == 0
    assert not out["late_is_new"]


def test_host_cc_streams_are_distinct_and_current_per_thread(tmp_path):
    out = facts(run(_STREAMS, tmp_path, NEURON_RT_ENABLE_HOST_CC="1"))
    assert out == {"distinct": 4, "all_default": False, "default_id": 0,
                   "outer_is_default": True, "inside": True, "nested": True, "back": True,
                   "other_thread_default": True, "after": True, "guarded": True,
                   "late_is_new": True}


def test_event_elapsed_time_refuses_as_torchneuron(tmp_path):
    out = facts(run("""
        import json, torch
        def refusal(a, b):
            try:
                return ["ok", a.elapsed_time(b) >= 0]
            except Exception as exc:
                return [type(exc).__name__, str(exc).splitlines()[0]]
        E = torch.neuron.Event
        timed, untimed = E(enable_timing=True), E()
        unrecorded = E(enable_timing=True)
        end = E(enable_timing=True)
        s = torch.neuron.Stream()
        timed.record(); untimed.record(); s.record_event(end)
        print(json.dumps({
            "untimed": refusal(untimed, end), "untimed_end": refusal(timed, untimed),
            "unrecorded": refusal(unrecorded, end), "unrecorded_end": refusal(timed, unrecorded),
            "ok": refusal(timed, end), "not_event": refusal(timed, object()),
            "is_event": isinstance(s.record_event(), torch.neuron.Event),
        }))
        """, tmp_path))
    assert out == {
        "untimed": ["RuntimeError", "Event was not created with timing enabled"],
        "untimed_end": ["RuntimeError", "End event was not created with timing enabled"],
        "unrecorded": ["RuntimeError", "Event has not been recorded"],
        "unrecorded_end": ["RuntimeError", "End event has not been recorded"],
        "ok": ["ok", True], "not_event": ["RuntimeError", "Expected a Neuron event"],
        "is_event": True}


def test_memory_stats_follow_torchneurons_schema(tmp_path):
    out = facts(run("""
        import json, torch
        torch.neuron.reset_accumulated_memory_stats()
        s0 = torch.neuron.memory_stats()
        x = torch.empty(1024, device="neuron")
        s1 = torch.neuron.memory_stats()
        del x
        s2 = torch.neuron.memory_stats()
        torch.neuron.reset_peak_memory_stats()
        s3 = torch.neuron.memory_stats()
        torch.neuron.reset_accumulated_memory_stats()
        s4 = torch.neuron.memory_stats()
        print(json.dumps({
            "keys": sorted(s0), "byte_keys": sorted(s0["allocated_bytes"]),
            "grew": s1["allocated_bytes"]["current"] - s0["allocated_bytes"]["current"],
            "requests": s1["allocation_requests"] - s0["allocation_requests"],
            "active": s1["active_bytes"]["current"] == s1["allocated_bytes"]["current"],
            "reserved": [s1["reserved_bytes"], torch.neuron.memory_reserved()],
            "frees": s2["num_tensor_frees"] - s1["num_tensor_frees"],
            "freed": s2["allocated_bytes"]["freed"] - s1["allocated_bytes"]["freed"],
            "peak_reset": s3["allocated_bytes"]["peak"] == s3["allocated_bytes"]["current"],
            "accumulated": [s4[k] for k in ("num_tensor_frees", "allocation_requests",
                                            "num_ooms", "num_alloc_retries")]
                           + [s4["allocated_bytes"]["allocated"], s4["allocated_bytes"]["freed"]],
            "allocated": torch.neuron.memory_allocated() == s4["allocated_bytes"]["current"],
            "summary": "Neuron Memory Summary" in torch.neuron.memory_summary(),
        }))
        """, tmp_path))
    zero = {"current": 0, "peak": 0, "allocated": 0, "freed": 0}
    assert out == {
        "keys": ["active_bytes", "allocated_bytes", "allocation_requests", "num_alloc_retries",
                 "num_ooms", "num_tensor_frees", "reserved_bytes"],
        "byte_keys": ["allocated", "current", "freed", "peak"],
        "grew": 4096, "requests": 1, "active": True, "reserved": [zero, 0],
        "frees": 1, "freed": 4096, "peak_reset": True, "accumulated": [0, 0, 0, 0, 0, 0],
        "allocated": True, "summary": True}


def test_random_ops_draw_from_the_cpu_generator(tmp_path):
    out = facts(run("""
        import json, torch
        torch.manual_seed(7)
        on_device = [torch.randn(6, device="neuron").cpu(),
                     torch.rand(3, device="neuron").cpu(),
                     torch.empty(5, device="neuron").normal_().cpu()]
        torch.manual_seed(7)
        on_cpu = [torch.randn(6), torch.rand(3), torch.empty(5).normal_()]
        torch.manual_seed(3)
        torch.neuron.manual_seed(99)   # the device's generator: not what the ops use
        a = torch.randn(4, device="neuron").cpu()
        torch.manual_seed(3)
        b = torch.randn(4)
        torch.manual_seed(5)
        state = torch.neuron.get_rng_state()
        gen = torch.Generator(device="neuron")
        print(json.dumps({
            "same": all(torch.equal(x, y) for x, y in zip(on_device, on_cpu)),
            "device_seed_ignored": torch.equal(a, b),
            "seeded": torch.neuron.initial_seed(),
            "state": [len(state), str(state.dtype), int.from_bytes(bytes(state[:8].tolist()),
                                                                   "little")],
            "generator": gen.device.type,
        }))
        """, tmp_path))
    assert out == {"same": True, "device_seed_ignored": True, "seeded": 5,
                   "state": [16, "torch.uint8", 5], "generator": "neuron"}


def test_dropout_masks_come_from_the_cpu_generator_as_on_the_device(tmp_path):
    out = facts(run("""
        import json, torch
        x = torch.randn(64, 8)
        torch.manual_seed(11)
        torch.neuron.manual_seed(123)   # the device's generator: not what dropout uses
        y, mask = torch.native_dropout(x.to("neuron"), 0.25, True)
        torch.manual_seed(11)
        want_mask = torch.bernoulli(torch.empty(64, 8, dtype=torch.bool), 0.75)
        want = x * want_mask.to(x.dtype) * (1 / 0.75)
        torch.manual_seed(11)
        torch.neuron.manual_seed(123)
        f = torch.nn.functional.dropout(x.to("neuron"), 0.25, training=True).cpu()
        print(json.dumps({"mask": torch.equal(mask.cpu(), want_mask),
                          "dtype": str(mask.dtype), "out": torch.equal(y.cpu(), want),
                          "functional": torch.equal(f, want)}))
        """, tmp_path))
    assert out == {"mask": True, "dtype": "torch.bool", "out": True, "functional": True}


def test_set_device_and_properties_refuse_bad_indices_as_torchneuron(tmp_path):
    out = facts(run("""
        import json, torch
        def err(f):
            try:
                f()
            except Exception as exc:
                return [type(exc).__name__, str(exc)]
            return None
        torch.neuron.set_device(None)            # None: the current device
        print(json.dumps({
            "set": err(lambda: torch.neuron.set_device(2)),
            "ctx": err(lambda: torch.neuron.device(5).__enter__()),
            "props": err(lambda: torch.neuron.get_device_properties(2 ** 32)),
            "name": [torch.neuron.get_device_name(1),
                     torch.neuron.get_device_name(torch.device("neuron:1")),
                     err(lambda: torch.neuron.get_device_name("neuron:1"))[0]],
            "tensor": err(lambda: torch.ones(1, device="neuron:2"))[0],
        }))
        """, tmp_path, NEURON_RT_NUM_CORES="2"))
    assert out == {
        "set": ["ValueError", "Invalid device id: 2. Valid range is 0 to 1"],
        "ctx": ["ValueError", "Invalid device id: 5. Valid range is 0 to 1"],
        "props": ["ValueError", "Invalid device id: 4294967296"],
        "name": ["neuron:1", "neuron:1", "ValueError"], "tensor": "RuntimeError"}


def test_rms_norm_runs_torchneurons_fused_kernels(tmp_path):
    # TorchNeuron's rms_norm runs _fused_rms_norm on the device and its gradient is
    # _fused_rms_norm_backward: both are device ops there, so both are listed as run
    out = facts(run("""
        import json, torch, torch_neuronx
        res = {}
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            x = torch.randn(3, 5, 8, dtype=dtype)
            w = torch.randn(8, dtype=dtype)
            xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
            xn = x.to("neuron").requires_grad_()
            wn = w.to("neuron").requires_grad_()
            torch_neuronx.clear_op_tracking()
            yn = torch.nn.functional.rms_norm(xn, [8], wn, 1e-6)
            fwd = sorted(o for o in torch_neuronx.get_executed_ops() if "rms" in o)
            torch_neuronx.clear_op_tracking()
            yn.sum().backward()
            bwd = sorted(o for o in torch_neuronx.get_executed_ops() if "rms" in o)
            yc = torch.nn.functional.rms_norm(xc, [8], wc, 1e-6)
            yc.sum().backward()
            tol = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
            close = [torch.allclose(a.cpu().float(), b.float(), **tol) for a, b in
                     ((yn, yc), (xn.grad, xc.grad), (wn.grad, wc.grad))]
            res[str(dtype)] = {"fwd": fwd, "bwd": bwd, "close": close,
                               "dtype": str(yn.dtype), "grad_fn": type(yn.grad_fn).__name__}
        with torch.inference_mode():
            y = torch.nn.functional.rms_norm(torch.ones(2, 4, device="neuron"), [4])
        res["inference"] = y.cpu().tolist()
        print(json.dumps(res))
        """, tmp_path))
    for dtype in ("torch.float32", "torch.bfloat16"):
        assert out[dtype]["fwd"] == ["aten::_fused_rms_norm", "aten::rms_norm"], out
        assert out[dtype]["bwd"] == ["aten::_fused_rms_norm_backward"], out
        assert out[dtype]["close"] == [True, True, True], out
        assert out[dtype]["dtype"] == dtype
    assert out["inference"] == [[1.0] * 4] * 2
