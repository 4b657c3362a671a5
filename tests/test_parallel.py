"""neuronmp.DataParallel: the SDK page's examples, splitting rules, scatter/gather of
containers, device_ids errors and a worker's error naming its core.

Runs on a 4-core host; which cores served a call is read from the pool's counters.
"""
from __future__ import annotations

import pickle
import re
import sys
import threading
import warnings

import pytest
import torch
from api_support import Net, served

import neuronmp
from neuronmp import DeviceIdError, ModelError
from neuronmp.host import runtime


@pytest.fixture
def traced(emulated):
    emulated("1x4")
    net = Net(3).eval()
    image = torch.rand([1, 3, 8, 8])
    return net, neuronmp.trace(net, image)


def _close(a, b):
    return torch.allclose(a, b.detach(), atol=1e-5)


def test_default_usage(traced):
    net, model_neuron = traced
    model_parallel = neuronmp.DataParallel(model_neuron)
    image_batched = torch.rand([5, 3, 8, 8])
    output, cores = served(lambda: model_parallel(image_batched))
    assert _close(output, net(image_batched))
    assert sorted(cores) == list(runtime.get_runtime().cores)   # all 4 cores, 2+1+1+1 rows


def test_specifying_neuron_cores(traced):
    net, model_neuron = traced
    model_parallel = neuronmp.DataParallel(model_neuron, device_ids=["nc:0", "nc:1"])
    image_batched = torch.rand([5, 3, 8, 8])
    output, cores = served(lambda: model_parallel(image_batched))
    assert _close(output, net(image_batched))
    assert cores == {0: 1, 1: 1}


def test_dim_not_zero(traced, caplog):
    net, model_neuron = traced
    with caplog.at_level("INFO", logger="neuronmp"):
        model_parallel = neuronmp.DataParallel(model_neuron, device_ids=[0, 1, 2, 3], dim=2)
    assert not model_parallel.dynamic_batching
    assert "dim=2" in caplog.text
    image_batched = torch.rand([1, 3, 4 * 8, 8])   # shape[dim] / len(device_ids) == 8
    output = model_parallel(image_batched)
    expected = torch.cat([net(c) for c in image_batched.split(8, 2)], 2)
    assert _close(output, expected)
    with pytest.raises(ValueError, match=r"input.shape\[2\] / len\(device_ids\).*8.*30 / 4"):
        model_parallel(torch.rand([1, 3, 30, 8]))


@pytest.mark.parametrize("dim, shape, want", [
    (0, [8, 3, 8, 9], "[8, 3, 8, 8]"),   # dynamic batching: 4 chunks of [2, 3, 8, 9]
    (2, [1, 3, 32, 9], "[1, 3, 32, 8]"),  # fixed chunks of [1, 3, 8, 9]
])
def test_a_shape_error_names_the_callers_input_not_a_chunk(traced, dim, shape, want):
    _net, model_neuron = traced
    model_parallel = neuronmp.DataParallel(model_neuron, dim=dim)
    with pytest.raises(ValueError) as info:
        model_parallel(torch.rand(shape))
    message = str(info.value)
    assert f"input 0 has shape {shape}" in message and f"expected {want}" in message
    assert f"dimension {dim} is split across the 4 NeuronCores" in message


def test_dynamic_batch_sizes_without_retracing(traced):
    net, model_neuron = traced
    model_parallel = neuronmp.DataParallel(model_neuron)
    for batch_size in [2, 3, 4, 5, 6]:
        image_batched = torch.rand([batch_size, 3, 8, 8])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            output, cores = served(lambda x=image_batched: model_parallel(x))
        assert _close(output, net(image_batched))
        assert len(cores) == min(batch_size, 4)    # a batch of 2 uses 2 cores, one row each


def test_dynamic_batching_disabled(traced):
    net, model_neuron = traced
    model_parallel = neuronmp.DataParallel(model_neuron, device_ids=[0, 1, 2, 3], dim=0)
    model_parallel.disable_dynamic_batching()
    with pytest.raises(ValueError, match=r"traced size 1, but got 8 / 4"):
        model_parallel(torch.rand([8, 3, 8, 8]))
    image_batched = torch.rand([4, 3, 8, 8])
    assert _close(model_parallel(image_batched), net(image_batched))
    off = neuronmp.DataParallel(model_neuron, device_ids=[0, 1], set_dynamic_batching=False)
    assert not off.dynamic_batching
    with pytest.raises(ValueError, match="got 3 / 2"):
        off(torch.rand([3, 3, 8, 8]))


def test_remainder_warns_and_split_size(traced):
    net, model_neuron = traced
    model_parallel = neuronmp.DataParallel(model_neuron, device_ids=[0, 1])
    x = torch.rand([5, 3, 8, 8])
    with pytest.warns(UserWarning, match="not fully utilized") as got:
        assert _close(model_parallel(x), net(x))
    assert got[0].filename == __file__   # the caller's line, not neuronmp's
    wrapped = neuronmp.DataParallel(torch.nn.Sequential(model_neuron, torch.nn.Identity()))
    with pytest.warns(UserWarning, match="not fully utilized") as got:
        assert _close(wrapped(x), net(x))
    assert got[0].filename == __file__
    model_parallel.split_size = 2                  # chunks 2, 2, 1 round robin on nc:0, nc:1
    out, cores = served(lambda: model_parallel(x))
    assert _close(out, net(x))
    assert cores == {0: 2, 1: 1}


def test_traced_inputs_with_different_dim0_warn(emulated):
    emulated("1x2")
    model = neuronmp.trace(lambda a, b: a + b.sum(), (torch.rand(2, 3), torch.rand(1, 3)))
    with pytest.warns(UserWarning, match="dynamic batching cannot be enabled") as got:
        dp = neuronmp.DataParallel(model)
    assert got[0].filename == __file__
    assert not dp.dynamic_batching


def test_bad_device_ids(traced):
    _, model_neuron = traced
    with pytest.raises(DeviceIdError, match=r"Expected `nc:#` or an integer, but got: 'gpu:0'"):
        neuronmp.DataParallel(model_neuron, device_ids=["gpu:0"])
    with pytest.raises(DeviceIdError, match="'nc:4' is out of range.*4 NeuronCore"):
        neuronmp.DataParallel(model_neuron, device_ids=["nc:4"])
    with pytest.raises(ValueError, match="device_ids is empty"):
        neuronmp.DataParallel(model_neuron, device_ids=[])
    with pytest.raises(TypeError, match="no neuronmp subgraph"):
        neuronmp.DataParallel(Net())


def test_worker_error_names_the_core(emulated):
    emulated("1x2")
    emb = torch.nn.Embedding(10, 4)
    dp = neuronmp.DataParallel(neuronmp.trace(emb, torch.tensor([[1, 2]])))
    ok = torch.tensor([[1, 2], [3, 4]])
    assert torch.allclose(dp(ok), emb(ok).detach())
    bad = torch.tensor([[1, 2], [3, 40]])          # row 1 goes to nc:1 and fails there
    with pytest.raises(ModelError) as info:
        dp(bad)
    err = info.value
    assert err.core == runtime.get_runtime().cores[1]
    assert isinstance(err, RuntimeError)   # what the traced model raises in process
    # the root message first, not after the TorchScript frames; the core named after it
    first, second = str(err).splitlines()[:2]
    assert re.fullmatch(r"\w+Error: index out of range in self", first), str(err)
    assert second == f"(raised by the model on NeuronCore {err.core})"
    # the worker's formatted traceback is the cause, as concurrent.futures gives it
    assert "Traceback" in str(err.__cause__) and "index out of range" in str(err.__cause__)
    assert pickle.loads(pickle.dumps(err)).args == err.args


def test_containers_and_non_tensor_arguments(traced):
    net, model_neuron = traced

    class Outer(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, batch, scale, tag=None):
            y = self.inner(batch["image"]) * scale
            return {"y": y, "pair": (batch["extra"][0] * 2, tag)}

    dp = neuronmp.DataParallel(Outer(model_neuron), device_ids=[0, 1])
    image, extra = torch.rand([4, 3, 8, 8]), torch.rand(4, 2)
    out, cores = served(lambda: dp({"image": image, "extra": [extra]}, 3.0, tag="t"))
    assert _close(out["y"], net(image) * 3.0)
    assert torch.allclose(out["pair"][0], extra * 2)
    assert out["pair"][1] == "t"
    assert set(cores) == {0, 1}


def test_pytree_outputs_on_the_direct_path(emulated):
    emulated("1x2")

    def func(x):
        return (x + 1, {"double": x * 2})

    dp = neuronmp.DataParallel(neuronmp.trace(func, torch.rand(1, 3)))
    x = torch.rand(6, 3)
    a, b = dp(x)
    assert torch.allclose(a, x + 1) and torch.allclose(b["double"], x * 2)


def test_chunks_of_whole_traced_batches_and_padded_ones_give_the_same_outputs(emulated):
    """Inputs checked once per call: chunks of whole traced batches and padded ones
    each still go as one request to one core, with the model's outputs."""
    emulated("1x4")
    net = Net(3).eval()
    model_parallel = neuronmp.DataParallel(neuronmp.trace(net, torch.rand([2, 3, 8, 8])))
    for rows, per_core in ((8, 1), (16, 1), (6, 1), (4, 1)):
        x = torch.rand([rows, 3, 8, 8])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # 6 rows: 2 + 2 + 1 + 1, "not fully utilized"
            out, cores = served(lambda x=x: model_parallel(x))
        assert _close(out, net(x))
        assert set(cores.values()) == {per_core}, (rows, cores)
    strided = torch.rand([3, 8, 8, 8]).permute(3, 0, 1, 2)   # not contiguous
    assert _close(model_parallel(strided), net(strided))
    with pytest.raises(ValueError, match="dtype float64"):
        model_parallel(torch.rand([8, 3, 8, 8], dtype=torch.float64))


def test_chunks_on_device_time_cores_are_read_ahead_and_joined_where_read(emulated,
                                                                         monkeypatch):
    """While the caller waits for its first chunk, it takes the other cores' answers
    off their rings, and each chunk's outputs go straight into the joined output."""
    from neuronmp.pool import answer, coordinator

    emulated("1x4")
    net = torch.nn.Linear(8, 3).eval()
    model_parallel = neuronmp.DataParallel(
        neuronmp.trace(net, torch.rand(4, 8), device_time=5000))
    me, read_ahead, in_place = threading.current_thread(), [], []
    spied_read, spied_join = coordinator._CoreWorker._read_ahead, answer.Joint.join

    def read(worker):
        read_ahead.append(threading.current_thread())
        spied_read(worker)

    def join(joint, parts):
        in_place.append(sum(p is joint for p in parts))
        return spied_join(joint, parts)

    monkeypatch.setattr(coordinator._CoreWorker, "_read_ahead", read)
    monkeypatch.setattr(answer.Joint, "join", join)
    x = torch.rand(16, 8)
    for _ in range(20):   # a reader thread may take an answer first: over 20 calls, not all
        assert _close(model_parallel(x), net(x))
    assert me in read_ahead
    assert 4 in in_place and len(in_place) == 20


def test_a_model_that_reduces_its_batch_gives_one_row_per_chunk(emulated):
    # its outputs cannot go into a chunk's rows: they are concatenated as before
    emulated("1x4")

    class Total(torch.nn.Module):
        def forward(self, x):
            return x.sum(dim=0, keepdim=True)

    model_parallel = neuronmp.DataParallel(neuronmp.trace(Total(), torch.rand(2, 5)))
    x = torch.rand(8, 5)
    want = torch.cat([c.sum(dim=0, keepdim=True) for c in x.split(2)])
    assert _close(model_parallel(x), want)


def test_a_caller_waiting_for_one_answer_leaves_other_cores_answers_to_their_waiters(
        emulated, monkeypatch):
    from neuronmp.pool import coordinator
    from neuronmp.session.model import model_of

    emulated("1x4")
    net = torch.nn.Linear(8, 3).eval()
    x = torch.rand(4, 8)
    here = neuronmp.trace(net, x, device_time=3000)     # nc:0
    there = neuronmp.trace(net, x, device_time=3000)
    neuronmp.set_neuron_cores(there, 1, 1)
    me, read_ahead = threading.current_thread(), []
    spied = coordinator._CoreWorker._read_ahead

    def read(worker):
        read_ahead.append(threading.current_thread())
        spied(worker)

    monkeypatch.setattr(coordinator._CoreWorker, "_read_ahead", read)
    for _ in range(20):
        other = model_of(there).submit([x])   # nc:1's answer: nobody waits for it yet
        assert _close(here(x), net(x))
        assert _close(other.result(timeout=30)[0], net(x))
    assert me not in read_ahead


# -- chunks of whole traced batches go as row ranges (ipc.codec.Rows) --------------------


class _TwoIn(torch.nn.Module):
    def forward(self, x, k):
        return x * 2 + k.sum(1, keepdim=True), x.sum(1)


def test_whole_traced_batches_go_as_row_ranges_and_match_torch(emulated):
    emulated("1x4")
    net = _TwoIn().eval()
    model = neuronmp.trace(net, (torch.zeros(3, 5), torch.zeros(3, 2, dtype=torch.float64)),
                           device_time=200)
    dp = neuronmp.DataParallel(model)
    x, k = torch.rand(12, 5), torch.rand(12, 2, dtype=torch.float64)
    for _ in range(2):   # the second call takes the kept even plan: row ranges
        got = dp(x, k)
    sizes = dp._chunk_sizes(12)
    assert [type(p) for p in dp._rows((x, k), sizes)[0]] == [neuronmp.ipc.codec.Rows] * 4
    want = net(x, k)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    # inputs that do not fit the trace are checked and refused as before
    for bad in [(x, k.float()), (x[:, :4], k), (x.t().contiguous().t(), k)]:
        assert dp._rows(bad, sizes) is None
    assert all(torch.equal(g, w) for g, w in zip(dp(x.t().contiguous().t(), k), want))
    with pytest.raises(ValueError, match=r"input 0 has shape \[12, 4\]"):
        dp(x[:, :4], k)


def test_row_ranges_a_dead_worker_never_read_go_to_its_replacement(emulated):
    import os
    import signal
    import time

    from neuronmp.session.session import current

    emulated("1x2")
    net = torch.nn.Linear(4, 3).eval()
    dp = neuronmp.DataParallel(neuronmp.trace(net, torch.zeros(2, 4), device_time=1000))
    x = torch.rand(4, 4)
    dp(x)
    pool = current().pool
    core = pool.cores[1]
    pid = pool.worker_pid(core)
    os.kill(pid, signal.SIGSTOP)     # its chunk waits unread in its ring
    result, failures = [], []

    def call():
        try:
            result.append(dp(x))
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(0.3)
    assert caller.is_alive() and not result, "the call must wait for the stopped core"
    os.kill(pid, signal.SIGKILL)
    caller.join(60)
    assert not caller.is_alive() and not failures, failures
    assert torch.allclose(result[0], net(x), atol=1e-5)
    assert pool.worker_pid(core) != pid
    assert pool.stats()[1].restarts == 1


class _Marked(torch.nn.Module):
    """A linear layer, and the batch size its graph was traced at (baked by float())."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.lin(x), torch.full((x.shape[0], 1), float(x.shape[0]))


def _bucket_rows(rows, buckets):
    """Per row, the bucket one core runs it in: full largest buckets, then the rest in
    the smallest that holds it."""
    out, largest = [], buckets[-1]
    while rows:
        n = min(rows, largest)
        out += [min(b for b in buckets if b >= n)] * n
        rows -= n
    return out


@pytest.mark.filterwarnings("ignore:DataParallel. batch size")
@pytest.mark.parametrize("rows", [3, 8, 37, 140])
def test_dataparallel_and_dynamic_batch_chunks_run_in_batch_buckets(emulated, rows):
    emulated("1x4")
    torch.manual_seed(0)
    net, buckets = _Marked().eval(), (1, 4, 8, 16, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = neuronmp.trace(net, torch.rand(1, 6), batch_buckets=buckets)
    x = torch.rand(rows, 6)
    (y, marker), _ = served(lambda: neuronmp.DataParallel(traced)(x))
    torch.testing.assert_close(y, net(x)[0].detach())
    sizes = [rows // 4 + (i < rows % 4) for i in range(min(rows, 4))]   # the SDK's split
    want = [b for n in sizes for b in _bucket_rows(n, buckets)]
    assert marker[:, 0].tolist() == want
    # dynamic_batch on the trace itself (one core): the same buckets, one core's plan
    (y, marker), _ = served(lambda: neuronmp.dynamic_batch(traced)(x))
    torch.testing.assert_close(y, net(x)[0].detach())
    assert marker[:, 0].tolist() == _bucket_rows(rows, buckets)


class _Holding(torch.nn.Module):
    """A module with a traced submodule: DataParallel copies it per core."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


@pytest.mark.filterwarnings("ignore:DataParallel. batch size")
@pytest.mark.parametrize("wrapped", [False, True], ids=["trace", "module holding it"])
def test_bucket_runs_of_the_trace_count_what_dataparallel_ran_on_every_core(emulated,
                                                                             wrapped):
    """DataParallel runs replicas of its own; the counts a user reads are the trace's
    (model_of(trace).bucket_runs), so they are the sum over those replicas."""
    import collections

    from neuronmp.session.model import model_of
    emulated("1x4")
    buckets = (1, 4, 8, 16, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = neuronmp.trace(_Marked().eval(), torch.rand(1, 6), batch_buckets=buckets)
    dp = neuronmp.DataParallel(_Holding(traced) if wrapped else traced)
    want = collections.Counter()
    for rows in (37, 5, 3):
        dp(torch.rand(rows, 6))
        sizes = [rows // 4 + (i < rows % 4) for i in range(min(rows, 4))]
        want.update(min(b for b in buckets if b >= n) for n in sizes)
    assert model_of(traced).bucket_runs == want
    assert sum(want.values()) == 4 + 4 + 3


# -- a call's chunks on device-time cores are sent together --------------------------------


def _calls_while_sending(dp, x):
    """Python calls, and calls of the codec's ring puts, made by one DataParallel call
    until it starts waiting for its chunks' answers (the send side)."""
    from neuronmp.session import model as nmp_model

    counts = {"python": 0, "put": 0, "put_many": 0}
    sending = [True]

    def profile(frame, event, arg):
        if not sending[0]:
            return
        if event == "call":
            if frame.f_code is nmp_model._results.__code__:
                sending[0] = False
            else:
                counts["python"] += 1
        elif event == "c_call" and getattr(arg, "__name__", "") in ("put", "put_many") \
                and getattr(arg, "__module__", "") == "neuronmp.ipc._frames":
            counts[arg.__name__] += 1

    sys.setprofile(profile)
    try:
        out = dp(x)
    finally:
        sys.setprofile(None)
    return out, counts


def test_a_call_on_32_device_time_cores_sends_its_chunks_in_one_c_call(emulated):
    """Each chunk's modelled time starts when it is sent: sent one by one, the last
    chunk waited behind every other's Python, and the call with it."""
    emulated("16x2")
    net = torch.nn.Linear(16, 4).eval()
    dp = neuronmp.DataParallel(neuronmp.trace(net, torch.rand(32, 16), device_time=500))
    x = torch.rand(32 * 32, 16)
    for _ in range(3):   # the third call takes the kept plan and the row ranges
        assert _close(dp(x), net(x))
    out, counts = _calls_while_sending(dp, x)
    assert _close(out, net(x))
    assert counts["put_many"] == 1 and counts["put"] == 0, counts
    # a Pending per chunk and a few calls per DataParallel call, not a path per chunk
    assert counts["python"] <= 2 * 32, counts


def test_chunks_sent_together_count_on_every_core_and_in_the_trace(emulated):
    from neuronmp.session.session import current

    emulated("1x4")
    net = torch.nn.Linear(8, 3).eval()
    dp = neuronmp.DataParallel(neuronmp.trace(net, torch.rand(2, 8), device_time=300))
    x = torch.rand(8, 8)
    pool = current().pool
    before = [s.submitted for s in pool.stats()]
    for _ in range(5):
        assert _close(dp(x), net(x))
    assert [s.submitted - b for s, b in zip(pool.stats(), before)] == [5] * 4
    assert _calls_while_sending(dp, x)[1]["put_many"] == 1


def test_a_device_time_worker_killed_mid_call_fails_the_call_and_the_next_one_runs(emulated):
    import os
    import signal
    import time

    from neuronmp import WorkerDiedError
    from neuronmp.session.session import current

    class Heavy(torch.nn.Module):
        def forward(self, x):
            y = x
            for _ in range(200):
                y = torch.tanh(y @ y.t() @ y)
            return x + 0 * y

    emulated("1x2")
    net = Heavy().eval()
    dp = neuronmp.DataParallel(neuronmp.trace(net, torch.rand(64, 64) / 64, device_time=100))
    x = torch.rand(128, 64) / 64
    assert _close(dp(x), net(x))
    pool = current().pool
    core, slot = pool.cores[1], 1
    victim = pool.worker_pid(core)
    idle = pool.stats()[slot].running
    failures = []

    def call():
        try:
            dp(x)
        except BaseException as exc:  # noqa: BLE001 - checked below
            failures.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    deadline = time.monotonic() + 30
    while pool.stats()[slot].running in (0, idle) and time.monotonic() < deadline:
        time.sleep(0.0005)
    os.kill(victim, signal.SIGKILL)
    caller.join(60)
    assert not caller.is_alive()
    assert len(failures) == 1 and isinstance(failures[0], WorkerDiedError), failures
    assert _close(dp(x), net(x))
    assert pool.worker_pid(core) != victim
