"""``python -m neuronmp``: the main demo on the emulated default host.

For now it prints the emulated host's cores and this process's view of them.
"""
from __future__ import annotations

import sys

from . import runtime


def main() -> int:
    rt = runtime.get_runtime()  # reserves this process's cores, like nrt_init
    topo, vis = rt.topology, rt.cores
    print(f"emulated host: {topo.name}, {topo.chips} chip(s) x {topo.cores_per_chip} core(s)")
    for core in range(topo.num_cores):
        local = f"nc:{vis.index(core)}" if core in vis else "-"
        cpus = ",".join(map(str, topo.cpus_of(core)))
        print(f"  core {core:3d}  chip {topo.chip_of(core):2d}  cpus {cpus:8s}  local {local}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
