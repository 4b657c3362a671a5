"""``neuronmp-ls``: the emulated instance, its cores, and who holds each one.

    topology.from_env() ----------------------------.
    reservation.core_states()  (holder records +     >--> table, or --json
                                /proc/locks; no lock) '

Never takes a lock and never creates the runtime directory, so it is safe to
run at any moment, even while other processes reserve and release cores.
Imports no torch: it starts in milliseconds.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional, Sequence

from .. import paths, reservation, topology, visibility
from ..errors import NeuronmpError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="neuronmp-ls",
        description="List the emulated NeuronCores (NEURONMP_TOPOLOGY), the CPUs backing "
        "each, and which process holds each core (runtime dir: NEURONMP_RUNTIME_DIR).",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document")
    return p


def inventory() -> dict:
    """Everything neuronmp-ls shows, as plain data."""
    topo = topology.from_env()
    base = paths.existing_runtime_dir()
    if base is None:
        states = [reservation.CoreState(c, False, None) for c in range(topo.num_cores)]
    else:
        states = reservation.core_states(topo.num_cores, base=base)
    cores = []
    for s in states:
        entry = s.to_dict()
        entry["chip"] = topo.chip_of(s.core)
        entry["cpus"] = list(topo.cpus_of(s.core))
        cores.append(entry)
    return {
        "topology": topo.to_dict(),
        "runtime_dir": base or paths.configured_runtime_dir(),
        "held": sum(1 for s in states if s.held),
        "free": sum(1 for s in states if not s.held),
        "cores": cores,
        "holders": _holders(states),
    }


def _holders(states: Sequence[reservation.CoreState]) -> List[dict]:
    by_pid = {}
    for s in states:
        if s.held and s.holder is not None:
            h = by_pid.setdefault(s.holder.pid, {**s.holder.to_dict(), "cores": []})
            h["cores"].append(s.core)
    return sorted(by_pid.values(), key=lambda h: h["cores"][0])


def _short(command: str, width: int = 60) -> str:
    return command if len(command) <= width else command[: width - 3] + "..."


def render(inv: dict) -> str:
    """The human-readable table."""
    t = inv["topology"]
    lines = [
        f"emulated instance: {t['name']}  {t['chips']} chip(s) x {t['cores_per_chip']} "
        f"core(s) = {t['num_cores']} NeuronCores  ({inv['held']} held, {inv['free']} free)",
        f"runtime dir: {inv['runtime_dir']}",
        "",
        f"{'CORE':>4}  {'CHIP':>4}  {'CPUS':<12} HOLDER",
    ]
    for c in inv["cores"]:
        cpus = ",".join(map(str, c["cpus"]))
        if not c["held"]:
            who = "-"
        elif c["holder"] is None:
            who = "held (holder unknown)"
        else:
            who = f"pid {c['holder']['pid']}  {_short(c['holder']['command'])}"
        lines.append(f"{c['core']:>4}  {c['chip']:>4}  {cpus:<12} {who}")
    if inv["holders"]:
        lines.append("")
        for h in inv["holders"]:
            cores = visibility.span(h["cores"], "nc")
            lines.append(f"pid {h['pid']} holds {cores}: {h['command']}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        inv = inventory()
    except NeuronmpError as exc:
        print(f"neuronmp-ls: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(inv, indent=2))
    else:
        print(render(inv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
