"""The calls TorchNeuron's process group refuses are refused alike here, on every rank,
with its class and the words its callers match, and the group works on after each;
integer AVG truncates and coalesced lists leave their empty tensors out
(checks_job.py makes every call in one two-rank torchrun job)."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from torchneuron_support import env_with

pytestmark = pytest.mark.timeout(900)
HERE = pathlib.Path(__file__).parent

# case -> (class, a RuntimeError as TorchNeuron's, the words its message holds)
REFUSED = {
    "all_reduce/cpu": ("CollectiveUsageError", False, "Expected neuron device, got cpu"),
    "broadcast/cpu": ("CollectiveUsageError", False, "Expected neuron device, got cpu"),
    "reduce_scatter/one_cpu": ("CollectiveUsageError", False,
                               "Expected neuron device, got cpu"),
    "all_to_all/cpu": ("CollectiveUsageError", False, "Expected neuron device, got cpu"),
    "reduce/root": ("CollectiveUsageError", False,
                    "Invalid rootRank 3 for broadcast with world size 2"),
    "broadcast/root": ("CollectiveUsageError", False,
                       "Invalid rootRank 999 for broadcast with world size 2"),
    "gather/root": ("CollectiveUsageError", False,
                    "Invalid rootRank 3 for broadcast with world size 2"),
    "scatter/root": ("CollectiveUsageError", False,
                     "Invalid rootRank 3 for broadcast with world size 2"),
    "reduce_scatter/identical": ("CollectiveOpError", True,
                                 "when input and output shapes are identical, replica group "
                                 "must have size 1, got 2"),
    "reduce_scatter/uneven": ("CollectiveOpError", True,
                              "scatter dimension 0: input size (8) must be evenly divisible "
                              "by replica group size (2)"),
    "reduce_scatter/product": ("CollectiveOpError", True,
                               "unsupported reduce operation 'PRODUCT', supported ops: "
                               "['SUM', 'AVG', 'MIN', 'MAX']"),
    "reduce_scatter_tensor/bxor": ("CollectiveOpError", True,
                                   "unsupported reduce operation 'BXOR'"),
    "reduce_scatter_tensor/input": ("CollectiveOpError", True,
                                    "scatter dimension 0: input size (21) must be evenly "
                                    "divisible by replica group size (2), but 21 / 2 = 10.5. "
                                    "Expected output size: 10, actual output size: 10"),
    "reduce_scatter_tensor/output": ("CollectiveOpError", True,
                                     "input size (20) must be evenly divisible by replica "
                                     "group size (2), but 20 / 2 = 10.0. Expected output "
                                     "size: 10, actual output size: 5"),
    "reduce_scatter_tensor_coalesced/rows": ("CollectiveUsageError", False,
                                             "requires all input tensors to have the same "
                                             "shape except dimension 0. Got shapes: "),
    "all_reduce/empty": ("CollectiveOpError", True,
                         "tensors cannot be empty, found empty tensors at indices: [0]"),
    "reduce/empty": ("CollectiveOpError", True,
                     "tensors cannot be empty, found empty tensors at indices: [0]"),
    "all_gather/empty": ("CollectiveUsageError", False,
                         "tensors cannot have zero size in dimension 0, found: "
                         "tensor[0]: torch.Size([0])"),
    "gather/empty": ("CollectiveOpError", True,
                     "tensors cannot have zero size in dimension 0, found: "
                     "tensor[0]: torch.Size([0])"),
    "all_gather_into_tensor/size": ("CollectiveOpError", True,
                                    "output shape mismatch, expected (10,), got "
                                    "torch.Size([11])"),
    "all_to_all/list": ("CollectiveOpError", True,
                        "number of input tensors (1) must equal world size (2)"),
    "all_to_all/shape": ("CollectiveOpError", True,
                         "all input tensors must have same shape, expected torch.Size([5]) "
                         "but found: tensor[1]: torch.Size([3])"),
    "all_gather_coalesced/shape": ("CollectiveOpError", True,
                                   "output tensor at index 2 has shape torch.Size([4]), "
                                   "expected torch.Size([3]) to match input tensor 1"),
    "all_to_all_single/uneven": ("NotImplementedError", True,
                                 "Only even split sizes are supported. Got "
                                 "input_split_sizes: [3, 1]"),
    "all_to_all_single/equal": ("NotImplementedError", True,
                                "Only even split sizes are supported. Got "
                                "input_split_sizes: [2, 2]"),
    "all_to_all_single/ones": ("CollectiveOpError", True,
                               "split_with_sizes expects split_sizes to sum exactly to 4 "
                               "(input tensor's size at dimension 0), but got "
                               "split_sizes=[1, 1]"),
}


def test_refused_calls_raise_torchneurons_class_and_words_and_integer_avg_truncates(
        procs, tmp_path):
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--standalone", str(HERE / "checks_job.py"), str(tmp_path)]
    job = procs.popen(argv, env=env_with(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      text=True, cwd="/")
    _, err = job.communicate(timeout=600)
    assert job.returncode == 0, _each_rank(err)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert set(r["facts"]) == set(REFUSED)
        for case, (cls, runtime, words) in REFUSED.items():
            fact = r["facts"][case]
            where = (r["rank"], case, fact)
            assert fact["raised"] == cls, where
            assert fact["runtime"] is runtime, where
            assert words in fact["msg"], where
            assert fact["pickled"] is True and fact["after"] is True, where
        # the refusals neuronmp makes alone keep refining ValueError
        assert all(f["value"] for f in r["facts"].values() if f["raised"].startswith("C"))
        res = r["results"]
        # (1 + 2) / 2 and (-1 - 2) / 2 toward zero; reduce_scatter's AVG alike
        assert res["avg"] == [1, -1] and res["avg_rs"] == [1]
        assert res["coalesced"] == [[3.0, 3.0], [], [2.0, 2.0, 2.0]]
        assert res["gathered"] == [[1.0, 1.0, 2.0, 2.0], []]
        assert res["objects"] == [{"rank": 0}, {"rank": 1}]
        # (2, 2) into (2,): rank r's row of the two ranks' sums; (4, 3) into (1, 2, 3)
        row = r["rank"]
        assert res["shorter"] == [2 * (2 * row + c) + 1 for c in range(2)]
        assert res["deeper"] == [[[2 * (3 * (2 * row + i) + c) + 1 for c in range(3)]
                                  for i in range(2)]]


def _each_rank(err: str) -> str:
    """Each rank's own last lines, then the lines that carry no rank's prefix (a rank
    that dies outside the process group's excepthook writes them), then torchrun's end:
    the last 4000 characters alone showed a peer's traceback, not the dead rank's."""
    lines = err.splitlines()
    parts = []
    for rank in range(2):
        mine = [line for line in lines if line.startswith(f"[rank{rank}]:")]
        parts.append("\n".join(mine)[-2000:])
    unprefixed = [line for line in lines if not line.startswith("[rank")]
    parts.append("\n".join(unprefixed)[:3000])
    parts.append(err[-1000:])
    return "\n---\n".join(parts)
