"""neuronmp.host.devicetime and device-time cores: a core never answers sooner than its
latency model, and sleeps rather than computes meanwhile."""
from __future__ import annotations

import time

import psutil
import pytest
import torch
from pool_support import RING_SLICE, wakeup_cpu_seconds

import neuronmp
from neuronmp.errors import ConfigError
from neuronmp.host import devicetime, procid
from neuronmp.session.session import current as _current_session


def _net():
    torch.manual_seed(0)
    return torch.nn.Linear(8, 3).eval()


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


@pytest.mark.parametrize("spec, rows, us", [
    ("2000", 32, 2000), ("500,20", 10, 700), (" 1.5 , 0.5 ", 4, 3.5), (250, 7, 250),
    ((100, 10), 3, 130), ({8: 100, 32: 300}, 8, 100), ({8: 100, 32: 300}, 9, 300),
    ({8: 100, 32: 300}, 33, 600),
])
def test_cost_of_each_form(spec, rows, us):
    dt = devicetime.parse(spec)
    assert dt.cost_us(rows) == pytest.approx(us)
    assert devicetime.wire_cost_ns(dt.wire(), rows) == pytest.approx(us * 1000, abs=1)
    assert devicetime.DeviceTime.from_meta(dt.to_meta()) == dt


@pytest.mark.parametrize("value, says", [
    ("abc", "not a number"), ("1,2,3", "3 comma-separated parts"), ("-5", ">= 0"),
    ("²", "ASCII"), ("inf", "finite"), ("1e3", "not a number"), ("200000000", "<= 100000000"),
])
def test_a_bad_variable_fails_naming_it(monkeypatch, value, says):
    monkeypatch.setenv(devicetime.ENV, value)
    with pytest.raises(ConfigError, match=f"NEURONMP_DEVICE_TIME_US={value!r}") as err:
        neuronmp.trace(_net(), torch.rand(4, 8))
    assert says in str(err.value) and "'500,20'" in err.value.accepted


@pytest.mark.parametrize("spec", ["x", {0: 5}, {4: -1}, {}, (1, 2, 3), True, object()])
def test_a_bad_trace_argument_is_refused(spec):
    with pytest.raises(ConfigError, match="device_time"):
        neuronmp.trace(_net(), torch.rand(4, 8), device_time=spec)


def test_a_core_never_answers_sooner_than_its_model():
    net = _net()
    traced = neuronmp.trace(net, torch.rand(4, 8), device_time="20000,1000")  # 24 ms at 4 rows
    x = torch.rand(4, 8)
    for _ in range(3):
        out, took = _timed(lambda: traced(x))
        assert took >= 0.024
        torch.testing.assert_close(out, net(x))   # the real outputs, computed


def test_queued_requests_take_one_modelled_time_each_in_turn():
    """Ten requests sent at once to one core: the device runs them one after another, so
    the last answer comes no sooner than ten modelled times after the first was sent."""
    net = _net()
    traced = neuronmp.trace(net, torch.rand(4, 8), device_time=10000)
    from neuronmp.session import model as nmp_model

    model = nmp_model.model_of(traced)
    x = torch.rand(4, 8)
    t0 = time.perf_counter()
    answers = [model.submit((x,), replica=0) for _ in range(10)]
    done_at = []
    for a in answers:
        a.result(timeout=30)
        done_at.append(time.perf_counter() - t0)
    for i, t in enumerate(done_at):
        assert t >= 0.010 * (i + 1), (i, t)


def test_dataparallel_chunk_rows_set_the_time_and_the_core_shows_busy(emulated):
    emulated("1x2")   # two cores, so each chunk is 8 rows
    net = _net()
    traced = neuronmp.trace(net, torch.rand(4, 8), device_time="0,2000")  # 2 ms a row
    dp = neuronmp.DataParallel(traced)
    pool = _current_session().pool
    before = {s.core: s.busy_ns for s in pool.stats()}
    x = torch.rand(16, 8)     # 8 rows on each of the two cores: 16 ms each, in parallel
    out, took = _timed(lambda: dp(x))
    torch.testing.assert_close(out, net(x))
    assert took >= 0.016
    # neuronmp-top shows each core busy for its modelled time; a worker counts a
    # timed request as its modelled time ends (2 ms early), so on a loaded host the
    # caller may have its answer first: wait for the count, bounded
    deadline = time.monotonic() + 10
    while True:
        busy = {s.core: s.busy_ns - before[s.core] for s in pool.stats()}
        if all(b >= 16e6 for b in busy.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.005)
    assert all(b >= 16e6 for b in busy.values()), busy


def test_the_context_wins_over_the_trace_and_the_variable(monkeypatch):
    monkeypatch.setenv(devicetime.ENV, "30000")
    net = _net()
    x = torch.rand(4, 8)
    with neuronmp.device_time_context(None):
        plain = neuronmp.trace(net, x, device_time=30000)
    with neuronmp.device_time_context("15000"):
        ctx = neuronmp.trace(net, x)
    host = neuronmp.trace(net, x)
    from neuronmp.session import model as nmp_model

    assert nmp_model.model_of(plain).device_time is None
    assert nmp_model.model_of(ctx).device_time == devicetime.DeviceTime(15000)
    assert nmp_model.model_of(host).device_time == devicetime.DeviceTime(30000)
    assert _timed(lambda: ctx(x))[1] >= 0.015 and _timed(lambda: host(x))[1] >= 0.030


def test_the_model_keeps_its_time_through_save_and_load(tmp_path):
    net = _net()
    x = torch.rand(4, 8)
    torch.jit.save(neuronmp.trace(net, x, device_time=25000), tmp_path / "m.pt")
    loaded = torch.jit.load(tmp_path / "m.pt")
    _, took = _timed(lambda: loaded(x))
    assert took >= 0.025


def test_a_waiting_core_burns_no_cpu():
    traced = neuronmp.trace(_net(), torch.rand(4, 8), device_time=400_000)  # 0.4 s
    pool = _current_session().pool
    worker = psutil.Process(pool.worker_pid(pool.cores[0]))
    traced(torch.rand(4, 8))
    cpu0 = sum(worker.cpu_times()[:2])
    traced(torch.rand(4, 8))
    assert sum(worker.cpu_times()[:2]) - cpu0 < 0.1   # of 0.4 s modelled


def test_idle_workers_stay_idle(emulated):
    emulated("16x2")   # 32 cores on this small machine
    pool = _current_session().pool
    assert len(pool.cores) == 32
    pids = [pool.worker_pid(c) for c in pool.cores]
    time.sleep(0.5)   # past any start-up work
    cpu0, t0 = sum(procid.cpu_seconds(p) for p in pids), time.monotonic()
    time.sleep(1.0)
    used = (sum(procid.cpu_seconds(p) for p in pids) - cpu0) / (time.monotonic() - t0)
    # beyond what their liveness checks cost on this host (see tests/pool/test_worker.py)
    checks = len(pids) / RING_SLICE * wakeup_cpu_seconds()
    assert used < 0.1 + 2 * checks, f"{used:.1%} of a CPU ({checks:.1%} for liveness checks)"

