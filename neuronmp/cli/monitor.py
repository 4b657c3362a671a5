"""``neuronmp-monitor`` (and ``neuron-monitor``): the Neuron SDK's monitoring stream for an
emulated host, one complete JSON report per line on stdout.

    -c FILE (monitorconf.py) --> groups, each with its period
    loop: sleep until a group is due --> monitordata.snapshot() (holders + pool counters,
          no lock) --> the due groups report the difference since their last report
          --> one report: neuron_runtime_data[] (per application), system_data,
              instance_info, neuron_hardware_info, neuron_k8s_info --> stdout
          --prometheus-port N: the same report as the SDK exporter's metrics (monitorprom.py)

Each report carries every configured group's latest data (a group not due this round
keeps its last), each with the period it measured and its error.  Applications are the
processes holding cores, keyed by pid, tagged by their ``NEURON_PROCESS_TAG`` (default: the
pid); one that exits is gone from the next report.  Reads only what the cores already
publish: it takes no core and no lock a worker waits on.  Imports no torch.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Dict, List, Optional, Sequence

from ..errors import MonitorConfigError, NeuronmpError
from ..host import settings
from . import monitorconf, monitordata

log = logging.getLogger(__name__)
_LEVELS = {0: logging.CRITICAL + 1, 1: logging.ERROR, 2: logging.WARNING, 3: logging.INFO,
           4: logging.DEBUG}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="neuronmp-monitor",
        description="Stream the emulated host's Neuron metrics as neuron-monitor does: one "
        "JSON report per line (runtime dir: NEURONMP_RUNTIME_DIR).")
    p.add_argument("-c", "--config-file", metavar="FILE",
                   help="a neuron-monitor JSON configuration file (default: every metric "
                   "group, every 5 s, every application)")
    p.add_argument("--verbose", type=_verbosity, nargs="?", const=1, default=0, metavar="0-4",
                   help="how much to log to stderr: 0 nothing (default) to 4 everything")
    p.add_argument("--prometheus-port", type=_port, metavar="PORT",
                   help="also serve the reports as the SDK exporter's Prometheus metrics on "
                   "this port (0: a free one, printed to stderr)")
    p.add_argument("--prometheus-address", default="127.0.0.1", metavar="ADDRESS",
                   help="the address the Prometheus endpoint listens on (default 127.0.0.1; "
                   "0.0.0.0 for every interface)")
    return p


def _verbosity(text: str) -> int:
    if text not in ("0", "1", "2", "3", "4"):
        raise argparse.ArgumentTypeError(f"invalid verbosity {text!r}: expected 0 to 4")
    return int(text)


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}: expected 0 to 65535")
    return int(text)


class _Scheduled:
    """One configured group: its collector, when it is due, its latest data."""

    def __init__(self, key: tuple, group: monitorconf.Group, collector, start: float):
        self.key = key   # ("runtime", entry index, type) or ("system", type)
        self.group = group
        self.collector = collector
        self.last = start
        self.due = start + group.period
        self.data = {}   # runtime: pid -> data; system: the data


class Monitor:
    """The report loop's state: the configuration, every group's collector and data."""

    def __init__(self, config: monitorconf.MonitorConfig, topo=None):
        self.config = config
        self.topo = settings.get("topology") if topo is None else topo
        self.start = time.monotonic()
        self.last_report = self.start
        self.groups: List[_Scheduled] = []
        for i, entry in enumerate(config.runtimes):
            for g in entry.groups:
                collector = monitordata.RUNTIME_COLLECTORS[g.type](self.topo)
                self.groups.append(_Scheduled(("runtime", i, g.type), g, collector, self.start))
        for g in config.system:
            collector = monitordata.SYSTEM_COLLECTORS[g.type](self.topo)
            self.groups.append(_Scheduled(("system", g.type), g, collector, self.start))
        self.instance = monitordata.instance_info(self.topo)
        self.hardware = monitordata.hardware_info(self.topo)
        # the baseline: what the cores had done before the monitor started is not reported
        first = monitordata.snapshot(self.topo)
        for s in self.groups:
            if s.key[0] == "runtime":
                s.collector.prev = first
                if isinstance(s.collector, monitordata.ExecutionStats):
                    s.collector.seen = {c: ((st.owner, st.owner_start), st.samples)
                                        for c, (st, _ring) in first.cores.items()}
        self.apps: Dict[int, monitordata.App] = {}

    def next_due(self) -> float:
        if not self.groups:   # nothing to collect: the objects every report carries, per period
            return self.last_report + self.config.period
        return min(s.due for s in self.groups)

    def round(self, now: Optional[float] = None) -> dict:
        """Collect the groups due now and return the consolidated report."""
        snap = monitordata.snapshot(self.topo)
        now = snap.t if now is None else now
        self.apps = snap.apps
        for s in self.groups:
            if s.due > now + 0.001:
                continue
            period = now - s.last
            if s.key[0] == "runtime":
                apps = [a for a in snap.apps.values()
                        if self.config.entry_for(a.tag) == s.key[1]]
                s.data = s.collector.collect(snap, apps, period)
            else:
                s.data = s.collector.collect(period)
            s.last = now
            s.due = max(s.due + s.group.period, now + s.group.period / 2)
            log.debug("collected %s over %.3f s", s.key, period)
        report = self.report(now)
        self.last_report = now
        return report

    def report(self, now: float) -> dict:
        runtimes = []
        for pid, app in sorted(self.apps.items()):
            entry = self.config.entry_for(app.tag)
            if entry is None:
                continue
            groups = {}
            for s in self.groups:
                if s.key[0] == "runtime" and s.key[1] == entry and pid in s.data:
                    groups[s.key[2]] = s.data[pid]
            runtimes.append({"pid": pid, "address": "", "neuron_runtime_tag": app.tag,
                             "error": "", "report": groups})
        system = {s.key[1]: s.data for s in self.groups if s.key[0] == "system" and s.data}
        return {"neuron_runtime_data": runtimes, "system_data": system,
                "instance_info": self.instance, "neuron_hardware_info": self.hardware,
                "neuron_k8s_info": monitordata.k8s_info(now - self.last_report)}


def _config(path: Optional[str]) -> monitorconf.MonitorConfig:
    return monitorconf.default() if path is None else monitorconf.load(path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=_LEVELS[args.verbose],
                        format="neuronmp-monitor: %(levelname)s %(message)s")
    try:
        config = _config(args.config_file)
        monitor = Monitor(config)
    except MonitorConfigError as exc:
        print(f"neuronmp-monitor: invalid configuration: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"neuronmp-monitor: cannot read the configuration file: {exc}", file=sys.stderr)
        return 2
    except NeuronmpError as exc:
        print(f"neuronmp-monitor: {exc}", file=sys.stderr)
        return 2
    exporter = None
    try:
        if args.prometheus_port is not None:
            from .monitorprom import Exporter

            exporter = Exporter(args.prometheus_address, args.prometheus_port)
            print(f"neuronmp-monitor: Prometheus metrics on http://{exporter.address}/metrics",
                  file=sys.stderr, flush=True)
        while True:
            time.sleep(max(0.0, monitor.next_due() - time.monotonic()))
            report = monitor.round()
            if exporter is not None:
                exporter.update(report)
            sys.stdout.write(json.dumps(report, separators=(",", ":")) + "\n")
            sys.stdout.flush()
    except OSError as exc:
        if isinstance(exc, BrokenPipeError):   # `neuronmp-monitor | head`
            sys.stderr.close()
            return 0
        print(f"neuronmp-monitor: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        if exporter is not None:
            exporter.close()


if __name__ == "__main__":
    sys.exit(main())
