"""neuronmp-monitor: neuron-monitor's stream of an emulated trn1.32xlarge, from real
applications holding cores, read without a lock."""
from __future__ import annotations

import statistics
import subprocess
import sys

import pytest
from monitor_support import (
    WEIGHT_BYTES,
    by_pid,
    next_report,
    report_until,
    start_app,
    start_monitor,
    stop_all,
    stop_app,
    write_config,
)

_EVERY_GROUP = {
    "period": "500ms",
    "neuron_runtimes": [{"tag_filter": ".*", "metrics": [
        {"type": "neuroncore_counters"}, {"type": "memory_used"},
        {"type": "neuron_runtime_vcpu_usage"}, {"type": "execution_stats"}]}],
    "system_metrics": [{"type": "vcpu_usage"}, {"type": "memory_info"},
                       {"type": "neuron_hw_counters", "period": "1s"}],
}


def _util(app: dict) -> dict:
    cores = app["report"]["neuroncore_counters"]["neuroncores_in_use"]
    return {core: data["neuroncore_utilization"] for core, data in cores.items()}


def _complete(pids):
    def ready(report):
        apps = by_pid(report)
        return all(pid in apps and "execution_stats" in apps[pid]["report"] for pid in pids)
    return ready


def test_applications_their_cores_use_memory_and_latency(procs, emulated, tmp_path):
    emulated("trn1.32xlarge")
    a = start_app(procs, "0-1", tag="app_a", every=True)       # both cores busy
    b = start_app(procs, "2-3", tag="app_b")                   # core 2 busy, core 3 idle
    c = start_app(procs, "4", mode="idle")                     # untagged, loaded, idle
    try:
        _stream_of_three(procs, tmp_path, a, b, c)
    finally:
        stop_all(a, b, c)


def _stream_of_three(procs, tmp_path, a, b, c):
    conf = write_config(tmp_path, _EVERY_GROUP)
    monitor = start_monitor(procs, "-c", conf)
    filtered = start_monitor(procs, "--config-file", write_config(tmp_path, {
        "period": "500ms",
        "neuron_runtimes": [{"tag_filter": "^app_", "metrics": [
            {"type": "neuroncore_counters"}]}]}, "filtered.conf"))

    report = report_until(monitor, lambda r: _complete([a.pid, b.pid, c.pid])(r)
                          and len(r["system_data"]) == 3)   # hw counters: every 1 s
    apps = by_pid(report)
    assert [apps[p]["neuron_runtime_tag"] for p in (a.pid, b.pid, c.pid)] == \
        ["app_a", "app_b", str(c.pid)]                          # untagged: the pid
    assert all(app["error"] == "" for app in apps.values())

    ua, ub, uc = _util(apps[a.pid]), _util(apps[b.pid]), _util(apps[c.pid])
    assert set(ua) == {"0", "1"} and set(ub) == {"2", "3"} and set(uc) == {"4"}
    assert ua["0"] > 0 and ua["1"] > 0 and ub["2"] > 0
    assert ub["3"] == 0 and uc["4"] == 0
    assert all(0 <= u <= 100 for u in (*ua.values(), *ub.values()))
    counters = apps[a.pid]["report"]["neuroncore_counters"]
    assert counters["error"] == "" and counters["period"] > 0.3   # asked for 0.5 s
    assert counters["neuroncores_in_use"]["0"]["flops"] == 0

    for app, cores in ((apps[a.pid], "01"), (apps[b.pid], "2"), (apps[c.pid], "4")):
        memory = app["report"]["memory_used"]["neuron_runtime_used_bytes"]
        per_core = memory["usage_breakdown"]["neuroncore_memory_usage"]
        for core in cores:
            assert per_core[core]["constants"] == WEIGHT_BYTES
            assert per_core[core]["model_code"] > 0
        assert memory["host"] > 0 and memory["neuron_device"] >= WEIGHT_BYTES * len(cores)
    busy_core = apps[a.pid]["report"]["memory_used"]["neuron_runtime_used_bytes"][
        "usage_breakdown"]["neuroncore_memory_usage"]["0"]
    assert busy_core["tensors"] == 2 * 4 * 64 * 4               # its input and output
    assert apps[b.pid]["report"]["memory_used"]["neuron_runtime_used_bytes"][
        "usage_breakdown"]["neuroncore_memory_usage"]["3"]["constants"] == 0

    for pid in (a.pid, b.pid):
        stats = apps[pid]["report"]["execution_stats"]
        assert stats["execution_summary"]["completed"] > 0
        assert set(stats["error_summary"].values()) == {0}
        total, device = (stats["latency_stats"][k] for k in ("total_latency",
                                                               "device_latency"))
        keys = ["p0", "p1", "p25", "p50", "p75", "p99", "p100"]
        assert list(total) == keys and list(device) == keys
        assert [total[k] for k in keys] == sorted(total.values())
        assert [device[k] for k in keys] == sorted(device.values())
        assert all(0 < device[k] <= total[k] for k in keys)   # the total includes the device's
    idle = apps[c.pid]["report"]["execution_stats"]
    assert idle["execution_summary"]["completed"] == 0
    assert idle["latency_stats"] == {"total_latency": None, "device_latency": None}
    vcpu = apps[a.pid]["report"]["neuron_runtime_vcpu_usage"]["vcpu_usage"]
    assert set(vcpu) == {"user", "system"}

    system = report["system_data"]
    assert [d["neuron_device_index"] for d in system["neuron_hw_counters"]["neuron_devices"]] \
        == list(range(16))
    assert all(v == 0 for d in system["neuron_hw_counters"]["neuron_devices"]
               for k, v in d.items() if k != "neuron_device_index")
    assert system["memory_info"]["memory_total_bytes"] > 0
    assert set(system["vcpu_usage"]["average_usage"]) == {
        "user", "nice", "system", "idle", "io_wait", "irq", "soft_irq"}
    hw = report["neuron_hardware_info"]
    assert (hw["neuron_device_type"], hw["neuron_device_count"],
            hw["neuroncore_per_device_count"], hw["logical_neuroncore_config"]) == \
        ("trainium", 16, 2, 1)
    assert hw["neuron_device_memory_size"] == 32 << 30 and hw["error"] == ""
    assert report["instance_info"]["instance_type"] == "trn1.32xlarge"
    assert report["instance_info"]["instance_id"].startswith("i-")
    assert "Kubernetes" in report["neuron_k8s_info"]["error"]

    # the tag filter: only app_a and app_b, and only the group it asked for
    seen = report_until(filtered, _has_counters([a.pid, b.pid]))
    assert sorted(by_pid(seen)) == sorted([a.pid, b.pid])
    assert set(seen["system_data"]) == set()
    assert all(set(app["report"]) == {"neuroncore_counters"}
               for app in seen["neuron_runtime_data"])

    # an application that exits leaves the stream; the others stay
    stop_app(a)
    later = report_until(monitor, lambda r: a.pid not in by_pid(r), timeout=20)
    assert {b.pid, c.pid} <= set(by_pid(later))


def _has_counters(pids):
    def ready(report):
        apps = by_pid(report)
        return all(pid in apps and apps[pid]["report"] for pid in pids)
    return ready


def test_device_time_cores_report_their_modelled_duty_cycle(procs, emulated, tmp_path):
    """20 ms of modelled device time every 40 ms: the core is half busy, whatever the
    host's CPUs do meanwhile."""
    emulated("trn1.32xlarge")
    app = start_app(procs, "6", mode="duty", tag="duty", cycle_s=0.04,
                    env={"NEURONMP_DEVICE_TIME_US": "20000"})
    try:
        _duty_cycle(procs, tmp_path, app)
    finally:
        stop_all(app)


def _duty_cycle(procs, tmp_path, app):
    monitor = start_monitor(procs, "-c", write_config(tmp_path, {
        "period": "1s", "neuron_runtimes": [{"metrics": [
            {"type": "neuroncore_counters"}, {"type": "execution_stats"}]}]}))
    report_until(monitor, _complete([app.pid]))       # the first period may start mid-cycle
    utils, device = [], []
    for _ in range(3):
        report = next_report(monitor)
        mine = by_pid(report)[app.pid]["report"]
        utils.append(_util(by_pid(report)[app.pid])["6"])
        device.append(mine["execution_stats"]["latency_stats"]["device_latency"]["p50"])
    assert abs(statistics.mean(utils) - 50.0) < 5.0, utils
    assert all(abs(d - 0.020) < 1e-6 for d in device), device   # the modelled time itself


_BAD = [
    ({"neuron_runtimes": [{"metrics": [{"type": "nc_counters"}]}]},
     "neuron_runtimes[0].metrics[0].type = 'nc_counters': unknown metric group",
     "neuroncore_counters, execution_stats, memory_used, neuron_runtime_vcpu_usage"),
    ({"system_metrics": [{"type": "memory_used"}]},
     "system_metrics[0].type = 'memory_used'", "neuron_hw_counters, vcpu_usage, memory_info"),
    ({"period": "fast"}, "period = 'fast': it is not a duration", "a Go duration string"),
    ({"period": 5}, "period = 5: it is not a duration", "\"500ms\""),
    ({"system_metrics": [{"type": "vcpu_usage", "period": "0s"}]},
     "system_metrics[0].period = '0s': the period is too short", "at least 10ms"),
    ({"neuron_runtimes": [{"tag_filter": "app_(", "metrics": []}]},
     "neuron_runtimes[0].tag_filter = 'app_(': it is not a regular expression",
     "a regular expression"),
    ({"neuron_runtime": []}, "neuron_runtime = []: unknown field",
     "period, neuron_runtimes, system_metrics"),
]


@pytest.mark.parametrize("doc,named,accepted", _BAD)
def test_bad_configuration_exits_2_naming_the_field(tmp_path, doc, named, accepted):
    path = write_config(tmp_path, doc)
    res = subprocess.run([sys.executable, "-m", "neuronmp.cli.monitor", "-c", path],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stdout == ""
    assert named in res.stderr and accepted in res.stderr, res.stderr
    assert path in res.stderr


def test_unreadable_and_non_json_configuration_files(tmp_path):
    (tmp_path / "broken.conf").write_text("{period: 1s}")
    for path, said in ((tmp_path / "missing.conf", "cannot read the configuration file"),
                       (tmp_path / "broken.conf", "it is not JSON")):
        res = subprocess.run([sys.executable, "-m", "neuronmp.cli.monitor", "-c", str(path)],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 2 and said in res.stderr, res.stderr


def test_default_configuration_is_every_group_every_5_seconds():
    from neuronmp.cli import monitorconf

    config = monitorconf.default()
    assert [g.type for g in config.runtimes[0].groups] == list(monitorconf.RUNTIME_GROUPS)
    assert [g.type for g in config.system] == list(monitorconf.SYSTEM_GROUPS)
    assert {g.period for g in config.runtimes[0].groups + config.system} == {5.0}
    assert config.entry_for("anything") == 0
    periods = monitorconf.parse({"period": "2s", "neuron_runtimes": [
        {"period": "1m30s", "metrics": [{"type": "memory_used"},
                                        {"type": "execution_stats", "period": "250ms"}]}],
        "system_metrics": [{"type": "memory_info"}]})
    assert [g.period for g in periods.runtimes[0].groups] == [90.0, 0.25]
    assert periods.system[0].period == 2.0


def test_monitor_imports_no_torch():
    code = ("import sys; from neuronmp.cli import monitor, monitorprom; "
            "m = monitor.Monitor(monitor.monitorconf.default()); m.round(); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr


def test_a_file_with_no_group_still_reports_every_period(tmp_path, procs):
    """The objects every report carries (instance, hardware, Kubernetes) come each root
    period even when no metric group is asked for."""
    monitor = start_monitor(procs, "-c", write_config(tmp_path, {"period": "100ms"}))
    first, second = next_report(monitor), next_report(monitor)
    monitor.kill()
    for report in (first, second):
        assert report["neuron_runtime_data"] == [] and report["system_data"] == {}
        assert set(report) == {"neuron_runtime_data", "system_data", "instance_info",
                               "neuron_hardware_info", "neuron_k8s_info"}
