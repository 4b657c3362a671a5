"""TorchNeuron's rank rules for ranks started without a launcher, as its own test harness
starts them (each rank given its core in NEURON_RT_VISIBLE_CORES, LOCAL_WORLD_SIZE set or
not), and what such a job does next: subgroups after the model is on the device,
reduce_scatter's one-tensor-list form, SyncBatchNorm (rules_job.py)."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from torchneuron_support import env_with, rank_facts, run

from neuronmp.launch import launcher

pytestmark = pytest.mark.timeout(600)
HERE = pathlib.Path(__file__).parent
WORLD = 2


def _job(procs, cores, local_world_size: bool):
    port = str(launcher.free_port())
    jobs = []
    for rank in range(WORLD):
        env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
                   WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
        if local_world_size:
            env["LOCAL_WORLD_SIZE"] = str(WORLD)
        if cores is not None:
            env["NEURON_RT_VISIBLE_CORES"] = str(cores[rank])
        jobs.append(procs.popen([sys.executable, str(HERE / "rules_job.py")],
                                env=env_with(**env), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd="/"))
    return rank_facts(jobs)


def _expect_reduce_scatter(rank):
    total = [sum(k + 10 * r for r in range(WORLD)) for k in range(2 * WORLD)]
    cube = [[[(i * 2 * WORLD + j) * 3 + k + 100 * (WORLD - 1) for k in range(3)]
             for j in range(2 * rank, 2 * rank + 2)] for i in range(2)]
    return [total[2 * rank:2 * rank + 2], cube]


@pytest.mark.parametrize("local_world_size", [True, False], ids=["lws-set", "lws-unset"])
def test_a_user_set_core_is_left_alone_and_devices_number_by_local_rank(procs,
                                                                        local_world_size):
    # cores 2 and 3, not the ranks' numbers: the rank's own core is the one it was given
    ranks = _job(procs, cores=[2, 3], local_world_size=local_world_size)
    for r in ranks:
        rank = r["rank"]
        assert r["visible_before"] == r["visible_after"] == str(2 + rank)
        assert r["cores"] == [2 + rank]
        # LOCAL_WORLD_SIZE unset: the ranks of this host, in rank order, give both numbers
        assert r["device_count"] == WORLD and r["current"] == rank
        assert r["device"] == f"neuron:{rank}"
        assert r["props"] == [f"neuron:{i}" for i in range(WORLD)]
        other = 1 - rank
        assert r["refused"][str(other)].startswith(
            "RuntimeError: Attempted to access device that doesn't attach to this process: "
            f"neuron:{other}")
        assert r["refused"][str(WORLD)].startswith(
            f"RuntimeError: Device index {WORLD} is out of range")


def test_subgroups_after_tensors_exist_and_reduce_scatter_one_tensor_and_syncbn(procs):
    ranks = _job(procs, cores=None, local_world_size=True)
    total = float(sum(range(1, WORLD + 1)))
    for r in ranks:
        rank = r["rank"]
        assert r["visible_after"] == str(rank)   # unset: the backend sets LOCAL_RANK
        assert r["subgroups"] == [[total] * 4, [float(rank + 1)] * 4, [total] * 4]
        assert r["seq"][0] < r["seq"][1] < r["seq"][2], r["seq"]
        assert r["reduce_scatter"] == _expect_reduce_scatter(rank)
        assert r["syncbn"] == {"out": True, "grad_input": True, "grad_weight": True,
                               "running_mean": True, "running_var": True}, r["syncbn"]


def test_linear_backward_runs_on_the_device(tmp_path):
    proc = run("""
        import json, torch
        g = torch.Generator().manual_seed(3)
        x, w, dy = (torch.randn(5, 4, generator=g), torch.randn(3, 4, generator=g),
                    torch.randn(5, 3, generator=g))
        got = torch.ops.aten.linear_backward(x.to("neuron"), dy.to("neuron"),
                                             w.to("neuron"), [True, True, True])
        want = (dy @ w, dy.t() @ x, dy.sum(0))
        none = torch.ops.aten.linear_backward(x.to("neuron"), dy.to("neuron"),
                                              w.to("neuron"), [False, True, False])
        print(json.dumps({"devices": [str(t.device) for t in got],
                          "equal": [bool(torch.allclose(a.cpu(), b, atol=1e-5))
                                    for a, b in zip(got, want)],
                          "masked": [t is None or t.numel() == 0 for t in none]}))
        """, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert facts == {"devices": ["neuron:0"] * 3, "equal": [True] * 3,
                     "masked": [True, False, True]}
