"""Prometheus metrics with Triton's names, so existing dashboards work.

Counters per model (labels ``model``, ``version``), named exactly as Triton names them
(no ``_total`` suffix): ``nv_inference_request_success``,
``nv_inference_request_failure``, ``nv_inference_count`` (inferences: rows),
``nv_inference_exec_count`` (batches run), ``nv_inference_request_duration_us``,
``nv_inference_queue_duration_us``, ``nv_inference_compute_infer_duration_us``
(cumulative microseconds).  Per core (label ``core``): ``neuronmp_core_busy_us``
(cumulative busy time, modelled device time included) and
``neuronmp_core_queue_depth`` (requests sent and not yet done); per model
``neuronmp_model_queue_depth`` (requests waiting for a batch).  The batching figures
are read from each BatchingServer and the session's core counters at scrape time.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Dict, Iterable, List, Tuple

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from ..session import session as _session

_LABELS = ("model", "version")


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.models: Dict[str, object] = {}
        self._lock = threading.Lock()
        self._counts: Dict[Tuple[str, str], collections.Counter] = \
            collections.defaultdict(collections.Counter)
        self.registry.register(self)

    def success(self, served, start: float) -> None:
        self._add(served, "success", start)

    def failure(self, served, start: float) -> None:
        self._add(served, "failure", start)

    def _add(self, served, what: str, start: float) -> None:
        us = (time.perf_counter() - start) * 1e6
        with self._lock:
            c = self._counts[(served.cfg.name, served.cfg.version)]
            c[what] += 1
            c["duration_us"] += us

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            counts = {k: dict(v) for k, v in self._counts.items()}
        per_model = {
            "nv_inference_request_success": ("Number of successful inference requests",
                                             "counter", lambda c, s: c.get("success", 0)),
            "nv_inference_request_failure": ("Number of failed inference requests",
                                             "counter", lambda c, s: c.get("failure", 0)),
            "nv_inference_count": ("Number of inferences performed", "counter",
                                   lambda c, s: s["completed"]),
            "nv_inference_exec_count": ("Number of model executions (batches) performed",
                                        "counter", lambda c, s: s["batches"]),
            "nv_inference_request_duration_us": (
                "Cumulative inference request duration in microseconds", "counter",
                lambda c, s: c.get("duration_us", 0.0)),
            "nv_inference_queue_duration_us": (
                "Cumulative inference queuing duration in microseconds", "counter",
                lambda c, s: s["queue_us"]),
            "nv_inference_compute_infer_duration_us": (
                "Cumulative compute inference duration in microseconds", "counter",
                lambda c, s: s["compute_us"]),
            "neuronmp_model_queue_depth": ("Requests waiting for a batch", "gauge",
                                           lambda c, s: s["queued"]),
        }
        rows: List[Tuple[List[str], dict, dict]] = []
        cores = set()
        for served in list(self.models.values()):
            key = (served.cfg.name, served.cfg.version)
            rows.append((list(key), counts.get(key, {}), served.server.stats()))
            cores.update(served.cores)
        for name, (doc, kind, value) in per_model.items():
            m = Metric(name, doc, kind)
            for labels, c, s in rows:
                m.add_sample(name, dict(zip(_LABELS, labels)), value(c, s))
            yield m
        yield from _core_metrics(cores)


def _core_metrics(cores) -> Iterable[Metric]:
    busy = Metric("neuronmp_core_busy_us",
                  "Cumulative time the core was busy (device time included), us", "counter")
    depth = Metric("neuronmp_core_queue_depth", "Requests sent to the core and not yet done",
                   "gauge")
    if cores:
        for s in _session.current().core_stats():
            if s.core in cores:
                busy.add_sample(busy.name, {"core": str(s.core)}, s.busy_ns / 1000)
                depth.add_sample(depth.name, {"core": str(s.core)}, s.in_flight)
    return busy, depth
