"""What neuronmp-monitor reports, read from what the host already publishes.

    reservation.core_states()   holder records + /proc/locks (no lock): the applications,
                                 their pids, tags (NEURON_PROCESS_TAG) and cores
    pool statistics segments     per-core counters and latency samples (no lock, no attach)
    psutil                       the applications' and the host's CPU and memory

One ``Snapshot`` is read per round; each metric group keeps the snapshot it reported
last and reports the difference (a core whose pool is newer than that counts from
zero: its counters started at zero with the pool).  Nothing here takes a lock a
worker or a caller waits on, or writes anything.  Imports no torch.

Fields neuronmp cannot know are reported as the SDK reports an idle quantity: ``flops``
is 0 (neuronmp does not count a traced graph's floating-point operations), as are
``completed_with_num_err``, ``incorrect_input``, ``failed_to_queue``, the ``generic``,
``numerical`` and ``transient`` errors, ``model_shared_scratchpad`` and
``runtime_memory``, and every ECC counter.
"""
from __future__ import annotations

import hashlib
import math
import os
import socket
import time
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import psutil

from ..host import paths, reservation, topology
from ..pool.stats import read_samples as read_core_samples
from ..pool.stats import samples_between

PERCENTILES = (0, 1, 25, 50, 75, 99, 100)
ERROR_TYPES = ("generic", "numerical", "transient", "model", "runtime", "hardware")
STATUS_TYPES = ("completed", "completed_with_err", "completed_with_num_err", "timed_out",
                "incorrect_input", "failed_to_queue")
_KUBELET_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"


@dataclass(frozen=True)
class App:
    """A Neuron application: a process holding cores."""

    pid: int
    start: Optional[int]
    tag: str
    cores: Tuple[int, ...]


@dataclass
class Snapshot:
    """One reading of the host: when, who holds which cores, every pool's counters."""

    t: float
    apps: Dict[int, App]
    cores: Dict[int, tuple]   # global core -> (CoreStats, latency ring bytes)

    def stats_of(self, app: App, core: int):
        """``core``'s counters when they are ``app``'s pool's, else None."""
        found = self.cores.get(core)
        if found is None:
            return None
        st = found[0]
        if st.owner != app.pid or (app.start is not None and st.owner_start != app.start):
            return None
        return st


def snapshot(topo: topology.Topology) -> Snapshot:
    """The host now: applications (by pid) and core counters (by global core)."""
    base = paths.existing_runtime_dir()
    apps: Dict[int, App] = {}
    cores: Dict[int, tuple] = {}
    if base is not None:
        for state in reservation.core_states(topo.num_cores, base=base):
            h = state.holder
            if not state.held or h is None:
                continue
            app = apps.get(h.pid)
            if app is None:
                apps[h.pid] = App(h.pid, h.start, h.tag or str(h.pid), (state.core,))
            else:
                apps[h.pid] = App(app.pid, app.start, app.tag, app.cores + (state.core,))
        shm = paths.shm_dir(base, create=False)
        if shm is not None:
            cores = read_core_samples(shm)
    return Snapshot(time.monotonic(), apps, cores)


def _same_pool(a, b) -> bool:
    return a is not None and b is not None and (a.owner, a.owner_start) == \
        (b.owner, b.owner_start)


def _before(prev: Optional[Snapshot], app: App, core: int, now):
    """``core``'s counters in ``prev`` when they belong to the pool ``now`` came from."""
    if prev is None:
        return None
    old = prev.stats_of(app, core)
    return old if _same_pool(old, now) else None


def percentiles(values: List[float]) -> Optional[Dict[str, float]]:
    """``p0`` ... ``p100`` of ``values`` (nearest rank), or None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    n = len(ordered)
    out = {}
    for p in PERCENTILES:
        rank = max(1, math.ceil(p / 100 * n))
        out[f"p{p}"] = ordered[min(n, rank) - 1]
    return out


# -- the application groups -------------------------------------------------------------


class RuntimeGroup:
    """A metric group reported per application: the difference since its last report."""

    def __init__(self, topo: topology.Topology):
        self.topo = topo
        self.prev: Optional[Snapshot] = None

    def collect(self, snap: Snapshot, apps: Iterable[App], period: float) -> Dict[int, dict]:
        out = {app.pid: {"period": period, **self.data(snap, app, period), "error": ""}
               for app in apps}
        self.prev = snap
        return out

    def data(self, snap: Snapshot, app: App, period: float) -> dict:
        raise NotImplementedError


class CoreCounters(RuntimeGroup):
    """``neuroncore_counters``: the share of the period each core's worker executed
    (a device-time core's modelled time), in percent."""

    def data(self, snap: Snapshot, app: App, period: float) -> dict:
        cores = {}
        for core in app.cores:
            now = snap.stats_of(app, core)
            old = _before(self.prev, app, core, now)
            busy = 0 if now is None else now.busy_ns - (old.busy_ns if old else 0)
            util = min(100.0, max(0.0, 100.0 * busy / (period * 1e9))) if period > 0 else 0.0
            entry = {"neuroncore_utilization": util, "flops": 0}
            if self.topo.lnc > 1 and self.topo.name.startswith("trn2"):
                entry["v3d"] = {f"nc_v3.{p}": {"neuroncore_utilization": util}
                                for p in self.topo.physical_cores_of(core)}
            cores[str(core)] = entry
        return {"neuroncores_in_use": cores}


class ExecutionStats(RuntimeGroup):
    """``execution_stats``: outcomes of the period's executions by the SDK's
    categories, and their latency percentiles (total: from the caller's send to the
    answer being ready; device: the worker's execution, a device-time core's
    modelled time)."""

    def __init__(self, topo: topology.Topology):
        super().__init__(topo)
        self.seen: Dict[int, Tuple[tuple, int]] = {}   # core -> (pool identity, samples read)

    def data(self, snap: Snapshot, app: App, period: float) -> dict:
        errors = dict.fromkeys(ERROR_TYPES, 0)
        status = dict.fromkeys(STATUS_TYPES, 0)
        device: List[float] = []
        total: List[float] = []
        for core in app.cores:
            now = snap.stats_of(app, core)
            if now is None:
                continue
            old = _before(self.prev, app, core, now)
            d = {f: getattr(now, f) - (getattr(old, f) if old else 0)
                 for f in ("runs", "model_errors", "runtime_errors", "timed_out", "died")}
            errors["model"] += d["model_errors"]
            errors["runtime"] += d["runtime_errors"] + d["timed_out"]
            errors["hardware"] += d["died"]
            status["completed"] += d["runs"]
            status["completed_with_err"] += d["model_errors"] + d["runtime_errors"] + d["died"]
            status["timed_out"] += d["timed_out"]
            ident = (now.owner, now.owner_start)
            mark = self.seen.get(core)
            seen = mark[1] if mark is not None and mark[0] == ident else 0
            for dev, tot in samples_between(snap.cores[core][1], seen, now.samples):
                device.append(dev / 1e9)
                total.append(tot / 1e9)
            self.seen[core] = (ident, now.samples)
        return {"error_summary": errors, "execution_summary": status,
                "latency_stats": {"total_latency": percentiles(total),
                                  "device_latency": percentiles(device)}}


class MemoryUsed(RuntimeGroup):
    """``memory_used``: each core's weights (constants), graphs (model_code) and last
    execution's tensors; host memory is the resident size of the application and of
    its cores' workers."""

    def data(self, snap: Snapshot, app: App, period: float) -> dict:
        per_core = {}
        device = 0
        host = _rss(app.pid)
        for core in app.cores:
            st = snap.stats_of(app, core)
            entry = {"constants": st.constants if st else 0,
                     "model_code": st.model_code if st else 0,
                     "model_shared_scratchpad": 0, "runtime_memory": 0,
                     "tensors": st.tensors if st else 0}
            device += entry["constants"] + entry["model_code"] + entry["tensors"]
            per_core[str(core)] = entry
            if st is not None and st.pid:
                host += _rss(st.pid)
        return {"neuron_runtime_used_bytes": {
                    "host": host, "neuron_device": device,
                    "usage_breakdown": {
                        "host": {"application_memory": host, "constants": 0,
                                 "dma_buffers": 0, "tensors": 0},
                        "neuroncore_memory_usage": per_core}},
                "loaded_models": []}


class RuntimeVcpu(RuntimeGroup):
    """``neuron_runtime_vcpu_usage``: CPU time of the application and its cores'
    workers over the period, in percent of the host's vCPUs."""

    def __init__(self, topo: topology.Topology):
        super().__init__(topo)
        self.times: Dict[Tuple[int, Optional[int]], Tuple[float, float]] = {}

    def data(self, snap: Snapshot, app: App, period: float) -> dict:
        pids = [app.pid] + [st.pid for st in (snap.stats_of(app, c) for c in app.cores)
                            if st is not None and st.pid]
        user = system = 0.0
        for pid in pids:
            times = _cpu_times(pid)
            if times is None:
                continue
            key = (pid, app.start if pid == app.pid else None)
            old = self.times.get(key)
            self.times[key] = times
            if old is not None:
                user += times[0] - old[0]
                system += times[1] - old[1]
        scale = 100.0 / (period * (os.cpu_count() or 1)) if period > 0 else 0.0
        return {"vcpu_usage": {"user": round(max(0.0, user * scale), 2),
                               "system": round(max(0.0, system * scale), 2)}}


RUNTIME_COLLECTORS = {"neuroncore_counters": CoreCounters, "execution_stats": ExecutionStats,
                      "memory_used": MemoryUsed, "neuron_runtime_vcpu_usage": RuntimeVcpu}


def _rss(pid: int) -> int:
    try:
        return psutil.Process(pid).memory_info().rss
    except (psutil.Error, OSError):
        return 0


def _cpu_times(pid: int) -> Optional[Tuple[float, float]]:
    try:
        t = psutil.Process(pid).cpu_times()
    except (psutil.Error, OSError):
        return None
    return t.user, t.system


# -- the system groups --------------------------------------------------------------------


class SystemGroup:
    def __init__(self, topo: topology.Topology):
        self.topo = topo

    def collect(self, period: float) -> dict:
        return {"period": period, **self.data(), "error": ""}

    def data(self) -> dict:
        raise NotImplementedError


class HwCounters(SystemGroup):
    """``neuron_hw_counters``: every device, and no ECC event on an emulated one."""

    def data(self) -> dict:
        return {"neuron_devices": [
            {"neuron_device_index": d, "mem_ecc_corrected": 0, "mem_ecc_uncorrected": 0,
             "sram_ecc_uncorrected": 0, "sram_ecc_corrected": 0}
            for d in range(self.topo.chips)]}


class VcpuUsage(SystemGroup):
    """``vcpu_usage``: the host's vCPUs over the period, in percent, and context switches."""

    def __init__(self, topo: topology.Topology):
        super().__init__(topo)
        self.prev = psutil.cpu_times(percpu=True)
        self.switches = psutil.cpu_stats().ctx_switches

    def data(self) -> dict:
        now = psutil.cpu_times(percpu=True)
        switches = psutil.cpu_stats().ctx_switches
        per = {str(i): _cpu_shares(a, b) for i, (a, b) in enumerate(zip(self.prev, now))}
        keys = ("user", "nice", "system", "idle", "io_wait", "irq", "soft_irq")
        average = {k: round(sum(p[k] for p in per.values()) / max(1, len(per)), 2)
                   for k in keys}
        count, self.prev, self.switches = switches - self.switches, now, switches
        return {"average_usage": average, "usage_data": per, "context_switch_count": count}


def _cpu_shares(a, b) -> dict:
    fields = {"user": "user", "nice": "nice", "system": "system", "idle": "idle",
              "io_wait": "iowait", "irq": "irq", "soft_irq": "softirq"}
    diffs = {k: max(0.0, getattr(b, f, 0.0) - getattr(a, f, 0.0)) for k, f in fields.items()}
    spent = sum(max(0.0, x - y) for x, y in zip(b, a)) or 1.0
    return {k: round(100.0 * v / spent, 2) for k, v in diffs.items()}


class MemoryInfo(SystemGroup):
    """``memory_info``: the host's memory and swap."""

    def data(self) -> dict:
        vm, sw = psutil.virtual_memory(), psutil.swap_memory()
        return {"memory_total_bytes": vm.total, "memory_used_bytes": vm.total - vm.available,
                "swap_total_bytes": sw.total, "swap_used_bytes": sw.used}


SYSTEM_COLLECTORS = {"neuron_hw_counters": HwCounters, "vcpu_usage": VcpuUsage,
                     "memory_info": MemoryInfo}


# -- the objects every report carries ---------------------------------------------------

#: instance family -> (neuron_device_type, neuron_device_version, neuroncore_version)
_DEVICES = {"inf1": ("inferentia", "v1", "v1"), "inf2": ("inferentia2", "v3", "v2"),
            "trn1": ("trainium", "v2", "v2"), "trn2": ("trainium2", "v4", "v3")}


def instance_info(topo: topology.Topology) -> dict:
    """The instance as EC2's metadata would describe it; fields only EC2 knows are empty.
    The id is stable per host (from its name and machine id), so series keep their labels."""
    host = socket.gethostname()
    try:
        with open("/etc/machine-id") as f:
            machine = f.read().strip()
    except OSError:
        machine = ""
    digest = hashlib.sha256(f"{host}:{machine}".encode()).hexdigest()
    return {"instance_name": host, "instance_id": f"i-{digest[:17]}",
            "instance_type": topo.name, "instance_availability_zone": "",
            "instance_availability_zone_id": "", "instance_region": "", "ami_id": "",
            "subnet_id": "", "error": ""}


def hardware_info(topo: topology.Topology) -> dict:
    """The emulated devices: type, count, memory, cores per device, LNC."""
    family = topo.name.split(".")[0]
    kind, version, nc = _DEVICES.get(family, _DEVICES["trn1"])
    if family == "trn2" and topo.lnc > 1:
        nc = "v3d"
    return {"neuron_device_type": kind, "neuron_device_version": version,
            "neuroncore_version": nc, "neuron_device_count": topo.chips,
            "neuron_device_memory_size": topo.device_memory,
            "neuroncore_per_device_count": topo.cores_per_chip,
            "logical_neuroncore_config": topo.lnc, "error": ""}


def k8s_info(period: float) -> dict:
    """Which pods use which cores: only the kubelet knows, and off Kubernetes there is
    none, which the error says."""
    if os.path.exists(_KUBELET_SOCKET):
        error = ("neuronmp-monitor does not query the kubelet's pod resources API "
                 f"({_KUBELET_SOCKET})")
    else:
        error = (f"not running on Kubernetes: the kubelet's pod resources socket "
                 f"{_KUBELET_SOCKET} does not exist")
    return {"period": period, "neuroncores_k8s_info": {}, "neurondevices_k8s_info": {},
            "error": error}
