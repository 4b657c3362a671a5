"""The benchmarks' plots, drawn one way for a fresh run and for the recorded figures.

    tools/bench_ipc.py --plot P ------\
    tools/bench_devtime.py --plot P ---+--> figure dict --> draw(fig, P) --> P (PNG)
    tools/bench_http.py --plot P -----/         |                 + P.json beside it
    tools/plot_recorded.py: docs/data/*.json ---/ --> docs/img/<name>.png

A figure dict is plain JSON: ``kind`` (``ring``, ``devtime`` or ``serving``), a
``title``, a ``source`` line (date, machine, command) printed under the plot, and
the figures.  A figure is a number or a ``[low, high]`` range over runs; a range is
drawn as its middle with a bar spanning it.  matplotlib (the ``bench`` extra) is
imported only when a plot is drawn.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
from typing import Any, Dict, List, Sequence, Tuple, Union

Figure = Union[float, Sequence[float]]


def source(argv: Sequence[str]) -> str:
    """The date, this machine and the exact command, for a fresh run's figure."""
    model = next((ln.split(":", 1)[1].strip() for ln in _cpuinfo() if ln.startswith("model name")),
                 platform.machine())
    try:
        import torch
        versions = f"Python {platform.python_version()}, torch {torch.__version__}"
    except ImportError:
        versions = f"Python {platform.python_version()}"
    day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return (f"measured {day}, {os.cpu_count()} CPUs ({model}, Linux {platform.release()}), "
            f"{versions}, load average {os.getloadavg()[0]:.1f}; python "
            + " ".join([os.path.relpath(sys.argv[0])] + list(argv)))


def _cpuinfo() -> List[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read().splitlines()
    except OSError:
        return []


def ring_figure(results: Dict[int, Dict[str, Any]], label, argv: Sequence[str]) -> Dict[str, Any]:
    """tools/bench_ipc.py's results ({size: {kind: (echo seconds, bytes/s)}}) as a figure."""
    return {"kind": "ring", "source": source(argv),
            "title": "Shared-memory rings against multiprocessing.Pipe and "
                     "torch.multiprocessing.Queue",
            "labels": {"ring": "neuronmp ring", "pipe": "multiprocessing.Pipe",
                       "queue": "torch.multiprocessing.Queue", "memcpy": "memcpy (limit)"},
            "echo_p50_us": {label(n): {k: statistics.median(v[0]) * 1e6 for k, v in row.items()
                                       if k != "memcpy"} for n, row in results.items()},
            # throughput means little for small frames: their cost is the hand-off
            "one_way_gbps": {label(n): {k: v[1] / 1e9 for k, v in row.items()}
                             for n, row in results.items() if n >= 1 << 20}}


def devtime_figure(rows: List[Dict[str, Any]], cost_us: float, callers: int,
                   argv: Sequence[str]) -> Dict[str, Any]:
    """tools/bench_devtime.py's rows (one per core count) as a figure."""
    share = [r["dpasync"] / r["ceiling"] for r in rows]
    floors = []
    for r in rows:
        f = r["floor"]
        floors.append(cost_us / (cost_us + f["puts"] + f["books"] + f["split"]
                                 + max(0.0, f["late"])))
    return {"kind": "devtime", "source": source(argv),
            "title": f"DataParallel on device-time cores ({cost_us / 1000:g} ms per batch "
                     f"of 32 rows)",
            "cores": [r["cores"] for r in rows], "cost_us": cost_us, "rows_per_batch": 32,
            "series": {"DataParallel, 1 calling thread": [r["dp1"] / r["ceiling"] for r in rows],
                       f"DataParallel, {callers} calling threads": share},
            "bounds": {"1-thread floor (a bound, not a run)": floors}}


def serving_figure(rows: List[Dict[str, Any]], formats: Dict[str, str],
                   argv: Sequence[str]) -> Dict[str, Any]:
    """tools/bench_http.py's median rows (server, codec, clients, rps, p99_ms) as a figure."""
    series: Dict[str, Dict[str, List[float]]] = {}
    clients = sorted({r["clients"] for r in rows})
    for r in sorted(rows, key=lambda r: r["clients"]):
        name = f"{r['server']}, {formats.get(r['codec'], r['codec'])}"
        s = series.setdefault(name, {"clients": [], "rps": [], "p99_ms": []})
        s["clients"].append(r["clients"])
        s["rps"].append(r["rps"])
        s["p99_ms"].append(r.get("p99_ms"))
    return {"kind": "serving", "source": source(argv), "clients": clients, "series": series,
            "title": "neuronmp-serve against other servers: one-sample MLP requests"}


def save(fig: Dict[str, Any], path: str) -> str:
    """Draw ``fig`` to the PNG ``path`` and keep its figures in ``path`` + ``.json``."""
    draw(fig, path)
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        json.dump(fig, f, indent=1)
    return path


def draw(fig: Dict[str, Any], path: str) -> None:
    """Draw the figure dict ``fig`` into the PNG ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = {"ring": _ring, "devtime": _devtime, "serving": _serving}
    if fig.get("kind") not in kinds:
        raise ValueError(f"figure kind {fig.get('kind')!r}: accepted {sorted(kinds)}")
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    kinds[fig["kind"]](fig, axes)
    figure.suptitle(fig["title"], fontsize=12)
    figure.text(0.5, 0.01, fig.get("source", ""), ha="center", fontsize=7.5, color="0.35",
                wrap=True)
    figure.tight_layout(rect=(0, 0.06, 1, 0.95))
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _mid_err(values: Sequence[Figure]) -> Tuple[List[float], List[List[float]]]:
    """Middles of figures and ranges, and the error bars (below, above) of the ranges."""
    mids, below, above = [], [], []
    for v in values:
        lo, hi = (v, v) if isinstance(v, (int, float)) else (min(v), max(v))
        mid = (lo + hi) / 2
        mids.append(mid)
        below.append(mid - lo)
        above.append(hi - mid)
    return mids, [below, above]


def _number(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def _bars(ax, groups: Dict[str, Dict[str, float]], kinds: List[str],
          labels: Dict[str, str]) -> None:
    """Grouped bars: one group per key of ``groups``, one bar per kind, values printed."""
    width = 0.8 / len(kinds)
    names = list(groups)
    for i, kind in enumerate(kinds):
        xs = [g + (i - (len(kinds) - 1) / 2) * width for g in range(len(names))]
        vals = [groups[n].get(kind) for n in names]
        shown = [(x, v) for x, v in zip(xs, vals) if v is not None]
        if not shown:
            continue
        bars = ax.bar([x for x, _ in shown], [v for _, v in shown], width,
                      label=labels.get(kind, kind), color=f"C{i}")
        ax.bar_label(bars, labels=[_number(v) for _, v in shown], fontsize=7, padding=1)
    ax.set_xticks(range(len(names)), names)
    ax.legend(fontsize=8, loc="upper left")


def _ring(fig, axes) -> None:
    labels = fig.get("labels", {})
    echo = fig["echo_p50_us"]
    kinds = [k for k in ("ring", "pipe", "queue") if any(k in v for v in echo.values())]
    _bars(axes[0], echo, kinds, labels)
    axes[0].set_yscale("log")
    axes[0].set_ylim(top=axes[0].get_ylim()[1] * 30)   # room for the legend
    axes[0].set_ylabel("echo round trip, p50 (microseconds, log scale)")
    axes[0].set_xlabel("message size")
    axes[0].set_title("Latency: lower is better", fontsize=10)
    tput = fig["one_way_gbps"]
    kinds = [k for k in ("ring", "pipe", "queue", "memcpy") if any(k in v for v in tput.values())]
    _bars(axes[1], tput, kinds, labels)
    axes[1].set_ylim(top=axes[1].get_ylim()[1] * 1.5)
    axes[1].set_ylabel("one-way throughput (GB/s)")
    axes[1].set_xlabel("message size")
    axes[1].set_title("Throughput: higher is better", fontsize=10)


def _devtime(fig, axes) -> None:
    cores = fig["cores"]
    per_core = fig["rows_per_batch"] / (fig["cost_us"] * 1e-6)
    ceiling = [n * per_core for n in cores]
    axes[0].plot(cores, ceiling, "k--", label="exact ceiling (cores / modelled time)")
    for i, (name, values) in enumerate(fig["series"].items()):
        mids, err = _mid_err(values)
        rows = [m * c for m, c in zip(mids, ceiling)]
        axes[0].errorbar(cores, rows, yerr=[[e * c for e, c in zip(err[0], ceiling)],
                                            [e * c for e, c in zip(err[1], ceiling)]],
                         marker="o", capsize=3, label=name, color=f"C{i}")
        axes[1].errorbar(cores, mids, yerr=err, marker="o", capsize=3, label=name,
                         color=f"C{i}")
    lowest = min(_mid_err(v)[0][i] for v in fig["series"].values() for i in range(len(cores)))
    for name, values in fig.get("bounds", {}).items():   # a limit, not a throughput
        axes[1].plot(cores, _mid_err(values)[0], color="0.5", linestyle=":", marker="x",
                     label=name)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(cores, [str(c) for c in cores])
        ax.set_xlabel("emulated NeuronCores")
        ax.legend(fontsize=8, loc="lower left")
    axes[0].legend(fontsize=8, loc="upper left")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("rows per second (log scale)")
    axes[0].set_title("Throughput against the ceiling", fontsize=10)
    axes[1].axhline(1.0, color="k", linestyle="--", linewidth=1)
    axes[1].set_ylim(max(0.0, round(lowest - 0.15, 1)), 1.03)
    axes[1].set_ylabel("share of the exact ceiling")
    axes[1].set_title("Share of the ceiling: 1.0 is perfect scaling", fontsize=10)


def _serving(fig, axes) -> None:
    clients = fig["clients"]
    for i, (name, s) in enumerate(fig["series"].items()):
        style = dict(marker="o", color=f"C{i}", label=name,
                     linestyle="-" if name.startswith("neuronmp") else ":")
        xs = s.get("clients", clients)
        axes[0].plot(xs, s["rps"], **style)
        axes[1].plot(xs, s["p99_ms"], **style)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(clients, [str(c) for c in clients])
        ax.set_xlabel("concurrent clients")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("requests per second")
    axes[0].set_title("Throughput: higher is better", fontsize=10)
    axes[1].set_yscale("log")
    axes[1].set_ylabel("p99 latency (ms, log scale)")
    axes[1].set_title("Tail latency: lower is better", fontsize=10)
