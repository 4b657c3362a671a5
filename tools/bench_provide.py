#!/usr/bin/env python3
"""What the NEURONMP_PROVIDE start-up hook costs every Python process.

neuronmp installs ``_neuronmp_provide.pth`` into site-packages, so every interpreter
start runs its one line.  This measures, in a throwaway venv (system site-packages
visible, so start-up reads the same .pth files as a real one), whole-process
``python -c pass``:

  * A: without the hook's .pth;
  * B: with it, NEURONMP_PROVIDE unset (the case every Python start pays);
  * C: with it, NEURONMP_PROVIDE=torch_neuronx (the finder installed; nothing imported
    beyond the standard library until ``import torch_neuronx``).

Runs alternate A, B, C so that load on the machine hits all three alike; the
table gives the median and the fastest run of each, wall and CPU time, and the CPU
ratio to A.  A second table times what ``site`` does with the .pth file alone
(``site.addpackage``: open, read, compile and run its line), which is what B - A
estimates without process noise.

    python tools/bench_provide.py [--runs N]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import timeit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTH = "_neuronmp_provide.pth"


def _venv(where: str) -> tuple:
    """A venv seeing this interpreter's site-packages; (python, its site-packages)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages",
                    where], check=True)
    python = os.path.join(where, "bin", "python")
    site = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    shutil.copy(os.path.join(ROOT, "_neuronmp_provide.py"), site)
    return python, site


def _start(python: str, env: dict) -> tuple:
    """(wall seconds, CPU seconds) of one ``python -c pass``."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([python, "-c", "pass"], env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"python -c pass exited {proc.returncode}")
    return wall, usage.ru_utime + usage.ru_stime


def measure(runs: int) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("NEURONMP_PROVIDE", "PYTHONPATH")}
    times = {"A": [], "B": [], "C": []}
    with tempfile.TemporaryDirectory(prefix="nmp-bench-provide-") as tmp:
        python, site = _venv(os.path.join(tmp, "venv"))
        on, off = os.path.join(site, PTH), os.path.join(site, PTH + ".off")
        shutil.copy(os.path.join(ROOT, PTH), off)
        for _ in range(3):   # warm the page cache
            _start(python, base)
        for _ in range(runs):
            os.replace(on, off) if os.path.exists(on) else None
            times["A"].append(_start(python, base))
            os.replace(off, on)
            times["B"].append(_start(python, base))
            times["C"].append(_start(python, dict(base, NEURONMP_PROVIDE="torch_neuronx")))
    return times


def in_process() -> dict:
    """Microseconds of what site does with the .pth at start-up (open, read, compile,
    run its line: ``site.addpackage``), NEURONMP_PROVIDE unset and set."""
    import site

    sys.path.insert(0, ROOT)
    import _neuronmp_provide  # noqa: F401  (cached, as after the first .pth run)

    saved = os.environ.pop("NEURONMP_PROVIDE", None)
    n = 5000
    try:
        unset = timeit.timeit(lambda: site.addpackage(ROOT, PTH, set()), number=n) / n * 1e6
        os.environ["NEURONMP_PROVIDE"] = "torch_neuronx"
        set_ = timeit.timeit(lambda: site.addpackage(ROOT, PTH, set()), number=n) / n * 1e6
    finally:
        _neuronmp_provide.install("")
        os.environ.pop("NEURONMP_PROVIDE", None)
        if saved is not None:
            os.environ["NEURONMP_PROVIDE"] = saved
    return {"unset": unset, "set": set_}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=60, help="runs of each variant (default 60)")
    runs = ap.parse_args().runs
    times = measure(runs)
    print(f"python -c pass, {runs} runs each, interleaved (ms; CPU = the child's user+sys)")
    print(f"{'variant':<42} {'wall p50':>9} {'wall min':>9} {'CPU p50':>8} {'CPU min':>8} "
          f"{'CPU p50/A':>10}")
    labels = {"A": "A  no hook", "B": "B  hook, NEURONMP_PROVIDE unset",
              "C": "C  hook, NEURONMP_PROVIDE=torch_neuronx"}
    a_cpu = statistics.median(c for _, c in times["A"])
    for key, label in labels.items():
        wall = [w for w, _ in times[key]]
        cpu = [c for _, c in times[key]]
        print(f"{label:<42} {statistics.median(wall) * 1e3:9.2f} {min(wall) * 1e3:9.2f} "
              f"{statistics.median(cpu) * 1e3:8.2f} {min(cpu) * 1e3:8.2f} "
              f"{statistics.median(cpu) / a_cpu:10.3f}")
    cost = in_process()
    print()
    print("site.addpackage of the .pth alone, in-process (us per interpreter start)")
    print(f"{'NEURONMP_PROVIDE unset':<44} {cost['unset']:8.2f}")
    print(f"{'NEURONMP_PROVIDE=torch_neuronx (module cached)':<44} {cost['set']:8.2f}")


if __name__ == "__main__":
    main()
