"""Answers written straight into the caller's buffers (``pool.call(..., into=)``): one
copy out of the response ring, and nothing written when the answer does not fit,
the guard is closed, the model fails or the worker dies."""
import mmap
import os
import signal
import time

import pytest
import torch
from pool_support import script_bytes

import neuronmp
from neuronmp.errors import ModelError, WorkerDiedError
from neuronmp.pool.answer import Destination, Joint
from neuronmp.session.model import model_of
from neuronmp.session.session import current as _current_session
from neuronmp.shm import _guard


class PlusOne(torch.nn.Module):
    def forward(self, x):
        return x + 1


class Pair(torch.nn.Module):
    def forward(self, x):
        return x + 1, x.sum(dim=1)


class Reduce(torch.nn.Module):
    def forward(self, x):
        return x.sum(dim=0, keepdim=True)   # one row whatever the batch


class Widen(torch.nn.Module):
    def forward(self, x):
        return x.repeat(1, 1 << 16)  # 4 MiB per row: over half the ring, on the arena


class Failing(torch.nn.Module):
    def forward(self, x):
        if bool(x.sum() < 0):
            raise ValueError("negative input is not allowed")
        return x + 1


class Heavy(torch.nn.Module):
    def forward(self, x):
        for _ in range(60):
            x = torch.tanh(x @ x)
        return x


def _loaded(module):
    pool = _current_session().pool
    core = pool.cores[0]
    data, mod = script_bytes(module)
    return pool, core, pool.load(core, data), mod


def test_the_answer_is_the_callers_buffer_and_others_on_the_ring_are_copied_as_usual():
    pool, core, mid, _mod = _loaded(PlusOne())
    x = torch.randn(4, 1000)
    buf = torch.full((4, 1000), -7.0)
    before = pool.call(core, mid, (x * 2,))   # answered on the same ring around it
    mine = pool.call(core, mid, (x,), into=Destination([buf]))
    after = pool.call(core, mid, (x * 3,))
    torch.testing.assert_close(after.result(timeout=30), x * 3 + 1)
    torch.testing.assert_close(before.result(timeout=30), x * 2 + 1)
    out = mine.result(timeout=30)
    assert out.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(buf, x + 1)


def test_several_outputs_go_into_their_buffers_in_order():
    pool, core, mid, _mod = _loaded(Pair())
    x = torch.randn(3, 50)
    bufs = [torch.zeros(3, 50), torch.zeros(3)]
    out = pool.call(core, mid, (x,), into=Destination(bufs)).result(timeout=30)
    assert isinstance(out, tuple) and [o.data_ptr() for o in out] == \
        [b.data_ptr() for b in bufs]
    torch.testing.assert_close(bufs[0], x + 1)
    torch.testing.assert_close(bufs[1], x.sum(dim=1))


def test_an_answer_on_the_writers_arena_goes_into_the_buffer_too():
    pool, core, mid, mod = _loaded(Widen())
    x = torch.randn(2, 16)
    buf = torch.zeros(2, 16 << 16)
    plain = pool.call(core, mid, (x * 2,))
    out = pool.call(core, mid, (x,), into=Destination([buf])).result(timeout=30)
    assert out.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(buf, mod(x))
    torch.testing.assert_close(plain.result(timeout=30), mod(x * 2))


@pytest.mark.parametrize("why", ["closed", "shape", "dtype", "count"])
def test_a_buffer_that_does_not_fit_or_is_closed_is_left_untouched(why):
    pool, core, mid, _mod = _loaded(PlusOne())
    x = torch.randn(4, 10)
    bufs = {"closed": [torch.zeros(4, 10)], "shape": [torch.zeros(2, 20)],
            "dtype": [torch.zeros(4, 10, dtype=torch.float64)],
            "count": [torch.zeros(4, 10), torch.zeros(4, 10)]}[why]
    into = Destination(bufs)
    if why == "closed":
        into.close()
    out = pool.call(core, mid, (x,), into=into).result(timeout=30)
    torch.testing.assert_close(out, x + 1)
    assert all(out.data_ptr() != b.data_ptr() for b in bufs)
    assert all(not b.any() for b in bufs)


def test_a_buffer_in_a_mapping_whose_file_shrank_gives_fresh_tensors_not_sigbus(runtime_dir):
    # the server's output regions: a client's file it maps, copied into through the
    # SIGBUS guard; the client shrinks it before the answer is read
    pool, core, mid, _mod = _loaded(PlusOne())
    x = torch.randn(4, 4096)
    path = os.path.join(runtime_dir, "into-region")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, x.nbytes)
        mm = mmap.mmap(fd, x.nbytes)
        buf = torch.frombuffer(memoryview(mm), dtype=torch.float32).reshape(4, 4096)
        out = pool.call(core, mid, (x,), into=Destination([buf], copy=_guard.copy))
        torch.testing.assert_close(out.result(timeout=30), x + 1)
        assert out.result().data_ptr() == buf.data_ptr()   # the guarded copy, in place
        os.ftruncate(fd, 0)
        out = pool.call(core, mid, (x * 2,), into=Destination([buf], copy=_guard.copy))
        got = out.result(timeout=30)
        assert got.data_ptr() != buf.data_ptr()
        torch.testing.assert_close(got, x * 2 + 1)   # (the mapping goes with its views)
    finally:
        os.close(fd)
        os.unlink(path)


def test_a_failed_call_writes_nothing():
    pool, core, mid, _mod = _loaded(Failing())
    buf = torch.zeros(2, 5)
    with pytest.raises(ModelError, match="negative input"):
        pool.call(core, mid, (-torch.ones(2, 5),), into=Destination([buf])).result(timeout=30)
    assert not buf.any()
    torch.testing.assert_close(pool.call(core, mid, (torch.ones(2, 5),)).result(timeout=30),
                               torch.full((2, 5), 2.0))


def test_a_call_whose_worker_dies_writes_nothing_and_the_next_one_does():
    pool, core, mid, mod = _loaded(Heavy())
    x = torch.randn(768, 768) / 30
    buf = torch.zeros(768, 768)
    slot = pool.cores.index(core)
    loaded = pool.stats()[slot].running   # the load's id may show until the worker is idle
    answer = pool.call(core, mid, (x,), into=Destination([buf]))
    victim = pool.worker_pid(core)
    deadline = time.monotonic() + 30
    while pool.stats()[slot].running in (0, loaded) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert pool.stats()[slot].running not in (0, loaded), "the worker never started the call"
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(WorkerDiedError):
        answer.result(timeout=30)
    assert not buf.any()
    out = pool.call(core, mid, (x,), into=Destination([buf])).result(timeout=60)
    assert out.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(buf, mod(x))


def test_requests_resent_to_a_replacement_keep_their_buffers():
    pool, core, mid, _mod = _loaded(PlusOne())
    x = torch.randn(4, 10)
    os.kill(pool.worker_pid(core), signal.SIGKILL)
    bufs = [torch.zeros(4, 10) for _ in range(3)]
    answers = [pool.call(core, mid, (x + i,), into=Destination([b])) for i, b in enumerate(bufs)]
    for i, (a, b) in enumerate(zip(answers, bufs)):
        assert a.result(timeout=60).data_ptr() == b.data_ptr()
        torch.testing.assert_close(b, x + i + 1)


def test_a_device_time_answer_is_held_until_due_then_answered_with_the_buffer():
    with neuronmp.device_time_context("20000"):
        traced = neuronmp.trace(PlusOne(), torch.zeros(2, 64))
    model = model_of(traced)
    x = torch.randn(2, 64)
    buf = torch.zeros(2, 64)
    out = model.submit([x], into=Destination([buf])).result(timeout=30)
    assert out[0].data_ptr() == buf.data_ptr()
    torch.testing.assert_close(buf, x + 1)


def test_a_call_cut_into_batches_ignores_the_buffers():
    traced = neuronmp.dynamic_batch(neuronmp.trace(PlusOne(), torch.zeros(2, 8)))
    model = model_of(traced)
    x = torch.randn(5, 8)   # padded to 6 rows, three traced batches, joined: not one answer
    buf = torch.zeros(5, 8)
    out = model.submit([x], into=Destination([buf])).result(timeout=30)
    torch.testing.assert_close(out[0], x + 1)
    assert not buf.any()


def test_a_destination_takes_contiguous_cpu_tensors_only():
    with pytest.raises(ValueError, match="contiguous CPU"):
        Destination([torch.zeros(4, 4).t()])


def _parts_into_a_joint(pool, core, mid, xs, joint, expect=True):
    answers = [pool.call(core, mid, (x,), into=joint) for x in xs]
    if expect:
        joint.expect(answers)
    return [a.result(timeout=30) for a in answers]


def test_a_joint_takes_each_parts_outputs_into_its_rows():
    pool, core, mid, _mod = _loaded(Pair())
    xs = [torch.randn(3, 20), torch.randn(3, 20), torch.randn(2, 20)]
    joint = Joint([3, 3, 2])
    results = _parts_into_a_joint(pool, core, mid, xs, joint)
    assert all(r is joint for r in results)
    out = joint.join(results)
    assert [o.data_ptr() for o in out] == [t.data_ptr() for t in joint.tensors]
    x = torch.cat(xs)
    torch.testing.assert_close(out[0], x + 1)
    torch.testing.assert_close(out[1], x.sum(dim=1))


@pytest.mark.parametrize("why", ["not expected", "closed", "rows"])
def test_a_joint_part_not_written_in_place_is_copied_in_at_the_join(why):
    pool, core, mid, _mod = _loaded(PlusOne())
    xs = [torch.randn(2, 8), torch.randn(2, 8)]
    joint = Joint([2, 3] if why == "rows" else [2, 2])
    if why == "closed":
        joint.close()
    results = _parts_into_a_joint(pool, core, mid, xs, joint, expect=why != "not expected")
    if why == "rows":   # part 1 has 2 rows where 3 were declared: the parts are joined
        assert results[0] is joint and results[1] is not joint    # as they came
    else:
        assert all(r is not joint for r in results) and joint.tensors is None
    torch.testing.assert_close(joint.join(results)[0], torch.cat(xs) + 1)


def test_a_joint_with_some_parts_in_place_copies_in_the_others():
    pool, core, mid, _mod = _loaded(PlusOne())
    xs = [torch.randn(2, 8), torch.randn(2, 8)]
    joint = Joint([2, 2])
    first = pool.call(core, mid, (xs[0],)).result(timeout=30)    # came as tensors
    second = pool.call(core, mid, (xs[1],), into=joint)
    joint.expect([object(), second])
    results = [first, second.result(timeout=30)]
    assert results[1] is joint
    torch.testing.assert_close(joint.join(results)[0], torch.cat(xs) + 1)


def test_a_joint_of_parts_that_are_not_their_rows_concatenates_them():
    pool, core, mid, _mod = _loaded(Reduce())
    xs = [torch.randn(2, 8), torch.randn(2, 8)]
    joint = Joint([2, 2])
    results = _parts_into_a_joint(pool, core, mid, xs, joint)
    assert all(r is not joint for r in results) and joint.tensors is None
    torch.testing.assert_close(joint.join(results)[0],
                               torch.cat([x.sum(dim=0, keepdim=True) for x in xs]))
