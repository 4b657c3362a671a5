"""neuronmp.batching.BatchingServer: right answers to the right callers, failures, limits."""
from __future__ import annotations

import asyncio
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

import neuronmp
from neuronmp import errors
from neuronmp.batching import BatchingServer
from neuronmp.session.session import current as _current_session


def affine(x):
    """y = 2x + 1: every output names the input it came from (exact in float32)."""
    return x * 2 + 1


class Pair(torch.nn.Module):
    """Two inputs, a structured output."""

    def forward(self, a, b):
        return {"sum": a + b, "parts": (a * 2, b - 1)}


class Slow(torch.nn.Module):
    """2x + 1 after a dense matrix product that keeps the core busy for a while.

    Tests that need a request to outlast what they do meanwhile give it device time
    too: how long a product takes depends on the host and its load."""

    def __init__(self, size: int):
        super().__init__()
        self.register_buffer("m", torch.rand(size, size) / size)

    def forward(self, x):
        return x * 2 + 1 + 0 * torch.mm(self.m, self.m)[0, 0]


@pytest.fixture
def two_cores(emulated):
    emulated("1x2")


def _traced(fn, *example, multicore=True, **trace_kw):
    model = neuronmp.trace(fn, example if len(example) > 1 else example[0], **trace_kw)
    if multicore:
        neuronmp.set_multicore(model)
    return model


def _serve_threads():
    return [t for t in threading.enumerate() if t.name.startswith("neuronmp-serve")]


def test_64_threads_each_get_their_own_results(two_cores):
    model = _traced(affine, torch.zeros(8, 4))
    bad, failures = [], []
    with BatchingServer(model, max_batch_size=8, max_queue_delay_ms=1) as server:
        assert server.cores == neuronmp.visible_cores() == (0, 1)

        def client(i):
            try:
                for j in range(200):
                    x = torch.full((4,), float(i * 1000 + j))
                    x[0] = -x[0]
                    y = server.infer(x)
                    if not torch.equal(y, x * 2 + 1):
                        bad.append((i, j, y))
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        stats = server.stats()
    assert not failures and not bad, (failures[:3], bad[:3])
    assert stats["completed"] == 64 * 200 and stats["failed"] == 0
    assert stats["batches"] < stats["completed"]          # requests were really combined
    stats = _current_session().pool.stats()
    assert stats[0].done > 1 and stats[1].done > 1  # both cores
    assert _serve_threads() == []


def test_small_batches_single_samples_structured_outputs_and_asyncio(two_cores):
    model = _traced(Pair(), torch.zeros(4, 3), torch.zeros(4, 3))
    with BatchingServer(model, max_batch_size=6, max_queue_delay_ms=5) as server:
        a, b = torch.rand(3, 3), torch.rand(3, 3)
        out = server.infer(a, b)                     # 3 rows: padded into 4-row chunks
        torch.testing.assert_close(out["sum"], a + b)
        torch.testing.assert_close(out["parts"][1], b - 1)
        one = server.infer(a[0], b[0])               # one sample: no batch dimension back
        assert one["sum"].shape == (3,) and isinstance(one["parts"], tuple)
        torch.testing.assert_close(one["parts"][0], a[0] * 2)

        async def many():
            xs = [torch.full((3,), float(i)) for i in range(40)]
            outs = await asyncio.gather(*(server.infer_async(x, x) for x in xs))
            return xs, outs

        xs, outs = asyncio.run(many())
        for x, o in zip(xs, outs):
            assert torch.equal(o["sum"], x + x)


def test_worker_killed_under_load_fails_its_requests_and_serving_goes_on(two_cores):
    model = _traced(Slow(640), torch.zeros(2, 4))
    pool = _current_session().pool
    futures, stop = [], threading.Event()
    with BatchingServer(model, max_batch_size=2, max_queue_delay_ms=1) as server:
        def client(i):
            n = 0
            while not stop.is_set() and n < 400:
                futures.append((i, n, server.submit(torch.full((4,), float(i * 1000 + n)))))
                futures[-1][2].exception(timeout=30)
                n += 1

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        victim = server.cores[1]
        slot = [s.core for s in pool.stats()].index(victim)
        deadline = time.monotonic() + 10
        while not pool.stats()[slot].running:   # killed while it runs a batch
            assert time.monotonic() < deadline, "no batch ever ran on the victim core"
            time.sleep(0.0005)
        pid = pool.worker_pid(victim)
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)   # the worker restarts meanwhile; traffic keeps flowing
        stop.set()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
        died = []
        for i, n, fut in futures:
            assert fut.done()                              # none hangs
            exc = fut.exception()
            if exc is None:
                assert torch.equal(fut.result(), torch.full((4,), i * 1000 + n * 1.0) * 2 + 1)
            else:
                assert isinstance(exc, errors.WorkerDiedError), exc
                died.append(exc)
        # the batch it was running fails (none, if the kill came just after its answer
        # left and before it noted itself idle); a batch it never read is sent again
        assert all(e.core == victim and e.pid == pid for e in died)
        assert all("killed by signal SIGKILL" in str(e) for e in died)
        # the server keeps serving, on the restarted worker too
        before = {s.core: s.done for s in pool.stats()}
        xs = [torch.full((4,), float(k)) for k in range(40)]
        outs = [f.result(timeout=30) for f in [server.submit(x) for x in xs]]
        assert all(torch.equal(o, x * 2 + 1) for o, x in zip(outs, xs))
        assert pool.worker_pid(victim) != pid
        after = {s.core: s.done for s in pool.stats()}
        assert after[victim] > before[victim]


def test_queue_full_is_rejected_clearly(two_cores):
    model = _traced(Slow(8), torch.zeros(1, 4), multicore=False, device_time=200_000)
    with BatchingServer(model, 1, 0, max_queue_size=3, batches_per_core=1) as server:
        accepted, rejected = [], None
        for k in range(50):
            try:
                accepted.append((k, server.submit(torch.full((4,), float(k)))))
            except errors.QueueFullError as exc:
                rejected = exc
                break
        assert rejected is not None and len(accepted) <= 3 + 1   # 3 waiting + 1 running
        assert rejected.max_queue_size == 3 and rejected.queued == 3
        assert "queue is full" in str(rejected) and "max_queue_size=3" in str(rejected)
        again = pickle.loads(pickle.dumps(rejected))
        assert type(again) is errors.QueueFullError and str(again) == str(rejected)
        assert isinstance(rejected, RuntimeError)
        for k, fut in accepted:     # what was accepted is served
            assert torch.equal(fut.result(timeout=30), torch.full((4,), k * 2 + 1.0))
        assert server.stats()["rejected"] == 1


def test_per_request_timeout_while_queued_and_while_running(two_cores):
    # device time makes "runs for a while" hold on any host (a 900x900 product took
    # under 20 ms on a fast one, and the queued request then ran in time)
    model = _traced(Slow(8), torch.zeros(1, 4), multicore=False, device_time=400_000)
    with BatchingServer(model, 1, 0, batches_per_core=1, timeout=30) as server:
        t0 = time.monotonic()
        first = server.submit(torch.ones(4))                   # runs for a while
        queued = server.submit(torch.ones(4), timeout=0.02)    # stuck behind it
        with pytest.raises(errors.RequestTimeoutError) as info:
            queued.result(timeout=5)
        assert time.monotonic() - t0 < 5
        assert info.value.timeout == 0.02 and "waiting in the queue" in str(info.value)
        assert isinstance(info.value, TimeoutError)
        assert torch.equal(first.result(timeout=30), torch.full((4,), 3.0))
        running = server.submit(torch.ones(4), timeout=0.005)  # the model takes longer
        with pytest.raises(errors.RequestTimeoutError, match="while running"):
            running.result(timeout=5)
        assert torch.equal(server.infer(torch.zeros(4)), torch.ones(4))  # still serving
        assert server.stats()["timed_out"] == 2
    with pytest.raises(ValueError, match="timeout must be a finite number > 0"):
        BatchingServer(model, 1, 0, timeout=0)


def test_close_fails_waiting_requests_and_leaves_no_thread(two_cores):
    model = _traced(Slow(8), torch.zeros(1, 4), multicore=False, device_time=300_000)
    server = BatchingServer(model, 1, 0, batches_per_core=1)
    futures = [server.submit(torch.full((4,), float(k))) for k in range(5)]
    deadline = time.monotonic() + 10
    while not futures[0].running():     # the first is on the core, the rest wait
        assert time.monotonic() < deadline
        time.sleep(0.001)
    server.close()
    assert all(f.done() for f in futures)
    outcomes = [f.exception() for f in futures]
    assert outcomes[0] is None                                  # the running batch finished
    closed = [e for e in outcomes if isinstance(e, errors.ServerClosedError)]
    assert len(closed) == 4 and "closed before this request ran" in str(closed[0])
    assert _serve_threads() == []
    with pytest.raises(errors.ServerClosedError, match="closed"):
        server.submit(torch.ones(4))
    server.close()   # idempotent


def test_runtime_shutdown_closes_the_server(two_cores):
    model = _traced(affine, torch.zeros(2, 4))
    server = BatchingServer(model, 2, 1)
    assert torch.equal(server.infer(torch.ones(4)), torch.full((4,), 3.0))
    neuronmp.shutdown()
    assert server.closed and _serve_threads() == []


def test_bad_input_is_refused_at_the_call(two_cores):
    model = _traced(affine, torch.zeros(4, 3))
    with pytest.raises(TypeError, match="made by neuronmp.trace"):
        BatchingServer(torch.nn.Linear(3, 3), 4, 1)
    with pytest.raises(ValueError, match="max_batch_size must be an int >= 1, got 0"):
        BatchingServer(model, 0, 1)
    with pytest.raises(ValueError, match="max_queue_delay_ms must be a finite number >= 0"):
        BatchingServer(model, 4, -1)
    with pytest.raises(ValueError, match="max_queue_size must be an int >= 1"):
        BatchingServer(model, 4, 1, max_queue_size=0)
    with BatchingServer(model, 4, 1) as server:
        with pytest.raises(ValueError, match=r"shape \[2, 5\]; expected one sample \[3\]"):
            server.submit(torch.zeros(2, 5))
        with pytest.raises(ValueError, match="a request of 5 rows does not fit max_batch_size=4"):
            server.submit(torch.zeros(5, 3))
        with pytest.raises(ValueError, match="float64 tensor; the model takes CPU float32"):
            server.submit(torch.zeros(3, dtype=torch.float64))
        with pytest.raises(TypeError, match="takes 1 input tensor"):
            server.submit(torch.zeros(3), torch.zeros(3))
        with pytest.raises(TypeError, match="must be a torch.Tensor"):
            server.submit([1.0, 2.0, 3.0])
        assert server.stats()["submitted"] == 0


def test_serving_errors_pickle_with_their_fields():
    for exc in (errors.QueueFullError(8, 8), errors.RequestTimeoutError(0.5, "running"),
                errors.ServerClosedError("gone")):
        again = pickle.loads(pickle.dumps(exc))
        assert type(again) is type(exc) and str(again) == str(exc)
        assert {f: getattr(again, f) for f in exc._fields} == {
            f: getattr(exc, f) for f in exc._fields}


def test_requests_arriving_while_every_core_is_busy_join_one_batch(two_cores):
    # the delay bounds the wait for more requests, not the wait for a core: singles
    # that arrive during a long batch are not sent one by one behind it
    model = _traced(Slow(8), torch.zeros(4, 4), multicore=False, device_time=500_000)
    with BatchingServer(model, 4, max_queue_delay_ms=1) as server:
        first = server.submit(torch.ones(4, 4))              # full: runs at once
        time.sleep(0.01)
        singles = []
        for k in range(3):
            singles.append(server.submit(torch.full((4,), float(k))))
            time.sleep(0.005)                                # each outwaits the delay
        assert not first.done(), "the first batch must still run for this test to mean much"
        for k, fut in enumerate(singles):
            assert torch.equal(fut.result(timeout=30), torch.full((4,), 2.0 * k + 1))
        assert torch.equal(first.result(timeout=30), torch.full((4, 4), 3.0))
        stats = server.stats()
        assert stats["batches"] == 2 and stats["rows"] == 7, stats


def test_each_full_batch_goes_at_once_to_a_free_core_while_others_run(emulated):
    # four cores, a minute of queue delay: a batch that fills up must wake a lane
    # whose core is free (not one whose core is busy, which cannot take it), or it
    # would sit out the delay while three cores idle
    emulated("2x2")
    model = _traced(affine, torch.zeros(4, 4), device_time=2_500_000)
    with BatchingServer(model, 4, max_queue_delay_ms=60_000, batches_per_core=1,
                        warmup=False) as server:
        first = server.submit(torch.full((4,), 0.0))          # an idle server: direct
        batches = [[server.submit(torch.full((4,), float(1 + 4 * b + k))) for k in range(4)]
                   for b in range(3)]
        deadline = time.monotonic() + 2.0
        while server.stats()["running"] < 4:
            assert time.monotonic() < deadline, \
                f"full batches left waiting beside free cores: {server.stats()}"
            time.sleep(0.005)
        assert not first.done(), "the first batch must still run for this test to mean much"
        assert torch.equal(first.result(timeout=30), torch.full((4,), 1.0))
        for b, futs in enumerate(batches):
            for k, fut in enumerate(futs):
                assert torch.equal(fut.result(timeout=30),
                                   torch.full((4,), 2.0 * (1 + 4 * b + k) + 1))
        stats = _settled_stats(server)
    assert stats["batches"] == 4 and stats["direct"] == 1, stats
    assert sorted(stats["batch_sizes"].items()) == [(1, 1), (4, 3)]


def test_server_follows_a_model_moved_by_set_neuron_cores(two_cores):
    model = _traced(affine, torch.zeros(2, 3), multicore=False)
    neuronmp.set_neuron_cores(model, 0, 1)
    pool = _current_session().pool
    cores = neuronmp.visible_cores()

    def done_by_core():
        return {s.core: s.done for s in pool.stats()}

    with BatchingServer(model, 2, 0.5, warmup=False) as server:
        before = done_by_core()
        x = torch.rand(3)
        assert torch.equal(server.infer(x), x * 2 + 1)
        assert done_by_core()[cores[0]] > before[cores[0]]
        neuronmp.set_neuron_cores(model, 1, 1)   # moved while the server runs
        assert server.cores == (cores[1],)
        before = done_by_core()
        assert torch.equal(server.infer(x), x * 2 + 1)
        after = done_by_core()
        assert after[cores[1]] > before[cores[1]] and after[cores[0]] == before[cores[0]]


def test_a_traced_model_serves_again_after_a_runtime_restart(two_cores):
    model = _traced(affine, torch.zeros(2, 3))
    with BatchingServer(model, 2, 0.5) as server:
        assert torch.equal(server.infer(torch.ones(3)), torch.full((3,), 3.0))
    neuronmp.shutdown()   # the session, its pool and every loaded copy go
    with BatchingServer(model, 2, 0.5) as server:   # the model loads again, same cores
        assert torch.equal(server.infer(torch.ones(3)), torch.full((3,), 3.0))
        assert server.cores == neuronmp.visible_cores()


def _wait_running(fut):
    deadline = time.monotonic() + 10
    while not (fut.running() or fut.done()):
        assert time.monotonic() < deadline, "the first request never started"
        time.sleep(0.001)


def _run_order(futures):
    """Futures' labels in the order the lane answered them (done callbacks run there)."""
    order, lock = [], threading.Lock()

    def record(label):
        def done(_):
            with lock:
                order.append(label)
        return done

    for label, fut in futures.items():
        fut.add_done_callback(record(label))
    for fut in futures.values():
        fut.result(timeout=30)
    return order


def test_a_high_priority_request_runs_before_the_low_ones_queued_ahead(two_cores):
    # one lane on one core, 100 ms a request: the first runs, the rest queue behind it
    model = neuronmp.trace(affine, torch.zeros(1, 4), device_time=100_000)
    with BatchingServer(model, 1, 0, batches_per_core=1, priority_levels=2,
                        default_priority_level=2, max_queue_size=2) as server:
        first = server.submit(torch.full((4,), 0.0))
        _wait_running(first)
        low = [server.submit(torch.full((4,), float(k))) for k in (1, 2)]
        # each level has its own bound (Triton's queue policy): level 2 is full...
        with pytest.raises(errors.QueueFullError) as full:
            server.submit(torch.ones(4), priority=2)
        assert full.value.priority == 2 and "at priority level 2" in str(full.value)
        assert server.stats()["queued_by_level"] == [0, 2]
        high = server.submit(torch.full((4,), 3.0), priority=1)   # ...level 1 is not
        order = _run_order({"first": first, "low1": low[0], "low2": low[1], "high": high})
        assert order == ["first", "high", "low1", "low2"]
        assert torch.equal(high.result(), torch.full((4,), 7.0))
        for bad in (3, -1, 1.0, "1"):
            with pytest.raises(ValueError, match=rf"priority {bad!r} is not a level; "
                               r"accepted: 1 \(highest\) \.\. 2"):
                server.submit(torch.ones(4), priority=bad)
    with pytest.raises(ValueError, match=r"default_priority_level must be in 1\.\.2"):
        BatchingServer(model, 1, 0, priority_levels=2, default_priority_level=3)
    with pytest.raises(ValueError, match="priority_queue_policy level 3 is not one of"):
        BatchingServer(model, 1, 0, priority_levels=2,
                       priority_queue_policy={3: neuronmp.batching.QueuePolicy(1)})


def test_a_level_policy_sets_its_own_bound_and_timeout(two_cores):
    model = neuronmp.trace(affine, torch.zeros(1, 4), device_time=100_000)
    policy = neuronmp.batching.QueuePolicy(max_queue_size=1, timeout=0.01)
    with BatchingServer(model, 1, 0, batches_per_core=1, priority_levels=2,
                        priority_queue_policy={1: policy}) as server:
        assert server.default_priority_level == 2          # the lowest, unless given
        first = server.submit(torch.zeros(4))               # runs for 100 ms
        _wait_running(first)
        lows = [server.submit(torch.zeros(4)) for _ in range(3)]   # level 2: no bound
        high = server.submit(torch.zeros(4), priority=1)
        with pytest.raises(errors.QueueFullError, match="max_queue_size=1"):
            server.submit(torch.zeros(4), priority=1)
        with pytest.raises(errors.RequestTimeoutError, match="waiting in the queue"):
            high.result(timeout=10)                         # level 1's 10 ms default
        for fut in [first, *lows]:
            assert torch.equal(fut.result(timeout=30), torch.ones(4))


def test_preferred_batch_sizes_are_formed_when_the_queue_reaches_one(two_cores):
    # traced at 8, one core, 20 ms of device time a row, a long delay
    model = neuronmp.trace(affine, torch.zeros(8, 4), device_time="0,20000")
    with BatchingServer(model, 8, max_queue_delay_ms=400,
                        preferred_batch_size=[4, 2]) as server:
        assert server.preferred_batch_size == (2, 4)
        busy = server.submit(torch.zeros(8, 4))          # full: runs at once, 160 ms
        _wait_running(busy)
        futs = [server.submit(torch.full((4,), float(k))) for k in range(7)]
        for k, fut in enumerate(futs):
            assert torch.equal(fut.result(timeout=30), torch.full((4,), 2.0 * k + 1))
        # while the core is busy the next batch is cut at the largest preferred size
        # (4); once it is free, 2 (preferred) goes at once; the last single waits out
        # the delay for company, then goes alone
        assert server.stats()["batch_sizes"] == {8: 1, 4: 1, 2: 1, 1: 1}
        three = server.submit(torch.zeros(3, 4))         # 3 rows, not preferred: waits
        five = server.submit(torch.zeros(5, 4))          # 3 + 5 = max_batch_size: goes
        assert torch.equal(three.result(timeout=30), torch.ones(3, 4))
        assert torch.equal(five.result(timeout=30), torch.ones(5, 4))
        assert server.stats()["batch_sizes"] == {8: 2, 4: 1, 2: 1, 1: 1}
        assert busy.result(timeout=30).shape == (8, 4)
    with pytest.raises(ValueError, match=r"preferred_batch_size 9 is not a row count in "
                       r"1\.\.max_batch_size \(8\)"):
        BatchingServer(model, 8, 1, preferred_batch_size=[4, 9])


# -- direct sends: an idle server's request goes from its caller to a core -------------


def _settled_stats(server: BatchingServer) -> dict:
    """The server's stats once no batch is running (within 10 s): a lane frees its
    core's slot just after it has answered its callers, so a caller that has its
    answer can still see the batch running for a moment."""
    deadline = time.monotonic() + 10
    while server.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.002)
    return server.stats()


def test_an_idle_servers_request_goes_direct_and_holds_its_cores_slot(two_cores):
    # one core, one batch at a time, 1 s a request: the first goes straight from
    # this thread to the core; the second (a full batch for the lane) must wait for
    # the slot the first holds, not run beside it on the same core
    model = _traced(Slow(8), torch.zeros(1, 4), multicore=False, device_time=1_000_000)
    with BatchingServer(model, 1, 1, batches_per_core=1) as server:
        first = server.submit(torch.full((4,), 1.0))
        stats = server.stats()
        assert stats["direct"] == 1 and stats["running"] == 1 and stats["queued"] == 0
        second = server.submit(torch.full((4,), 2.0))
        assert server.stats()["direct"] == 1            # queued: the server was busy
        deadline = time.monotonic() + 30
        while not second.running():
            assert time.monotonic() < deadline, "the second request never ran"
            assert server.stats()["running"] <= 1
            time.sleep(0.002)
        # it starts as the first's answer comes back (the slot is freed just before
        # the first caller is answered), not beside it with a second still to run
        assert torch.equal(first.result(timeout=0.5), torch.full((4,), 3.0)), \
            "two batches on a core with one slot"
        assert torch.equal(second.result(timeout=30), torch.full((4,), 5.0))
        stats = _settled_stats(server)
    assert stats["batches"] == 2 and stats["completed"] == 2 and stats["running"] == 0
    assert stats["compute_us"] > 0


def test_direct_sends_and_lanes_never_share_a_slot_under_mixed_load(two_cores):
    # no delay: any core without a batch takes a request from its caller, while
    # lanes take what queued meanwhile, so both paths race for the same slots
    model = _traced(affine, torch.zeros(4, 4))
    limit = len(neuronmp.visible_cores())     # one slot per core
    bad, failures, over, stop = [], [], [], threading.Event()
    with BatchingServer(model, 4, 0, batches_per_core=1) as server:
        def client(i):
            try:
                for j in range(150):
                    x = torch.full((4,), float(i * 1000 + j))
                    if not torch.equal(server.infer(x), x * 2 + 1):
                        bad.append((i, j))
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

        def watch():
            while not stop.is_set():
                running = server.stats()["running"]
                if running > limit:
                    over.append(running)

        watcher = threading.Thread(target=watch)
        watcher.start()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        stop.set()
        watcher.join(10)
        assert not any(t.is_alive() for t in threads + [watcher])
        stats = _settled_stats(server)
    assert not failures and not bad and not over, (failures[:3], bad[:3], over[:3])
    assert stats["completed"] == 12 * 150 and stats["running"] == 0
    assert 0 < stats["direct"] < stats["batches"], stats      # both paths were taken


def test_a_direct_request_fails_alone_when_its_worker_dies(two_cores):
    # a product that computes for a while (a device-time core would have answered
    # already, its answer only held back until due): the worker dies computing it
    model = _traced(Slow(2560), torch.zeros(1, 4), multicore=False)
    pool = _current_session().pool
    with BatchingServer(model, 1, 1) as server:
        core = server.cores[0]
        slot = [s.core for s in pool.stats()].index(core)
        # the worker notes itself idle only after its answer has left: the warm-up's
        # id may still show, and a kill then would hit a worker that never read ours
        warm_up = pool.stats()[slot].running
        doomed = server.submit(torch.ones(4))
        assert server.stats()["direct"] == 1
        deadline = time.monotonic() + 10
        while pool.stats()[slot].running in (0, warm_up):
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.001)
        pid = pool.worker_pid(core)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(errors.WorkerDiedError) as died:
            doomed.result(timeout=30)
        assert died.value.core == core and died.value.pid == pid
        after = server.submit(torch.zeros(4), timeout=60)   # on the restarted worker
        assert torch.equal(after.result(timeout=60), torch.ones(4))
        stats = _settled_stats(server)
    assert stats["failed"] == 1 and stats["completed"] == 1 and stats["running"] == 0


def test_close_fails_a_direct_request_that_outlasts_the_grace(two_cores):
    model = _traced(Slow(8), torch.zeros(1, 4), multicore=False, device_time=1_500_000)
    server = BatchingServer(model, 1, 1)
    running = server.submit(torch.ones(4))
    assert server.stats()["direct"] == 1
    server.close(timeout=0.05)
    with pytest.raises(errors.ServerClosedError, match="still ran after 0.05 s"):
        running.result(timeout=0)
    assert _serve_threads() == []


def test_asyncio_callers_time_out_and_cancel_on_either_path(two_cores):
    model = _traced(Slow(8), torch.zeros(1, 4), multicore=False, device_time=300_000)
    with BatchingServer(model, 1, 1, batches_per_core=1) as server:
        async def scenario():
            late = asyncio.ensure_future(server.infer_async(torch.ones(4), timeout=0.01))
            await asyncio.sleep(0)                  # sent directly, now running
            queued = asyncio.ensure_future(server.infer_async(torch.ones(4)))
            kept = asyncio.ensure_future(server.infer_async(torch.full((4,), 2.0)))
            await asyncio.sleep(0.02)
            queued.cancel()                         # still queued: never runs
            with pytest.raises(errors.RequestTimeoutError, match="while running"):
                await late
            with pytest.raises(asyncio.CancelledError):
                await queued
            return await asyncio.wait_for(kept, 30)

        assert torch.equal(asyncio.run(scenario()), torch.full((4,), 5.0))
        # an asyncio caller may have its answer before the lane counts it (only a
        # blocked caller is woken after the count): wait for the count, bounded
        deadline = time.monotonic() + 10
        while not server.stats()["completed"] and time.monotonic() < deadline:
            time.sleep(0.005)
        stats = server.stats()
    assert stats["direct"] == 1 and stats["batches"] == 2      # the cancelled one: none
    assert stats["timed_out"] == 1 and stats["completed"] == 1


# -- answers written into the caller's buffers (``into``) ---------------------------------


class Mix(torch.nn.Module):
    """Long enough on any host that a 20 ms timeout fires while its core runs it."""

    def forward(self, x):
        y = x
        for _ in range(60):
            y = torch.tanh(y @ y)
        return x + 1 + 0 * y


def test_an_idle_servers_request_is_answered_in_its_buffers_a_batched_one_is_not(emulated):
    from neuronmp.pool.answer import Destination

    emulated("1x1")
    model = _traced(affine, torch.zeros(4, 6), multicore=False)
    with BatchingServer(model, max_batch_size=4, max_queue_delay_ms=0) as server:
        x = torch.randn(4, 6)
        buf = torch.zeros(4, 6)
        y = server.infer(x, into=Destination([buf]))
        assert y.data_ptr() == buf.data_ptr() and server.stats()["direct"] == 1
        torch.testing.assert_close(buf, x * 2 + 1)
        small = torch.zeros(4, 6)   # 2 rows padded to the traced 4: its buffers are not used
        y = server.infer(x[:2], into=Destination([small]))
        torch.testing.assert_close(y, x[:2] * 2 + 1)
        assert not small.any()


def test_a_request_that_timed_out_while_running_writes_nothing_once_its_guard_is_closed(
        emulated):
    from neuronmp.pool.answer import Destination

    emulated("1x1")
    model = _traced(Mix(), torch.zeros(512, 512), multicore=False)
    x = torch.randn(512, 512) / 25
    with BatchingServer(model, max_batch_size=512, max_queue_delay_ms=0) as server:
        for close in (False, True):
            buf = torch.zeros(512, 512)
            into = Destination([buf])
            with pytest.raises(errors.RequestTimeoutError, match="while running"):
                server.infer(x, timeout=0.02, into=into)
            if close:   # what the HTTP server does before it answers the client
                into.close()
            deadline = time.monotonic() + 60
            while server.stats()["running"] and time.monotonic() < deadline:
                time.sleep(0.005)
            assert not server.stats()["running"], "the timed-out request never finished"
            if close:
                assert not buf.any()
            else:   # the late answer went in whole: the documented state after a failure
                torch.testing.assert_close(buf, x + 1)


class _Marked(torch.nn.Module):
    """Doubles its input, and says the batch size its graph was traced at."""

    def forward(self, x):
        return x * 2, torch.full((x.shape[0], 1), float(x.shape[0]))


def test_a_bucketed_model_runs_each_batch_in_its_smallest_bucket_not_max_batch(two_cores):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        model = _traced(_Marked(), torch.zeros(1, 3), batch_buckets=(1, 4, 8, 16))
    with BatchingServer(model, max_queue_delay_ms=0) as server:
        assert server.max_batch_size == 16          # the largest bucket
        for rows, bucket in [(1, 1), (3, 4), (5, 8), (16, 16)]:
            x = torch.rand(rows, 3)
            y, marker = server.infer(x)
            torch.testing.assert_close(y, x * 2)
            assert torch.equal(marker, torch.full((rows, 1), float(bucket)))
        with pytest.raises(ValueError, match="max_batch_size=17 .* largest batch bucket"):
            BatchingServer(model, max_batch_size=17)


def test_asyncio_callers_of_a_bucketed_model_run_in_the_smallest_bucket(two_cores):
    # the event loop sends its batches itself: the bucket is chosen there too
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        model = _traced(_Marked(), torch.zeros(1, 3), batch_buckets=(1, 4, 8, 16))

    async def main(server):
        for rows, bucket in [(1, 1), (3, 4), (5, 8), (16, 16)]:
            x = torch.rand(rows, 3)
            y, marker = await server.infer_async(x)
            torch.testing.assert_close(y, x * 2)
            assert torch.equal(marker, torch.full((rows, 1), float(bucket)))

    runs = neuronmp.session.model.model_of(model).bucket_runs
    with BatchingServer(model, max_queue_delay_ms=0) as server:
        before = dict(runs)
        asyncio.run(main(server))
    assert {b: runs[b] - before.get(b, 0) for b in (1, 4, 8, 16)} == {1: 1, 4: 1, 8: 1, 16: 1}


def test_the_warm_up_runs_every_bucket_a_batch_may_use_on_every_core(two_cores):
    # each bucket is a graph of its own: run first by the warm-up, not by a request
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        model = _traced(_Marked(), torch.zeros(1, 3), batch_buckets=(1, 4, 8, 16))
    runs = neuronmp.session.model.model_of(model).bucket_runs
    cores = neuronmp.session.model.model_of(model).cores
    done = _done_per_core()
    before = dict(runs)
    with BatchingServer(model, max_batch_size=5) as server:   # 5 rows fit bucket 8
        warmed = {b: runs[b] - before.get(b, 0) for b in (1, 4, 8, 16)}
        assert warmed == {1: 2, 4: 2, 8: 2, 16: 0}   # one per core, 16 never used
        after = _done_per_core()
        assert all(after[c] - done.get(c, 0) == 3 for c in cores), (done, after)
        before = dict(runs)
        y, marker = server.infer(torch.rand(3, 3))
        assert torch.equal(marker, torch.full((3, 1), 4.0))
    with BatchingServer(model, warmup=False):   # nothing run: warm-up is the caller's choice
        assert dict(runs) == {**before, 4: before[4] + 1}


def _done_per_core():
    return {s.core: s.done for s in _current_session().core_stats()}


def test_the_old_import_path_warns_and_the_command_does_not():
    import warnings

    import neuronmp.serve

    vars(neuronmp.serve).pop("BatchingServer", None)   # warned once per name and process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from neuronmp.serve import BatchingServer as Old
    assert Old is BatchingServer
    assert [w.category for w in caught] == [DeprecationWarning]
    assert "neuronmp.batching.BatchingServer" in str(caught[0].message)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        neuronmp.serve.__getattr__("Nope")
    # the command loads the BatchingServer's module once, and warns about nothing
    res = subprocess.run([sys.executable, "-W", "error", "-m", "neuronmp.serve", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "--model-repository" in res.stdout
