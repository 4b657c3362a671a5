"""Host-wide core reservations between real processes: exclusivity, refusal, release on death."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import neuronmp
from neuronmp.errors import ConfigError, CoreUnavailableError, RuntimeDirError
from neuronmp.host import procid, reservation, topology
from neuronmp.host.visibility import Request

TOPO = topology.parse("4x4", cpus=[0, 1])

# Reserve per the environment, report, then hold until told how to end on stdin.
HOLD = r"""
import json, os, sys
import neuronmp.host.runtime as rt
from neuronmp.errors import CoreUnavailableError
try:
    cores = rt.init().cores
except CoreUnavailableError as exc:
    print(json.dumps({"refused": str(exc), "holders": [list(h) for h in exc.holders]}),
          flush=True)
    sys.exit(3)
print(json.dumps({"pid": os.getpid(), "cores": list(cores)}), flush=True)
how = sys.stdin.readline().strip()
if how == "raise":
    raise RuntimeError("the holder fails")
"""


def hold(procs, **env) -> tuple:
    """Start a holder; return (process, its first report)."""
    p = procs.python(HOLD, env=env, stdin=subprocess.PIPE)
    line = p.stdout.readline()
    assert line, f"holder produced no report: {p.communicate(timeout=10)[1]}"
    return p, json.loads(line)


def end(p: subprocess.Popen, how: str) -> None:
    if how == "kill":
        p.send_signal(signal.SIGKILL)
    else:
        p.stdin.write(how + "\n")
        p.stdin.flush()
    p.wait(timeout=20)


def take(cores=None, count=None, timeout=0.0) -> reservation.Reservation:
    return reservation.reserve(Request(cores=cores, count=count), TOPO, timeout=timeout)


@pytest.mark.parametrize("ending", ["exit", "raise", "kill"])
def test_overlap_is_refused_naming_holder_and_freed_at_once(procs, ending):
    first, info = hold(procs, NEURON_RT_VISIBLE_CORES="0-3")
    assert info["cores"] == [0, 1, 2, 3]

    second, report = hold(procs, NEURON_RT_VISIBLE_CORES="3-5")
    assert second.wait(timeout=20) == 3
    msg = report["refused"]
    assert msg.startswith("NeuronCore(s) not available - Requested:nc3-nc5 Available:12"), msg
    assert f"nc3 held by pid {info['pid']} (" in msg and "python" in msg
    assert report["holders"][0][:2] == [3, info["pid"]]

    end(first, ending)
    assert first.returncode == {"exit": 0, "raise": 1, "kill": -signal.SIGKILL}[ending]
    held = take(cores=tuple(range(6)))  # no waiting: free the moment the holder is gone
    try:
        assert held.cores == tuple(range(6))
        assert reservation.read_holder(held.directory, 0).pid == os.getpid()
    finally:
        held.release()


def test_refusal_in_process_and_release_removes_holder_records():
    a = take(cores=(1,))
    try:
        with pytest.raises(CoreUnavailableError) as info:
            take(cores=(1,))
        err = info.value
        assert str(err).startswith("NeuronCore(s) not available - Requested:nc1-nc1 Available:15")
        assert err.requested == (1,) and err.available == 15
        assert err.holders[0][:2] == (1, os.getpid())
        assert isinstance(err, RuntimeError)
        rec = reservation.read_holder(a.directory, 1)
        assert (rec.pid, rec.start) == tuple(procid.current()) and rec.cores == (1,)
        assert rec.host and rec.command
    finally:
        a.release()
    a.release()  # idempotent
    assert not os.path.exists(reservation.holder_path(a.directory, 1))
    assert not reservation.core_states(16)[1].held


def test_race_32_processes_for_16_single_cores(procs, tmp_path):
    go = tmp_path / "go"
    racer = r"""
import json, os, sys, time
import neuronmp.host.runtime as rt
from neuronmp.errors import CoreUnavailableError
print("ready", flush=True)
deadline = time.monotonic() + 60
while not os.path.exists(os.environ["GO"]):
    if time.monotonic() > deadline:
        sys.exit("no start signal")
    time.sleep(0.005)
try:
    out = {"pid": os.getpid(), "cores": list(rt.init().cores)}
except CoreUnavailableError as exc:
    out = {"refused": str(exc)}
print(json.dumps(out), flush=True)
sys.stdin.readline()  # successes hold their core until every racer has reported
"""
    racers = [procs.python(racer, env={"GO": str(go), "NEURON_RT_NUM_CORES": "1"},
                           stdin=subprocess.PIPE) for _ in range(32)]
    for p in racers:
        assert p.stdout.readline() == "ready\n"
    go.touch()
    results = [json.loads(p.stdout.readline()) for p in racers]
    for p in racers:
        p.stdin.close()
        assert p.wait(timeout=20) == 0

    won = [r["cores"] for r in results if "cores" in r]
    refused = [r["refused"] for r in results if "refused" in r]
    assert len(won) == 16 and len(refused) == 16
    assert sorted(c for cores in won for c in cores) == list(range(16))  # disjoint, all used
    for msg in refused:
        assert msg.startswith("NeuronCore(s) not available - Requested:1 Available:0"), msg
        assert "held by pid" in msg


def test_sdk_example_num_cores_3_five_times_then_sixth_refused(procs):
    holders = [hold(procs, NEURON_RT_NUM_CORES="3") for _ in range(5)]
    blocks = [info["cores"] for _, info in holders]
    assert blocks == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11], [12, 13, 14]]

    sixth, report = hold(procs, NEURON_RT_NUM_CORES="3")
    assert sixth.wait(timeout=20) == 3
    msg = report["refused"]
    assert msg.startswith("NeuronCore(s) not available - Requested:3 Available:1"), msg
    for _, info in holders:
        assert f"held by pid {info['pid']}" in msg

    end(holders[1][0], "exit")  # a hole of 3 opens in the middle: the next one takes it
    again, info = hold(procs, NEURON_RT_NUM_CORES="3")
    assert info["cores"] == [3, 4, 5]
    for p, _ in holders[:1] + holders[2:] + [(again, None)]:
        end(p, "exit")


def test_concurrent_blocks_stay_contiguous_and_pack(procs, tmp_path):
    """Five NUM_CORES=3 racers started together all fit on 16 cores, contiguous, disjoint."""
    go = tmp_path / "go"
    racer = r"""
import json, os, sys, time
import neuronmp.host.runtime as rt
print("ready", flush=True)
while not os.path.exists(os.environ["GO"]):
    time.sleep(0.005)
print(json.dumps(list(rt.init().cores)), flush=True)
sys.stdin.readline()
"""
    racers = [procs.python(racer, env={"GO": str(go), "NEURON_RT_NUM_CORES": "3"},
                           stdin=subprocess.PIPE) for _ in range(5)]
    for p in racers:
        assert p.stdout.readline() == "ready\n"
    go.touch()
    blocks = sorted(json.loads(p.stdout.readline()) for p in racers)
    for p in racers:
        p.stdin.close()
        p.wait(timeout=20)
    assert blocks == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11], [12, 13, 14]]


SPAWNER = r"""
import os, subprocess, sys, time
import neuronmp.host.runtime as rt
rt.init()
if sys.argv[1] == "exec":
    # close_fds=False: only close-on-exec keeps the lock descriptors out of the child
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             close_fds=False)
    pid = child.pid
else:
    pid = os.fork()
    if pid == 0:
        # os.write: one atomic pipe write, never interleaved with the parent's
        os.write(1, f"child-initialized {rt.is_initialized()}\n".encode())
        time.sleep(60)
        os._exit(0)
os.write(1, f"{pid}\n".encode())
time.sleep(60)
"""


@pytest.mark.parametrize("how", ["exec", "fork"])
def test_child_does_not_keep_reservation_after_parent_dies(procs, how):
    parent = procs.popen([sys.executable, "-c", SPAWNER, how], stdout=subprocess.PIPE,
                         text=True, env={**os.environ, "NEURON_RT_VISIBLE_CORES": "2-4"})
    lines = [parent.stdout.readline()]
    if how == "fork":
        lines.append(parent.stdout.readline())
        assert "child-initialized False\n" in lines
    child_pid = int(next(line for line in lines if line.strip().isdigit()))
    child = procid.of(child_pid)
    try:
        assert reservation.core_states(16)[3].holder.pid == parent.pid
        with pytest.raises(CoreUnavailableError):
            take(cores=(3,))
        parent.kill()
        parent.wait(timeout=10)
        assert child.alive(), "the child should outlive its parent for this test"
        held = take(cores=(2, 3, 4))  # while the child still runs
        held.release()
    finally:
        if child is not None and child.alive():
            os.kill(child_pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while child is not None and child.alive() and time.monotonic() < deadline:
            time.sleep(0.01)


def test_fork_child_closing_does_not_unlock_parent():
    held = take(cores=(5,))
    try:
        pid = os.fork()
        if pid == 0:  # a child's release only drops its inherited descriptors
            code = 1
            try:
                held.release()
                code = 0 if not held.active else 2
            finally:
                os._exit(code)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        with pytest.raises(CoreUnavailableError):
            take(cores=(5,))
        assert os.path.exists(reservation.holder_path(held.directory, 5))
        assert reservation.core_states(16)[5].holder.pid == os.getpid()
    finally:
        held.release()


def test_world_writable_group_writable_and_foreign_dirs_refused(runtime_dir, monkeypatch):
    for mode in (0o777, 0o770, 0o702):
        os.chmod(runtime_dir, mode)
        with pytest.raises(RuntimeDirError, match=f"writable by others.*{mode:o}"):
            take(cores=(0,))
    os.chmod(runtime_dir, 0o700)
    os.chown(runtime_dir, 12345, 12345)
    try:
        with pytest.raises(RuntimeDirError, match="owned by uid 12345"):
            take(cores=(0,))
    finally:
        os.chown(runtime_dir, os.getuid(), os.getgid())
    # the cores subdirectory is checked too
    cores = os.path.join(runtime_dir, "cores")
    os.makedirs(cores, exist_ok=True)
    os.chmod(cores, 0o777)
    with pytest.raises(RuntimeDirError, match="cores"):
        take(cores=(0,))
    os.chmod(cores, 0o700)
    take(cores=(0,)).release()
    # a fresh directory is created private
    fresh = os.path.join(runtime_dir, "fresh")
    monkeypatch.setenv("NEURONMP_RUNTIME_DIR", fresh)
    take(cores=(0,)).release()
    assert os.stat(fresh).st_mode & 0o777 == 0o700


def test_reserve_timeout_waits_for_release(procs):
    first, info = hold(procs, NEURON_RT_VISIBLE_CORES="0")
    t0 = time.monotonic()
    with pytest.raises(CoreUnavailableError, match=f"held by pid {info['pid']}"):
        take(cores=(0,), timeout=0.3)
    assert time.monotonic() - t0 >= 0.3
    waiter = procs.python(HOLD, env={"NEURON_RT_VISIBLE_CORES": "0",
                                     "NEURONMP_RESERVE_TIMEOUT": "30"}, stdin=subprocess.PIPE)
    time.sleep(0.3)
    assert waiter.poll() is None  # still waiting, not refused
    end(first, "exit")
    report = json.loads(waiter.stdout.readline())
    assert report["cores"] == [0]
    end(waiter, "exit")


@pytest.mark.parametrize("value,reason", [
    ("soon", "not a number"), ("-1", ">= 0"), ("nan", "finite"), ("inf", "finite"),
])
def test_bad_reserve_timeout_named(monkeypatch, value, reason):
    monkeypatch.setenv("NEURONMP_RESERVE_TIMEOUT", value)
    with pytest.raises(ConfigError) as info:
        reservation.reserve_timeout_from_env()
    msg = str(info.value)
    assert f"NEURONMP_RESERVE_TIMEOUT={value!r}" in msg and reason in msg
    assert "seconds >= 0" in msg
    assert isinstance(info.value, ValueError)


def test_reserve_timeout_accepted_values(monkeypatch):
    for value, expected in (("", 0.0), ("0", 0.0), ("2.5", 2.5), (" 10 ", 10.0)):
        monkeypatch.setenv("NEURONMP_RESERVE_TIMEOUT", value)
        assert reservation.reserve_timeout_from_env() == expected


def test_stale_holder_record_of_dead_process_is_ignored(procs):
    first, info = hold(procs, NEURON_RT_VISIBLE_CORES="6-7")
    end(first, "kill")  # leaves its holder records behind
    directory = reservation.cores_dir()
    assert reservation.read_holder(directory, 6).pid == info["pid"]
    assert not any(s.held for s in reservation.core_states(16))
    held = take(count=2)
    try:
        assert held.cores == (0, 1)
        again = take(cores=(6, 7))
        assert reservation.read_holder(directory, 6).pid == os.getpid()
        again.release()
    finally:
        held.release()


def test_error_pickles_with_fields():
    import pickle

    err = CoreUnavailableError(3, 1, [(0, 42, "python a.py")])
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) and back.holders == ((0, 42, "python a.py"),)


def test_racing_block_requests_never_fragment_the_host():
    """Threads race with their own lock descriptors (the same flock contention as
    processes, far tighter timing): every round the five blocks pack from core 0."""
    import threading

    expected = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (9, 10, 11), (12, 13, 14)]
    for _ in range(30):
        barrier = threading.Barrier(5)
        got, errors = [], []

        def racer(barrier=barrier, got=got, errors=errors):
            barrier.wait(timeout=10)
            try:
                got.append(take(count=3))
            except Exception as exc:  # reported below, with the round's blocks
                errors.append(exc)

        threads = [threading.Thread(target=racer) for _ in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        blocks = sorted(r.cores for r in got)
        for r in got:
            r.release()
        assert not errors and blocks == expected, (errors, blocks)


def test_last_process_out_removes_the_runtime_directory(procs, runtime_dir):
    from neuronmp.host import reservation as res

    code = "import neuronmp; neuronmp.init(); print('up', flush=True); input()"
    first = procs.python(code, env={"NEURON_RT_VISIBLE_CORES": "0-1"},
                         stdin=subprocess.PIPE)
    assert first.stdout.readline().strip() == "up"
    assert not res.tidy()                      # a core is held: the directory stays
    assert os.path.isdir(os.path.join(runtime_dir, "cores"))
    first.communicate("\n", timeout=30)
    assert first.returncode == 0
    assert not os.path.exists(runtime_dir)     # its shutdown was the last one out
    # and a new reservation simply makes it again, private as before
    again = procs.python("import neuronmp; print(neuronmp.init().cores)",
                         env={"NEURON_RT_VISIBLE_CORES": "2"})
    assert again.communicate(timeout=30)[0].strip() == "(2,)"
    assert not os.path.exists(runtime_dir)


def test_tidy_keeps_a_directory_with_segments(runtime_dir):
    from neuronmp.host import reservation as res

    rt = neuronmp.init()
    shm = os.path.join(runtime_dir, "shm")
    os.makedirs(shm, exist_ok=True)
    stray = os.path.join(shm, "someone-elses-segment")
    open(stray, "w").close()
    try:
        neuronmp.shutdown()
        assert rt.closed and os.path.isdir(runtime_dir)   # not ours to remove
        assert not any(s.held for s in res.core_states(16))
    finally:
        os.unlink(stray)


# -- holder records: written safely, small at any size ----------


def test_planted_symlink_at_the_records_temp_name_is_never_written_through(tmp_path):
    directory = reservation.cores_dir()
    victim = tmp_path / "victim"
    victim.write_text("precious")
    tmp = f"{reservation.holder_path(directory, 2)}.{os.getpid()}.tmp"
    os.symlink(victim, tmp)
    os.symlink(victim, reservation.holder_path(directory, 3))  # and one at the final name
    held = take(cores=(2, 3))
    try:
        assert victim.read_text() == "precious"
        for core in (2, 3):
            path = reservation.holder_path(directory, core)
            st = os.lstat(path)
            assert os.path.isfile(path) and not os.path.islink(path)
            assert st.st_mode & 0o777 == 0o600
            assert reservation.read_holder(directory, core).pid == os.getpid()
        assert not os.path.lexists(tmp)
    finally:
        held.release()
    assert victim.read_text() == "precious"


def test_a_record_that_cannot_be_written_backs_out_every_lock():
    directory = reservation.cores_dir()
    tmp = f"{reservation.holder_path(directory, 9)}.{os.getpid()}.tmp"
    os.mkdir(tmp)  # neither openable nor unlinkable as a file
    try:
        with pytest.raises(OSError):
            take(cores=(8, 9, 10))
        assert not any(s.held for s in reservation.core_states(16))
        assert reservation.read_holder(directory, 8) is None
    finally:
        os.rmdir(tmp)


def test_records_of_an_earlier_format_and_corrupt_ones_are_read_safely():
    directory = reservation.cores_dir()
    path = reservation.holder_path(directory, 4)
    me = procid.current()
    with open(path, "w") as f:
        json.dump({"pid": me.pid, "start": me.start, "host": "h", "command": "c",
                   "cores": [4, 5]}, f)
    assert reservation.read_holder(directory, 4).cores == (4, 5)
    for bad in ('{"pid": 1, "first": 0, "last": 99999999999}', "[1, 2]", '"x"', "{", "\xff"):
        with open(path, "w") as f:
            f.write(bad)
        assert reservation.read_holder(directory, 4) is None
    os.unlink(path)


HOLD_ALL = r"""
import json, os, resource, sys
from neuronmp.host import reservation
import neuronmp.host.runtime as rt
from neuronmp.errors import CoreUnavailableError
# a common default soft limit; 4096 lock descriptors need more
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
try:
    cores = rt.init().cores
except CoreUnavailableError as exc:
    print(json.dumps({"refused": str(exc)}), flush=True)
    sys.exit(3)
d = reservation.cores_dir()
print(json.dumps({"pid": os.getpid(), "n": len(cores), "first": cores[0], "last": cores[-1],
                  "record": os.path.getsize(reservation.holder_path(d, 4095)),
                  "soft": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}), flush=True)
sys.stdin.readline()
"""


def test_all_4096_cores_of_64x64_exclusive_all_or_nothing_and_freed(procs, emulated):
    big = emulated("64x64")
    mine = reservation.reserve(Request(cores=(4095,)), big)
    try:  # one core of the 4096 is busy: the whole request is refused, nothing kept
        p = procs.python(HOLD_ALL, stdin=subprocess.PIPE)
        report = json.loads(p.stdout.readline())
        assert p.wait(timeout=60) == 3
        assert report["refused"].startswith("NeuronCore(s) not available - "
                                            "Requested:nc0-nc4095 Available:4095")
        assert f"nc4095 held by pid {os.getpid()}" in report["refused"]
        assert [s.core for s in reservation.core_states(4096) if s.held] == [4095]
    finally:
        mine.release()

    p = procs.python(HOLD_ALL, stdin=subprocess.PIPE)
    report = json.loads(p.stdout.readline())
    assert (report["n"], report["first"], report["last"]) == (4096, 0, 4095)
    assert report["soft"] > 4096       # the descriptor limit was raised to fit
    assert report["record"] < 1024     # a record names a span, not 4096 cores
    states = reservation.core_states(4096)
    assert all(s.held and s.holder.pid == report["pid"] for s in states)
    assert states[17].holder.cores == tuple(range(4096))
    for request in (Request(count=1), Request(cores=(4095,))):
        with pytest.raises(CoreUnavailableError, match="Available:0"):
            reservation.reserve(request, big)
    p.communicate("\n", timeout=60)
    assert p.returncode == 0
    again = reservation.reserve(Request(), big)
    assert again.cores == tuple(range(4096))
    again.release()


def test_counts_on_a_big_host_skip_past_busy_cores(emulated):
    big = emulated("64x64")
    held = [reservation.reserve(Request(cores=(c,)), big) for c in (1, 100)]
    try:
        held.append(reservation.reserve(Request(count=2048), big))
        assert held[-1].cores == tuple(range(101, 2149))
        held.append(reservation.reserve(Request(count=1), big))
        assert held[-1].cores == (0,)
        with pytest.raises(CoreUnavailableError) as info:
            reservation.reserve(Request(count=2048), big)
        msg = str(info.value)
        assert msg.startswith("NeuronCore(s) not available - Requested:2048 Available:2045")
        # the cores in the way, as spans: a message, not a list of two thousand cores
        assert f"; nc0-nc1,nc100-nc2148 held by pid {os.getpid()} (" in msg and len(msg) < 400
    finally:
        for r in held:
            r.release()


def test_import_neuronmp_needs_no_filelock_and_a_held_core_survives_without_it(procs):
    """filelock is for the allocation lock alone: importing neuronmp does not load it,
    and the core locks a process holds are flock.py's."""
    code = ("import sys, neuronmp.host.runtime as rt\n"
            "print('filelock' in sys.modules, rt.init().cores)\n"
            "sys.modules['filelock'] = None\n"
            "from neuronmp.host import reservation\n"
            "print([s.core for s in reservation.core_states(16) if s.held])")
    p = procs.python(code, env={"NEURON_RT_VISIBLE_CORES": "6"})
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert out.split("\n")[:2] == ["False (6,)", "[6]"]


HOLD_ALLOC = r"""
import fcntl, os, sys
from neuronmp.host import reservation
d = reservation.cores_dir()
fd = os.open(os.path.join(d, reservation.ALLOC_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.readline()
"""


def test_a_stuck_allocation_lock_is_a_clear_error_after_its_timeout(procs, monkeypatch):
    holder = procs.python(HOLD_ALLOC, stdin=subprocess.PIPE)
    assert holder.stdout.readline().strip() == "held"
    monkeypatch.setattr(reservation, "_MUTEX_TIMEOUT", 0.3)
    with pytest.raises(CoreUnavailableError) as info:
        reservation.reserve(Request(cores=(1,)), TOPO)
    assert "alloc.lock locked for 0.3 s while reserving" in str(info.value)
    assert type(info.value.__cause__).__name__ == "Timeout"
    holder.communicate("\n", timeout=60)
    reservation.reserve(Request(cores=(1,)), TOPO).release()   # free again: it works


@pytest.mark.parametrize("value", ["\u00b2", "1e3", "9" * 5000, "1_0"])
def test_reserve_timeout_refuses_what_float_would_take_or_choke_on(monkeypatch, value):
    monkeypatch.setenv("NEURONMP_RESERVE_TIMEOUT", value)
    with pytest.raises(ConfigError) as info:
        reservation.reserve_timeout_from_env()
    assert info.value.variable == "NEURONMP_RESERVE_TIMEOUT"
    assert "seconds >= 0" in str(info.value)


def test_threads_of_one_process_sharing_the_allocation_lock_exclude_each_other():
    """The allocation lock's filelock is made once per path and shared: a thread that
    holds it keeps another thread of the same process out until it lets go."""
    import threading

    import filelock

    directory = reservation.cores_dir()
    held = reservation._alloc_lock(directory)
    assert reservation._alloc_lock(directory) is held
    outcomes = []

    def other():
        lock = reservation._alloc_lock(directory)
        try:
            with lock.acquire(timeout=0.2):
                outcomes.append("got it")
        except filelock.Timeout:
            outcomes.append("kept out")

    with held.acquire(timeout=5):
        t = threading.Thread(target=other)
        t.start()
        t.join(10)
    t = threading.Thread(target=other)
    t.start()
    t.join(10)
    assert outcomes == ["kept out", "got it"]
    reservation.reserve(Request(cores=(1,)), TOPO).release()   # and reserving still works
