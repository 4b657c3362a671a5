"""Ranks that call a collective with arguments that disagree: every rank raises,
naming every rank's call, and the group works on afterwards (mismatch_job.py runs
every collective with the last rank's size, dtype or call shape differing)."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from torchneuron_support import env_with

pytestmark = pytest.mark.timeout(900)
HERE = pathlib.Path(__file__).parent

# the shape cases the odd rank refuses by itself (its own arguments do not fit the
# group); its peers learn of it where they meet it
REFUSED_THERE = {"all_gather", "all_gather_into_tensor", "reduce_scatter",
                 "reduce_scatter_tensor", "all_to_all", "all_to_all_single"}
# the name each case's error gives (torch's coalesced and list forms call these)
OPS = {"all_reduce_mapped": "all_reduce"}
# the op TorchNeuron runs a collective as, which its execution error names
RUNS_AS = {"reduce": "all_reduce", "broadcast": "all_reduce",
           "all_reduce_coalesced": "all_reduce", "gather": "all_gather",
           "all_gather_into_tensor": "all_gather", "all_gather_coalesced": "all_gather",
           "scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
           "all_to_all_single": "all_to_all"}


@pytest.mark.parametrize("nproc", [2, 3])
def test_every_collective_with_ranks_that_disagree_raises_on_every_rank(
        procs, tmp_path, nproc):
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--standalone", str(HERE / "mismatch_job.py"), "60", str(tmp_path)]
    job = procs.popen(argv, env=env_with(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      text=True, cwd="/")
    _, err = job.communicate(timeout=800)
    assert job.returncode == 0, err[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text())["facts"]
             for r in range(nproc)]
    odd, n = nproc - 1, 8 * nproc
    # every case ran: 12 collectives by size and dtype, the mapped all_reduce by both,
    # and 14 shapes (the barrier has only that one)
    assert len(ranks[0]) == 12 * 2 + 2 + 14
    for case in ranks[0]:
        name, kind = case.split("/")
        op = OPS.get(name, name)
        for rank, facts in enumerate(ranks):
            fact = facts[case]
            where = (case, rank, fact)
            assert fact["raised"] is not None, where
            assert fact["pickled"] is True and fact["after"] is True, where
            if rank == odd and kind == "shape" and name in REFUSED_THERE:
                # the odd rank's own refusal, as when it is alone in the mistake
                want = {"all_to_all_single": "NotImplementedError",
                        "all_gather_into_tensor": "CollectiveOpError",
                        "reduce_scatter_tensor": "CollectiveOpError",
                        "all_to_all": "CollectiveOpError"}.get(name, "CollectiveUsageError")
                assert fact["raised"] == want, where
                continue
            assert fact["raised"] == "CollectiveMismatchError" and fact["usage"], where
            # as TorchNeuron's failed execution: a RuntimeError naming the op it runs as
            assert fact["runtime"] is True, where
            named = fact["fields"]["op"]
            assert fact["msg"].startswith("NRT Execution error occurred on Neuron for "
                                          f"operation={RUNS_AS.get(named, named)}: "
                                          f"{named}: "), where
            fields = fact["fields"]
            assert fields["differ"] == [odd], where
            sent = fields["sent"]
            assert len(sent) == nproc and sent[0] == sent[odd - 1] != sent[odd], where
            for r in range(nproc):
                assert f"rank {r}" in fact["msg"], where
            mine, theirs = sent[0], sent[odd]
            if kind == "size":
                assert mine["op"] == theirs["op"], where
                assert (mine["numel"], theirs["numel"]) in ((n, n + nproc),
                                                          (1 << 18, (1 << 18) + nproc)), where
            elif kind == "dtype":
                assert (mine["dtype"], theirs["dtype"]) == ("torch.float32",
                                                            "torch.int32"), where
            elif name in REFUSED_THERE:
                assert theirs["refused"] and not mine["refused"], where
            elif name == "barrier":
                assert (mine["op"], theirs["op"]) == ("barrier", "all_reduce"), where
            elif name in ("reduce", "broadcast", "gather", "scatter"):
                assert (mine["root"], theirs["root"]) == (0, 1), where
            else:
                assert (mine["reduce_op"], theirs["reduce_op"]) == ("SUM", "MAX"), where
            assert op in (mine["op"], fields["op"]), where
