"""neuronmp-monitor's Prometheus endpoint, scraped by a real Prometheus server (Debian's
``prometheus`` package): PromQL over its HTTP API sees the busy core and the idle one.

Without the ``prometheus`` binary the test is skipped, saying so; with
NEURONMP_REQUIRE_PROMETHEUS=1 (set by .ci/run, which installs it) a missing binary
fails the test instead.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
from monitor_support import start_app, start_monitor, stop_all, write_config

from neuronmp.launch.launcher import free_port

_PROMETHEUS = shutil.which("prometheus")
_REQUIRED = os.environ.get("NEURONMP_REQUIRE_PROMETHEUS") == "1"


def _need_prometheus():
    if _PROMETHEUS is None:
        why = ("the prometheus binary is not installed (apt-get install prometheus); "
               ".ci/run installs it")
        if _REQUIRED:
            pytest.fail(f"NEURONMP_REQUIRE_PROMETHEUS=1 but {why}")
        pytest.skip(why)


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _query(api: str, promql: str) -> list:
    url = f"{api}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    doc = json.loads(_get(url))
    assert doc["status"] == "success", doc
    return doc["data"]["result"]


def _exporter_address(monitor: subprocess.Popen, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = monitor.stderr.readline()
        assert line, "the monitor ended before serving its metrics"
        m = re.search(r"http://(\S+)/metrics", line)
        if m:
            return m.group(1)
    raise AssertionError("the monitor did not say where its metrics are")


def test_prometheus_scrapes_busy_and_idle_cores(procs, emulated, tmp_path):
    _need_prometheus()
    emulated("trn1.32xlarge")
    app = start_app(procs, "8-9", tag="scraped")                # core 8 busy, core 9 idle
    monitor = None
    try:
        monitor = start_monitor(procs, "-c", write_config(tmp_path, {
            "period": "500ms", "neuron_runtimes": [{"metrics": [
                {"type": "neuroncore_counters"}, {"type": "execution_stats"},
                {"type": "memory_used"}]}],
            "system_metrics": [{"type": "memory_info"}]}), "--prometheus-port", "0")
        target = _exporter_address(monitor)
        _scrape(procs, tmp_path, target)
    finally:
        if monitor is not None:
            monitor.terminate()
            monitor.wait(timeout=30)
        stop_all(app)


def _scrape(procs, tmp_path, target: str) -> None:
    deadline = time.monotonic() + 30
    text = ""
    while "runtime_tag" not in text and time.monotonic() < deadline:   # the first report
        time.sleep(0.2)
        text = _get(f"http://{target}/metrics")
    assert "# TYPE neuroncore_utilization_ratio gauge" in text, text

    port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: neuron\n    static_configs:\n"
        f"      - targets: ['{target}']\n")
    server = procs.popen([_PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                          f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                          f"--web.listen-address=127.0.0.1:{port}"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    api = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        found = {}
        while time.monotonic() < deadline:
            assert server.poll() is None, server.stderr.read()[-3000:]
            try:
                rows = _query(api, 'neuroncore_utilization_ratio{runtime_tag="scraped"}')
            except OSError:   # not listening yet
                rows = []
            found = {r["metric"]["neuroncore"]: float(r["value"][1]) for r in rows}
            if found.get("8", 0) > 0 and "9" in found:
                break
            time.sleep(0.5)
        assert found.get("8", 0) > 0 and found.get("9") == 0.0, found
        row = _query(api, 'neuroncore_utilization_ratio{neuroncore="8"}')[0]["metric"]
        assert row["instance_type"] == "trn1.32xlarge" and row["job"] == "neuron"
        assert row["instance_id"].startswith("i-")
        constants = _query(api, 'neuroncore_memory_usage_constants{neuroncore="8"}')
        assert float(constants[0]["value"][1]) == (64 * 64 + 64) * 4
        completed = _query(api, 'execution_status_total{status_type="completed"}')
        assert float(completed[0]["value"][1]) > 0
        latency = _query(api, 'execution_latency_seconds{percentile="p50"}')
        assert float(latency[0]["value"][1]) > 0
        assert _query(api, "system_memory_total_bytes")
    finally:
        server.terminate()
        server.wait(timeout=30)
