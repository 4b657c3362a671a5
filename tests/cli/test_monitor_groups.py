"""neuronmp-monitor's groups and exporter on readings made by hand: what each figure is
computed from, without processes (their real counterparts are in test_monitor.py)."""
from __future__ import annotations

from neuronmp.cli import monitordata
from neuronmp.cli.monitorprom import Metrics
from neuronmp.host import topology
from neuronmp.pool.stats import CoreStats


def _stats(core, busy_ns, owner=41, start=7, **counts):
    return CoreStats(core, 900 + core, 0, 0, 0, busy_ns, 0, 0, owner=owner, owner_start=start,
                     **counts)


def _snap(t, app, cores):
    return monitordata.Snapshot(t, {app.pid: app}, {c: (st, bytes(16 * 512))
                                                    for c, st in cores.items()})


def test_trn2_with_lnc_2_reports_its_physical_cores_and_device():
    topo = topology.parse("trn2.48xlarge")
    hw = monitordata.hardware_info(topo)
    assert (hw["neuron_device_type"], hw["neuroncore_version"], hw["neuron_device_count"],
            hw["neuroncore_per_device_count"], hw["logical_neuroncore_config"]) == \
        ("trainium2", "v3d", 16, 4, 2)
    app = monitordata.App(41, 7, "t", (5,))
    group = monitordata.CoreCounters(topo)
    group.prev = _snap(0.0, app, {5: _stats(5, 1_000_000_000)})
    data = group.collect(_snap(2.0, app, {5: _stats(5, 1_500_000_000)}), [app], 2.0)[41]
    core = data["neuroncores_in_use"]["5"]
    assert core["neuroncore_utilization"] == 25.0     # 0.5 s busy of 2 s
    assert core["v3d"] == {"nc_v3.10": {"neuroncore_utilization": 25.0},
                           "nc_v3.11": {"neuroncore_utilization": 25.0}}


def test_a_pool_newer_than_the_last_report_counts_from_zero():
    """A core whose counters belong to another pool than last time (the application
    restarted its runtime) reports what the new pool did, not a negative difference."""
    topo = topology.parse("trn1.2xlarge")
    app = monitordata.App(41, 7, "t", (0,))
    group = monitordata.CoreCounters(topo)
    group.prev = _snap(0.0, app, {0: _stats(0, 9_000_000_000, owner=41, start=7)})
    # the same pool's counters never go down; were they to, the share is clamped at 0
    lower = _snap(1.0, app, {0: _stats(0, 300_000_000)})
    assert group.collect(lower, [app], 1.0)[41]["neuroncores_in_use"]["0"][
        "neuroncore_utilization"] == 0.0
    other = monitordata.App(43, 8, "u", (0,))
    group.prev = _snap(0.0, app, {0: _stats(0, 9_000_000_000)})
    fresh = _snap(1.0, other, {0: _stats(0, 300_000_000, owner=43, start=8)})
    assert group.collect(fresh, [other], 1.0)[43]["neuroncores_in_use"]["0"][
        "neuroncore_utilization"] == 30.0


def test_execution_categories_follow_the_sdk():
    topo = topology.parse("trn1.2xlarge")
    app = monitordata.App(41, 7, "t", (0, 1))
    group = monitordata.ExecutionStats(topo)
    group.prev = _snap(0.0, app, {0: _stats(0, 0), 1: _stats(1, 0)})
    now = {0: _stats(0, 0, runs=10, model_errors=2, timed_out=1),
           1: _stats(1, 0, runs=5, runtime_errors=1, died=1)}
    data = group.collect(_snap(1.0, app, now), [app], 1.0)[41]
    assert data["error_summary"] == {"generic": 0, "numerical": 0, "transient": 0,
                                     "model": 2, "runtime": 2, "hardware": 1}
    assert data["execution_summary"] == {"completed": 15, "completed_with_err": 4,
                                         "completed_with_num_err": 0, "timed_out": 1,
                                         "incorrect_input": 0, "failed_to_queue": 0}
    assert monitordata.percentiles([0.3, 0.1, 0.2, 0.4]) == {
        "p0": 0.1, "p1": 0.1, "p25": 0.1, "p50": 0.2, "p75": 0.3, "p99": 0.4, "p100": 0.4}


def _report(tag, completed, util=50.0):
    stats = {"period": 1.0, "error_summary": dict.fromkeys(monitordata.ERROR_TYPES, 0),
             "execution_summary": {**dict.fromkeys(monitordata.STATUS_TYPES, 0),
                                   "completed": completed},
             "latency_stats": {"total_latency": {"p50": 0.01}, "device_latency": None},
             "error": ""}
    return {"pid": 1, "neuron_runtime_tag": tag, "report": {
        "neuroncore_counters": {"neuroncores_in_use": {"3": {"neuroncore_utilization": util}}},
        "execution_stats": stats}}


def test_exporter_counts_each_period_once_and_forgets_an_application_that_left():
    metrics = Metrics()
    info = {"instance_type": "trn1.2xlarge", "instance_id": "i-1"}
    a = _report("a", 3)
    text = metrics.render({"neuron_runtime_data": [a], "instance_info": info})
    assert 'neuroncore_utilization_ratio{availability_zone="",instance_id="i-1",' \
           'instance_name="",instance_type="trn1.2xlarge",neuroncore="3",region="",' \
           'runtime_tag="a",subnet_id=""} 0.5' in text
    line = [ln for ln in text.splitlines()
            if ln.startswith("execution_status_total") and 'status_type="completed"' in ln]
    assert line[0].endswith(" 3.0")
    # the same group data again (not due this round): the counter does not move
    text = metrics.render({"neuron_runtime_data": [a], "instance_info": info})
    assert [ln for ln in text.splitlines() if 'status_type="completed"' in ln][0] \
        .endswith(" 3.0")
    text = metrics.render({"neuron_runtime_data": [_report("a", 4)], "instance_info": info})
    assert [ln for ln in text.splitlines() if 'status_type="completed"' in ln][0] \
        .endswith(" 7.0")
    assert 'execution_latency_seconds{' in text and 'percentile="p50"' in text
    text = metrics.render({"neuron_runtime_data": [], "instance_info": info})
    assert "runtime_tag" not in text and "instance_info{" in text
    assert "# TYPE execution_status_total counter" not in text
