"""Shared-memory ring transport: real segments, real processes, real SIGKILLs."""
import os
import queue
import signal
import threading
import time

import pytest
import torch

from neuronmp.errors import PeerDiedError, ShmSpaceError
from neuronmp.host import procid
from neuronmp.ipc import codec
from neuronmp.ipc.ring import Ring
from neuronmp.shm.segment import Segment, sweep


def _shm(runtime_dir):
    """The segments (a writer's .live file beside them is liveness.py's, not a segment)."""
    path = os.path.join(runtime_dir, "shm")
    names = sorted(os.listdir(path)) if os.path.isdir(path) else []
    return [n for n in names if not n.endswith(".live")]





def test_frames_bigger_than_half_the_ring_reuse_the_writers_arenas(pair, runtime_dir, next_kind):
    owner, peer = pair
    big = torch.randn(owner.capacity // 2)  # 2x the ring's bytes
    owner.send((big, "tag"))
    assert next_kind(peer) == codec.ARENA
    assert len(_shm(runtime_dir)) == 2  # the ring and the first arena
    got = peer.recv(timeout=5)
    assert got[1] == "tag" and torch.equal(got[0], big)
    first = _shm(runtime_dir)
    # the next big frame overwrites that arena: what recv returned owns its memory
    owner.send(-big)
    assert _shm(runtime_dir) == first and next_kind(peer) == codec.ARENA
    assert torch.equal(got[0], big)
    with peer.recv_view(timeout=5) as frame:
        assert torch.equal(frame.value, -big)
        owner.send(big * 2)  # the first arena is viewed: a second one
        assert next_kind(peer) == codec.ARENA and len(_shm(runtime_dir)) == 3
        owner.send(big * 3)  # both are in use: a one-off segment
        assert len(_shm(runtime_dir)) == 4
        assert torch.equal(frame.value, -big)
    assert torch.equal(peer.recv(timeout=5), big * 2)
    assert torch.equal(peer.recv(timeout=5), big * 3)
    both = _shm(runtime_dir)
    assert len(both) == 3  # the receiver unlinked the one-off on mapping
    # a bigger frame than the arenas replaces one of them
    bigger = torch.randn((1 << 20) // 4 + 1024)  # past the 1 MiB arena
    owner.send(bigger)
    assert next_kind(peer) == codec.ARENA
    assert len(_shm(runtime_dir)) == 3 and len(set(both) - set(_shm(runtime_dir))) == 1
    assert torch.equal(peer.recv(timeout=5), bigger)
    for _ in range(3):  # never received: two arenas, then a one-off
        owner.send(big)
    assert len(_shm(runtime_dir)) == 4  # the sender's close removes them all


def test_arena_frames_cross_processes_by_copy_and_view(procs, runtime_dir):
    ring = Ring.create(64 << 10)
    child = procs.python(ECHO_BIG, env={"RING": ring.name})
    back = Ring.attach(child.stdout.readline().strip())
    back.set_peer(procid.of(child.pid))
    ring.set_peer(procid.of(child.pid))
    try:
        for rows in (40, 40, 400, 40):  # the arena is reused, grown (past 1 MiB), reused
            x = torch.randn(rows, 1024)
            ring.send(x)
            got = back.recv(timeout=30)
            assert torch.equal(got, x * 2)
        ring.send(None)
        assert child.wait(timeout=30) == 0
    finally:
        back.close()
        ring.close()
    assert _shm(runtime_dir) == []


ECHO_BIG = r"""
import os, sys
from neuronmp.ipc.ring import Ring
req = Ring.attach(os.environ["RING"])
resp = Ring.create(64 << 10)
print(resp.name, flush=True)
while True:
    with req.recv_view(timeout=30) as frame:
        if frame.value is None:
            break
        resp.send(frame.value * 2)  # a big frame back, on this process's arena
resp.close()  # the caller read every answer before it sent None
req.close()
"""



class _Op(int):
    pass


def test_recv_into_reuses_the_callers_tensor(runtime_dir, same):
    owner = Ring.create(16 << 20)
    peer = Ring.attach(owner.name)
    try:
        for x in [torch.randn(3, 4), torch.randn(6 << 20 >> 2), torch.tensor([True, False])]:
            out = torch.empty_like(x)
            owner.send(x)
            assert peer.recv_into(out, timeout=5) is out
            assert torch.equal(out, x)
        out = torch.zeros(3, 4)
        owner.send(torch.ones(4, 3))
        with pytest.raises(ValueError, match="shape"):
            peer.recv_into(out, timeout=5)
        assert torch.equal(out, torch.zeros(3, 4))
        assert torch.equal(peer.recv(timeout=5), torch.ones(4, 3))  # still next in line
        owner.send((1, torch.ones(2)))
        with pytest.raises(ValueError, match="tuple"):
            peer.recv_into(out, timeout=5)
        same((1, torch.ones(2)), peer.recv(timeout=5))
        with pytest.raises(ValueError, match="contiguous"):
            peer.recv_into(out.t(), timeout=0)
        with pytest.raises(queue.Empty):
            peer.recv_into(out, timeout=0)
    finally:
        peer.close()
        owner.close()


def test_emptied_ring_restarts_at_its_start_but_never_over_a_held_view(runtime_dir):
    owner = Ring.create(1 << 20)
    peer = Ring.attach(owner.name)
    try:
        x = torch.arange(16 << 10, dtype=torch.int32)  # 64 KiB frames
        for i in range(40):  # 2.5 MiB of traffic through a 1 MiB ring, one frame at a time
            owner.send(x + i)
            assert torch.equal(peer.recv(timeout=5), x + i)
            assert owner._head % owner.capacity <= (256 << 10) + (65 << 10)
        owner.send(x)
        held = peer.recv_view(timeout=5)  # not released: the ring is not empty
        for i in range(8):
            owner.send(x + i)
            assert torch.equal(peer.recv(timeout=5), x + i)
        assert torch.equal(held.value, x)  # nobody wrote over it
        held.release()
    finally:
        peer.close()
        owner.close()


def test_big_frames_copy_exactly(runtime_dir, same):
    # frames past the cache-bypassing copy threshold, by copy, view and into
    owner = Ring.create(64 << 20)
    peer = Ring.attach(owner.name)
    try:
        x = torch.randint(0, 2 ** 31, (5 << 20,), dtype=torch.int32)[1:]  # odd-aligned source
        for _ in range(3):
            owner.send((x, 3))
            same((x, 3), peer.recv(timeout=5))
            owner.send(x)
            with peer.recv_view(timeout=5) as frame:
                same(x, frame.value)
    finally:
        peer.close()
        owner.close()


def test_corrupt_record_is_an_error_not_a_crash(pair):
    owner, peer = pair
    owner.send(torch.ones(4))
    base = 4096 + peer._read % peer.capacity
    peer._buf[base + 16 + 1] = 200  # ndim beyond any tensor
    with pytest.raises(ValueError, match="corrupt ring record"):
        peer.recv(timeout=1)


def test_views_stay_valid_until_released_then_space_is_reused(pair):
    owner, peer = pair
    a = torch.full((1000,), 1.0)
    owner.send(a)
    owner.send(a * 2)
    f1 = peer.recv_view(timeout=5)
    f2 = peer.recv_view(timeout=5)
    f2.release()  # out of order: space is returned only once f1 goes too
    for _ in range(200):
        try:
            owner.send(torch.full((1000,), 3.0), timeout=0)
        except queue.Full:
            break
    else:
        pytest.fail("writer overwrote frames still held as views")
    assert torch.equal(f1.value, a)
    f1.release()
    while True:
        try:
            peer.recv(timeout=0)
        except queue.Empty:
            break
    owner.send(a, timeout=1)
    assert torch.equal(peer.recv(timeout=1), a)


def test_full_ring_raises_full_then_order_is_intact(pair):
    owner, peer = pair
    sent = 0
    with pytest.raises(queue.Full):
        while True:
            owner.send((sent, torch.full((100,), sent)), timeout=0.2)
            sent += 1
    assert sent > 10
    for i in range(sent):
        n, t = peer.recv(timeout=1)
        assert n == i and bool((t == i).all())
    with pytest.raises(queue.Empty):
        peer.recv(timeout=0.05)
    owner.send((sent, torch.full((100,), sent)), timeout=1)
    assert peer.recv(timeout=1)[0] == sent


def test_a_frame_sent_without_waking_is_published_at_once(pair):
    owner, peer = pair
    for i in range(3):
        owner.send(torch.full((4,), float(i)), wake=False)
    owner.wake_reader()
    got = [peer.recv(timeout=0) for _ in range(3)]
    assert [int(x[0]) for x in got] == [0, 1, 2]
    with pytest.raises(queue.Empty):
        peer.recv(timeout=0)


def test_put_many_sends_one_frame_on_each_ring_and_stops_where_send_must_take_over():
    rings = [Ring.create(64 << 10) for _ in range(3)]
    peers = [Ring.attach(r.name) for r in rings]
    try:
        frames = [(7, k, torch.full((8,), float(k))) for k in range(3)]
        assert Ring.put_many(rings, frames) == 3
        for k, peer in enumerate(peers):
            n, got, t = peer.recv(timeout=0)
            assert (n, got) == (7, k) and bool((t == k).all())
        # a frame for codec.py (a dict), then one that does not fit: the call stops at
        # the first, nothing after it is sent, and each goes by send as before
        assert Ring.put_many(rings, [torch.ones(2), {"a": 1}, torch.ones(2)]) == 1
        assert torch.equal(peers[0].recv(timeout=0), torch.ones(2))
        for peer in peers[1:]:
            with pytest.raises(queue.Empty):
                peer.recv(timeout=0)
        while Ring.put_many(rings[:1], [torch.zeros(4000)]) == 1:
            pass                                  # rings[0] is full now
        assert Ring.put_many(rings[:2], [torch.zeros(4000), torch.ones(3)]) == 0
        with pytest.raises(queue.Empty):
            peers[1].recv(timeout=0)
        rings[2].close()
        assert Ring.put_many(rings[1:], [torch.ones(3), torch.ones(3)]) == 1
        assert torch.equal(peers[1].recv(timeout=0), torch.ones(3))
    finally:
        for ring in peers + rings:
            ring.close()


def test_put_many_wakes_each_sleeping_reader_once_all_are_published(monkeypatch):
    from neuronmp.ipc import ring as ring_module

    monkeypatch.setattr(ring_module, "_SLICE", 30.0)   # unwoken, a reader sleeps on
    rings = [Ring.create(64 << 10) for _ in range(4)]
    peers = [Ring.attach(r.name) for r in rings]
    got, started = [None] * 4, threading.Barrier(5)

    def read(k):
        started.wait()
        got[k] = peers[k].recv(timeout=20)   # asleep on the futex well before the send

    threads = [threading.Thread(target=read, args=(k,)) for k in range(4)]
    try:
        for t in threads:
            t.start()
        started.wait()
        time.sleep(0.3)
        t0 = time.monotonic()
        assert Ring.put_many(rings, [torch.full((4,), float(k)) for k in range(4)]) == 4
        for t in threads:
            t.join(20)
        # woken by the call, not found at the end of a wait's slice
        assert time.monotonic() - t0 < 10
        assert [int(x[0]) for x in got] == [0, 1, 2, 3]
    finally:
        for ring in peers + rings:
            ring.close()


def test_blocked_sender_resumes_when_reader_drains(pair):
    owner, peer = pair
    x = torch.zeros(4000)
    got = []

    def drain():
        time.sleep(0.2)
        for _ in range(40):
            got.append(peer.recv(timeout=5))

    th = threading.Thread(target=drain)
    th.start()
    for _ in range(40):  # far more than the ring holds
        owner.send(x, timeout=5)
    th.join()
    assert len(got) == 40


_PRODUCER = """
import os, signal, sys, torch
from neuronmp.ipc.ring import Ring
from neuronmp.ipc import _frames
ring = Ring.attach(sys.argv[1] if len(sys.argv) > 1 else input())
die = os.environ.get("DIE_BEFORE_PUBLISH") == "1"
for i in range(3):
    x = torch.full((50000,), float(i))
    if die and i == 1:
        # the second frame is written in full but not published (the C encoder's
        # last flag), then the writer is SIGKILLed: what a crash mid-send leaves
        assert _frames.put(ring._buf, x, ring._head, ring._max_inline, False) > 0
        os.kill(os.getpid(), signal.SIGKILL)
    ring.send(x)
print("unreachable" if die else "sent", flush=True)
"""


def test_producer_killed_between_copy_and_publish_leaves_no_partial_frame(procs):
    ring = Ring.create(1 << 20)
    try:
        p = procs.python(_PRODUCER, env={"DIE_BEFORE_PUBLISH": "1"},
                         stdin=__import__("subprocess").PIPE)
        p.stdin.write(ring.name + "\n")
        p.stdin.flush()
        first = ring.recv(timeout=30)
        assert bool((first == 0).all())
        p.wait(timeout=30)
        assert p.returncode == -signal.SIGKILL
        t0 = time.monotonic()
        with pytest.raises(PeerDiedError):
            ring.recv(timeout=5)
        assert time.monotonic() - t0 < 2
    finally:
        ring.close()
    fresh = Ring.create(1 << 20)
    try:
        p2 = procs.python(_PRODUCER, env={}, stdin=__import__("subprocess").PIPE)
        p2.stdin.write(fresh.name + "\n")
        p2.stdin.flush()
        for i in range(3):
            assert bool((fresh.recv(timeout=30) == i).all())
        assert p2.wait(timeout=30) == 0
    finally:
        fresh.close()


_WAITER = """
import torch
from neuronmp.ipc.ring import Ring
ring = Ring.attach(input())
print("attached", flush=True)
try:
    if {send}:
        while True:  # fill the ring, then block on space
            ring.send(torch.zeros(1000))
    else:
        ring.recv()
except Exception as exc:
    print(type(exc).__name__, flush=True)
"""


@pytest.mark.parametrize("send", [False, True], ids=["recv", "send"])
def test_owner_killed_while_peer_waits_raises_peer_died(procs, send):
    import subprocess

    owner = procs.python(
        "from neuronmp.ipc.ring import Ring\nimport time\nr = Ring.create(8192)\n"
        "print(r.name, flush=True)\ntime.sleep(60)")
    name = owner.stdout.readline().strip()
    waiter = procs.python(_WAITER.replace("{send}", str(send)), stdin=subprocess.PIPE)
    waiter.stdin.write(name + "\n")
    waiter.stdin.flush()
    assert waiter.stdout.readline().strip() == "attached"
    time.sleep(0.5)
    owner.kill()
    t0 = time.monotonic()
    owner.wait()
    out = waiter.stdout.readline().strip()
    assert out == "PeerDiedError", waiter.stderr.read()
    assert time.monotonic() - t0 < 2
    waiter.wait(timeout=10)
    assert sweep() == [name]  # the dead owner's ring is cleaned at the next start-up


def test_attacher_killed_while_owner_waits_raises_peer_died(procs):
    ring = Ring.create(1 << 16)
    try:
        p = procs.python("from neuronmp.ipc.ring import Ring\nimport time\n"
                         "r = Ring.attach(input())\n"
                         "print('ok', flush=True)\ntime.sleep(60)",
                         stdin=__import__("subprocess").PIPE)
        p.stdin.write(ring.name + "\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "ok"
        assert ring.peer == procid.of(p.pid)  # recorded by attach, no set_peer needed
        threading.Timer(0.3, p.kill).start()
        t0 = time.monotonic()
        with pytest.raises(PeerDiedError) as err:
            ring.recv()
        assert time.monotonic() - t0 < 2.5 and err.value.pid == p.pid
    finally:
        ring.close()


def test_peer_closing_wakes_waiter():
    owner = Ring.create(1 << 16)
    peer = Ring.attach(owner.name)
    threading.Timer(0.2, peer.close).start()
    t0 = time.monotonic()
    with pytest.raises(PeerDiedError, match="closed"):
        owner.recv(timeout=10)
    assert time.monotonic() - t0 < 2
    owner.close()


def test_recv_releases_gil_for_other_threads():
    owner = Ring.create(1 << 16)
    peer = Ring.attach(owner.name)
    counter = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            counter[0] += 1

    th = threading.Thread(target=spin)
    th.start()
    try:
        with pytest.raises(queue.Empty):
            owner.recv(timeout=0.5)
        before = counter[0]
        time.sleep(0)
        assert before > 1000
    finally:
        stop.set()
        th.join()
        peer.close()
        owner.close()


_STRESS_READER = """
import sys, zlib
from neuronmp.ipc.ring import Ring
ring = Ring.attach(input())
n = int(sys.argv[1])
bad = 0
for i in range(n):
    seq, t = ring.recv(timeout=30)
    if seq != i or int(t[0]) != i or zlib.crc32(t[:-1].numpy().tobytes()) != int(t[-1]) \\
            or t.numel() != 2 + i % 13:
        bad += 1
        print("bad", i, seq, t.tolist(), flush=True)
        break
print("done", bad, flush=True)
"""


def test_ordering_stress_across_processes(procs):
    import subprocess
    import sys
    import zlib

    n = 200_000
    ring = Ring.create(64 << 10)  # small: wraps and back-pressure all the time
    try:
        p = procs.popen([sys.executable, "-c", _STRESS_READER, str(n)], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        p.stdin.write(ring.name + "\n")
        p.stdin.flush()
        frames = []
        for k in range(13):
            t = torch.zeros(2 + k, dtype=torch.int64)
            frames.append(t)
        for i in range(n):
            t = frames[i % 13]
            t[0] = i
            t[1:-1] = i * 7 + k_of(i)
            t[-1] = zlib.crc32(t[:-1].numpy().tobytes())
            ring.send((i, t), timeout=30)
        out, err = p.communicate(timeout=60)
        assert out.strip().splitlines()[-1] == "done 0", out + err
    finally:
        ring.close()


def k_of(i):
    return i % 13


def test_too_large_ring_is_a_clear_error_not_sigbus(runtime_dir):
    st = os.statvfs(os.path.join(runtime_dir))
    free = st.f_bavail * st.f_frsize
    with pytest.raises(ShmSpaceError) as err:
        Ring.create(free + (1 << 30))
    assert err.value.requested >= free + (1 << 30) and err.value.free > 0
    assert "No space" in str(err.value)
    assert _shm(runtime_dir) == []


def test_bad_arguments_are_refused_clearly():
    with pytest.raises(ValueError, match="capacity 100"):
        Ring.create(100)
    with pytest.raises(ValueError, match="Invalid segment name"):
        Ring.attach("../etc/passwd")
    with pytest.raises(FileNotFoundError, match="No shared-memory segment"):
        Ring.attach("nmp-1-1-0123456789abcdef")
    with pytest.raises(ValueError, match="size"):
        Segment.create(0)
    ring = Ring.create(1 << 16)
    try:
        with pytest.raises(TypeError, match="qint8"):
            ring.send(torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8))
        with pytest.raises(TypeError, match="Cannot send"):
            ring.send({"f": lambda: 1})
        with pytest.raises(TypeError, match="ProcId"):
            ring.set_peer(123)
        ring.send(torch.ones(2))  # still usable after refused frames
        peer = Ring.attach(ring.name)
        assert torch.equal(peer.recv(timeout=1), torch.ones(2))
        peer.close()
    finally:
        ring.close()
    with pytest.raises(ValueError, match="closed"):
        ring.send(1)


def test_segments_private_and_removed_on_close(runtime_dir):
    ring = Ring.create(1 << 16)
    path = os.path.join(runtime_dir, "shm", ring.name)
    me = procid.current()
    assert ring.name.startswith(f"nmp-{me.pid}-{me.start}-")
    assert os.stat(path).st_mode & 0o777 == 0o600
    seg = Segment.create(12345)
    assert seg.size == 16384 and bytes(seg.buf[:4]) == b"\0\0\0\0"
    other = Segment.attach(seg.name)
    other.buf[:5] = b"hello"
    assert bytes(seg.buf[:5]) == b"hello"
    other.close()
    assert os.path.exists(seg.path)  # only the owner unlinks
    seg.close()
    ring.close()
    assert _shm(runtime_dir) == []
    assert sweep() == []


def test_sweep_removes_segments_of_killed_owner_only(procs, runtime_dir):
    mine = Segment.create(4096)
    p = procs.python("from neuronmp.ipc.ring import Ring\n"
                     "from neuronmp.shm.segment import Segment\nimport os, signal\n"
                     "r = Ring.create(1 << 16)\ns = Segment.create(4096)\n"
                     "os.kill(os.getpid(), signal.SIGKILL)")
    p.wait(timeout=30)
    left = [n for n in _shm(runtime_dir) if n != mine.name]
    assert len(left) == 2
    assert sorted(sweep()) == sorted(left)
    assert _shm(runtime_dir) == [mine.name]
    mine.close()


@pytest.mark.parametrize("msg", [
    (3, True, [torch.ones(2), torch.zeros(2), torch.full((2,), 5.0)]),   # 3 items, 3 tensors
    [torch.ones(1), (torch.zeros(1),)],                                  # 2 items, 2 tensors
    (torch.ones(1), 7),
])
def test_structure_survives_when_tensor_count_equals_item_count(pair, msg):
    owner, peer = pair
    owner.send(msg)
    got = peer.recv(timeout=5)
    assert type(got) is type(msg) and len(got) == len(msg)
    for a, b in zip(got, msg):
        assert type(a) is type(b)
        if isinstance(b, torch.Tensor):
            assert torch.equal(a, b)
        elif isinstance(b, (list, tuple)):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        else:
            assert a == b


def test_pending_tells_a_frame_the_reader_has_not_taken(pair):
    tx, rx = pair
    assert not rx.pending()
    tx.send((1, torch.ones(3)))
    tx.send("second")
    assert rx.pending()
    rx.recv()
    assert rx.pending()
    with rx.recv_view():
        assert not rx.pending()
    tx.send(torch.zeros(1 << 20))  # a frame over a quarter of the ring, then nothing
    assert rx.pending()
    rx.recv()
    assert not rx.pending()


# A writer of large frames that dies inside the copy: its source's second half is
# unreadable (PROT_NONE), so the copy into the ring (inline) or the arena faults
# half-way through and the kernel kills it with SIGSEGV -- deterministically mid-frame,
# with no hook in the ring's code.  Before that it sends one whole frame of sevens.
_DIES_MID_COPY = r"""
import ctypes, mmap, os, sys, torch
from neuronmp.ipc.ring import Ring
ring = Ring.attach(os.environ["RING"])
n = 16 << 20
mm = mmap.mmap(-1, n)
x = torch.frombuffer(mm, dtype=torch.uint8)
x.fill_(7)
ring.send(x)
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
if libc.mprotect(x.data_ptr() + n // 2, n // 2, 0):  # PROT_NONE
    sys.exit("mprotect failed: " + os.strerror(ctypes.get_errno()))
x[0] = 9  # the first half stays writable: the next frame differs from the first
ring.send(x)
print("unreachable", flush=True)
"""


@pytest.mark.parametrize("capacity", [8 << 20, 64 << 20], ids=["arena", "inline"])
def test_writer_dying_inside_a_large_frames_copy_gives_an_error_not_data(procs, runtime_dir,
                                                                         capacity):
    ring = Ring.create(capacity)
    try:
        p = procs.python(_DIES_MID_COPY, env={"RING": ring.name})
        ring.set_peer(procid.of(p.pid))
        with ring.recv_view(timeout=60) as frame:
            first = frame.value
            assert first.shape == (16 << 20,) and bool((first == 7).all())
            del first
        assert p.wait(timeout=60) == -signal.SIGSEGV, p.stderr.read()
        assert p.stdout.read() == ""
        with pytest.raises(PeerDiedError):
            ring.recv_view(timeout=5)
        assert not ring.pending()  # nothing of the half-written frame was published
    finally:
        ring.close()
    sweep()  # the dead writer's arena (arena case) and .live file
    assert _shm(runtime_dir) == []


# A writer that streams large frames, each filled with its index, until it is SIGKILLed.
_STREAMS = r"""
import os, torch
from neuronmp.ipc.ring import Ring
ring = Ring.attach(os.environ["RING"])
x = torch.empty(16 << 20, dtype=torch.uint8)
i = 0
while True:
    x.fill_(i % 251)
    ring.send((i, x))
    i += 1
"""


@pytest.mark.parametrize("capacity", [8 << 20, 64 << 20], ids=["arena", "inline"])
def test_writer_sigkilled_while_streaming_large_frames_leaves_only_whole_ones(
        procs, runtime_dir, capacity):
    # The kill lands at some point of the writer's loop, most of which is the
    # 16 MiB copy; whichever it is, every frame the reader gets is whole and in
    # order, and then the reader gets PeerDiedError.
    for delay in (0.0, 0.0007, 0.0015):
        ring = Ring.create(capacity)
        try:
            p = procs.python(_STREAMS, env={"RING": ring.name})
            ring.set_peer(procid.of(p.pid))
            got = 0
            with ring.recv_view(timeout=60) as frame:  # the writer is up and copying
                assert frame.value[0] == 0
            got = 1
            time.sleep(delay)
            p.kill()
            assert p.wait(timeout=30) == -signal.SIGKILL
            while True:
                try:
                    frame = ring.recv_view(timeout=5)
                except PeerDiedError:
                    break
                with frame:
                    i, x = frame.value
                    assert i == got
                    assert x.shape == (16 << 20,) and bool((x == i % 251).all())
                    del x
                got += 1
        finally:
            ring.close()
        sweep()
        assert _shm(runtime_dir) == []


@pytest.mark.parametrize("variable, value, says", [
    ("NEURONMP_IPC_SPIN_US", "huge", "it is not a number"),
    ("NEURONMP_IPC_SPIN_US", "-5", "it must be >= 0"),
    ("NEURONMP_IPC_SPIN_US", "nan", "it must be a finite number"),
    ("NEURONMP_IPC_PAUSE_US", "1e3", "it is not a number"),
    ("NEURONMP_IPC_PAUSE_US", "99999999", "it must be <="),
])
def test_a_bad_tuning_variable_is_a_config_error_naming_it(variable, value, says, runtime_dir,
                                                          monkeypatch):
    # read from the settings when a ring is made (no runtime is up here, so
    # settings.get parses the environment as it is now), and refused before the
    # ring's segment exists
    from neuronmp.errors import ConfigError

    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as info:
        Ring.create(65536).close()
    assert (info.value.variable, info.value.value) == (variable, value)
    assert says in str(info.value), info.value
    assert "Accepted: microseconds from 0 to" in str(info.value), info.value
    assert _shm(runtime_dir) == []


def test_good_tuning_variables_are_read(monkeypatch):
    monkeypatch.setenv("NEURONMP_IPC_SPIN_US", " 80 ")
    monkeypatch.setenv("NEURONMP_IPC_PAUSE_US", "10.5")
    r = Ring.create(65536)
    try:
        spin, pause = r._spin, r._pause
    finally:
        r.close()
    assert (round(spin * 1e6, 3), round(pause * 1e6, 3)) == (80.0, 10.5)


def test_spin_window_is_the_longer_of_spin_and_budget_and_zero_when_off(monkeypatch):
    monkeypatch.setenv("NEURONMP_IPC_SPIN_US", "80")
    r = Ring.create(65536)
    try:
        windows = [round(r.spin_window * 1e6, 3)]
        r.spin_budget = 200e-6
        windows.append(round(r.spin_window * 1e6, 3))
        r.spin = False
        windows.append(r.spin_window)
    finally:
        r.close()
    assert windows == [80.0, 200.0, 0.0]
