"""``neuronmp-run``: torchrun's command line, with each rank's own slice of NeuronCores.

    neuronmp-run --nproc-per-node 4 --cores-per-proc 4 train.py --epochs 3

    job cores (--cores, else NEURON_RT_VISIBLE_CORES, else every core)
        |  plan_slices: N ranks x K contiguous cores, refused up front if it does not fit
        v
    one host:    neuronmp.launch.launcher.run  (spawn, watch, stop in stages, restart, summary)
    several:     torch.distributed.run with NEURON_RT_VISIBLE_CORES = the job's cores;
                 each rank narrows to its share (visibility.torchrun_share)

Every option may also come from the environment, first ``NEURONMP_RUN_<OPTION>``
then torchrun's ``PET_<OPTION>`` (option name upper-cased, dashes as
underscores: ``NEURONMP_RUN_NPROC_PER_NODE=4``, ``PET_MAX_RESTARTS=1``); the
command line wins.  This module imports no torch: torch.distributed.run is
imported only for a multi-host job.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import List, Optional, Sequence, Tuple

from ..errors import NeuronmpError
from ..host import settings, visibility
from ..launch import launcher

ENV_PREFIXES = ("NEURONMP_RUN_", "PET_")
_TRUE = ("1", "true", "yes", "on")


def _env(dest: str, default=None):
    for prefix in ENV_PREFIXES:
        value = os.environ.get(prefix + dest.upper())
        if value is not None and value != "":
            return value
    return default


def _env_flag(dest: str) -> bool:
    value = _env(dest)
    return value is not None and value.strip().lower() in _TRUE


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (defaults already read from NEURONMP_RUN_* / PET_* variables)."""
    p = argparse.ArgumentParser(
        prog="neuronmp-run",
        description="Start N ranks of a script, each with its own contiguous slice of "
                    "NeuronCores (NEURON_RT_VISIBLE_CORES), torchrun-style.",
        epilog="Each option may also be set as NEURONMP_RUN_<OPTION> or PET_<OPTION> "
               "(e.g. NEURONMP_RUN_CORES_PER_PROC=2); the command line wins.",
    )
    cores = p.add_argument_group("cores")
    cores.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node",
                       default=_env("nproc_per_node"), metavar="N|auto",
                       help="ranks on this host: a number, or 'auto' = job cores / "
                            "--cores-per-proc (default: 1, or auto with --cores-per-proc)")
    cores.add_argument("--cores-per-proc", "--cores_per_proc", dest="cores_per_proc",
                       default=_env("cores_per_proc"), metavar="K",
                       help="cores per rank (default: the job's cores divided evenly)")
    cores.add_argument("--cores", dest="cores", default=_env("cores"), metavar="SPEC",
                       help="cores the job may use, NEURON_RT_VISIBLE_CORES grammar such as "
                            "'0-7' (default: the cores visible to neuronmp-run)")
    job = p.add_argument_group("job")
    job.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int,
                     default=_env("max_restarts", "0"),
                     help="restart the whole group up to this many times on failure")
    job.add_argument("--monitor-interval", "--monitor_interval", dest="monitor_interval",
                     type=float, default=_env("monitor_interval", "0.1"),
                     help="seconds between checks of the ranks (exits also wake it)")
    job.add_argument("--stop-timeout", "--stop_timeout", dest="stop_timeout", type=float,
                     default=_env("stop_timeout", "30"),
                     help="seconds the ranks get, together, to exit after the stop signal "
                          "(SIGTERM, or the one the launcher got) before SIGKILL (default 30)")
    job.add_argument("--log-dir", "--log_dir", dest="log_dir", default=_env("log_dir"),
                     help="root of <log_dir>/<run_id>/attempt_<n>/<local_rank>/ "
                          "(default: a temporary directory)")
    job.add_argument("-r", "--redirects", dest="redirects", default=_env("redirects", "0"),
                     help="send rank output to files only: " + launcher.STD_STREAMS_ACCEPTED)
    job.add_argument("-t", "--tee", dest="tee", default=_env("tee", "0"),
                     help="copy rank output to files and to the console, lines prefixed "
                          "with the rank: " + launcher.STD_STREAMS_ACCEPTED)
    job.add_argument("--master-addr", "--master_addr", dest="master_addr",
                     default=_env("master_addr", "127.0.0.1"))
    job.add_argument("--master-port", "--master_port", dest="master_port", type=int,
                     default=_env("master_port"),
                     help="default: a free port on one host, 29500 across hosts")
    job.add_argument("--standalone", action="store_true", default=_env_flag("standalone"),
                     help="one host, a fresh local rendezvous (the default on one host)")
    hosts = p.add_argument_group("several hosts (handed to torch.distributed.run)")
    hosts.add_argument("--nnodes", default=_env("nnodes", "1"))
    hosts.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int,
                       default=_env("node_rank"))
    hosts.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend",
                       default=_env("rdzv_backend"))
    hosts.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint",
                       default=_env("rdzv_endpoint"))
    hosts.add_argument("--rdzv-conf", "--rdzv_conf", dest="rdzv_conf",
                       default=_env("rdzv_conf"))
    hosts.add_argument("--rdzv-id", "--rdzv_id", "--run-id", dest="rdzv_id",
                       default=_env("rdzv_id"),
                       help="the job's id (TORCHELASTIC_RUN_ID, log directory name)")
    cmd = p.add_argument_group("command")
    cmd.add_argument("-m", "--module", dest="module", action="store_true",
                     default=_env_flag("module"), help="run the target as a module (python -m)")
    cmd.add_argument("--no-python", "--no_python", dest="no_python", action="store_true",
                     default=_env_flag("no_python"),
                     help="run the target as an executable, not with python")
    p.add_argument("script", help="the script (or module, or executable) each rank runs")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


# -- turning options into a plan ---------------------------------------------------------


def _int_option(name: str, value, accepted: str) -> Optional[int]:
    if value is None:
        return None
    text = str(value).strip()
    if not text.isdigit() or int(text) < 1:
        raise _usage(f"{name} {value!r} is not a whole number of 1 or more; accepted: {accepted}")
    return int(text)


class _UsageError(Exception):
    pass


def _usage(message: str) -> _UsageError:
    return _UsageError(message)


def job_cores(args: argparse.Namespace) -> Tuple[Tuple[int, ...], str]:
    """The cores the job may use and where that came from."""
    topo = settings.get("topology")
    if args.cores is not None:
        try:
            cores = visibility.parse_visible_cores(args.cores, topo.num_cores)
        except NeuronmpError as exc:
            raise _usage(f"--cores {args.cores!r} is refused: {exc}") from None
        return cores, f"--cores {args.cores}"
    env = dict(os.environ)
    env.pop(visibility.ENV_LOCAL_RANK, None)  # the launcher is no rank: never narrow its view
    request = settings.parse_field("request", env)
    if request.cores is not None:
        return request.cores, request.describe()
    if request.count is not None:
        raise _usage(
            f"neuronmp-run hands out explicit cores, but only {visibility.ENV_NUM}="
            f"{request.count} is set; give --cores or {visibility.ENV_VISIBLE} "
            f"(for example --cores 0-{request.count - 1})"
        )
    return tuple(range(topo.num_cores)), f"all cores of {topo.name}"


def plan(args: argparse.Namespace) -> List[Tuple[int, ...]]:
    """Each rank's cores, refused with the arithmetic when they do not fit."""
    cores, source = job_cores(args)
    per = _int_option("--cores-per-proc", args.cores_per_proc, "a number of cores per rank")
    nproc_text = args.nproc_per_node
    if nproc_text is None:
        nproc: Optional[int] = None if per is not None else 1
    elif str(nproc_text).strip() == "auto":
        nproc = None
    else:
        nproc = _int_option("--nproc-per-node", nproc_text, "a number of ranks or 'auto'")
    return launcher.plan_slices(cores, nproc, per, source)


def rank_command(args: argparse.Namespace) -> List[str]:
    """The argv every rank runs (python -u like torchrun, unless --no-python)."""
    if args.no_python and args.module:
        raise _usage("--no-python and -m/--module cannot be used together")
    if args.no_python:
        return [args.script, *args.script_args]
    if args.module:
        return [sys.executable, "-u", "-m", args.script, *args.script_args]
    return [sys.executable, "-u", args.script, *args.script_args]


def _is_multi_host(args: argparse.Namespace) -> bool:
    return (str(args.nnodes).strip() != "1" or args.node_rank is not None
            or args.rdzv_backend is not None or args.rdzv_endpoint is not None
            or args.rdzv_conf is not None)


# -- the two ways to run --------------------------------------------------------------------


def _run_here(args: argparse.Namespace, slices: List[Tuple[int, ...]]) -> int:
    redirects = launcher.parse_std_streams(args.redirects, "--redirects")
    tee = launcher.parse_std_streams(args.tee, "--tee")
    keep_logs = args.log_dir is not None or any(redirects.values()) or any(tee.values())
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="neuronmp-run-")
    cfg = launcher.LaunchConfig(
        cmd=rank_command(args),
        slices=slices,
        run_id=args.rdzv_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}",
        log_dir=os.path.abspath(log_dir),
        master_addr=args.master_addr,
        master_port=args.master_port or launcher.free_port(),
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        stop_timeout=args.stop_timeout,
        redirects=redirects,
        tee=tee,
    )
    try:
        return launcher.run(cfg)
    finally:
        if not keep_logs:
            shutil.rmtree(log_dir, ignore_errors=True)


def torchrun_argv(args: argparse.Namespace, nproc: int) -> List[str]:
    """torch.distributed.run's command line for this job (several hosts)."""
    argv = ["--nproc-per-node", str(nproc), "--nnodes", str(args.nnodes),
            "--max-restarts", str(args.max_restarts),
            "--monitor-interval", str(args.monitor_interval),
            "--redirects", str(args.redirects), "--tee", str(args.tee),
            "--master-addr", args.master_addr]
    for flag, value in (("--node-rank", args.node_rank), ("--rdzv-backend", args.rdzv_backend),
                        ("--rdzv-endpoint", args.rdzv_endpoint), ("--rdzv-conf", args.rdzv_conf),
                        ("--rdzv-id", args.rdzv_id), ("--log-dir", args.log_dir),
                        ("--master-port", args.master_port)):
        if value is not None:
            argv += [flag, str(value)]
    if args.standalone:
        argv.append("--standalone")
    if args.module:
        argv.append("--module")
    if args.no_python:
        argv.append("--no-python")
    return argv + [args.script, *args.script_args]


def _run_torchrun(args: argparse.Namespace, slices: List[Tuple[int, ...]]) -> int:
    cores = [c for s in slices for c in s]
    # every rank inherits the job's cores and narrows to its share (torchrun_share)
    os.environ[visibility.ENV_VISIBLE] = f"{cores[0]}-{cores[-1]}"
    os.environ.pop(visibility.ENV_NUM, None)
    os.environ.pop(visibility.ENV_SLICED_BY, None)
    os.environ.setdefault("OMP_NUM_THREADS", str(len(slices[0])))
    host = args.master_addr
    if args.rdzv_endpoint and args.master_addr == "127.0.0.1":
        host = args.rdzv_endpoint.rsplit(":", 1)[0] if "]" not in args.rdzv_endpoint \
            else args.rdzv_endpoint.split("]")[0].lstrip("[")
    os.environ.setdefault("NEURON_RT_ROOT_COMM_ID", launcher.root_comm_id(host))
    from torch.distributed import run as torchrun  # several hosts only: costs seconds

    try:
        torchrun.main(torchrun_argv(args, len(slices)))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except Exception as exc:  # ChildFailedError: torchrun has printed its summary
        print(f"neuronmp-run: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``neuronmp-run`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rank_command(args)
        slices = plan(args)
        launcher.parse_std_streams(args.redirects, "--redirects")
        launcher.parse_std_streams(args.tee, "--tee")
        if args.max_restarts < 0:
            raise _usage(f"--max-restarts {args.max_restarts} must be 0 or more")
        if args.monitor_interval <= 0 or args.stop_timeout < 0:
            raise _usage("--monitor-interval must be above 0 and --stop-timeout 0 or more")
    except (_UsageError, NeuronmpError) as exc:
        print(f"neuronmp-run: error: {exc}", file=sys.stderr)
        return 2
    if _is_multi_host(args):
        return _run_torchrun(args, slices)
    return _run_here(args, slices)


if __name__ == "__main__":
    sys.exit(main())
