"""The per-process runtime: init/shutdown life cycle, hooks, exit and fork behaviour."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

import neuronmp
from neuronmp.errors import ConfigError, CoreUnavailableError, VisibilityError
from neuronmp.host import reservation, runtime, topology
from neuronmp.host.visibility import Request

TOPO = topology.parse("4x4", cpus=[0, 1])


def held_by_me(core: int) -> bool:
    state = reservation.core_states(16)[core]
    return state.held and state.holder is not None and state.holder.pid == os.getpid()


def test_init_reserves_once_and_visible_cores_reflect_it(monkeypatch):
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "4-6")
    assert not runtime.is_initialized()
    rt = neuronmp.init()
    assert runtime.is_initialized() and rt.cores == (4, 5, 6)
    assert neuronmp.init() is rt and runtime.get_runtime() is rt
    assert neuronmp.visible_cores() == (4, 5, 6) and neuronmp.core_count() == 3
    assert rt.topology.name == "4x4"
    assert all(held_by_me(c) for c in (4, 5, 6)) and not held_by_me(3)


def test_visible_cores_is_implicit_init_reserving_everything():
    assert neuronmp.visible_cores() == tuple(range(16))
    assert runtime.is_initialized()
    with pytest.raises(CoreUnavailableError, match="Requested:1 Available:0"):
        reservation.reserve(Request(count=1), TOPO)


def test_shutdown_runs_hooks_lifo_before_release_and_init_works_again(monkeypatch):
    monkeypatch.setenv("NEURON_RT_NUM_CORES", "2")
    rt = runtime.init()
    calls = []

    def hook(name):
        # the cores must still be ours while hooks run (workers are stopped first)
        calls.append((name, held_by_me(0) and held_by_me(1)))

    rt.add_shutdown_hook(lambda: hook("first"))
    rt.add_shutdown_hook(lambda: hook("second"))
    with pytest.raises(TypeError, match="callable"):
        rt.add_shutdown_hook("not a function")
    from neuronmp.session import session
    assert session.active() is None  # the session (and its pool) start lazily, not at init

    runtime.shutdown()
    assert calls == [("second", True), ("first", True)]
    assert rt.closed and not runtime.is_initialized()
    assert not reservation.core_states(16)[0].held
    runtime.shutdown()  # idempotent
    assert len(calls) == 2

    again = runtime.init()
    assert again is not rt and again.cores == (0, 1) and held_by_me(0)


def test_failing_hook_still_releases_and_is_reported(monkeypatch):
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "7")
    rt = runtime.init()
    ran = []
    rt.add_shutdown_hook(lambda: ran.append("earlier"))
    rt.add_shutdown_hook(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        runtime.shutdown()
    assert ran == ["earlier"]
    assert not reservation.core_states(16)[7].held
    assert not runtime.is_initialized()


def test_count_skips_cores_held_elsewhere(monkeypatch):
    other = reservation.reserve(Request(cores=(0, 1)), TOPO)
    try:
        monkeypatch.setenv("NEURON_RT_NUM_CORES", "2")
        assert runtime.init().cores == (2, 3)
        runtime.shutdown()
        monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "8-9")  # VISIBLE_CORES wins
        assert runtime.init().cores == (8, 9)
    finally:
        runtime.shutdown()
        other.release()


def test_concurrent_first_use_from_threads_gives_one_runtime():
    barrier = threading.Barrier(4)
    seen = []

    def use():
        barrier.wait(timeout=10)
        seen.append(runtime.get_runtime())

    threads = [threading.Thread(target=use) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert len(seen) == 4 and all(rt is seen[0] for rt in seen)


def test_bad_settings_refused_at_init_holding_nothing(monkeypatch):
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "3,5")
    with pytest.raises(VisibilityError, match="not contiguous"):
        runtime.init()
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES")
    monkeypatch.setenv("NEURONMP_RESERVE_TIMEOUT", "forever")
    with pytest.raises(ConfigError, match="NEURONMP_RESERVE_TIMEOUT='forever'"):
        runtime.init()
    assert not runtime.is_initialized()
    assert not any(s.held for s in reservation.core_states(16))


def test_refused_init_leaves_runtime_uninitialised(monkeypatch):
    other = reservation.reserve(Request(cores=(2,)), TOPO)
    try:
        with pytest.raises(CoreUnavailableError, match=rf"nc2 held by pid {os.getpid()}"):
            runtime.init()  # all cores, one of them busy
        assert not runtime.is_initialized()
        assert not held_by_me(0)
    finally:
        other.release()


EXIT_AND_FORK = r"""
import json, os, sys
import neuronmp.host.runtime as rt
from neuronmp.host import reservation
from neuronmp.errors import CoreUnavailableError
rt.init()
pid = os.fork()
if pid == 0:
    ok = not rt.is_initialized()
    try:
        rt.init()  # the parent still holds the cores: refused, as for any other process
        ok = False
    except CoreUnavailableError:
        pass
    sys.exit(0 if ok else 1)  # a normal exit: atexit runs in the child too
_, status = os.waitpid(pid, 0)
states = reservation.core_states(4)
print(json.dumps({
    "child_status": os.waitstatus_to_exitcode(status),
    "still_held": all(s.held and s.holder.pid == os.getpid() for s in states),
    "records": sorted(n for n in os.listdir(reservation.cores_dir()) if n.endswith(".holder")),
}), flush=True)
"""


def test_fork_child_drops_runtime_and_exit_releases(procs, runtime_dir):
    p = procs.python(EXIT_AND_FORK, env={"NEURONMP_TOPOLOGY": "1x4"})
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    report = json.loads(out)
    assert report["child_status"] == 0
    assert report["still_held"]
    assert report["records"] == [f"nc{c}.holder" for c in range(4)]
    # the parent's normal exit removed its holder records and released its locks
    cores = os.path.join(runtime_dir, "cores")
    left = os.listdir(cores) if os.path.isdir(cores) else []  # the last one out tidies
    assert not [n for n in left if n.endswith(".holder")]
    assert not any(s.held for s in reservation.core_states(4))


def test_demo_shows_what_neuronmp_is_for(procs):
    """The README's first command: cores as local ids, a second process refused naming
    the holder, DataParallel equal to torch, and device-time cores adding up."""
    p = procs.popen([sys.executable, "-m", "neuronmp"], stdout=subprocess.PIPE, text=True,
                    env={**os.environ, "NEURON_RT_NUM_CORES": "2",
                         "NEURONMP_TOPOLOGY": "inf2.xlarge"})
    out = p.communicate(timeout=120)[0]
    assert p.returncode == 0, out
    assert f"this process (pid {p.pid}) owns global core(s) [0, 1] as nc:0-nc:1" in out
    assert "a second process asking for core 1: NeuronCore(s) not available" in out
    assert f"nc1 held by pid {p.pid}" in out
    assert "output (64, 10) matches plain torch" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("4. device-time cores"))
    speedup = float(line.split("(")[-1].split("x;")[0])
    rows_per_s = float(line.split("core(s) ")[1].split(" rows/s")[0].replace(",", ""))
    assert speedup > 1.0 and "exact ceiling 2x" in line
    assert rows_per_s <= 2 * 32 / 0.010 * 1.01   # never faster than the modelled device
    assert "why: each emulated core sleeps" in out


# A process that first uses neuronmp from the main thread or from another one, with a
# pool (workers and segments) or only a reservation; it says "ready", then waits for a
# signal.  "unhandled" imports neuronmp from the thread too: no handler can be installed.
_FIRST_USE = """
import os, sys, threading, time
where, what = sys.argv[1], sys.argv[2]
def use():
    import neuronmp
    if what == "pool":
        from neuronmp.session.session import current
        current().pool
    else:
        neuronmp.init()
        from neuronmp.shm.segment import Segment
        Segment.create(4096)  # left open: the shutdown must close what the process made
if where == "main":
    use()
else:
    if where == "thread":
        import neuronmp
    t = threading.Thread(target=use)
    t.start()
    t.join()
print("ready", flush=True)
time.sleep(60)
"""


def _first_use(procs, where, what, env=None):
    p = procs.popen([sys.executable, "-c", _FIRST_USE, where, what], stdout=subprocess.PIPE,
                    text=True, env={**os.environ, "NEURONMP_TOPOLOGY": "1x2", **(env or {})})
    assert p.stdout.readline().strip() == "ready"
    return p


def _left(runtime_dir):
    return sorted(os.path.relpath(os.path.join(d, n), runtime_dir)
                  for d, dirs, files in os.walk(runtime_dir) for n in dirs + files)


@pytest.mark.parametrize("where, what, sig", [
    ("thread", "pool", "SIGTERM"), ("thread", "reserve", "SIGTERM"),
    ("main", "reserve", "SIGTERM"), ("thread", "reserve", "SIGINT"),
])
def test_signal_leaves_nothing_however_the_runtime_was_first_used(procs, runtime_dir,
                                                                   where, what, sig):
    import signal

    p = _first_use(procs, where, what)
    p.send_signal(getattr(signal, sig))
    p.wait(timeout=20)
    assert p.returncode in (-getattr(signal, sig), 1)  # SIGINT: a KeyboardInterrupt exit
    assert not os.path.exists(runtime_dir), _left(runtime_dir)


def test_what_an_unhandled_sigterm_left_goes_at_the_next_start_up(procs, runtime_dir,
                                                                  monkeypatch):
    import signal

    p = _first_use(procs, "unhandled", "reserve", env={"NEURON_RT_VISIBLE_CORES": "0"})
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=20) == -signal.SIGTERM
    left = _left(runtime_dir)  # no handler could run: its record, segment and .live stay
    assert "cores/nc0.holder" in left and len([n for n in left if n.startswith("shm/")]) == 2
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "1")
    assert neuronmp.init().cores == (1,)  # another core: its own record replaces nothing
    left = _left(runtime_dir)
    assert "cores/nc0.holder" not in left and "cores/nc1.holder" in left
    assert not [n for n in left if n.startswith("shm/n")]
    neuronmp.shutdown()
    assert not os.path.exists(runtime_dir)


def test_a_second_failing_shutdown_hook_is_reported_through_logging(caplog):
    import neuronmp.host.runtime as rt_module

    rt = rt_module.init()

    def first():
        raise ValueError("first hook")

    def second():
        raise KeyError("second hook")

    rt.add_shutdown_hook(first)
    rt.add_shutdown_hook(second)   # runs first: hooks run last added first
    with caplog.at_level("ERROR", logger="neuronmp.host.runtime"):
        with pytest.raises(KeyError, match="second hook"):
            rt_module.shutdown()
    assert [r.name for r in caplog.records] == ["neuronmp.host.runtime"]
    assert "first hook" in caplog.text
