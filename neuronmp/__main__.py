"""``python -m neuronmp``: the main demo on the emulated default host.

For now it prints the emulated host's cores and this process's view of them.
"""
from __future__ import annotations

import sys

from . import topology, visibility


def main() -> int:
    topo = topology.from_env()
    vis = visibility.candidate_blocks(visibility.request_from_env(topo), topo.num_cores)[0]
    print(f"emulated host: {topo.name}, {topo.chips} chip(s) x {topo.cores_per_chip} core(s)")
    for core in range(topo.num_cores):
        local = f"nc:{vis.index(core)}" if core in vis else "-"
        cpus = ",".join(map(str, topo.cpus_of(core)))
        print(f"  core {core:3d}  chip {topo.chip_of(core):2d}  cpus {cpus:8s}  local {local}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
