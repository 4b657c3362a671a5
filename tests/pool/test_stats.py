"""neuronmp.pool.stats: per-core counters in shared memory, read by any process."""
from __future__ import annotations

import json
import os

import torch
from pool_support import Affine, script_bytes

from neuronmp import topology
from neuronmp.pool.stats import read_all
from neuronmp.session import current as _current_session


def test_stats_block_counts_only_its_own_slots():
    from neuronmp.pool.stats import StatsBlock

    block = StatsBlock.create([5, 7])
    try:
        assert block.slots == 2  # not the page the segment was rounded up to
        block.add(0, "submitted", 3)
        block.add(1, "submitted", 4)
        assert block.others_submitted(0) == 4 and block.others_submitted(1) == 3
        block.finished(1, 250)
        snap = block.snapshot()
        assert [s.core for s in snap] == [5, 7]
        assert (snap[1].done, snap[1].busy_ns, snap[1].in_flight) == (1, 250, 3)
    finally:
        block.close()


def test_statistics_readable_from_another_process(procs):
    data, _ = script_bytes(Affine().eval(), torch.zeros(1, 8))
    pool = _current_session().pool
    mid = pool.load(2, data)
    for _ in range(5):
        pool.call(2, mid, (torch.zeros(1, 8),)).result()
    code = ("import json; from neuronmp.pool.stats import read_all; "
            "print(json.dumps({c: s._asdict() for c, s in read_all().items()}))")
    out = json.loads(procs.python(code).communicate(timeout=60)[0])
    assert out["2"]["done"] >= 6 and out["2"]["submitted"] == out["2"]["done"]
    assert out["2"]["owner"] == os.getpid() and out["2"]["pid"] == pool.worker_pid(2)
    assert out["2"]["busy_ns"] > 0 and out["0"]["done"] == 0
    assert read_all()[2].in_flight == 0
    assert topology.from_env().num_cores == len(out)

