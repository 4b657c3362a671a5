"""Ranks started by torchrun itself: each narrows to its own share of the visible cores.

Covers visibility.torchrun_share (torch-neuronx's two rules, errors naming both
numbers), plain ``python -m torch.distributed.run``, and neuronmp-run's hand-off
to it for several hosts (two launchers on this host standing in for two nodes,
one process group across them).  The process tests import torch in their launcher.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from neuronmp.errors import VisibilityError
from neuronmp.host import topology, visibility
from neuronmp.launch import launcher

TOPO16 = topology.parse("4x4", cpus=[0, 1])


def _share(**env):
    return visibility.request_from_env(TOPO16, env)


def test_unset_visible_cores_rank_takes_its_local_rank_core():
    assert _share(LOCAL_RANK="0", LOCAL_WORLD_SIZE="2").cores == (0,)
    assert _share(LOCAL_RANK="3", LOCAL_WORLD_SIZE="4").cores == (3,)
    # as torch-neuronx: VISIBLE_CORES unset means core LOCAL_RANK, NUM_CORES notwithstanding
    assert _share(LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", NEURON_RT_NUM_CORES="4").cores == (1,)


def test_visible_cores_cut_into_one_contiguous_share_per_rank():
    env = {"NEURON_RT_VISIBLE_CORES": "4-11", "LOCAL_WORLD_SIZE": "2"}
    assert _share(LOCAL_RANK="0", **env).cores == (4, 5, 6, 7)
    assert _share(LOCAL_RANK="1", **env).cores == (8, 9, 10, 11)
    # one entry per rank: rank i takes entry i (torch-neuronx's rule)
    assert _share(LOCAL_RANK="2", LOCAL_WORLD_SIZE="4",
                  NEURON_RT_VISIBLE_CORES="8,9,10,11").cores == (10,)
    req = _share(LOCAL_RANK="1", **env)
    assert "LOCAL_RANK=1 of LOCAL_WORLD_SIZE=2" in req.describe() and "4-11" in req.describe()


def test_not_narrowed_outside_torchrun_or_under_neuronmp_run():
    assert _share(NEURON_RT_VISIBLE_CORES="4-11").cores == tuple(range(4, 12))
    assert _share(LOCAL_RANK="1", NEURON_RT_VISIBLE_CORES="4-11").cores == tuple(range(4, 12))
    assert _share(LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", NEURON_RT_VISIBLE_CORES="4-5",
                  NEURONMP_SLICED_BY="neuronmp-run").cores == (4, 5)


@pytest.mark.parametrize("env,needles", [
    ({"NEURON_RT_VISIBLE_CORES": "0-6", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"},
     ["NEURON_RT_VISIBLE_CORES='0-6'", "7 core(s)", "LOCAL_WORLD_SIZE=2", "7 = 2 x 3 + 1"]),
    ({"NEURON_RT_VISIBLE_CORES": "0-2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"},
     ["3 core(s)", "LOCAL_WORLD_SIZE=4"]),
    ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "17"},
     ["LOCAL_WORLD_SIZE=17 ranks exceed this host's 16 cores"]),
    ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, ["LOCAL_RANK='2'", "not below"]),
    ({"LOCAL_RANK": "x", "LOCAL_WORLD_SIZE": "2"}, ["LOCAL_RANK='x'", "not a whole number"]),
    ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "0"}, ["LOCAL_WORLD_SIZE='0'"]),
])
def test_counts_that_do_not_fit_are_refused_naming_both(env, needles):
    with pytest.raises(VisibilityError) as info:
        _share(**env)
    for needle in needles:
        assert needle in str(info.value)


RANK = """
    import json, os, sys
    import neuronmp
    cores = neuronmp.init().cores
    with open(os.path.join(sys.argv[1], "rank." + os.environ["LOCAL_RANK"]), "w") as f:
        json.dump({"cores": list(cores), "omp": os.environ.get("OMP_NUM_THREADS"),
                   "comm": os.environ.get("NEURON_RT_ROOT_COMM_ID")}, f)
"""


def _run(procs, tmp_path, argv, env):
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK))
    full = dict(os.environ)
    full.update(env)
    job = procs.popen([*argv, str(script), str(tmp_path)], env=full, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True)
    out, err = job.communicate(timeout=90)
    assert job.returncode == 0, err[-3000:]
    return [json.loads((tmp_path / f"rank.{r}").read_text()) for r in range(2)]


def test_plain_torchrun_two_ranks_each_get_their_share(procs, tmp_path):
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--standalone"]
    ranks = _run(procs, tmp_path, argv, {"NEURON_RT_VISIBLE_CORES": "8-15"})
    assert [r["cores"] for r in ranks] == [[8, 9, 10, 11], [12, 13, 14, 15]]


def test_several_hosts_path_hands_off_to_torchrun_with_core_slicing(procs, tmp_path):
    port = launcher.free_port()
    argv = [sys.executable, "-m", "neuronmp.cli.run", "--nnodes", "1", "--node-rank", "0",
            "--master-port", str(port), "--nproc-per-node", "2", "--cores", "4-7"]
    ranks = _run(procs, tmp_path, argv, {})
    assert [r["cores"] for r in ranks] == [[4, 5], [6, 7]]
    assert [r["omp"] for r in ranks] == ["2", "2"]
    assert ranks[0]["comm"] == "127.0.0.1:62182"


TWO_NODE_RANK = """
    import json, os, sys
    import neuronmp
    cores = neuronmp.init().cores
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")   # env://, across both launchers
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "NEURON_RT_ROOT_COMM_ID"]
    out = {"cores": list(cores), "sum": t.item(), **{k: os.environ.get(k) for k in keys}}
    with open(os.path.join(sys.argv[1], "rank." + os.environ["RANK"]), "w") as f:
        json.dump(out, f)
"""


def test_two_nodes_on_one_host_rendezvous_and_all_reduce(procs, tmp_path):
    # two neuronmp-run launchers, as on two hosts (static rendezvous on node 0's
    # master port), each on its own cores: four ranks, one process group
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(TWO_NODE_RANK))
    port = launcher.free_port()
    jobs = [procs.popen([sys.executable, "-m", "neuronmp.cli.run", "--nnodes", "2",
                         "--node-rank", str(node), "--master-addr", "127.0.0.1",
                         "--master-port", str(port), "--nproc-per-node", "2",
                         "--cores", f"{4 * node}-{4 * node + 3}", str(script), str(tmp_path)],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for node in (0, 1)]
    for job in jobs:
        out, err = job.communicate(timeout=120)
        assert job.returncode == 0, err[-3000:]
    ranks = [json.loads((tmp_path / f"rank.{r}").read_text()) for r in range(4)]
    assert [r["cores"] for r in ranks] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all(r["sum"] == 1 + 2 + 3 + 4 for r in ranks)
    assert [(r["RANK"], r["LOCAL_RANK"], r["GROUP_RANK"]) for r in ranks] == [
        ("0", "0", "0"), ("1", "1", "0"), ("2", "0", "1"), ("3", "1", "1")]
    assert {(r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"]) for r in ranks} == {("4", "2")}
    assert {r["NEURON_RT_ROOT_COMM_ID"] for r in ranks} == {"127.0.0.1:62182"}
