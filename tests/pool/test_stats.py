"""neuronmp.pool.stats: per-core counters in shared memory, read by any process."""
from __future__ import annotations

import json
import os

import torch
from pool_support import Affine, script_bytes

from neuronmp.host import settings
from neuronmp.pool.stats import read_all
from neuronmp.session.session import current as _current_session


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
    assert settings.get("topology").num_cores == len(out)



def test_latency_samples_keep_the_last_pairs_and_drop_the_ones_being_overwritten():
    from neuronmp.pool.stats import SAMPLES, StatsBlock, samples_between

    block = StatsBlock.create([3])
    try:
        rec = block.recorder(0)
        for i in range(SAMPLES + 88):
            assert rec.ran(1000 + i, 2000 + i) == i
        (st, ring), = read_all_samples().values()
        assert st.samples == st.runs == SAMPLES + 88
        got = samples_between(ring, 0, st.samples)
        assert len(got) == SAMPLES - 1                 # the oldest may be being overwritten
        assert got[-1] == (1000 + SAMPLES + 87, 2000 + SAMPLES + 87)
        assert got[0] == (1000 + 89, 2000 + 89)
        assert samples_between(ring, st.samples - 5, st.samples) == [
            (1000 + i, 2000 + i) for i in range(SAMPLES + 83, SAMPLES + 88)]
        assert samples_between(ring, st.samples, st.samples) == []
    finally:
        block.close()


def read_all_samples():
    from neuronmp.pool.stats import read_samples

    return read_samples()


def test_executions_their_errors_and_memory_by_kind(procs):
    """A worker counts each execution's outcome, a sample pair, and what its models hold:
    weights, graph, the last execution's tensors; an error in the model is a model error."""
    import time

    class Picky(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(16, 16))

        def forward(self, x):
            if bool(x.sum() < 0):
                raise ValueError("negative input")
            return x @ self.w

    data, _ = script_bytes(Picky())
    pool = _current_session().pool
    mid = pool.load(1, data)
    for _ in range(4):
        pool.call(1, mid, (torch.ones(2, 16),)).result()
    try:
        pool.call(1, mid, (-torch.ones(2, 16),)).result()
    except Exception:  # noqa: BLE001 - the model's ValueError, as a ModelError
        pass
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:   # written after each answer left
        st = read_all()[1]
        if st.runs == 4 and st.model_errors == 1:
            break
        time.sleep(0.01)
    assert (st.runs, st.model_errors, st.runtime_errors, st.samples) == (4, 1, 0, 4)
    assert st.constants == 16 * 16 * 4 and 0 < st.model_code < len(data)
    assert st.tensors == 2 * (2 * 16 * 4)            # its input and its output
    (_, ring) = read_all_samples()[1]
    from neuronmp.pool.stats import samples_between

    pairs = samples_between(ring, 0, st.samples)
    assert len(pairs) == 4 and all(0 < dev <= total for dev, total in pairs)
    pool.unload(1, mid)
    assert (read_all()[1].constants, read_all()[1].model_code, read_all()[1].tensors) == (0, 0, 0)
