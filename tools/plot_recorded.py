"""Redraw every plot of docs/performance.md from the recorded figures.

    docs/data/<name>.json --tools/plotting.draw--> docs/img/<name>.png

The JSON files hold the figures the tables of docs/performance.md give (with the
date, machine and command in their ``source``); the benchmarks' ``--plot`` option
draws a fresh run's figures through the same code.  Needs matplotlib (the ``bench``
extra).

    python tools/plot_recorded.py [--data docs/data] [--out docs/img]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plotting  # noqa: E402  (tools/ is not a package)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=os.path.join(ROOT, "docs", "data"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "img"))
    args = ap.parse_args(argv)
    names = sorted(n for n in os.listdir(args.data) if n.endswith(".json"))
    if not names:
        raise SystemExit(f"no recorded figures (*.json) in {args.data}")
    os.makedirs(args.out, exist_ok=True)
    for name in names:
        with open(os.path.join(args.data, name)) as f:
            fig = json.load(f)
        path = os.path.join(args.out, name[:-len(".json")] + ".png")
        plotting.draw(fig, path)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
