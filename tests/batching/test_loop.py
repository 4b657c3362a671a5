"""neuronmp.batching.loop: a BatchingServer's callers batched on the event loop that calls it.

Real workers, rings and signals: the loop owns the cores (their readiness fds), no
serving thread runs, and worker death, a closed loop and close() fail what they must.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import textwrap
import threading
import time

import pytest
import torch
from batching.test_server import Slow  # the same busy model as the threads' tests

import neuronmp
from neuronmp import errors
from neuronmp.batching import BatchingServer
from neuronmp.batching.rowbytes import RowInput, RowsWaiter
from neuronmp.session.session import current as _current_session


@pytest.fixture
def two_cores(emulated):
    emulated("1x2")


def _traced(fn, example, multicore=True, **kw):
    model = neuronmp.trace(fn, example, **kw)
    if multicore:
        neuronmp.set_multicore(model)
    return model


def _serving_threads():
    return [t.name for t in threading.enumerate()
            if t.name.startswith(("neuronmp-serve", "neuronmp-settle"))]


def _owners(server):
    pool = _current_session().pool
    return [pool._workers[core].owner for core in server.cores]


def _running(pool, core, timeout=10.0):
    """Wait until the core's worker runs a request still pending (the count of the
    one before, the warm-up, may not be cleared yet)."""
    slot = [s.core for s in pool.stats()].index(core)
    deadline = time.monotonic() + timeout
    while pool.stats()[slot].running not in pool._workers[core].pending:
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.001)


def test_many_asyncio_callers_are_served_by_the_loop_alone(two_cores):
    model = _traced(lambda x: x * 2 + 1, torch.zeros(8, 4), device_time=2000)
    with BatchingServer(model, 8, max_queue_delay_ms=1) as server:
        seen = {}

        async def scenario():
            async def one(i):
                x = torch.full((4,), float(i))
                y = await server.infer_async(x)
                seen.setdefault("threads", _serving_threads())
                seen.setdefault("owners", _owners(server))
                return x, y
            return await asyncio.gather(*(one(i) for i in range(200)))

        for x, y in asyncio.run(scenario()):
            assert torch.equal(y, x * 2 + 1)
        stats = server.stats()
    assert seen["threads"] == []                    # no lane, no delivery thread
    assert all(o is not None for o in seen["owners"])   # the loop read both cores
    assert stats["completed"] == 200 and stats["batches"] < 200
    assert all(o is None for o in _owners(server))  # given back at close


def test_a_worker_killed_while_the_loop_owns_its_core(two_cores):
    # the worker dies computing the first request (failed); the second, sent behind
    # it and never read, is sent again to the replacement and answered
    model = _traced(Slow(2560), torch.zeros(1, 4), multicore=False)
    pool = _current_session().pool
    with BatchingServer(model, 1, 0, batches_per_core=2) as server:
        core = server.cores[0]

        async def scenario():
            doomed = asyncio.ensure_future(server.infer_async(torch.ones(4)))
            await asyncio.sleep(0)
            behind = asyncio.ensure_future(server.infer_async(torch.full((4,), 3.0)))
            await asyncio.sleep(0)
            assert pool._workers[core].owner is not None
            await asyncio.get_running_loop().run_in_executor(None, _running, pool, core)
            pid = pool.worker_pid(core)
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(errors.WorkerDiedError) as died:
                await asyncio.wait_for(doomed, 60)
            assert died.value.core == core and died.value.pid == pid
            again = await asyncio.wait_for(behind, 60)
            after = await asyncio.wait_for(server.infer_async(torch.zeros(4)), 60)
            return again, after, pid

        again, after, pid = asyncio.run(scenario())
        assert torch.equal(again, torch.full((4,), 7.0))
        assert torch.equal(after, torch.ones(4))
        assert pool.worker_pid(core) != pid
        stats = server.stats()
    assert stats["failed"] == 1 and stats["completed"] == 2 and stats["running"] == 0


def test_a_loop_closed_while_answers_are_pending_fails_them_cleanly(two_cores):
    model = _traced(lambda x: x * 2 + 1, torch.zeros(1, 4), multicore=False,
                    device_time=300_000)
    with BatchingServer(model, 1, 0, batches_per_core=1, timeout=60) as server:
        loop = asyncio.new_event_loop()
        running = loop.create_task(server.infer_async(torch.ones(4)))
        queued = loop.create_task(server.infer_async(torch.ones(4)))
        loop.run_until_complete(asyncio.sleep(0.02))   # one sent, one queued behind it
        assert server.stats()["running"] == 1 and server.stats()["queued"] == 1
        from_thread = server.submit(torch.full((4,), 5.0))   # the threads' own path
        for task in (running, queued):
            task.cancel()
        loop.run_until_complete(asyncio.gather(running, queued, return_exceptions=True))
        loop.close()
        # the thread's request waited for the one slot the closed loop's batch held:
        # the pool's reader reads that answer (failing it: its loop is gone), the slot
        # frees, and the threads' path sends its own
        assert torch.equal(from_thread.result(timeout=30), torch.full((4,), 11.0))
        assert torch.equal(server.infer(torch.zeros(4), timeout=30), torch.ones(4))
        deadline = time.monotonic() + 10
        while server.stats()["running"] and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = server.stats()
    assert stats["running"] == 0 and stats["completed"] == 2
    assert stats["failed"] == 1   # the batch the closed loop had sent
    assert stats["by_path"]["threads"]["submitted"] == 2


def test_close_on_the_loop_lets_the_running_batch_finish(two_cores):
    model = _traced(lambda x: x * 2 + 1, torch.zeros(1, 4), multicore=False,
                    device_time=100_000)
    server = BatchingServer(model, 1, 0, batches_per_core=1)

    async def scenario():
        first = asyncio.ensure_future(server.infer_async(torch.ones(4)))
        second = asyncio.ensure_future(server.infer_async(torch.ones(4)))
        await asyncio.sleep(0.01)
        server.close()                                   # on the loop: no blocking
        with pytest.raises(errors.ServerClosedError, match="before this request ran"):
            await second
        with pytest.raises(errors.ServerClosedError):
            await server.infer_async(torch.ones(4))
        return await asyncio.wait_for(first, 30)

    assert torch.equal(asyncio.run(scenario()), torch.full((4,), 3.0))
    assert all(o is None for o in _owners(server))


def test_infer_on_the_serving_loop_is_refused_and_threads_take_their_own_path(two_cores):
    model = _traced(lambda x: x * 2 + 1, torch.zeros(2, 4), device_time=1000)
    with BatchingServer(model, 4, max_queue_delay_ms=1) as server:
        async def scenario():
            assert torch.equal(await server.infer_async(torch.ones(4)), torch.full((4,), 3.0))
            with pytest.raises(RuntimeError, match="await infer_async"):
                server.infer(torch.ones(4))
            loop = asyncio.get_running_loop()
            xs = [torch.full((4,), float(i)) for i in range(20)]
            outs = await loop.run_in_executor(
                None, lambda: [f.result(timeout=30) for f in [server.submit(x) for x in xs]])
            return xs, outs

        xs, outs = asyncio.run(scenario())
        assert all(torch.equal(o, x * 2 + 1) for o, x in zip(outs, xs))
        paths = server.stats()["by_path"]
    # the loop batched its caller, the threads theirs: no hand-off between them
    assert paths["event_loop"]["submitted"] == 1 and paths["threads"]["submitted"] == 20
    assert paths["threads"]["batches"] >= 1


_STOPPED = textwrap.dedent("""
    import asyncio, json, os, signal, torch, neuronmp
    from neuronmp.batching import BatchingServer
    from neuronmp.errors import ExecTimeoutError
    from neuronmp.session.session import current

    class Slow(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("m", torch.rand(2560, 2560) / 2560)

        def forward(self, x):
            return x * 2 + 1 + 0 * torch.mm(self.m, self.m)[0, 0]

    model = neuronmp.trace(Slow(), torch.zeros(1, 4))
    pool = current().pool
    server = BatchingServer(model, 1, 0, batches_per_core=2)
    core = server.cores[0]
    slot = [s.core for s in pool.stats()].index(core)

    async def main():
        doomed = asyncio.ensure_future(server.infer_async(torch.ones(4)))
        await asyncio.sleep(0)
        behind = asyncio.ensure_future(server.infer_async(torch.full((4,), 3.0)))
        # running a request still pending (the warm-up's count may not be cleared yet)
        while pool.stats()[slot].running not in pool._workers[core].pending:
            await asyncio.sleep(0.001)
        owned = pool._workers[core].owner is not None
        pid = pool.worker_pid(core)
        os.kill(pid, signal.SIGSTOP)    # stuck while it runs the first request
        try:
            await asyncio.wait_for(doomed, 60)
            first = "answered"
        except ExecTimeoutError as exc:
            first = f"timeout core={exc.core}"
        rest = (await asyncio.wait_for(behind, 60)).tolist()
        return first, rest, pid, owned

    first, rest, pid, owned = asyncio.run(main())
    stats = server.stats()
    server.close()
    print(json.dumps({"first": first, "rest": rest, "core": core, "owned": owned,
                      "replaced": pool.worker_pid(core) != pid,
                      "failed": stats["failed"], "completed": stats["completed"]}))
    neuronmp.shutdown()
""")


def test_a_stuck_worker_of_a_loop_owned_core_is_bounded_by_the_exec_timeout(procs):
    # the request it was running fails naming the core; the one behind it, never
    # read, is sent again to the replacement and answered on the loop
    proc = procs.python(_STOPPED, env={"NEURON_RT_VISIBLE_CORES": "0",
                                       "NEURON_RT_EXEC_TIMEOUT": "1"})
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    got = json.loads(out)
    assert got["owned"] and got["replaced"]
    assert got["first"] == f"timeout core={got['core']}"
    assert got["rest"] == [7.0] * 4
    assert got["failed"] == 1 and got["completed"] == 1


@pytest.mark.parametrize("wait_when_idle", [False, True])
def test_wait_when_idle_batches_requests_an_idle_server_would_send_alone(two_cores,
                                                                         wait_when_idle):
    """Two requests 50 ms apart on the event loop path: by default each goes at once
    to an idle core, alone; with wait_when_idle (Triton's rule) the first waits the
    delay (1 s) and the second joins its batch."""
    model = _traced(lambda x: x * 2 + 1, torch.zeros(8, 4))
    with BatchingServer(model, 8, max_queue_delay_ms=1000,
                        wait_when_idle=wait_when_idle) as server:
        async def scenario():
            first = asyncio.ensure_future(server.infer_async(torch.ones(4)))
            await asyncio.sleep(0.05)
            second = await server.infer_async(torch.full((4,), 2.0))
            return await first, second

        a, b = asyncio.run(scenario())
        stats = server.stats()
    assert torch.equal(a, torch.full((4,), 3.0)) and torch.equal(b, torch.full((4,), 5.0))
    assert (stats["batches"], stats["direct"]) == ((1, 0) if wait_when_idle else (2, 2)), stats


class _Waiter(RowsWaiter):
    """Records how its request was answered (rows as bytes, a value, or an error)."""

    __slots__ = ("got", "fut")

    def __init__(self, loop):
        self.got = None
        self.fut = loop.create_future()

    def done(self):
        return self.got is not None

    def set_rows(self, view, out, start, rows):
        self.got = ("rows", bytes(view), out[start:start + rows].clone())
        self.fut.set_result(None)

    def set_result(self, value):
        self.got = ("value", None, value)
        self.fut.set_result(None)

    def set_exception(self, exc):
        self.got = ("error", None, exc)
        self.fut.set_result(None)


def test_row_input_requests_batch_as_bytes_beside_tensor_requests(two_cores):
    """RowInput requests (an input's bytes, one or two rows) are stacked from their
    bytes, padded, and answered with their rows' bytes; in a batch with an ordinary
    request they become tensors and get the model's value; bad shapes are refused
    when the RowInput is made, and a closed server takes none (submit is False)."""
    model = _traced(lambda x: x * 2 + 1, torch.zeros(8, 4))
    with BatchingServer(model, 8, max_queue_delay_ms=5, wait_when_idle=True) as server:
        one, two = RowInput(server, [1, 4], torch.float32), RowInput(server, [2, 4], torch.float32)
        assert (one.rows, one.nbytes, two.rows, two.nbytes) == (1, 16, 2, 32)
        for shape, dtype in (([9, 4], torch.float32), ([1, 5], torch.float32), ([4], torch.float32),
                             ([1, 4], torch.int64)):
            with pytest.raises((ValueError, TypeError)):
                RowInput(server, shape, dtype)

        async def scenario(mixed):
            loop = asyncio.get_running_loop()
            sent = []
            extra = asyncio.ensure_future(server.infer_async(torch.full((4,), 7.0))) \
                if mixed else None
            await asyncio.sleep(0)   # queued first: the first batch holds it and rows
            for i in range(12):
                rin = two if i % 3 == 0 else one
                x = torch.arange(rin.rows * 4, dtype=torch.float32).reshape(rin.rows, 4) + i
                w = _Waiter(loop)
                assert rin.submit(loop, memoryview(x.numpy().tobytes()), w)
                sent.append((x, w))
            await asyncio.gather(*(w.fut for _, w in sent))
            return sent, (await extra if mixed else None)

        sent, _ = asyncio.run(scenario(False))
        for x, w in sent:
            kind, raw, value = w.got
            assert kind == "rows" and torch.equal(value, x * 2 + 1)
            assert raw == (x * 2 + 1).numpy().tobytes()
        sent, extra = asyncio.run(scenario(True))
        assert torch.equal(extra, torch.full((4,), 15.0))
        kinds = {w.got[0] for _, w in sent}
        assert "value" in kinds   # those batched with the tensor request
        for x, w in sent:
            assert torch.equal(w.got[2], x * 2 + 1), w.got
        stats = server.stats()
        assert stats["completed"] == 25 and stats["failed"] == 0

    async def closed():   # not served by this loop (closed): the caller's usual path says so
        loop = asyncio.get_running_loop()
        return one.submit(loop, memoryview(bytes(16)), _Waiter(loop))
    assert asyncio.run(closed()) is False
