"""neuronmp-monitor's Prometheus endpoint: each report as the SDK exporter's metrics
(``neuron-monitor-prometheus.py``), so its Grafana dashboard and the alerts built on
those names read an emulated host.

    report (monitor.py) --update()--> metrics text (exposition format 0.0.4)
    GET /metrics (any path) on a thread of its own --> the latest text

Names and labels are the exporter's: every series carries the instance labels
(``instance_name``, ``instance_id``, ``instance_type``, ``availability_zone``,
``region``, ``subnet_id``); an application's carry ``runtime_tag``; a core's
``neuroncore``.  Gauges are the latest report's (an application that exited has no
series); ``execution_errors_total`` and ``execution_status_total`` are counters,
summed over the reports of each application while it lives.  The standard library
only: no prometheus_client needed.
"""
from __future__ import annotations

import http.server
import logging
import threading
from typing import Dict, List, Tuple

from .monitordata import ERROR_TYPES, STATUS_TYPES

log = logging.getLogger(__name__)
_MEMORY_KINDS = ("constants", "model_code", "model_shared_scratchpad", "runtime_memory",
                 "tensors")
_ECC = ("mem_ecc_corrected", "mem_ecc_uncorrected", "sram_ecc_corrected",
        "sram_ecc_uncorrected")
#: name -> (type, help), in the order they are written
_METRICS = {
    "instance_info": ("gauge", "EC2 instance information"),
    "neuron_hardware_info": ("gauge", "Neuron hardware information"),
    "neuroncore_utilization_ratio": ("gauge", "NeuronCore utilization ratio"),
    "execution_errors_total": ("counter", "Execution errors total"),
    "execution_status_total": ("counter", "Execution status total"),
    "execution_latency_seconds": ("gauge", "Execution latency in seconds"),
    "neuron_runtime_memory_used_bytes": ("gauge", "Runtime memory used bytes"),
    **{f"neuroncore_memory_usage_{k}": ("gauge", f"NeuronCore memory utilization for {k}")
       for k in _MEMORY_KINDS},
    "neuron_runtime_vcpu_usage_ratio": ("gauge", "Runtime vCPU utilization ratio"),
    "system_memory_total_bytes": ("gauge", "System memory total_bytes bytes"),
    "system_memory_used_bytes": ("gauge", "System memory used_bytes bytes"),
    "system_swap_total_bytes": ("gauge", "System swap total_bytes bytes"),
    "system_swap_used_bytes": ("gauge", "System swap used_bytes bytes"),
    "hardware_ecc_events_total": ("counter", "Hardware ecc events total"),
    "system_vcpu_count": ("gauge", "System vCPU count"),
    "system_vcpu_usage_ratio": ("gauge", "System CPU utilization ratio"),
}

Sample = Tuple[str, Dict[str, str], float]


class Metrics:
    """The exporter's series, rebuilt from each report; counters kept per application."""

    def __init__(self):
        # (metric, runtime tag, label value) -> running total, while the application lives
        self.totals: Dict[Tuple[str, str, str], float] = {}
        # runtime tag -> the execution_stats data last added to its totals: a report
        # repeats a group's data until the group collects again, and that adds nothing
        self.added: Dict[str, dict] = {}

    def render(self, report: dict) -> str:
        return _text(self.samples(report))

    def samples(self, report: dict) -> List[Sample]:
        base = _instance_labels(report.get("instance_info", {}))
        out: List[Sample] = [("instance_info", dict(base), 1.0)]
        hw = report.get("neuron_hardware_info", {})
        out.append(("neuron_hardware_info", {**base, **{
            k: str(hw.get(k, "")) for k in ("neuron_device_type", "neuroncore_version",
                                            "neuron_device_count",
                                            "neuroncore_per_device_count")}}, 1.0))
        live = set()
        for app in report.get("neuron_runtime_data", []):
            tag = str(app.get("neuron_runtime_tag", app.get("pid")))
            live.add(tag)
            out += self._application({**base, "runtime_tag": tag}, tag, app.get("report", {}))
        self.totals = {k: v for k, v in self.totals.items() if k[1] in live}
        self.added = {k: v for k, v in self.added.items() if k in live}
        out += _system(base, report.get("system_data", {}))
        return out

    def _application(self, labels: Dict[str, str], tag: str, groups: dict) -> List[Sample]:
        out: List[Sample] = []
        cores = groups.get("neuroncore_counters", {}).get("neuroncores_in_use", {})
        for core, data in cores.items():
            out.append(("neuroncore_utilization_ratio", {**labels, "neuroncore": str(core)},
                        data.get("neuroncore_utilization", 0.0) / 100.0))
        stats = groups.get("execution_stats")
        if stats is not None:
            fresh = self.added.get(tag) is not stats
            self.added[tag] = stats
            for name, kinds, field, label in (
                    ("execution_errors_total", ERROR_TYPES, "error_summary", "error_type"),
                    ("execution_status_total", STATUS_TYPES, "execution_summary",
                     "status_type")):
                counts = stats.get(field, {})
                for kind in kinds:
                    key = (name, tag, kind)
                    if fresh:
                        self.totals[key] = self.totals.get(key, 0.0) + counts.get(kind, 0)
                    out.append((name, {**labels, label: kind}, self.totals.get(key, 0.0)))
            latency = stats.get("latency_stats", {}).get("total_latency") or {}
            for p, value in latency.items():
                out.append(("execution_latency_seconds", {**labels, "percentile": p}, value))
        memory = groups.get("memory_used")
        if memory is not None:
            used = memory.get("neuron_runtime_used_bytes", {})
            for where in ("host", "neuron_device"):
                out.append(("neuron_runtime_memory_used_bytes",
                            {**labels, "memory_location": where}, used.get(where, 0)))
            per_core = used.get("usage_breakdown", {}).get("neuroncore_memory_usage", {})
            for core, kinds in per_core.items():
                for kind in _MEMORY_KINDS:
                    out.append((f"neuroncore_memory_usage_{kind}",
                                {**labels, "memory_location": "None", "neuroncore": str(core)},
                                kinds.get(kind, 0)))
        vcpu = groups.get("neuron_runtime_vcpu_usage")
        if vcpu is not None:
            for kind in ("user", "system"):
                out.append(("neuron_runtime_vcpu_usage_ratio", {**labels, "usage_type": kind},
                            vcpu.get("vcpu_usage", {}).get(kind, 0.0) / 100.0))
        return out


def _instance_labels(info: dict) -> Dict[str, str]:
    return {"instance_name": str(info.get("instance_name", "")),
            "instance_id": str(info.get("instance_id", "")),
            "instance_type": str(info.get("instance_type", "")),
            "availability_zone": str(info.get("instance_availability_zone", "")),
            "region": str(info.get("instance_region", "")),
            "subnet_id": str(info.get("subnet_id", ""))}


def _system(base: Dict[str, str], data: dict) -> List[Sample]:
    out: List[Sample] = []
    mem = data.get("memory_info")
    if mem is not None:
        for field in ("memory_total_bytes", "memory_used_bytes", "swap_total_bytes",
                      "swap_used_bytes"):
            out.append((f"system_{field}", dict(base), mem.get(field, 0)))
    hw = data.get("neuron_hw_counters")
    if hw is not None:
        for device in hw.get("neuron_devices", []):
            for event in _ECC:
                out.append(("hardware_ecc_events_total", {
                    **base, "event_type": event,
                    "neuron_device_index": str(device.get("neuron_device_index"))},
                    device.get(event, 0)))
    vcpu = data.get("vcpu_usage")
    if vcpu is not None:
        out.append(("system_vcpu_count", dict(base), len(vcpu.get("usage_data", {}))))
        for kind in ("user", "system"):
            out.append(("system_vcpu_usage_ratio", {**base, "usage_type": kind},
                        vcpu.get("average_usage", {}).get(kind, 0.0) / 100.0))
    return out


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _text(samples: List[Sample]) -> str:
    by_name: Dict[str, List[Sample]] = {}
    for sample in samples:
        by_name.setdefault(sample[0], []).append(sample)
    lines = []
    for name, (kind, text) in _METRICS.items():
        if name not in by_name:
            continue
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        for _, labels, value in by_name[name]:
            inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
            lines.append(f"{name}{{{inner}}} {float(value)!r}")
    return "\n".join(lines) + "\n"


class Exporter:
    """The HTTP endpoint: serves the text of the latest report on a daemon thread."""

    def __init__(self, host: str, port: int):
        self.metrics = Metrics()
        self._text = b""
        self._lock = threading.Lock()
        exporter = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the http.server API
                body = exporter.text()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt, *args):
                log.debug("scrape: " + fmt, *args)

        self.server = http.server.ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        host_, port_ = self.server.server_address[:2]
        self.address = f"{host_}:{port_}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True,
                                       name="neuronmp-monitor-prometheus")
        self.thread.start()

    def update(self, report: dict) -> None:
        text = self.metrics.render(report).encode()
        with self._lock:
            self._text = text

    def text(self) -> bytes:
        with self._lock:
            return self._text

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
