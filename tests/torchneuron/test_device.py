"""The ``neuron`` device: TorchNeuron-style scripts, unmodified, in fresh interpreters.

Every script sees only NEURONMP_PROVIDE=torchneuron (plus the test's runtime directory
and emulated topology): ``import torch`` registers the device.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
from torchneuron_support import env_with, facts, run

from neuronmp.host import leftovers

# the first test of a session waits for the extension's one compile (the session
# fixture, a minute or more on a loaded host) inside its own timeout
pytestmark = pytest.mark.timeout(900)


@pytest.mark.parametrize("index", [0, 1])
def test_eager_forward_and_a_training_step_equal_cpu(tmp_path, index):
    out = facts(run(f"""
        import json, torch
        torch.manual_seed(0)
        dev = torch.device("neuron:{index}")
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 4))
        ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                  torch.nn.Linear(32, 4))
        ref.load_state_dict(model.state_dict())
        model = model.to(dev)
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
        same_fwd = torch.equal(model(x.to(dev)).cpu(), ref(x))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
        for m, o, a, b in ((model, opt, x.to(dev), y.to(dev)), (ref, ref_opt, x, y)):
            loss = torch.nn.functional.cross_entropy(m(a), b)
            loss.backward()
            o.step()
        params = list(model.parameters())
        print(json.dumps({{
            "fwd": same_fwd,
            "step": all(torch.allclose(p.cpu(), q, atol=1e-6)
                        for p, q in zip(params, ref.parameters())),
            "devices": sorted({{str(p.device) for p in params}}),
            "grads": sorted({{str(p.grad.device) for p in params}}),
            "x.neuron()": str(x.neuron({index}).device),
        }}))
        """, tmp_path))
    dev = f"neuron:{index}"
    assert out == {"fwd": True, "step": True, "devices": [dev], "grads": [dev],
                   "x.neuron()": dev}


COUNT = """
import json, torch
n = torch.neuron.device_count()
t = torch.ones(2, device=f"neuron:{n - 1}") * 3
try:
    torch.ones(2, device=f"neuron:{n}")
    err = None
except RuntimeError as exc:
    err = str(exc)
import neuronmp
print(json.dumps({"count": n, "accel": torch.accelerator.device_count(), "last": t.sum().item(),
                  "error": err, "cores": list(neuronmp.visible_cores())}))
"""


@pytest.mark.parametrize("env, count, cores", [
    ({"NEURON_RT_VISIBLE_CORES": "1-3"}, 3, [1, 2, 3]),
    ({"NEURON_RT_NUM_CORES": "2"}, 2, None),
    ({"NEURONMP_TOPOLOGY": "trn2.3xlarge"}, 4, [0, 1, 2, 3]),
    ({"NEURONMP_TOPOLOGY": "trn2.3xlarge", "NEURON_LOGICAL_NC_CONFIG": "1"}, 8, None),
])
def test_device_count_and_indices_follow_the_visible_cores(tmp_path, env, count, cores):
    out = facts(run(COUNT, tmp_path, **env))
    assert out["count"] == out["accel"] == count and out["last"] == 6.0
    assert out["error"] == (f"Device index {count} is out of range. Valid range is 0 to "
                            f"{count - 1} for this process")
    assert len(out["cores"]) == count
    if cores is not None:
        assert out["cores"] == cores


def test_an_index_past_what_torch_can_name_is_reported_as_asked(tmp_path):
    """torch keeps a device's index in 8 bits, so neuron:128 reaches the device as -128:
    the refusal still names 128 and the range this process may use."""
    out = facts(run("""
        import json, torch
        said = {}
        for asked in (128, 200, 254):
            try:
                torch.ones(2, device=f"neuron:{asked}")
            except RuntimeError as exc:
                said[asked] = str(exc)
        try:
            torch.neuron.set_device(130)   # an int, never wrapped: TorchNeuron's own check
        except ValueError as exc:
            said["set_device"] = str(exc)
        last = torch.ones(2, device="neuron:127").sum().item()
        print(json.dumps({"count": torch.neuron.device_count(), "said": said, "last": last}))
        """, tmp_path, NEURONMP_TOPOLOGY="64x64"))
    assert out["count"] == 128 and out["last"] == 2.0
    for asked in ("128", "200", "254"):
        assert out["said"][asked].startswith(
            f"Device index {asked} is out of range. Valid range is 0 to 127 for this process")
        assert "8 bits" in out["said"][asked]
    assert out["said"]["set_device"] == "Invalid device id: 130. Valid range is 0 to 127"


def test_a_bad_visible_cores_value_fails_at_first_use_not_at_import(tmp_path):
    out = facts(run("""
        import json, torch
        errors = []
        for use in (torch.neuron.device_count, lambda: torch.ones(1, device="neuron")):
            try:
                use()
            except ValueError as exc:
                errors.append([type(exc).__name__, str(exc).split(":")[0]])
        print(json.dumps(errors))
        """, tmp_path, NEURON_RT_VISIBLE_CORES="3-1"))
    assert out == [["VisibilityError", "Invalid NEURON_RT_VISIBLE_CORES='3-1'"]] * 2


def test_a_rank_numbers_devices_as_torchneuron_does_in_a_distributed_job(tmp_path):
    out = facts(run("""
        import json, torch
        from neuronmp.torchneuron import device
        device.attach_rank(2, 4)       # what the neuron process group does at init
        x = torch.ones(3, device="neuron") * 2
        try:
            torch.ones(1, device="neuron:1")
            other = None
        except RuntimeError as exc:
            other = str(exc)
        import neuronmp
        with torch.no_grad():
            y = torch.compile(torch.nn.Linear(3, 2).to("neuron:2"), backend="neuron")(x[None])
        print(json.dumps({"count": torch.neuron.device_count(), "x": str(x.device),
                          "current": torch.neuron.current_device(), "other": other,
                          "y": str(y.device), "cores": list(neuronmp.visible_cores())}))
        """, tmp_path, NEURON_RT_VISIBLE_CORES="5"))
    assert out["count"] == 4 and out["x"] == out["y"] == "neuron:2" and out["current"] == 2
    assert out["other"].startswith("Attempted to access device that doesn't attach to this "
                                   "process: neuron:1")
    assert out["cores"] == [5]


HOLD = """
import sys, torch
torch.zeros(1, device="neuron")
print("held", flush=True)
sys.stdin.readline()
"""


def test_a_second_process_is_refused_naming_the_holder(tmp_path, procs):
    env = env_with(NEURON_RT_VISIBLE_CORES="2")
    holder = procs.python(HOLD, env=env, stdin=subprocess.PIPE, cwd=str(tmp_path))
    assert holder.stdout.readline().strip() == "held", holder.stderr.read()
    second = run("""
        import json, torch
        n = torch.neuron.device_count()       # no device use yet: nothing reserved
        try:
            torch.zeros(1, device="neuron")
            print(json.dumps({"count": n, "error": None}))
        except RuntimeError as exc:
            print(json.dumps({"count": n, "error": str(exc), "type": type(exc).__name__}))
        """, tmp_path, NEURON_RT_VISIBLE_CORES="2", NEURONMP_RESERVE_TIMEOUT="0")
    out = facts(second)
    holder.stdin.write("\n")
    holder.stdin.flush()
    assert holder.wait(timeout=60) == 0
    assert out["count"] == 1 and out["type"] == "CoreUnavailableError"
    assert "NeuronCore(s) not available - Requested:nc2-nc2" in out["error"]
    assert f"held by pid {holder.pid}" in out["error"]


def test_a_forked_child_touching_the_device_gets_torchneuron_error(tmp_path):
    out = facts(run("""
        import json, multiprocessing as mp, torch
        torch.ones(1, device="neuron")      # the runtime has started in the parent

        def child(q):
            try:
                torch.ones(1, device="neuron")
                q.put(None)
            except RuntimeError as exc:
                q.put((type(exc).__name__, str(exc)))

        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q,))
        p.start()
        got = q.get(timeout=120)
        p.join(60)
        spawn = mp.get_context("spawn")
        print(json.dumps({"child": got, "parent_ok": torch.ones(1, device="neuron").item()}))
        """, tmp_path))
    assert out["child"] == ["NeuronForkError",
                            "Cannot re-initialize Neuron runtime in forked subprocess. To use "
                            "Neuron with multiprocessing, use the 'spawn' start method"]
    assert out["parent_ok"] == 1.0


def test_mixed_devices_fail_as_pytorch_says(tmp_path):
    # atan2 has no TorchNeuron device kernel: torch's check, in torch's words
    out = facts(run("""
        import json, torch
        a = torch.ones(3, device="neuron:0")
        errors = []
        for other in (torch.ones(3), torch.ones(3, device="neuron:1")):
            try:
                torch.atan2(a, other)
            except RuntimeError as exc:
                errors.append(str(exc))
        scalar = (a + torch.tensor(2.0)).cpu().tolist()   # a CPU scalar mixes, as on CUDA
        print(json.dumps({"errors": errors, "scalar": scalar}))
        """, tmp_path))
    assert len(out["errors"]) == 2
    assert all(e.startswith("Expected all tensors to be on the same device") for e in out["errors"])
    assert "neuron:0 and cpu" in out["errors"][0] and "neuron:0 and neuron:1" in out["errors"][1]
    assert out["scalar"] == [3.0, 3.0, 3.0]


def test_a_device_kernel_refuses_a_cpu_tensor_in_torchneurons_words(tmp_path):
    # TorchNeuron's Python device kernels check where each argument lives before they
    # run: a positional argument by its index, a list's element by both indices, a
    # keyword-only one by name (with no space before "device", as TorchNeuron words it)
    out = facts(run("""
        import json, torch
        a, c = torch.ones(3, device="neuron"), torch.ones(3)
        got = []
        for call in (lambda: a * c, lambda: torch.add(c, a), lambda: torch.cat([a, c]),
                     lambda: torch.add(a, a, out=c), lambda: torch.where(a > 0, a, c)):
            try:
                call()
                got.append(None)
            except RuntimeError as exc:
                got.append(str(exc))
        ok = [(a * torch.tensor(2.0)).cpu().tolist(), a[torch.tensor([0, 2])].cpu().tolist()]
        print(json.dumps({"got": got, "ok": ok}))
        """, tmp_path))
    assert out["got"] == [
        "Non-scalar tensor arg1 is on cpu device, expected neuron",
        "Non-scalar tensor arg0 is on cpu device, expected neuron",
        "Non-scalar tensor arg0[1] is on cpu device, expected neuron",
        "Non-scalar tensor kwarg 'out' is on cpudevice, expected neuron",
        "Non-scalar tensor arg2 is on cpu device, expected neuron"]
    # a CPU scalar, and CPU indices (index's kernel takes them), still mix
    assert out["ok"] == [[2.0, 2.0, 2.0], [1.0, 1.0]]


def test_set_refuses_memory_off_the_device_in_torchneurons_words(tmp_path):
    out = facts(run("""
        import json, torch
        n, c = torch.empty(0, device="neuron"), torch.randn(3)
        got = []
        for call in (lambda: n.set_(c), lambda: n.set_(c.untyped_storage()),
                     lambda: c.set_(torch.ones(2, device="neuron"))):
            try:
                call()
                got.append(None)
            except RuntimeError as exc:
                got.append(str(exc))
        n.set_(torch.ones(2, device="neuron"))
        print(json.dumps({"got": got, "ok": n.cpu().tolist()}))
        """, tmp_path))
    assert out["got"] == ["set_: expected neuron source tensor, but got tensor on device cpu",
                          "set_: expected neuron storage, but got storage on device cpu",
                          "set_: expected neuron tensor, but got tensor on device cpu"]
    assert out["ok"] == [1.0, 1.0]


def test_autocast_follows_the_cuda_policy(tmp_path):
    out = facts(run("""
        import json, torch
        a = torch.randn(4, 4, device="neuron:1")
        got = {}
        for dt in (torch.bfloat16, torch.float16):
            with torch.autocast(device_type="neuron", dtype=dt):
                got[str(dt)] = [str((a @ a).dtype), str(torch.nn.functional.linear(a, a).dtype),
                                str(torch.softmax(a @ a, -1).dtype), str((a + a).dtype),
                                str(torch.exp(a.half()).dtype)]
        print(json.dumps({"got": got, "supported": [str(d) for d in
                          torch.neuron.get_amp_supported_dtype()],
                          "bf16": torch.neuron.is_bf16_supported()}))
        """, tmp_path))
    for dt in ("torch.bfloat16", "torch.float16"):
        # mm/linear lower precision; softmax fp32; add untouched; exp (fp32 list) widens
        assert out["got"][dt] == [dt, dt, "torch.float32", "torch.float32", "torch.float32"]
    assert out["bf16"] and "torch.bfloat16" in out["supported"]


def test_save_load_round_trips_and_pin_memory(tmp_path):
    out = facts(run(f"""
        import json, torch
        model = torch.nn.Linear(4, 3).to("neuron:1")
        x = torch.arange(6.0).reshape(2, 3).to("neuron:1")
        torch.save({{"x": x, "state": model.state_dict()}}, {str(tmp_path / "c.pt")!r})
        back = torch.load({str(tmp_path / "c.pt")!r})
        fresh = torch.nn.Linear(4, 3)
        fresh.load_state_dict(torch.load({str(tmp_path / "c.pt")!r},
                                         map_location="cpu")["state"])
        pinned = torch.ones(5).pin_memory()
        print(json.dumps({{
            "device": str(back["x"].device), "x": back["x"].cpu().tolist(),
            "state": all(torch.equal(v.cpu(), model.state_dict()[k].cpu())
                         for k, v in back["state"].items()),
            "state_device": sorted({{str(v.device) for v in back["state"].values()}}),
            "cpu_load": torch.equal(fresh.weight, model.weight.cpu()),
            "pinned": pinned.is_pinned(), "plain": torch.ones(5).is_pinned(),
            "to": str(pinned.to("neuron", non_blocking=True).device),
        }}))
        """, tmp_path))
    assert out == {"device": "neuron:1", "x": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]],
                   "state": True, "state_device": ["neuron:1"], "cpu_load": True,
                   "pinned": True, "plain": False, "to": "neuron:0"}


def test_memory_statistics_move_with_allocations(tmp_path):
    out = facts(run("""
        import json, torch
        base = torch.neuron.memory_allocated(1)
        a = torch.empty(1024, dtype=torch.float32, device="neuron:1")
        b = torch.empty(256, dtype=torch.float64, device="neuron:1")
        c = a * 2                                   # a kernel's output counts too
        during = torch.neuron.memory_allocated(1)
        other = torch.neuron.memory_allocated(0)
        del a, b, c
        after = torch.neuron.memory_allocated(1)
        peak = torch.neuron.max_memory_allocated(1)
        torch.neuron.reset_peak_memory_stats(1)
        stats = torch.neuron.memory_stats(1)
        torch.neuron.empty_cache()
        print(json.dumps({"base": base, "during": during, "after": after, "peak": peak,
                          "reset_peak": torch.neuron.max_memory_allocated(1),
                          "reserved": torch.neuron.memory_reserved(1), "other": other,
                          "allocs": stats["allocation_requests"]}))
        """, tmp_path))
    assert out["during"] - out["base"] == 4096 + 2048 + 4096
    assert out["after"] == out["base"] and out["other"] == 0
    assert out["peak"] >= out["during"] and out["reset_peak"] == out["after"]
    assert out["reserved"] == 0 and out["allocs"] >= 3   # nothing cached: reserved is 0


def test_torch_neuron_and_accelerator_api(tmp_path):
    out = facts(run("""
        import json, torch, torch_neuronx
        torch.neuron.set_device(1)
        here = torch.ones(1, device="neuron").device
        with torch.neuron.device(0):
            inside = torch.neuron.current_device()
        torch.accelerator.set_device_index(2)
        acc = torch.accelerator.current_device_index()
        torch.accelerator.synchronize()
        torch.neuron.synchronize()
        torch.manual_seed(7)            # random ops draw from the CPU's generator
        r1 = torch.randn(3, device="neuron:0").cpu()
        state = torch.get_rng_state()
        r2 = torch.randn(3, device="neuron:0").cpu()
        torch.set_rng_state(state)
        r3 = torch.randn(3, device="neuron:0").cpu()
        torch.manual_seed(7)
        r4 = torch.randn(3)
        s = torch.neuron.Stream()
        e1, e2 = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
        e1.record(); torch.ones(100, device="neuron") * 2; e2.record(); e2.synchronize()
        props = torch.neuron.get_device_properties(1)
        print(json.dumps({
            "here": str(here), "inside": inside, "acc": acc, "now": torch.neuron.current_device(),
            "accel": str(torch.accelerator.current_accelerator()),
            "avail": torch.neuron.is_available(), "name": torch.neuron.get_device_name(1),
            "props": [props.name, props.total_memory],
            "rng": [torch.equal(r2, r3), torch.equal(r1, r4), torch.equal(r1, r2)],
            "stream": [s.device.type, s == torch.neuron.current_stream(), s.query()],
            "elapsed": e1.elapsed_time(e2) >= 0,
            "pkg": torch_neuronx.device_count() == torch.neuron.device_count(),
        }))
        """, tmp_path))
    assert out == {"here": "neuron:1", "inside": 0, "acc": 2, "now": 2, "accel": "neuron",
                   "avail": True, "name": "neuron:1",
                   "props": ["neuron:1", out["props"][1]], "rng": [True, True, False],
                   "stream": ["neuron", True, True], "elapsed": True, "pkg": True}
    assert out["props"][1] > 0


def test_many_aten_ops_give_the_cpu_result(tmp_path):
    out = facts(run("""
        import json, torch
        torch.manual_seed(1)
        a, b = torch.randn(5, 6), torch.randn(5, 6)
        x, y = a.to("neuron:1"), b.to("neuron:1")
        cases = {
            "cat": lambda p, q: torch.cat([p, q], 1),
            "where": lambda p, q: torch.where(p > q, p, q),
            "sort": lambda p, q: torch.sort(p, 1)[0], "topk": lambda p, q: p.topk(2, 1)[1],
            "index": lambda p, q: p[[0, 2]], "cpu_index": lambda p, q: p[torch.tensor([3, 1])],
            "index_put": lambda p, q: p.clone().index_put_((torch.tensor([1]),), q[0]),
            "slice_t": lambda p, q: p[1:, ::2].t().contiguous(),
            "cumsum": lambda p, q: p.cumsum(0), "norm": lambda p, q: p.norm(dim=1),
            "out": lambda p, q: torch.add(p, q, out=torch.empty(0, device=p.device)),
            "inplace": lambda p, q: p.clone().mul_(q).add_(1), "max": lambda p, q: p.max(),
            "conv": lambda p, q: torch.nn.functional.conv1d(p[None], q[:, :, None][:, :5]),
            "arange": lambda p, q: torch.arange(7, device=p.device) * 2,
            "sdpa": lambda p, q: torch.nn.functional.scaled_dot_product_attention(
                p[None], q[None], p[None]),
            "conv_grad": lambda p, q: torch.autograd.functional.vjp(
                lambda w: torch.nn.functional.conv2d(p[None, None], w).sum(),
                q[None, None, :3, :3])[1],
        }
        bad = [k for k, f in cases.items()
               if not torch.allclose(f(x, y).cpu(), f(a, b), atol=1e-6)
               or f(x, y).device != x.device]
        print(json.dumps({"bad": bad}))
        """, tmp_path))
    assert out["bad"] == []


def test_eager_op_overhead_is_small_enough_to_use(tmp_path):
    """Not a timing assertion: the figures are in tools/bench_torchneuron.py; this checks
    that the fast path (no Python per op) is the one taken, by counting Python calls."""
    out = facts(run("""
        import json, sys, torch
        x = torch.ones(4, 4, device="neuron")
        calls = []
        sys.setprofile(lambda f, e, a: calls.append(e) if e == "call" else None)
        for _ in range(10):
            x + x
        sys.setprofile(None)
        print(json.dumps({"python_calls": len(calls)}))
        """, tmp_path))
    assert out["python_calls"] <= 1   # the setprofile(None) call itself


def test_errors_pickle_with_their_fields():
    import pickle

    from neuronmp.errors import (
        CompileOptionError,
        DeviceExtensionError,
        NeuronForkError,
        ProvideConflictError,
    )

    for err in (ProvideConflictError("NEURONMP_PROVIDE", "a,b", ("a", "b"), "clash"),
                DeviceExtensionError("a C++ compiler", "not found"),
                NeuronForkError(12), CompileOptionError("dynamic", True, "False")):
        again = pickle.loads(pickle.dumps(err))
        assert type(again) is type(err) and str(again) == str(err)
    assert sys.modules["neuronmp"].NeuronForkError is NeuronForkError


def test_big_tensors_live_in_memory_a_peer_maps_and_go_with_the_tensor(tmp_path, runtime_dir):
    out = facts(run("""
        import json, os, subprocess, sys, torch
        from neuronmp.torchneuron import device
        floor = device.shared_min()
        big = torch.zeros(floor // 4 + 3, device="neuron")   # a block at the threshold
        small = torch.zeros(floor // 4 - 1024, device="neuron")
        made = (big * 2).to("neuron")                         # a CPU kernel's output
        where = device.shared_block(big[5:])
        link = os.readlink(f"/proc/self/fd/{where.fd}")
        # a peer process maps it through /proc, writes, and the tensor shows the write
        peer = subprocess.run([sys.executable, "-c", '''
        import mmap, os, struct, sys
        pid, fd, size = map(int, sys.argv[1:])
        with open(f"/proc/{pid}/fd/{fd}", "r+b") as f:
            mm = mmap.mmap(f.fileno(), size, mmap.MAP_SHARED)
        first = struct.unpack_from("<f", mm, 20)[0]
        struct.pack_into("<f", mm, 24, 42.0)
        print(first)
        '''.replace(chr(10) + "        ", chr(10)), str(os.getpid()), str(where.fd),
            str(where.size)], capture_output=True, text=True, timeout=120)
        big[5] = 7.0
        fd, allocated = where.fd, torch.neuron.memory_allocated()
        seen_before = big[6].item()
        del big, made
        try:
            after = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:
            after = None
        print(json.dumps({"floor": floor, "offset": where.offset, "size": where.size,
                          "link": link, "serial": where.serial, "peer": peer.stdout.strip(),
                          "peer_err": peer.stderr[-2000:], "wrote": seen_before,
                          "small": device.shared_block(small) is None,
                          "cpu": device.shared_block(torch.zeros(1 << 20)) is None,
                          "freed": allocated - torch.neuron.memory_allocated(),
                          "after": after}))
        """, tmp_path))
    assert out["floor"] == 1 << 20
    assert out["small"] and out["cpu"]
    # the view's first element, 5 floats into the block; whole pages mapped
    assert out["offset"] == 20 and out["size"] == out["floor"] + 4096
    assert out["link"] == f"/memfd:neuronmp-{out['serial']} (deleted)"
    assert out["peer_err"] == "" and out["peer"] == "0.0"   # read before big[5] = 7
    assert out["wrote"] == 42.0                              # the peer's write, seen here
    # freeing the tensor closed its memfd: no file, no descriptor, no memory kept
    assert out["freed"] == 2 * (out["floor"] + 12)   # big and the kernel's output
    assert out["after"] != out["link"]
    assert leftovers.segments(runtime_dir) == []


def test_shutdown_waits_for_the_autograd_device_thread_s_backward(tmp_path):
    # The engine's device thread ends a backward (drops its task, whose thread-local
    # state holds Python objects) after the caller went on; were the interpreter
    # finalizing by then, the process would abort (std::terminate).  The runtime's
    # shutdown, which atexit runs, first lets each device thread finish what it holds:
    # here a backward still in its node (a slow custom Function) from another thread.
    out = facts(run("""
        import json, threading, time, torch
        from neuronmp.host import runtime
        started, done = threading.Event(), threading.Event()

        class Slow(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x * 2

            @staticmethod
            def backward(ctx, grad):
                started.set()
                time.sleep(2.0)
                done.set()
                return grad * 2

        x = torch.ones(4, device="neuron:1", requires_grad=True)
        caller = threading.Thread(target=lambda: Slow.apply(x).sum().backward())
        caller.start()
        started.wait(60)
        thread = threading.current_thread().name
        runtime.shutdown()
        finished = done.is_set()
        caller.join(60)
        print(json.dumps({"finished_before_shutdown_returned": finished,
                          "grad": x.grad.cpu().tolist(), "main": thread}))
        """, tmp_path))
    assert out == {"finished_before_shutdown_returned": True, "grad": [2.0] * 4,
                   "main": "MainThread"}
