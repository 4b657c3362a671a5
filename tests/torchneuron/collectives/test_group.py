"""The ``neuron`` process group in real torchrun / neuronmp-run jobs on this host.

Each job checks many things at once (the suite runs on 2 CPUs): ops_job.py runs every
collective, reduce op and dtype on the neuron group and on gloo in the same ranks and
reports the ones that differ; train_job.py trains DDP and FSDP2 on both.
"""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from torchneuron_support import env_with, run

from neuronmp.launch import launcher

pytestmark = pytest.mark.timeout(900)
HERE = pathlib.Path(__file__).parent
EXAMPLE = HERE.parents[2] / "docs" / "guides" / "examples" / "neuron_all_reduce.py"


def _torchrun(procs, script, *args, nproc=2, timeout=300, **env):
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--standalone", str(script), *map(str, args)]
    job = procs.popen(argv, env=env_with(**env), stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True, cwd="/")
    out, err = job.communicate(timeout=timeout)
    assert job.returncode == 0, err[-4000:]
    return out


def _facts(out: str):
    """Every rank's JSON object in the job's output. Ranks share the launcher's stdout,
    so one rank's object may land on the same line as another's: decode them one by one."""
    decoder, facts = json.JSONDecoder(), []
    for line in out.splitlines():
        at = 0 if line.startswith("{") else -1
        while at >= 0:
            fact, end = decoder.raw_decode(line, at)
            facts.append(fact)
            at = line.find("{", end)
    return sorted(facts, key=lambda f: f["rank"])


@pytest.mark.parametrize("nproc", [2, 4])
def test_every_collective_op_and_dtype_equals_gloo_and_the_rank_rules_hold(procs, nproc):
    # a 64 KiB slot: the larger tensors take several rounds through the segment; two
    # ranks reduce every round whole, four split the larger rounds (both paths)
    ranks = _facts(_torchrun(procs, HERE / "ops_job.py", nproc=nproc,
                             NEURONMP_COLLECTIVE_SLOT_KB="64"))
    assert [r["rank"] for r in ranks] == list(range(nproc))
    total = float(sum(range(1, nproc + 1)))
    for r in ranks:
        assert r["bad"] == [], r["bad"]
        assert r["backend"] == "neuron"
        # the all_gathers above a slot took the path that reads the peers in place
        assert r["in_place"] is True
        # every all_reduce of shareable tensors reduced them where they live; one rank's
        # unshareable tensor sent every rank the segment's way
        assert r["mapped"] == [r["mapped"][1], r["mapped"][1], 0, True]
        assert r["claimed"][1] == ranks[0]["claimed"][1] > 0
        # back-to-back small all_reduces: one arrival each, and no call read a slot
        # its peer had already rewritten for the next call
        b2b = r["back_to_back"]
        assert b2b["torn"] == [] and b2b["arrivals"] == b2b["calls"], b2b
        # async Work: wait() True, result() and the future's value the outputs
        assert r["waited"] is True and r["is_completed"] is True
        assert r["result"] == r["future"] == [[total] * 4]
        # TorchNeuron's rank rules: LOCAL_WORLD_SIZE devices, this rank's is LOCAL_RANK
        assert r["device_count"] == nproc and r["device"] == f"neuron:{r['rank']}"
        assert r["visible"] == str(r["rank"])
        assert r["refused"]["bxor_float"] == [
            "all_reduce", "BXOR needs an integer or bool tensor, not torch.float32"]
        assert r["refused"]["uneven"].startswith(
            "alltoall_base: Only even split sizes are supported. Got output_split_sizes: [2, 1")
        # destroy_process_group releases every segment the rank held
        assert r["released"] == {"held": True, "after_destroy": []}
        # neuronmp-top: the rank's core held, busy and counting its collectives
        assert r["top"] == {"held": True, "busy": True, "requests": True}
        assert r["other"].startswith("Attempted to access device that doesn't attach "
                                     "to this process")
    # every claimed piece was reduced by exactly one rank
    assert sum(r["claimed"][0] for r in ranks) == ranks[0]["claimed"][1]


def test_docs_example_unmodified_under_torchrun_and_neuronmp_run(procs):
    out = _torchrun(procs, EXAMPLE)
    assert "rank 0 (LOCAL_RANK 0, neuron:0): sum = 3.0" in out
    assert "rank 1 (LOCAL_RANK 1, neuron:1): sum = 3.0" in out
    job = procs.popen([sys.executable, "-m", "neuronmp.cli.run", "--nproc-per-node", "2",
                       "--cores", "2-3", str(EXAMPLE)], env=env_with(),
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
    out, err = job.communicate(timeout=300)
    assert job.returncode == 0, err[-4000:]
    assert "rank 0 (LOCAL_RANK 0, neuron:0): sum = 3.0" in out
    assert "rank 1 (LOCAL_RANK 1, neuron:1): sum = 3.0" in out


def test_runtime_started_before_init_process_group_is_refused(tmp_path):
    proc = run("""
        import torch, torch.distributed as dist
        torch.ones(1, device="neuron")     # the runtime starts here
        try:
            dist.init_process_group("neuron")
        except AssertionError as exc:
            print(exc)
        """, tmp_path, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(launcher.free_port()))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == ("Neuron runtime should not be initialized before the "
                                   "init_process_group")


def test_ddp_and_fsdp2_train_to_gloos_parameters(procs):
    ranks = _facts(_torchrun(procs, HERE / "train_job.py"))
    for r in ranks:
        assert r["ddp_equal"] is True, r
        assert r["fsdp_equal"] is True, r
        assert r["ddp_moved"] is True   # the model did change: the comparison is not vacuous


def test_two_launchers_as_two_nodes_fall_back_to_gloo(procs, tmp_path):
    port = launcher.free_port()
    jobs = [procs.popen([sys.executable, "-m", "neuronmp.cli.run", "--nnodes", "2",
                         "--node-rank", str(node), "--master-addr", "127.0.0.1",
                         "--master-port", str(port), "--nproc-per-node", "2",
                         "--cores", f"{4 * node}-{4 * node + 1}", str(HERE / "nodes_job.py")],
                        env=env_with(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        text=True, cwd="/")
            for node in (0, 1)]
    outs = []
    for job in jobs:
        out, err = job.communicate(timeout=300)
        assert job.returncode == 0, err[-4000:]
        outs.append(out)
    ranks = _facts("".join(outs))
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    for r in ranks:
        assert r["transport"] == "gloo"
        assert r["sum"] == [10.0] * 3 and r["gathered"] == [0.0, 1.0, 2.0, 3.0]
        assert r["device"] == f"neuron:{r['rank'] % 2}"


@pytest.mark.parametrize("nproc", [2, 4])
def test_all_reduces_of_ranks_arriving_apart_sum_exactly(procs, nproc):
    # each rank sleeps a random while of its own before every call: any rank comes
    # first or last, and the last to come reduces a small all_reduce for everyone
    calls = 300
    ranks = _facts(_torchrun(procs, HERE / "skew_job.py", calls, nproc=nproc,
                             NEURONMP_COLLECTIVE_SLOT_KB="64"))
    assert [r["rank"] for r in ranks] == list(range(nproc))
    small = ranks[0]["small"]
    for r in ranks:
        assert r["wrong"] == [], r
        assert r["small"] == small
    # every small call was reduced by exactly one rank, the last to arrive, and the
    # random sleeps made more than one rank that rank
    last = [r["reduced_last"] for r in ranks]
    assert sum(last) == small, last
    assert sum(1 for n in last if n) >= 2, last
