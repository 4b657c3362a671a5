"""``neuronmp-ls``: the emulated instance, its cores, and who holds each one.

    settings.get("topology") ---------------------------.
    reservation.core_states()  (holder records +     >--> table, or --json,
                                /proc/locks; no lock) '     or --json-output (neuron-ls's schema)

Never takes a lock and never creates the runtime directory, so it is safe to
run at any moment, even while other processes reserve and release cores.
Imports no torch: it starts in milliseconds.

``--json-output`` prints what the real ``neuron-ls --json-output`` prints (one
object per device), so tools that parse it (Ray, DJL Serving, scripts) can read
an emulated host; ``--install-tools DIR`` writes ``neuron-ls``, ``neuron-top`` and
``neuron-monitor`` commands that run this neuronmp, for tools that shell out to those
names.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import stat
import sys
import tempfile
from typing import Dict, List, Optional, Sequence, Set

from .. import __version__
from ..errors import NeuronmpError, UnsafeDirectoryError
from ..host import paths, reservation, settings, topology, visibility

#: the line that marks a command written by --install-tools (and so safe to replace)
_TOOL_MARK = "# written by neuronmp-ls --install-tools"
_TOOLS = {"neuron-ls": "neuronmp.cli.ls", "neuron-top": "neuronmp.cli.top",
          "neuron-monitor": "neuronmp.cli.monitor"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="neuronmp-ls",
        description="List the emulated NeuronCores (NEURONMP_TOPOLOGY), the CPUs backing "
        "each, and which process holds each core (runtime dir: NEURONMP_RUNTIME_DIR).",
    )
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print one JSON document")
    out.add_argument("-j", "--json-output", action="store_true",
                     help="print the devices as the real neuron-ls --json-output does")
    out.add_argument("--install-tools", metavar="DIR",
                     help="write neuron-ls, neuron-top and neuron-monitor commands for this "
                     "emulated host "
                     "into DIR (a PATH entry, or /opt/aws/neuron/bin where Ray looks)")
    # neuron-ls's other switches, so scripts that pass them keep working
    p.add_argument("-a", "--show-all-procs", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("-w", "--wide", action="store_true", help=argparse.SUPPRESS)
    return p


def inventory() -> dict:
    """Everything neuronmp-ls shows, as plain data."""
    topo = settings.get("topology")
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


# -- neuron-ls --json-output ----------------------------------------------------


def neuron_ls_devices(inv: Optional[dict] = None,
                      topo: Optional[topology.Topology] = None) -> List[dict]:
    """The host as the real ``neuron-ls --json-output`` prints it: one object per device.

    Keys, in the real tool's order: ``neuron_device``, ``bdf``, ``cpu_affinity``,
    ``numa_node`` (a string), ``connected_to`` (None on a one-device host),
    ``nc_count`` (logical cores), ``logical_neuroncore_config`` (only where logical
    cores are in play, as on trn2), ``memory_size`` (bytes), ``neuroncore_ids`` and
    ``neuron_processes`` (``pid``, ``command``, ``neuron_runtime_version`` of each
    process holding a core of the device).
    """
    topo = settings.get("topology") if topo is None else topo
    inv = inventory() if inv is None else inv
    nodes = _numa_nodes()
    return [_device(topo, chip, inv["cores"], nodes) for chip in range(topo.chips)]


def _device(topo: topology.Topology, chip: int, cores: Sequence[dict],
            nodes: Dict[int, Set[int]]) -> dict:
    ids = topo.cores_of_chip(chip)
    cpus = sorted({cpu for core in ids for cpu in topo.cpus_of(core)})
    links = topo.connected_to(chip)
    device = {
        "neuron_device": chip,
        "bdf": f"0000:{0x10 + chip // 32:02x}:{chip % 32:02x}.0",
        "cpu_affinity": _cpulist(cpus),
        "numa_node": _numa_node(cpus, nodes),
        "connected_to": None if links is None else list(links),
        "nc_count": len(ids),
    }
    if topo.lnc != 1 or topo.lnc_choices[0] != 1:
        device["logical_neuroncore_config"] = topo.lnc
    device["memory_size"] = topo.device_memory
    device["neuroncore_ids"] = list(ids)
    device["neuron_processes"] = _device_processes([cores[c] for c in ids])
    return device


def _device_processes(entries: Sequence[dict]) -> List[dict]:
    found: Dict[tuple, dict] = {}
    for entry in entries:
        h = entry["holder"]
        if entry["held"] and h is not None:
            found.setdefault((h["pid"], h.get("start")), {
                "pid": h["pid"], "command": h["command"],
                "neuron_runtime_version": __version__,
            })
    return list(found.values())


def _cpulist(cpus: Sequence[int]) -> str:
    """``0-3,8`` for (0, 1, 2, 3, 8), as the kernel and neuron-ls write CPU sets."""
    runs: List[List[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _parse_cpulist(text: str) -> Set[int]:
    out: Set[int] = set()
    for part in text.strip().split(","):
        if part:
            a, _, b = part.partition("-")
            out.update(range(int(a), int(b or a) + 1))
    return out


def _numa_nodes(base: str = "/sys/devices/system/node") -> Dict[int, Set[int]]:
    try:
        names = os.listdir(base)
    except OSError:
        return {}
    nodes = {}
    for name in names:
        m = re.fullmatch(r"node(\d+)", name)
        if not m:
            continue
        try:
            with open(os.path.join(base, name, "cpulist")) as f:
                nodes[int(m.group(1))] = _parse_cpulist(f.read())
        except (OSError, ValueError):
            continue
    return nodes


def _numa_node(cpus: Sequence[int], nodes: Dict[int, Set[int]]) -> str:
    # a PCI device reports -1 on a single-node host, as on a trn1.2xlarge
    if len(nodes) > 1:
        for node, members in sorted(nodes.items()):
            if set(cpus) <= members:
                return str(node)
    return "-1"


# -- --install-tools --------------------------------------------------------------


def install_tools(directory: str) -> List[str]:
    """Write ``neuron-ls``, ``neuron-top`` and ``neuron-monitor`` into ``directory``;
    return their paths.

    Each is a shell script that runs this interpreter (absolute path) on neuronmp's
    command with the caller's environment, so it shows the emulated host the caller
    configured.  neuronmp comes from the caller's ``sys.path`` first, else from where
    it was found now.  A file of the same name not written here (a real Neuron tool)
    is never replaced: FileExistsError.  A directory another user can write is
    refused (UnsafeDirectoryError) unless it is sticky and ours; directories made
    here are 0755 whatever the umask allows.
    """
    directory = os.path.abspath(directory)
    _make_dirs(directory)
    _check_directory(directory)
    targets = [os.path.join(directory, name) for name in _TOOLS]
    for path in targets:
        _refuse_foreign(path)
    for path in targets:
        _write_tool(path, _TOOLS[os.path.basename(path)])
    return targets


def _make_dirs(directory: str) -> None:
    """``directory`` and its missing parents, each at most 0755 (``os.makedirs`` under
    umask 000 made them 0777: anyone could then plant files in them)."""
    missing = []
    path = directory
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o755)
        except FileExistsError:
            pass


def _check_directory(directory: str) -> None:
    st = os.stat(directory)
    others_write = st.st_mode & 0o022
    sticky_and_ours = st.st_mode & stat.S_ISVTX and st.st_uid == os.geteuid()
    if others_write and not sticky_and_ours:
        raise UnsafeDirectoryError(directory, stat.S_IMODE(st.st_mode), st.st_uid)


def _refuse_foreign(path: str) -> None:
    if not os.path.lexists(path):
        return
    try:
        with open(path, errors="replace") as f:
            head = f.read(4096)
    except OSError:
        head = ""
    if _TOOL_MARK not in head:
        raise FileExistsError(
            f"refusing to replace {path}: it was not written by neuronmp-ls --install-tools "
            "(a real Neuron tool?); remove it or choose another directory")


def _write_tool(path: str, module: str) -> None:
    # the directory holding the neuronmp package, so the tool imports this copy of it
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = (f"import sys; sys.path.append({root!r}); "
            f"from {module} import main; sys.exit(main())")
    text = "\n".join([
        "#!/bin/sh",
        _TOOL_MARK,
        f"# {os.path.basename(path)} of an emulated Neuron host: runs {module} with this",
        "# interpreter and the caller's environment (NEURONMP_TOPOLOGY, NEURONMP_RUNTIME_DIR,",
        "# NEURON_LOGICAL_NC_CONFIG).",
        f'exec {shlex.quote(os.path.abspath(sys.executable))} -c {shlex.quote(code)} "$@"',
        "",
    ])
    # a fresh name made with O_CREAT|O_EXCL|O_NOFOLLOW (mkstemp), so nothing planted
    # under a guessable name is written through; the mode set on the descriptor, and
    # the finished file renamed over the target (replacing a link, never following it)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                               dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            os.fchmod(f.fileno(), 0o755)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _print_json_output() -> int:
    # on any failure the real tool prints nothing on stdout and exits 1
    try:
        text = json.dumps(neuron_ls_devices(), indent=4)
    except (NeuronmpError, OSError) as exc:
        print(f"neuron-ls: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(text)  # no trailing newline, like the real tool
    sys.stdout.flush()
    return 0


def _print_install(directory: str) -> int:
    try:
        written = install_tools(directory)
    except OSError as exc:
        print(f"neuronmp-ls: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(f"installed {path}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.json_output:
        return _print_json_output()
    if args.install_tools is not None:
        return _print_install(args.install_tools)
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
