"""Run TorchNeuron's own test suite against neuronmp's emulated ``neuron`` device.

    python tools/conformance.py PATH_TO_SUITE [--dirs device storage ...] [--timeout S]
                                [--venv DIR] [--json] [--exclusions FILE]

PATH_TO_SUITE is a copy of TorchNeuron's repository that the user fetched: neuronmp
never downloads or bundles it.  It may be a checkout (a plain directory holding
``tests/``) or a git directory without a work tree, whose ``HEAD`` is extracted with
``git archive``.  Only the suite's ``conftest.py``, ``tests/`` and pytest settings are
copied to a scratch directory, never its ``torch_neuronx/`` package, so
``import torch_neuronx`` finds neuronmp's stand-in.

Each directory of ``tests/`` (``distributed``'s subdirectories one by one) runs in its
own pytest process under ``--timeout`` seconds, with the environment the suite's
conftest sets on hardware: ``NEURONMP_PROVIDE=torchneuron``, ``NEURON_RT_NUM_CORES=1``,
``TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS=1`` (``0`` for ``cpu_fallback``, as
the suite's parallel runner does), the scratch directory on ``PYTHONPATH`` (the tests
import ``tests.…``); the host the suite's runner assumes (``NEURONMP_TOPOLOGY``
:data:`HOST` unless the user set it) and a runtime directory of the run's own (unless
``NEURONMP_RUNTIME_DIR`` is set), so cores other neuronmp processes hold are not
asked for.  The files in :data:`TORCHRUN` run under
``torchrun --nproc-per-node 2``; a test there counts as passed only if both ranks
passed it.  The files in :data:`ALONE` run in a pytest process of their own, as the
suite's runner runs them, with what it sets for them (the lnc1 file: LNC=1 and every
core of a trn2.48xlarge, unless ``NEURONMP_TOPOLOGY`` names another host).  A small
pytest plugin of this tool records each test's outcome (junit XML cannot tell an
unexpected pass from a pass), and the table gives per directory:
collected, passed, failed, errors, skipped, expected failures (xfail) and expected
failures that now pass (XPASS).

Excluded tests: ``tools/conformance-exclusions.txt``, one path (relative to the suite's
root, such as ``tests/nki``) or pytest node id per line, then `` # reason``.  A
directory excluded whole is not run; a file is ``--ignore``d, a node id
``--deselect``ed.  The list is printed after the table.

The virtualenv: made with ``torch==2.13.0``, this project (installed editable from
this checkout, so a later run tests the checkout's code as it is then, not a copy of
an earlier day's), and the pins the suite needs (:data:`PINS`), under
``$XDG_CACHE_HOME/neuronmp/conformance-venv`` unless ``--venv`` names one; an existing
one is reused (``--venv .venv`` reuses a development environment).  A reused default
virtualenv whose ``neuronmp`` is not this checkout's gets this checkout installed
again; a ``--venv`` that imports another checkout's is refused, naming both.

``--forked``: the suite's runners use ``pytest --forked`` (every test in a fork of the
collecting process).  pytest-forked 1.7.5 fails under pytest 9 (each child exits with
status 3, even for a trivial test), so the made virtualenv pins pytest 8.4.2, with which
it works, and tests run forked as on hardware.  A reused virtualenv without
pytest-forked, or with pytest 9, runs them without ``--forked`` (said in the output):
the tests of one directory then share one process and its device.  Forked, the
per-test timeout (``--test-timeout``) bounds the test function, in its fork
(pytest-timeout's ``timeout_func_only``): a test past it fails and the directory goes
on; its fixtures are bounded by the directory's ``--timeout``.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXCLUSIONS = ROOT / "tools" / "conformance-exclusions.txt"
TORCH = "2.13.0"
#: what the suite imports beyond torch and torch_neuronx, and the pytest that runs
#: pytest-forked 1.7.5 (see the module's docstring); collective_ops' fixtures ask for
#: pytest-xdist's worker_id even when run without -n
PINS = ("pytest==8.4.2", "pytest-forked==1.7.5", "pytest-timeout==2.4.0", "pytest-xdist",
        "expecttest", "hypothesis", "numpy", "filelock", "PyYAML")
#: the emulated host unless NEURONMP_TOPOLOGY names one
HOST = "trn2.48xlarge"
#: files that the suite runs as ranks of one job
TORCHRUN = ("tests/distributed/process_group/test_process_group_neuron.py",)
#: files the suite's runner (tools/run-test-parallel) runs by themselves, with what it
#: changes in their environment (None: unset); its conftest gives a file the logical
#: core size and all the cores it asks for only when nothing else runs with it
ALONE: Dict[str, Dict[str, Optional[str]]] = {
    "tests/device/test_device_lnc1_all_cores.py": {"NEURON_LOGICAL_NC_CONFIG": "1",
                                                   "NEURON_RT_NUM_CORES": None},
}
#: the host an ALONE file assumes (128 logical cores at LNC=1), unless the user chose one
ALONE_TOPOLOGY = "trn2.48xlarge"
#: directories of tests/ whose subdirectories are reported one by one
SPLIT = ("distributed",)
#: what is copied from a checkout (the suite's own package is not: see above)
COPIED = ("conftest.py", "tests", "pytest.ini", "pyproject.toml", "setup.cfg", "tox.ini")
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
#: a test seen twice (setup and call, or two ranks) keeps the worst outcome
_RANK = {"error": 5, "failed": 4, "xpassed": 3, "passed": 2, "xfailed": 1, "skipped": 0}

_PLUGIN = '''
"""Records each test's outcome for tools/conformance.py (one JSON line each)."""
import json, os

_OUT = os.environ["CONFORMANCE_RESULTS"] + "." + os.environ.get("RANK", "0") + ".jsonl"


def _write(record):
    with open(_OUT, "a") as f:
        f.write(json.dumps(record) + "\\n")


def pytest_collection_finish(session):
    _write({"collected": len(session.items)})


def pytest_collectreport(report):
    if report.failed:
        _write({"nodeid": report.nodeid, "outcome": "error", "when": "collect"})


def pytest_runtest_logreport(report):
    xfail = hasattr(report, "wasxfail")
    if report.when == "call":
        if report.failed and "XPASS(strict)" in str(report.longrepr):
            outcome = "xpassed"
        else:
            outcome = {"passed": "xpassed" if xfail else "passed", "failed": "failed",
                       "skipped": "xfailed" if xfail else "skipped"}[report.outcome]
    elif report.failed:
        outcome = "error"
    elif report.skipped:
        outcome = "xfailed" if xfail else "skipped"
    else:
        return
    _write({"nodeid": report.nodeid, "outcome": outcome, "when": report.when})
'''


class ConformanceError(Exception):
    """The suite, the virtualenv or an option cannot be used (exit status 2)."""


# -- the suite -------------------------------------------------------------------------


def is_git_dir(path: pathlib.Path) -> bool:
    """A git directory without a work tree (bare, or a ``.git`` given itself)."""
    return (path / "HEAD").is_file() and (path / "objects").is_dir() and not (
        path / "tests").is_dir()


def extract(suite: pathlib.Path, scratch: pathlib.Path) -> Optional[str]:
    """The suite's tests copied into ``scratch``; its commit, when it is known."""
    if not suite.is_dir():
        raise ConformanceError(f"{suite} is not a directory: give a checkout of TorchNeuron's "
                               "repository or its git directory")
    if is_git_dir(suite):
        git = ["git", f"--git-dir={suite}"]
        names = subprocess.run(git + ["ls-tree", "--name-only", "HEAD"], capture_output=True,
                               text=True, check=False)
        if names.returncode != 0:
            raise ConformanceError(f"{suite}: git cannot read it: {names.stderr.strip()}")
        wanted = [n for n in COPIED if n in names.stdout.split()]
        if "tests" not in wanted:
            raise ConformanceError(f"{suite}: its HEAD has no tests/ directory")
        archive = subprocess.Popen(git + ["archive", "HEAD", *wanted], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", str(scratch)], stdin=archive.stdout, check=True)
        if archive.wait() != 0:
            raise ConformanceError(f"{suite}: git archive failed")
        return _commit(git)
    if not (suite / "tests").is_dir():
        raise ConformanceError(f"{suite} has no tests/ directory: give a checkout of "
                               "TorchNeuron's repository or its git directory")
    for name in COPIED:
        src = suite / name
        if src.is_dir():
            shutil.copytree(src, scratch / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__"))
        elif src.is_file():
            shutil.copy2(src, scratch / name)
    return _commit(["git", "-C", str(suite)]) if (suite / ".git").exists() else None


def _commit(git: List[str]) -> Optional[str]:
    out = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True,
                         check=False)
    return out.stdout.strip() or None if out.returncode == 0 else None


def directories(scratch: pathlib.Path) -> List[str]:
    """Every directory of tests/ that holds test files, as ``tests/<dir>``."""
    found = []
    for top in sorted(p for p in (scratch / "tests").iterdir() if p.is_dir()):
        parts = [p for p in sorted(top.iterdir()) if p.is_dir()] if top.name in SPLIT else [top]
        for d in parts:
            if any(d.rglob("test_*.py")) or any(d.rglob("*_test.py")):
                found.append(d.relative_to(scratch).as_posix())
    return found


def read_exclusions(path: pathlib.Path) -> List[Tuple[str, str]]:
    """(path or node id, reason) per line of the exclusion file."""
    if not path.is_file():
        return []
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        entry, sep, reason = text.partition(" #")
        if not sep or not reason.strip():
            raise ConformanceError(f"{path}:{n}: expected 'PATH_OR_NODEID # reason', got "
                                   f"{text!r}")
        out.append((entry.strip().rstrip("/"), reason.strip()))
    return out


def _inside(entry: str, directory: str) -> bool:
    path = entry.split("::")[0]
    return path == directory or path.startswith(directory + "/")


# -- the virtualenv --------------------------------------------------------------------


def default_venv() -> pathlib.Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(cache) / "neuronmp" / f"conformance-venv-torch{TORCH}"


def venv_python(venv: pathlib.Path) -> pathlib.Path:
    """The virtualenv's interpreter, making the virtualenv first when it is missing."""
    python = venv / "bin" / "python"
    if python.exists():
        return python
    if venv.exists() and any(venv.iterdir()):
        raise ConformanceError(f"--venv {venv}: not a virtualenv (no bin/python) and not "
                               "empty; give an existing virtualenv or a new path")
    print(f"conformance: making a virtualenv in {venv} (torch=={TORCH}, this project, "
          f"{', '.join(PINS)})", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", f"torch=={TORCH}", *PINS,
                    "-e", str(ROOT)], check=True)
    return python


def ensure_this_checkout(python: pathlib.Path, reinstall: bool) -> None:
    """Make sure the virtualenv imports this checkout's neuronmp: a virtualenv made
    on an earlier day (or by another checkout) would test that code instead."""
    code = "import neuronmp, os; print(os.path.dirname(os.path.dirname(neuronmp.__file__)))"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                         check=False)
    where = out.stdout.strip()
    if out.returncode == 0 and pathlib.Path(where).resolve() == ROOT:
        return
    if not reinstall:
        raise ConformanceError(
            f"{python} imports neuronmp from {where or 'nowhere'}, not from this checkout "
            f"({ROOT}): install it there (pip install -e {ROOT}) or omit --venv")
    print(f"conformance: installing this checkout ({ROOT}) into {python.parent.parent}",
          file=sys.stderr)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT)],
                   check=True)


def probe(python: pathlib.Path) -> Dict[str, bool]:
    """What the virtualenv can run: --forked (pytest-forked with a pytest before 9) and
    per-test timeouts (pytest-timeout)."""
    code = ("import importlib.util as u, json, pytest; print(json.dumps({"
            "'forked': u.find_spec('pytest_forked') is not None and "
            "int(pytest.__version__.split('.')[0]) < 9, "
            "'timeout': u.find_spec('pytest_timeout') is not None, "
            "'torchrun': u.find_spec('torch') is not None}))")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise ConformanceError(f"{python} cannot import pytest: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout)


# -- running ---------------------------------------------------------------------------


def environment(scratch: pathlib.Path, directory: str, results: pathlib.Path,
                runtime_dir: Optional[str] = None) -> dict:
    env = dict(os.environ)
    # the host the suite's runner counts its cores on (neuron-ls on a trn2): its tests
    # of four and eight ranks need that many cores, more than one per CPU gives
    env.setdefault("NEURONMP_TOPOLOGY", HOST)
    if runtime_dir is not None:
        env["NEURONMP_RUNTIME_DIR"] = runtime_dir
    env.update({
        "NEURONMP_PROVIDE": "torchneuron",
        "NEURON_RT_NUM_CORES": "1",
        "TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS":
            "0" if directory.split("/")[1] == "cpu_fallback" else "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(scratch),
                                                    os.environ.get("PYTHONPATH")])),
        "CONFORMANCE_RESULTS": str(results),
    })
    return env


@contextlib.contextmanager
def _runtime_dir() -> Iterator[Optional[str]]:
    """A runtime directory of the run's own (core locks, shared memory), unless the user
    named one: other neuronmp processes on the host then hold no core the suite asks
    for.  In /dev/shm, where the default one is, so the rings stay in memory."""
    if os.environ.get("NEURONMP_RUNTIME_DIR"):
        yield None
        return
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    path = tempfile.mkdtemp(prefix="neuronmp-conformance-", dir=shm)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _run(cmd: List[str], cwd: pathlib.Path, env: dict, timeout: float,
         log: pathlib.Path) -> Optional[str]:
    """Run one pytest (or torchrun) process; a note when it did not end by itself."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)   # pytest's forks and torchrun's ranks too
            proc.wait()
            return f"timed out after {timeout:.0f} s"
    if proc.returncode not in (0, 1, 5):   # 1: failures, 5: nothing collected
        return f"pytest exited with status {proc.returncode}"
    return None


def run_directory(python: pathlib.Path, scratch: pathlib.Path, directory: str,
                  exclusions: Sequence[Tuple[str, str]], caps: Dict[str, bool],
                  timeout: float, test_timeout: float, work: pathlib.Path,
                  runtime_dir: Optional[str] = None) -> dict:
    """One directory's row of the table."""
    results = work / directory.replace("/", "_")
    log = results.with_suffix(".log")
    env = environment(scratch, directory, results, runtime_dir)
    # a file that cannot import counts as one error; the rest of the directory still runs
    args = ["-q", "-p", "no:cacheprovider", "-p", "_conformance_plugin", "-rN",
            "--continue-on-collection-errors"]
    if caps["forked"]:
        args.append("--forked")
    if caps["timeout"] and test_timeout > 0:
        args.append(f"--timeout={test_timeout:.0f}")
        if caps["forked"]:
            # the timer around the test function only, which runs in the fork: around
            # the whole protocol it is armed in pytest's own process, where it fires
            # inside pytest-forked's wait and ends the directory's run (INTERNALERROR)
            args += ["-o", "timeout_func_only=true"]
    for entry, _ in exclusions:
        if _inside(entry, directory):
            args += [f"--deselect={entry}"] if "::" in entry else [f"--ignore={entry}"]
    ranked = [f for f in TORCHRUN if _inside(f, directory) and (scratch / f).is_file()]
    alone = [f for f in ALONE if _inside(f, directory) and (scratch / f).is_file()
             and f"--ignore={f}" not in args]
    notes = []
    note = _run([str(python), "-m", "pytest", *args,
                 *[f"--ignore={f}" for f in ranked + alone], directory], scratch, env,
                timeout, log)
    if note:
        notes.append(note)
    for f in alone:
        own = dict(env, NEURONMP_TOPOLOGY=env.get("NEURONMP_TOPOLOGY") or ALONE_TOPOLOGY)
        for name, value in ALONE[f].items():
            if value is None:
                own.pop(name, None)
            else:
                own[name] = value
        note = _run([str(python), "-m", "pytest", *args, f], scratch, own, timeout, log)
        if note:
            notes.append(f"{f}: {note}")
    for f in ranked:
        torchrun = [str(python), "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    "-m", "pytest", *args, f]
        note = _run(torchrun, scratch, env, timeout, log)
        if note:
            notes.append(f"{f}: {note}")
    row = tally(sorted(work.glob(results.name + ".*.jsonl")))
    row.update(directory=directory, notes=notes, log=str(log))
    return row


def tally(files: Sequence[pathlib.Path]) -> dict:
    """Counts from the plugin's records (each rank's file; the worst outcome of a test)."""
    collected: Dict[str, int] = collections.Counter()
    worst: Dict[str, str] = {}
    for path in files:
        rank = path.suffixes[-2] if len(path.suffixes) > 1 else ".0"
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if "collected" in rec:
                collected[rank] += rec["collected"]
                continue
            nodeid, outcome = rec["nodeid"], rec["outcome"]
            if nodeid not in worst or _RANK[outcome] > _RANK[worst[nodeid]]:
                worst[nodeid] = outcome
    counts = collections.Counter(worst.values())
    row = {"collected": max(collected.values(), default=0)}
    row.update({k: counts.get(k, 0) for k in OUTCOMES})
    row["xpassed_tests"] = sorted(n for n, o in worst.items() if o == "xpassed")
    return row


# -- output ----------------------------------------------------------------------------

_COLUMNS = (("directory", "directory"), ("collected", "collected"), ("passed", "passed"),
            ("failed", "failed"), ("error", "errors"), ("skipped", "skipped"),
            ("xfailed", "xfail"), ("xpassed", "XPASS"))


def table(rows: Sequence[dict]) -> str:
    cells = [[h for _, h in _COLUMNS] + ["note"]]
    for r in rows:
        cells.append([str(r[k]) for k, _ in _COLUMNS] + ["; ".join(r["notes"])])
    widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) if i < len(cell) - 1 else c
                       for i, (c, w) in enumerate(zip(cell, widths))).rstrip()
             for cell in cells]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", type=pathlib.Path, help="a fetched copy of TorchNeuron's "
                        "repository: a checkout, or a git directory without a work tree")
    parser.add_argument("--dirs", nargs="+", metavar="DIR",
                        help="directories of tests/ to run (such as device or "
                        "distributed/process_group; default: all)")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds one directory may take (default 1800)")
    parser.add_argument("--test-timeout", type=float, default=300.0,
                        help="seconds one test may take, with pytest-timeout (default 300)")
    parser.add_argument("--venv", type=pathlib.Path,
                        help=f"the virtualenv to run in, made when missing (default "
                        f"{default_venv()})")
    parser.add_argument("--exclusions", type=pathlib.Path, default=EXCLUSIONS,
                        help="the exclusion list (default tools/conformance-exclusions.txt)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error(f"--timeout {args.timeout:g}: expected a number of seconds > 0")
    try:
        return _main(args)
    except ConformanceError as exc:
        print(f"conformance: {exc}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    exclusions = read_exclusions(args.exclusions)
    python = venv_python((args.venv or default_venv()).absolute())
    ensure_this_checkout(python, reinstall=args.venv is None)
    caps = probe(python)
    with tempfile.TemporaryDirectory(prefix="neuronmp-conformance-") as tmp:
        scratch, work = pathlib.Path(tmp) / "suite", pathlib.Path(tmp) / "results"
        scratch.mkdir()
        work.mkdir()
        commit = extract(args.suite.absolute(), scratch)
        (scratch / "_conformance_plugin.py").write_text(_PLUGIN)
        known = directories(scratch)
        chosen = known
        if args.dirs:
            chosen = [d if d.startswith("tests/") else f"tests/{d}" for d in
                      (d.strip("/") for d in args.dirs)]
            unknown = [d for d in chosen if not (scratch / d).is_dir()]
            if unknown:
                raise ConformanceError(f"--dirs {' '.join(unknown)}: not in the suite; "
                                       f"its directories: {', '.join(known)}")
        skipped = [d for d in chosen if any(e == d or d.startswith(e + "/")
                                            for e, _ in exclusions)]
        with _runtime_dir() as runtime_dir:
            rows = [run_directory(python, scratch, d, exclusions, caps, args.timeout,
                                  args.test_timeout, work, runtime_dir)
                    for d in chosen if d not in skipped]
        logs = {r["directory"]: pathlib.Path(r.pop("log")).read_text(errors="replace")[-4000:]
                for r in rows if pathlib.Path(r["log"]).exists()}
    report = {"suite": str(args.suite), "commit": commit,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
              "python": str(python), "forked": caps["forked"], "results": rows,
              "not_run": skipped,
              "excluded": [{"entry": e, "reason": r} for e, r in exclusions]}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _print(report, logs)
    return 0


def _print(report: dict, logs: Dict[str, str]) -> None:
    print(f"TorchNeuron suite {report['suite']} (commit {report['commit'] or 'unknown'}), "
          f"{report['date']}, {'--forked' if report['forked'] else 'without --forked'}")
    print(table(report["results"]))
    for r in report["results"]:
        if r["xpassed_tests"]:
            print(f"\nXPASS in {r['directory']}:")
            print("\n".join(f"  {n}" for n in r["xpassed_tests"]))
        if r["notes"] or (r["collected"] == 0 and r["error"] == 0):
            print(f"\nlast lines of {r['directory']}'s output:\n{logs.get(r['directory'], '')}")
    print("\nexcluded:")
    for e in report["excluded"]:
        print(f"  {e['entry']}  # {e['reason']}")


if __name__ == "__main__":
    sys.exit(main())
