"""Sub-groups of the ``neuron`` process group as TorchNeuron has them: all_to_all only
over the group sizes and placements its hardware exchanges in (refused with its class
and words otherwise), and a group that leaves out world rank 0 -- the store's host --
works although rank 0 has reached destroy_process_group (subgroups_job.py: one
four-rank job whose rank 0 hosts the store)."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from torchneuron_support import env_with

from neuronmp.errors import CollectiveOpError, CollectiveUsageError
from neuronmp.launch.launcher import free_port
from neuronmp.torchneuron.collectives import checks

pytestmark = pytest.mark.timeout(900)
HERE = pathlib.Path(__file__).parent


def test_subgroups_refuse_unsupported_exchanges_and_outlive_rank_0(procs, tmp_path):
    argv = [sys.executable, str(HERE / "subgroups_job.py"), str(tmp_path), str(free_port())]
    job = procs.popen(argv, env=env_with(NEURONMP_TOPOLOGY="trn2.48xlarge"),
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
    _, err = job.communicate(timeout=600)
    assert job.returncode == 0, err[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r in (0, 1):
        for pair in (ranks[r]["pair"], ranks[r]["pair_single"]):
            assert pair["raised"] == "CollectiveOpError" and pair["runtime"], pair
            assert ("unsupported world size 2, supported sizes: 4, 8, 16, or multiples of "
                    "32" in pair["msg"]), pair
    assert ranks[2]["pair"] is None and ranks[3]["pair"] is None
    for r in (0, 1, 2):
        three = ranks[r]["three"]
        assert three["raised"] == "CollectiveUsageError" and three["value"], three
        assert ("Cannot create global_replica_group when world_size:4 is not divisible by "
                "group_size: 3." in three["msg"]), three
    # ranks 2 and 3 gathered each other's rows after ranks 0 and 1 left the job
    for r in (2, 3):
        assert ranks[r]["gathered"] == [[20, 21], [30, 31]], ranks[r]
    assert "gathered" not in ranks[0] and "gathered" not in ranks[1]


@pytest.mark.parametrize("ranks, found", [
    ([0, 2, 4, 6], "group[1] [1, 3, 5, 7] starts at rank 1"),
    ([2, 3, 4, 5], "group[0] [2, 3, 4, 5] starts at rank 2"),
    # the others, [0, 9, ..., 15], start at 0: only the group itself is named
    ([1, 2, 3, 4, 5, 6, 7, 8], "group[0] [1, 2, 3, 4, 5, 6, 7, 8] starts at rank 1"),
])
def test_exchange_groups_must_start_at_multiples_of_their_size(ranks, found):
    world = 16 if len(ranks) == 8 else 8
    exc = checks.exchange_groups("all_to_all", ranks, world)
    assert isinstance(exc, CollectiveOpError) and isinstance(exc, RuntimeError)
    assert str(exc).endswith(f"replica group start ranks must be multiples of world size "
                             f"({len(ranks)}), found: {found}")


def test_exchange_groups_that_fit_and_the_world_itself_pass():
    assert checks.exchange_groups("all_to_all", [4, 5, 6, 7], 8) is None
    assert checks.exchange_groups("all_to_all", [0, 1, 2, 3], 8) is None
    assert checks.exchange_groups("all_to_all", [0, 1], 2) is None   # the world's own
    exc = checks.exchange_groups("all_to_all", [0, 1, 2], 8)
    assert isinstance(exc, CollectiveUsageError) and isinstance(exc, ValueError)
    assert "world_size:8 is not divisible by group_size: 3." in str(exc)
