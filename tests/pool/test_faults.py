"""Faults the pool survives: nothing a dead worker never read is lost, a stuck
worker is bounded by NEURON_RT_EXEC_TIMEOUT, a worker-side failure is not a death."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from pool_support import run_on_a_small_tmpfs

_IDLE_DEATH = textwrap.dedent("""
    import json, os, signal, time, torch, neuronmp
    from neuronmp.session.session import current
    m = neuronmp.trace(torch.nn.Identity(), torch.zeros(4, 256))
    x = torch.ones(4, 256)
    m(x)
    pool = current().pool
    results = []
    for delay in (0.0, 0.05, 0.2):
        victim = pool.worker_pid(pool.cores[0])
        os.kill(victim, signal.SIGKILL)
        time.sleep(delay)
        results.append(bool(torch.equal(m(x), x)))   # sent while the worker is dead
    print(json.dumps({"ok": results, "restarts": pool.stats()[0].restarts}))
""")


def test_requests_a_dead_worker_never_read_are_sent_to_its_replacement(procs):
    proc = procs.python(_IDLE_DEATH, env={"NEURON_RT_VISIBLE_CORES": "0"})
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert json.loads(out) == {"ok": [True, True, True], "restarts": 3}


_CALLBACK_SENDS = textwrap.dedent("""
    import json, os, signal, threading, time, torch, neuronmp
    from neuronmp.session import model as _model
    from neuronmp.session.session import current
    traced = neuronmp.trace(torch.nn.Identity(), torch.zeros(2, 4))
    m = _model.model_of(traced)
    pool = current().pool
    core = pool.cores[0]
    entered, go, follow = threading.Event(), threading.Event(), []

    def chain(_answer):   # runs in the core's reader thread, which holds its ring
        entered.set()
        go.wait(30)
        follow.append(m.submit([torch.full((2, 4), 7.0)]))

    m.submit([torch.ones(2, 4)]).add_done_callback(chain)
    assert entered.wait(30)
    os.kill(pool.worker_pid(core), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not pool._workers[core].dead:     # the supervisor has begun the replacement
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.3)
    go.set()
    deadline = time.monotonic() + 30
    while not follow and time.monotonic() < deadline:
        time.sleep(0.01)
    ok = bool(follow) and torch.equal(follow[0].result(timeout=30)[0], torch.full((2, 4), 7.0))
""")

_RETRY_IN_CALLBACK = textwrap.dedent("""
    import json, os, signal, threading, time, torch, neuronmp
    from neuronmp.session import model as _model
    from neuronmp.errors import WorkerDiedError
    from neuronmp.session.session import current

    class Slow(torch.nn.Module):
        def forward(self, x):
            y = x
            for _ in range(400):
                y = torch.tanh(y @ y)
            return x + 0 * y

    traced = neuronmp.trace(Slow(), torch.zeros(256, 256))
    m = _model.model_of(traced)
    pool = current().pool
    core = pool.cores[0]
    x = torch.rand(256, 256) / 256
    retried = []

    def retry(answer):   # the usual retry: on a dead worker, send it again
        if isinstance(answer.exception(), WorkerDiedError):
            retried.append(m.submit([x]))

    loaded = pool.stats()[0].running   # the load's id may show until the worker notes itself idle
    m.submit([x]).add_done_callback(retry)
    deadline = time.monotonic() + 30
    while pool.stats()[0].running in (0, loaded):
        assert time.monotonic() < deadline
        time.sleep(0.002)
    os.kill(pool.worker_pid(core), signal.SIGKILL)
    while not retried and time.monotonic() < deadline:
        time.sleep(0.01)
    ok = bool(retried) and torch.equal(retried[0].result(timeout=60)[0], x)
""")

_REPORT = textwrap.dedent("""
    print(json.dumps({"ok": ok, "restarts": pool.stats()[0].restarts}), flush=True)
    if not ok:
        os._exit(1)   # a deadlocked reader or supervisor must not keep the process
    neuronmp.shutdown()
""")


@pytest.mark.parametrize("scenario", [_CALLBACK_SENDS, _RETRY_IN_CALLBACK],
                         ids=["chains-a-call", "retries-the-failed-one"])
def test_a_callback_that_sends_while_its_worker_is_replaced_gets_its_answer(procs, scenario):
    # chains: the reader thread runs an answer's callback holding the core's ring; a
    # callback that sends takes the core's send lock, which the supervisor's
    # replacement held while it waited for the ring.  retries: the supervisor failed
    # the request the dead worker ran while it held the core's locks, so a callback
    # that sent it again waited for a lock its own thread held.  Both hung for good.
    proc = procs.python(scenario + _REPORT, env={"NEURON_RT_VISIBLE_CORES": "0"})
    out, err = proc.communicate(timeout=120)
    assert json.loads(out) == {"ok": True, "restarts": 1}, err[-3000:]
    assert proc.returncode == 0, err[-3000:]


_STUCK = textwrap.dedent("""
    import io, json, os, signal, sys, time, torch
    from neuronmp.errors import ExecTimeoutError
    from neuronmp.session.session import current

    class Spin(torch.nn.Module):
        def forward(self, x):
            # stuck in a loop for a negative input, like a model that never converges
            while bool(x.sum() < 0):
                x = x * 1.0
            return x + 1

    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(Spin()), buf)
    pool = current().pool
    core = pool.cores[0]
    mid = pool.load(core, buf.getvalue())
    first_pid = pool.worker_pid(core)
    if sys.argv[1] == "loop":
        answer = pool.call(core, mid, (-torch.ones(2),))
    else:
        os.kill(first_pid, signal.SIGSTOP)
        answer = pool.call(core, mid, (torch.ones(2),))
    queued = [pool.call(core, mid, (torch.full((2,), float(i)),)) for i in range(3)]
    try:
        answer.result(timeout=60)
        first = "answered"
    except ExecTimeoutError as exc:
        first = f"timeout core={exc.core} model={exc.model}"
    rest = [a.result(timeout=60).tolist() for a in queued]
    st = {s.core: s for s in pool.stats()}[core]
    print(json.dumps({"first": first, "rest": rest, "core": core, "mid": mid,
                      "replaced": pool.worker_pid(core) != first_pid,
                      "timed_out": st.timed_out, "died": st.died}))
""")


@pytest.mark.parametrize("how", ["loop", "sigstop"])
def test_a_stuck_worker_is_bounded_by_the_exec_timeout_and_replaced(procs, how, tmp_path):
    script = tmp_path / "stuck.py"   # a file: TorchScript reads the model's source
    script.write_text(_STUCK)
    proc = procs.popen([sys.executable, str(script), how], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True,
                       env={**os.environ, "NEURON_RT_VISIBLE_CORES": "0",
                            "NEURON_RT_EXEC_TIMEOUT": "1"})
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    got = json.loads(out)
    assert got["replaced"]
    stuck = f"timeout core={got['core']} model={got['mid']}"
    if how == "loop":   # the call that hung fails naming core and model; the queue goes on
        assert got["first"] == stuck
    else:               # stopped with nothing read: nothing ran, everything is sent again
        assert got["first"] == "answered"
    # the monitors' count of executions the timeout stopped (the supervisor's to write)
    assert (got["timed_out"], got["died"]) == ((1, 0) if how == "loop" else (0, 0))
    assert got["rest"] == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]


def test_a_bad_exec_timeout_is_refused_naming_it(procs):
    proc = procs.python("import neuronmp.session.session; neuronmp.session.session.current().pool",
                        env={"NEURON_RT_EXEC_TIMEOUT": "soon"})
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "Invalid NEURON_RT_EXEC_TIMEOUT='soon'" in err


def test_exec_timeout_error_pickles_with_its_fields():
    import pickle

    from neuronmp.errors import ExecTimeoutError

    err = ExecTimeoutError(3, 7, 1.5)
    again = pickle.loads(pickle.dumps(err))
    assert (again.core, again.model, again.timeout) == (3, 7, 1.5)
    assert isinstance(again, TimeoutError) and "NeuronCore 3" in str(again)


_NO_SPACE = textwrap.dedent("""
    import json, torch, neuronmp
    from neuronmp.errors import ModelError
    class Grow(torch.nn.Module):
        def forward(self, x):
            return x.repeat(1024, 1)          # 4 MiB out of 4 KiB in
    m = neuronmp.trace(Grow(), torch.zeros(1, 1024))
    from neuronmp.session.session import current
    pool = current().pool
    pid = pool.worker_pid(pool.cores[0])
    try:
        m(torch.zeros(1, 1024))
        first = "answered"
    except ModelError as exc:
        first = str(exc).splitlines()[0]
    small = neuronmp.trace(torch.nn.Identity(), torch.zeros(4))
    print(json.dumps({"first": first, "same_worker": pool.worker_pid(pool.cores[0]) == pid,
                      "still_serving": bool(torch.equal(small(torch.ones(4)), torch.ones(4)))}))
""")


def test_no_shared_memory_for_an_output_fails_that_request_not_the_worker(procs, tmp_path):
    """The repro: a 4 MiB tmpfs as the runtime directory, a 1 MiB ring, and
    an output that needs a spill segment the tmpfs cannot hold (in a private mount
    namespace, so nothing outlives the test)."""
    got = run_on_a_small_tmpfs(procs, tmp_path, _NO_SPACE, 4)
    assert "ShmSpaceError" in got["first"] or "No space" in got["first"], got
    assert got["same_worker"] and got["still_serving"]


class _Unrestartable:
    """A worker whose replacement fails, as one does when its core cannot be respawned."""

    core = 3

    def replace(self):
        raise OSError("no forkserver")


def test_a_worker_that_cannot_be_restarted_is_reported_through_logging(caplog):
    from neuronmp.pool import supervisor

    with caplog.at_level("ERROR", logger="neuronmp.pool.supervisor"):
        supervisor._replace(_Unrestartable())   # the other cores stay supervised: no raise
    [record] = caplog.records
    assert record.name == "neuronmp.pool.supervisor" and "NeuronCore 3" in record.getMessage()
    assert "no forkserver" in caplog.text
