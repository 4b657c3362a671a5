"""The worker pool with real worker processes, rings and reservations."""
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import psutil
import pytest
import torch
from pool_support import Affine, script_bytes

import neuronmp
from neuronmp.errors import ModelError, WorkerDiedError
from neuronmp.session.session import current as _current_session


class Heavy(torch.nn.Module):
    def forward(self, x):
        for _ in range(20):
            x = torch.tanh(x @ x)
        return x


class Failing(torch.nn.Module):
    def forward(self, x):
        if bool(x.sum() < 0):
            raise ValueError("negative input is not allowed")
        return x


def _segments(runtime_dir):
    """Shared-memory segments left (the last process out removes the directory)."""
    shm = os.path.join(runtime_dir, "shm")
    return os.listdir(shm) if os.path.isdir(shm) else []


def _alive(pids):
    """The pids still running (a zombie has exited: only its parent's reaping is left)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out




def test_four_cores_eight_threads_match_in_process(emulated):
    emulated("1x4")
    data, mod = script_bytes(Affine().eval(), torch.zeros(2, 8))
    pool = _current_session().pool
    assert pool.cores == (0, 1, 2, 3)
    cores = pool.cores
    mids = {c: pool.load(c, data) for c in cores}
    errors = []

    def client(seed):
        gen = torch.Generator().manual_seed(seed)
        for i in range(40):
            x = torch.randn(2, 8, generator=gen)
            core = cores[(seed + i) % 4]
            try:
                got = pool.call(core, mids[core], (x,)).result(timeout=30)
                torch.testing.assert_close(got, mod(x))
            except Exception as exc:  # collected: assertion in a thread must reach the test
                errors.append(exc)

    threads = [threading.Thread(target=client, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]
    snap = {s.core: s for s in pool.stats()}
    assert sum(snap[c].done for c in cores) == 8 * 40 + 4   # every call, and a load each




def test_model_error_reaches_caller_and_worker_keeps_serving():
    data, _ = script_bytes(Failing())
    pool = _current_session().pool
    core = pool.cores[1]
    mid = pool.load(core, data)
    pid = pool.worker_pid(core)
    with pytest.raises(ModelError) as info:
        pool.call(core, mid, (-torch.ones(3),)).result()
    err = info.value
    assert err.core == core and "negative input is not allowed" in str(err)
    assert "Traceback" in err.traceback
    torch.testing.assert_close(pool.call(core, mid, (torch.ones(3),)).result(), torch.ones(3))
    assert pool.worker_pid(core) == pid
    assert pool.stats()[1].errors == 1


def test_calls_in_flight_on_four_cores_answer_in_call_order():
    data, mod = script_bytes(Affine().eval(), torch.zeros(2, 8))
    pool = _current_session().pool
    cores = pool.cores[:4]
    mids = [pool.load(c, data) for c in cores]
    xs = [torch.randn(2, 8, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    calls = [(cores[i % 4], mids[i % 4], (x,)) for i, x in enumerate(xs)]
    answers = [pool.call(*c) for c in calls]   # all sent before any is waited for
    outs = [a.result(timeout=30) for a in answers]
    for x, out in zip(xs, outs):
        torch.testing.assert_close(out, mod(x))
    assert [s.done for s in pool.stats()[:4]] == [3, 3, 3, 3]   # a load and two calls each


def test_a_model_error_leaves_the_other_calls_running_to_completion():
    failing, _ = script_bytes(Failing())
    heavy, _ = script_bytes(Heavy(), torch.rand(256, 256))
    pool = _current_session().pool
    bad, slow = pool.cores[0], pool.cores[1]
    mid = pool.load(bad, failing)
    calls = [(bad, mid, (-torch.ones(3),)), (bad, mid, (-2 * torch.ones(3),)),
             (slow, pool.load(slow, heavy), (torch.rand(256, 256) / 256,))]
    answers = [pool.call(*c) for c in calls]
    errors = [a.exception(timeout=60) for a in answers]
    assert [type(e) for e in errors] == [ModelError, ModelError, type(None)]
    assert errors[0].core == bad and "negative input" in str(errors[0])
    assert str(errors[0]).splitlines()[0].endswith("negative input is not allowed")
    assert [s.in_flight for s in pool.stats()[:2]] == [0, 0]   # nothing left running
    assert pool.stats()[0].errors == 2


def test_bad_load_and_unknown_core_are_clear_errors():
    pool = _current_session().pool
    with pytest.raises(ModelError, match="on NeuronCore 0"):
        pool.load(0, b"not a torchscript archive")
    with pytest.raises(ValueError, match=r"core 99 is not served by this pool"):
        pool.call(99, 1, ())
    with pytest.raises(TypeError, match="script_bytes must be bytes"):
        pool.load(0, "text")


def _wait_running(pool, slot, before, timeout=20.0):
    """Until the worker of the pool's core ``slot`` executes a request sent after
    ``before`` (its ``running`` field read before sending them: a worker may still
    show the request it answered last): only a request it has started may fail with
    its death (the rest are sent again)."""
    deadline = time.monotonic() + timeout
    while pool.stats()[slot].running in (0, before):
        assert time.monotonic() < deadline, "the worker never started a request"
        time.sleep(0.0005)


def _signal_under_load(slot, in_flight, sig, side=64, future=True):
    """Heavy loaded on the pool's core ``slot``, ``in_flight`` requests submitted,
    then ``sig`` sent to that core's worker while it executes one of them.  (A
    worker killed after sending an answer but before it notes that it is idle
    fails nothing: a larger ``side`` makes that window a small part of a request.)"""
    data, mod = script_bytes(Heavy(), torch.rand(side, side))
    pool = _current_session().pool
    core = pool.cores[slot]
    mid = pool.load(core, data)
    x = torch.rand(side, side) / side
    before = pool.stats()[slot].running
    futures = [pool.call(core, mid, (x,), None, future) for _ in range(in_flight)]
    victim = pool.worker_pid(core)
    _wait_running(pool, slot, before)
    os.kill(victim, sig)
    return SimpleNamespace(pool=pool, core=core, mid=mid, mod=mod, x=x, futures=futures,
                           victim=victim)


def test_worker_sigkilled_with_100_in_flight():
    run = _signal_under_load(0, 100, signal.SIGKILL, side=128)
    pool, core, victim = run.pool, run.core, run.victim
    killed_at = time.monotonic()
    ok = died = 0
    for fut in run.futures:
        # the unread ones wait for the replacement's start-up, nothing longer
        remaining = killed_at + 30.0 - time.monotonic()
        try:
            fut.result(timeout=max(remaining, 0.01))
            ok += 1
        except WorkerDiedError as exc:
            assert exc.core == core and exc.pid == victim and exc.exitcode == -signal.SIGKILL
            assert "SIGKILL" in str(exc)
            died += 1
    assert ok + died == 100 and died == 1   # only the request it was running
    # a new worker serves the core, with the model loaded again
    torch.testing.assert_close(pool.call(core, run.mid, (run.x,)).result(), run.mod(run.x))
    assert pool.worker_pid(core) != victim
    assert pool.stats()[0].restarts == 1


def test_blocking_calls_keep_the_death_semantics():
    # a caller that only waits (future=False: a Pending, no Future) hears of the
    # death as a Future user does: the running request fails, the rest are re-sent
    run = _signal_under_load(0, 20, signal.SIGKILL, side=128, future=False)
    assert all(type(f).__name__ == "Pending" for f in run.futures)
    outcomes = []
    for fut in run.futures:
        try:
            torch.testing.assert_close(fut.result(timeout=30), run.mod(run.x))
            outcomes.append("ok")
        except WorkerDiedError as exc:
            assert exc.core == run.core and exc.pid == run.victim
            outcomes.append("died")
    assert outcomes.count("died") == 1 and outcomes.count("ok") == 19
    assert all(f.done() and not f.cancelled() for f in run.futures)


_COORDINATOR = """
import io, json, sys, torch, neuronmp
from neuronmp.session.session import current as _current_session
pool = _current_session().pool
print(json.dumps({"workers": [pool.worker_pid(c) for c in pool.cores]}), flush=True)
sys.stdin.read()
"""


def test_coordinator_sigkilled_workers_exit_and_cores_come_back(procs, runtime_dir):
    coord = procs.python(_COORDINATOR, stdin=__import__("subprocess").PIPE)
    line = coord.stdout.readline()
    assert line, coord.stderr.read()
    workers = json.loads(line)["workers"]
    assert len(workers) == 16
    segments_before = set(os.listdir(os.path.join(runtime_dir, "shm")))
    assert segments_before
    coord.kill()
    coord.wait()
    deadline = time.monotonic() + 2.0
    while _alive(workers) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(workers), "workers still alive 2 s after their coordinator died"
    # the cores can be reserved again at once, and the next runtime's start-up (not a
    # test's own call) removes the dead coordinator's segments and its .live file
    assert set(os.listdir(os.path.join(runtime_dir, "shm"))) >= segments_before
    rt = neuronmp.init()
    assert rt.cores == tuple(range(16))
    assert not set(os.listdir(os.path.join(runtime_dir, "shm"))) & segments_before


def test_sigterm_stops_workers_and_frees_everything(procs, runtime_dir):
    coord = procs.python(_COORDINATOR, stdin=__import__("subprocess").PIPE)
    workers = json.loads(coord.stdout.readline())["workers"]
    coord.send_signal(signal.SIGTERM)
    assert coord.wait(timeout=15) == -signal.SIGTERM
    assert not _alive(workers)
    assert _segments(runtime_dir) == []
    assert neuronmp.init().cores == tuple(range(16))


def test_shutdown_then_use_again(emulated):
    emulated("1x2")
    pool = _current_session().pool
    pids = [pool.worker_pid(c) for c in pool.cores]
    neuronmp.shutdown()
    assert pool.closed
    assert not _alive(pids)
    assert _current_session().pool is not pool




_EXITING = """
import faulthandler, json, signal, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True)   # the stacks, if it hangs
from neuronmp.session.session import current as _current_session
pool = _current_session().pool
print(json.dumps([pool.worker_pid(c) for c in pool.cores]), flush=True)
if sys.argv[1] == "wait":
    time.sleep(60)
"""


@pytest.mark.parametrize("how", ["exit", "sigint"])
def test_interpreter_exit_and_sigint_leave_nothing(procs, runtime_dir, how):
    pipe = __import__("subprocess").PIPE
    proc = procs.popen([__import__("sys").executable, "-c", _EXITING,
                        "wait" if how == "sigint" else "exit"], stdout=pipe, stderr=pipe,
                       text=True)
    workers = json.loads(proc.stdout.readline())
    if how == "sigint":
        proc.send_signal(signal.SIGINT)
    try:
        proc.communicate(timeout=45)   # about 1 s on a quiet machine
    except __import__("subprocess").TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1)
        proc.kill()
        pytest.fail(f"no exit 45 s after {how}; its threads:\n{proc.communicate()[1]}")
    assert not _alive(workers)
    assert _segments(runtime_dir) == []
    assert neuronmp.init().cores == tuple(range(16))


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGTERM])
def test_worker_crash_is_reported_with_its_signal_and_replaced(sig):
    run = _signal_under_load(3, 6, sig, side=384)
    outcomes = []
    for fut in run.futures:
        try:
            fut.result(timeout=5)
            outcomes.append("ok")
        except WorkerDiedError as exc:
            assert (exc.core, exc.pid, exc.exitcode) == (run.core, run.victim, -sig)
            assert signal.Signals(sig).name in str(exc)
            outcomes.append("died")
    assert "died" in outcomes
    torch.testing.assert_close(run.pool.call(run.core, run.mid, (run.x,)).result(), run.mod(run.x))












class Widen(torch.nn.Module):
    def forward(self, x):
        return x.repeat(1, 1 << 16)  # a 16-column input comes back as 4 MiB per row


def test_killed_workers_spill_arena_is_removed_when_it_is_replaced(runtime_dir):
    pool = _current_session().pool
    core = pool.cores[0]
    data, mod = script_bytes(Widen())
    mid = pool.load(core, data)
    x = torch.randn(3, 16)  # 12 MiB of answer: over half the 8 MiB ring, on the arena
    torch.testing.assert_close(pool.call(core, mid, (x,)).result(), mod(x))
    victim = pool.worker_pid(core)
    theirs = [n for n in _segments(runtime_dir) if n.startswith(f"nmp-{victim}-")]
    assert len(theirs) == 2  # the worker's arena, kept for its next big answer, and its .live
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while pool.worker_pid(core) == victim and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.worker_pid(core) != victim, "the pool did not replace the killed worker"
    assert not [n for n in _segments(runtime_dir) if n.startswith(f"nmp-{victim}-")]
    torch.testing.assert_close(pool.call(core, mid, (x,)).result(), mod(x))


def test_a_restart_never_runs_on_a_callers_thread():
    """With the forkserver stopped no replacement can start: a caller whose request the
    dead worker held still gets its error at once, and another core keeps answering."""
    import multiprocessing.forkserver as mpfs

    data, mod = script_bytes(Heavy(), torch.rand(384, 384))
    pool = _current_session().pool
    healthy, victim_core = pool.cores[0], pool.cores[1]
    mids = {c: pool.load(c, data) for c in (healthy, victim_core)}
    x = torch.rand(384, 384) / 384   # tens of ms a request: killed while running one
    before = pool.stats()[1].running
    held = [pool.call(victim_core, mids[victim_core], (x,)) for _ in range(6)]
    server = mpfs._forkserver._forkserver_pid
    os.kill(server, signal.SIGSTOP)
    try:
        _wait_running(pool, 1, before)
        os.kill(pool.worker_pid(victim_core), signal.SIGKILL)
        # no restart can finish now: the request the worker was running fails at once,
        # the ones it never read wait for the replacement
        deadline = time.monotonic() + 20
        failed = []
        while not failed and time.monotonic() < deadline:
            failed = [a for a in held if a.done() and a.exception(0) is not None]
            time.sleep(0.01)
        assert len(failed) == 1 and isinstance(failed[0].exception(0), WorkerDiedError)
        assert not all(a.done() for a in held)
        for _ in range(5):
            torch.testing.assert_close(
                pool.call(healthy, mids[healthy], (x,)).result(timeout=20), mod(x))
        supervisor = [t for t in threading.enumerate() if t.name == "neuronmp-supervisor"]
        assert len(supervisor) == 1   # the one thread that replaces workers
    finally:
        os.kill(server, signal.SIGCONT)
    torch.testing.assert_close(
        pool.call(victim_core, mids[victim_core], (x,)).result(timeout=60), mod(x))


def test_a_worker_of_another_neuronmp_copy_is_refused_naming_both(procs, tmp_path):
    # Python 3.11's forkserver imports the worker module with the current directory
    # first on its path: started from inside another checkout, a program would get
    # that checkout's workers (a wire protocol of another version) without a word
    ours = os.path.dirname(os.path.realpath(neuronmp.__file__))
    other = tmp_path / "checkout"
    shutil.copytree(ours, other / "neuronmp",
                    ignore=shutil.ignore_patterns("__pycache__"))
    script = tmp_path / "start.py"   # a file: its directory, not the cwd, is on the path
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(ours)!r})
        import neuronmp
        from neuronmp.errors import WorkerPackageError
        from neuronmp.session.session import current
        try:
            current().pool
        except WorkerPackageError as exc:
            print(exc.core, exc.ours, exc.theirs)
            print(exc)
    """))
    proc = procs.popen([sys.executable, str(script)], cwd=other, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True,
                       env={**os.environ, "NEURON_RT_VISIBLE_CORES": "0"})
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    fields, message = out.splitlines()
    assert fields == f"0 {ours} {other / 'neuronmp'}"
    assert str(other / "neuronmp") in message and ours in message and "forkserver" in message


def test_worker_package_error_pickles_with_its_fields():
    import pickle

    from neuronmp.errors import WorkerPackageError

    again = pickle.loads(pickle.dumps(WorkerPackageError(2, "/a/neuronmp", "/b/neuronmp")))
    assert (again.core, again.ours, again.theirs) == (2, "/a/neuronmp", "/b/neuronmp")
    assert isinstance(again, ImportError) and "NeuronCore 2" in str(again)
