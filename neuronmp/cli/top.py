"""``neuronmp-top``: a live view of every NeuronCore on the host, refreshed each second.

    reservation.core_states()  (holder records + /proc/locks; no lock) --.
    pool statistics segments   (<runtime dir>/shm, per-core counters) ---+--> frame
        sample t0 ... sleep --interval ... sample t1: deltas -> req/s, busy %

Per core: the holder process, its worker's pid, requests per second (requests
the core's worker completed; a batching server's batch is one request), requests
in flight, busy % (time the worker spent running requests), and cumulative
requests, errors and worker restarts.  ``--once`` prints one frame (measured over
one interval) and exits; ``--json`` prints the frame as JSON.  Like neuronmp-ls it
takes no lock, creates nothing, and imports no torch.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Dict, Optional, Sequence

from ..errors import NeuronmpError
from ..host import paths, reservation, settings, topology
from ..pool.stats import read_all as read_core_counters

_CLEAR = "\x1b[H\x1b[2J"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="neuronmp-top",
        description="Live per-NeuronCore view of this host: holder process, requests/s, "
        "in flight, busy %%, errors (runtime dir: NEURONMP_RUNTIME_DIR).",
    )
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--json", action="store_true",
                   help="print frames as JSON (one document per line when live)")
    p.add_argument("--interval", type=_positive, default=1.0, metavar="SECONDS",
                   help="seconds between frames, and the window of the rates (default 1)")
    p.add_argument("--all", action="store_true",
                   help="also list cores nobody holds (default: held cores, or all if none)")
    return p


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(
            f"invalid interval {text!r}: expected a number of seconds > 0, such as 0.5")
    return value


def sample(num_cores: int) -> dict:
    """One reading: holders and raw counters of every core, with a timestamp."""
    base = paths.existing_runtime_dir()
    if base is None:
        states = [reservation.CoreState(c, False, None) for c in range(num_cores)]
        counters: Dict[int, object] = {}
    else:
        states = reservation.core_states(num_cores, base=base)
        shm = paths.shm_dir(base, create=False)
        counters = read_core_counters(shm) if shm is not None else {}
    return {"t": time.monotonic(), "states": states, "counters": counters, "dir": base}


def frame(topo: topology.Topology, before: dict, after: dict) -> dict:
    """The view between two samples, as plain data."""
    dt = max(after["t"] - before["t"], 1e-9)
    cores = []
    for st in after["states"]:
        c = after["counters"].get(st.core)
        p = before["counters"].get(st.core)
        same = p is not None and c is not None and p.owner == c.owner
        entry = {
            "core": st.core,
            "chip": topo.chip_of(st.core),
            "held": st.held,
            "holder": st.holder.to_dict() if st.holder else None,
            "worker_pid": c.pid if c else None,
            "requests": c.done if c else 0,
            "in_flight": c.in_flight if c else 0,
            "errors": c.errors if c else 0,
            "restarts": c.restarts if c else 0,
            "requests_per_s": (c.done - p.done) / dt if same else 0.0,
            "busy_pct": min(100.0, 100.0 * (c.busy_ns - p.busy_ns) / (dt * 1e9)) if same else 0.0,
        }
        cores.append(entry)
    return {
        "topology": topo.to_dict(),
        "runtime_dir": after["dir"],
        "interval": dt,
        "held": sum(1 for e in cores if e["held"]),
        "requests_per_s": sum(e["requests_per_s"] for e in cores),
        "cores": cores,
    }


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def render(view: dict, show_all: bool = False) -> str:
    """The human-readable frame."""
    t = view["topology"]
    lines = [
        f"neuronmp-top  {time.strftime('%H:%M:%S')}  {t['name']}: {t['num_cores']} NeuronCores, "
        f"{view['held']} held  {view['requests_per_s']:.0f} req/s "
        f"(over {view['interval']:.1f} s)",
        "",
        f"{'CORE':>4} {'PID':>7} {'WORKER':>7} {'REQ/S':>9} {'INFLT':>5} {'BUSY%':>6} "
        f"{'REQUESTS':>10} {'ERRORS':>6} {'RESTART':>7}  COMMAND",
    ]
    rows = [e for e in view["cores"] if e["held"] or e["worker_pid"]]
    if show_all or not rows:
        rows = view["cores"]
    for e in rows:
        h = e["holder"]
        pid = str(h["pid"]) if h else ("?" if e["held"] else "-")
        cmd = _short(h["command"], 60) if h else ("" if e["held"] else "free")
        worker = str(e["worker_pid"]) if e["worker_pid"] else "-"
        lines.append(
            f"{e['core']:>4} {pid:>7} {worker:>7} {e['requests_per_s']:>9.1f} "
            f"{e['in_flight']:>5} {e['busy_pct']:>6.1f} {e['requests']:>10} "
            f"{e['errors']:>6} {e['restarts']:>7}  {cmd}"
        )
    return "\n".join(lines)


def _emit(view: dict, args, live: bool) -> None:
    if args.json:
        text = json.dumps(view, separators=(",", ":")) if live else json.dumps(view, indent=2)
    else:
        text = render(view, args.all)
        if live and sys.stdout.isatty():
            text = _CLEAR + text
        elif live:
            text += "\n"
    print(text, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        topo = settings.get("topology")
        before = sample(topo.num_cores)
        while True:
            time.sleep(args.interval)
            after = sample(topo.num_cores)
            _emit(frame(topo, before, after), args, live=not args.once)
            if args.once:
                return 0
            before = after
    except NeuronmpError as exc:
        print(f"neuronmp-top: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # `neuronmp-top | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
