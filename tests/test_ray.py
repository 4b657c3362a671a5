"""Ray on an emulated host: detection, neuron_cores actors, a killed actor.

One Ray instance serves the module (``ray.init`` costs seconds).  When it can, the
module installs neuronmp's ``neuron-ls`` where Ray looks (``/opt/aws/neuron/bin``,
only when that directory does not exist yet; everything created is removed at
teardown) and lets ``ray.init()`` count the cores by itself; otherwise it passes
``resources={"neuron_cores": 4}`` and the detection test is skipped.

Ray's processes (raylet, GCS, workers) are the module's, not a test's: they are
started with conftest's SHARED_MARK in their environment, so the per-test leak check
passes over them, and the module teardown shuts Ray down and fails if any of them
outlives it.  Each test kills the actors it made, so their core locks are gone
before the per-test lock check.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from conftest import SHARED_MARK

ray = pytest.importorskip("ray")

from neuronmp.cli import ls as nmp_ls  # noqa: E402

NEURON_BIN = "/opt/aws/neuron/bin"
CORES = 4


def _make_neuron_bin():
    """Create NEURON_BIN with neuronmp's tools; the topmost directory created (to remove
    afterwards), or None when it exists already or cannot be made."""
    top = NEURON_BIN
    while not os.path.exists(os.path.dirname(top)):
        top = os.path.dirname(top)
    if os.path.exists(NEURON_BIN):
        return None   # never touch a real (or another run's) Neuron install
    try:
        os.makedirs(NEURON_BIN)
        nmp_ls.install_tools(NEURON_BIN)
    except OSError:
        shutil.rmtree(top, ignore_errors=True)
        return None
    return top


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(how Ray learned the core count, its temp dir); Ray shut down at the end."""
    saved = {k: os.environ.get(k) for k in (SHARED_MARK, "NEURONMP_TOPOLOGY",
                                            "NEURONMP_RUNTIME_DIR")}
    rundir = tmp_path_factory.mktemp("ray-nmp-rt")
    os.chmod(rundir, 0o700)
    created = _make_neuron_bin()
    os.environ.update({SHARED_MARK: "ray", "NEURONMP_TOPOLOGY": f"1x{CORES}",
                       "NEURONMP_RUNTIME_DIR": str(rundir)})
    # Ray's socket paths must stay under 107 characters: a short directory of our own
    temp = tempfile.mkdtemp(prefix="nmp-ray-", dir="/tmp")
    try:
        if created:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp)
        else:
            ray.init(num_cpus=2, resources={"neuron_cores": CORES}, include_dashboard=False,
                     log_to_driver=False, _temp_dir=temp)
    except BaseException:   # a Ray that did not start leaves nothing behind either
        ray.shutdown()
        _ray_processes_left()
        shutil.rmtree(temp, ignore_errors=True)
        raise
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        if created:
            shutil.rmtree(created, ignore_errors=True)
    try:
        yield "detected" if created else "given"
    finally:
        ray.shutdown()
        left = _ray_processes_left()
        shutil.rmtree(temp, ignore_errors=True)
        assert not left, f"Ray left processes behind: {left}"


def _ray_processes_left():
    deadline = time.monotonic() + 30
    while True:
        left = []
        for p in psutil.Process().children(recursive=True):
            try:
                if p.environ().get(SHARED_MARK) == "ray" and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for p in left:
        p.kill()
    return [f"{p.pid}" for p in left]


@ray.remote(num_cpus=0)
class Holder:
    """An actor that starts neuronmp on the cores Ray gave it."""

    def __init__(self, rundir: str):
        os.environ["NEURONMP_RUNTIME_DIR"] = rundir
        os.environ["NEURONMP_TOPOLOGY"] = f"1x{CORES}"

    def cores(self):
        import neuronmp

        try:
            held = list(neuronmp.visible_cores())
        except neuronmp.NeuronmpError as exc:
            held = f"{type(exc).__name__}: {exc}"
        return os.environ.get("NEURON_RT_VISIBLE_CORES"), held, os.getpid()


def _holders(rundir: str) -> dict:
    """{pid: [cores]} as neuronmp-ls --json shows the test's runtime directory."""
    env = dict(os.environ, NEURONMP_RUNTIME_DIR=rundir, NEURONMP_TOPOLOGY=f"1x{CORES}")
    out = subprocess.run([sys.executable, "-m", "neuronmp.cli.ls", "--json"], env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    held = {}
    for core in json.loads(out)["cores"]:
        if core["held"]:
            held.setdefault(core["holder"]["pid"], []).append(core["core"])
    return held


def _gone(pid: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _kill_all(actors):
    pids = []
    for actor, pid in actors:
        ray.kill(actor)
        pids.append(pid)
    assert all(_gone(pid) for pid in pids)


def test_ray_counts_the_emulated_cores_by_itself(cluster):
    if cluster != "detected":
        pytest.skip(f"{NEURON_BIN} exists already or cannot be created: Ray was given "
                    "its neuron_cores instead of detecting them")
    assert ray.cluster_resources()["neuron_cores"] == CORES


def test_a_copy_of_rays_rule_counts_neuronmp_ls(emulated):
    # Ray's rule: run `neuron-ls --json-output`, sum nc_count over the devices
    for topo, lnc, want in (("trn1.32xlarge", None, 32), ("inf2.xlarge", None, 2),
                            ("trn2.48xlarge", None, 64), ("trn2.48xlarge", "1", 128)):
        emulated(topo)
        env = dict(os.environ)
        if lnc:
            env["NEURON_LOGICAL_NC_CONFIG"] = lnc
        result = subprocess.run([sys.executable, "-m", "neuronmp.cli.ls", "--json-output"],
                                env=env, capture_output=True, timeout=60)
        assert result.returncode == 0 and result.stdout
        devices = json.loads(result.stdout)
        assert sum(d.get("nc_count", 0) for d in devices) == want, (topo, lnc)


def test_actors_get_disjoint_cores_and_a_killed_one_frees_them_at_once(cluster, runtime_dir,
                                                                      monkeypatch):
    actors = [Holder.options(resources={"neuron_cores": 2}).remote(runtime_dir)
              for _ in range(2)]
    seen = ray.get([a.cores.remote() for a in actors], timeout=120)
    try:
        (env_a, cores_a, pid_a), (env_b, cores_b, pid_b) = seen
        assert {env_a, env_b} == {"0,1", "2,3"}              # what Ray set
        assert [cores_a, cores_b] == [[int(c) for c in env.split(",")]
                                      for env in (env_a, env_b)]   # what neuronmp took
        assert _holders(runtime_dir) == {pid_a: cores_a, pid_b: cores_b}
        pids = {p["pid"] for p in _devices(runtime_dir)[0]["neuron_processes"]}
        assert pids == {pid_a, pid_b}                        # neuron-ls's schema names both
        ray.kill(actors[0])
        assert _gone(pid_a)
        assert _holders(runtime_dir) == {pid_b: cores_b}     # nothing to clean up first
        monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", env_a)
        monkeypatch.setenv("NEURONMP_TOPOLOGY", f"1x{CORES}")
        import neuronmp

        assert list(neuronmp.visible_cores()) == cores_a     # free for the next process
    finally:
        _kill_all(zip(actors, (s[2] for s in seen)))


def test_non_contiguous_ids_from_ray_are_refused_like_the_runtime(cluster, runtime_dir):
    ones = [Holder.options(resources={"neuron_cores": 1}).remote(runtime_dir)
            for _ in range(CORES)]
    seen = ray.get([a.cores.remote() for a in ones], timeout=120)
    live = list(zip(ones, (s[2] for s in seen)))
    try:
        by_core = {s[1][0]: i for i, s in enumerate(seen)}
        # free cores 1 and 3: the only two-core request Ray can now place is "1,3"
        _kill_all([live[by_core[1]], live[by_core[3]]])
        live = [live[by_core[0]], live[by_core[2]]]
        pair = Holder.options(resources={"neuron_cores": 2}).remote(runtime_dir)
        env, held, pid = ray.get(pair.cores.remote(), timeout=120)
        live.append((pair, pid))
        assert env == "1,3"
        assert held.startswith("VisibilityError") and "'1,3'" in held and \
            "not contiguous" in held
    finally:
        _kill_all(live)


def _devices(rundir: str):
    env = dict(os.environ, NEURONMP_RUNTIME_DIR=rundir, NEURONMP_TOPOLOGY=f"1x{CORES}")
    out = subprocess.run([sys.executable, "-m", "neuronmp.cli.ls", "--json-output"], env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return json.loads(out)
