"""DTensor's sharding rule for ``linear_backward`` (neuronmp/torchneuron/sharding.py):
two ranks started by hand run ``linear`` on DTensors of the ``neuron`` device, laid out
four ways, and get the CPU's output and gradients (sharding_job.py)."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from torchneuron_support import env_with, rank_facts

from neuronmp.launch import launcher

pytestmark = pytest.mark.timeout(600)
HERE = pathlib.Path(__file__).parent
WORLD = 2


def _ranks(procs):
    port = str(launcher.free_port())
    jobs = [procs.popen(
        [sys.executable, str(HERE / "sharding_job.py")],
        env=env_with(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
                     WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                     LOCAL_WORLD_SIZE=str(WORLD)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
        for rank in range(WORLD)]
    return rank_facts(jobs)


# the gradients' placements each layout's row of the rule gives, with no collective in
# the backward (the operands already match a row)
EXPECTED = {
    "in_features": ["S(1)", "S(1)", "R"],
    "out_features": ["P(sum)", "S(0)", "S(0)"],
    "batch": ["S(0)", "P(sum)", "P(sum)"],
    "replicated": ["R", "R", "R"],
}


def test_linear_on_dtensors_gives_the_cpus_output_and_gradients_by_the_rule(procs):
    ranks = _ranks(procs)
    assert [r["rule_is_ours"] for r in ranks] == [True] * WORLD
    for r, layout in ((r, layout) for r in ranks for layout in EXPECTED):
        case = r["cases"][layout]
        assert case["out"], (r["rank"], layout)
        assert case["grads"] == [True, True, True], (r["rank"], layout, case)
        assert case["on_device"] == ["neuron"] * 3
        assert case["device_ops"] == ["aten::linear_backward"], case
        assert case["backward_comms"] == 0, case
    for r in ranks:
        assert {k: c["grad_placements"] for k, c in r["cases"].items()} == EXPECTED
