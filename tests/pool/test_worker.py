"""neuronmp.pool.worker: the process serving one core (pinning, name, memory, settings)."""
from __future__ import annotations

import time
import types

import psutil
import pytest
import torch
from pool_support import RING_SLICE, script_bytes, wakeup_cpu_seconds

import neuronmp
from neuronmp.host import procid
from neuronmp.session.session import current as _current_session


def test_worker_affinity_threads_and_name(emulated):
    topo = emulated("2x2")
    pool = _current_session().pool
    for core in pool.cores:
        info = pool.info(core)
        assert info["core"] == core
        assert tuple(info["cpus"]) == topo.cpus_of(core)
        assert info["torch_threads"] == len(topo.cpus_of(core))
        proc = psutil.Process(info["pid"])
        assert proc.cpu_affinity() == list(topo.cpus_of(core))
        assert proc.name() == f"neuronmp-nc{core}"


def _minor_faults(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def test_worker_reuses_freed_activations_instead_of_faulting_them_in():
    # With glibc's default thresholds this net's activations are unmapped or trimmed
    # after every call and faulted in again: about 1300 page faults a call.
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU()).eval()
    x = torch.rand(32, 3, 64, 64)
    data, mod = script_bytes(net, x)
    pool = _current_session().pool
    core = pool.cores[0]
    mid = pool.load(core, data)
    for _ in range(20):
        pool.call(core, mid, (x,)).result()
    pid = pool.worker_pid(core)
    before = _minor_faults(pid)
    for _ in range(20):
        got = pool.call(core, mid, (x,)).result()
    per_call = (_minor_faults(pid) - before) / 20
    assert per_call < 200, f"{per_call:.0f} page faults per call"
    torch.testing.assert_close(got, mod(x))


def test_a_bad_keep_setting_fails_in_the_caller_naming_it(procs):
    code = "import neuronmp.session.session; neuronmp.session.session.current().pool"
    proc = procs.python(code, env={"NEURONMP_WORKER_KEEP_MB": "lots"})
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "ConfigError: Invalid NEURONMP_WORKER_KEEP_MB='lots'" in err
    assert "the megabytes a worker keeps" in err


@pytest.mark.parametrize("name, value", [
    ("NEURONMP_RING_BYTES", "huge"), ("NEURONMP_RING_BYTES", "1e6"),
    ("NEURONMP_WORKER_START_TIMEOUT", "abc"), ("NEURONMP_WORKER_START_TIMEOUT", "-1"),
    ("NEURONMP_WAIT_SPIN_US", "\u00b2"), ("NEURONMP_WORKER_SPIN_US", "9" * 5000),
])
def test_every_pool_setting_is_checked_in_the_caller(procs, name, value):
    proc = procs.python("import neuronmp.session.session; neuronmp.session.session.current().pool",
                        env={name: value})
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and f"ConfigError: Invalid {name}=" in err, err


def test_32_idle_workers_keep_the_cpus_free(emulated):
    # 32 emulated cores on a 2-CPU runner: an idle worker sleeps on its ring's futex,
    # waking only to check that its coordinator lives (a few times a second)
    emulated("trn1.32xlarge")
    x = torch.zeros(1, 4)
    with neuronmp.multicore_context():
        traced = neuronmp.trace(torch.nn.Linear(4, 4), x)
    pool = _current_session().pool
    assert len(pool.cores) == 32
    for _ in pool.cores:   # round robin: every worker has served a request
        traced(x)
    pids = [pool.worker_pid(core) for core in pool.cores]
    time.sleep(0.3)        # past the short spin after the last answer
    before, t0 = sum(procid.cpu_seconds(p) for p in pids), time.monotonic()
    time.sleep(1.0)
    used = (sum(procid.cpu_seconds(p) for p in pids) - before) / (time.monotonic() - t0)
    # What the liveness checks alone cost on this host: a wake-up from a timed sleep
    # costs from microseconds on a bare CPU to over a millisecond on some VMs.
    checks = len(pids) / RING_SLICE * wakeup_cpu_seconds()
    assert used < 0.05 + 2 * checks, \
        f"32 idle workers used {used:.1%} of one CPU ({checks:.1%} for their liveness checks)"



@pytest.mark.parametrize("waited_us, window_us, spins", [
    (30, 50, True),       # a caller in a loop: caught by the spin
    (90, 50, True),       # just after it: a wake-up's worth late, still worth it
    (2000, 50, False),    # a server's next batch, milliseconds later: spinning was lost
    (2000, 200, False),   # the same with the pool's budget for a lone core
    (60, 0, True),        # spinning was off, and the request came soon: turn it back on
    (400, 0, False),      # spinning was off, and still nothing came soon
])
def test_a_worker_spins_for_its_next_request_only_after_one_that_came_soon(
        waited_us, window_us, spins):
    from neuronmp.pool.worker import _keep_spinning

    assert _keep_spinning(waited_us * 1000, window_us * 1e-6) is spins


@pytest.mark.parametrize("waited_us, spinning, spins", [
    (250, False, True),    # off after a pause, then a loop's request plus the wake-up
    (250, True, True),     # the same caller while spinning
    (2000, False, False),  # a server's next batch: it stays off
])
def test_spinning_comes_back_for_a_caller_whose_requests_come_within_the_window(
        waited_us, spinning, spins):
    # once a pause turned the spin off, a caller whose requests come a little apart
    # (a compiled call: Dynamo's guards and the copies between its requests) must get
    # it back: judged against the probe alone, with the wake-up counted in, it never did
    from neuronmp.pool.worker import _next_spin

    req = types.SimpleNamespace(spin=spinning, spin_window=200e-6 if spinning else 0.0,
                                spin_window_on=200e-6)
    assert _next_spin(req, waited_us * 1000) is spins


def test_a_worker_whose_request_came_long_after_its_spin_sleeps_for_the_next():
    # a server's batches come milliseconds apart: the worker that waited that long
    # does not spin for the next request (INFO reports the wait it just had)
    pool = _current_session().pool
    core = pool.cores[0]
    pool.info(core)
    time.sleep(0.05)          # far past any spin (NEURONMP_IPC_SPIN_US, the budget)
    assert pool.info(core)["spins"] is False


def test_a_worker_answers_a_slow_caller_and_a_fast_one_alike():
    # a caller that pauses between requests turns the worker's spin off; one that
    # calls in a loop right after must still be answered (the futex wakes it)
    net = torch.nn.Linear(8, 4).eval()
    x = torch.rand(2, 8)
    data, mod = script_bytes(net, x)
    pool = _current_session().pool
    core = pool.cores[0]
    mid = pool.load(core, data)
    want = mod(x)
    for pause in (0.005, 0.005, 0.0, 0.0, 0.005, 0.0):
        time.sleep(pause)
        torch.testing.assert_close(pool.call(core, mid, (x,)).result(timeout=30), want)
