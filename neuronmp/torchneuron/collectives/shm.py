"""The shared-memory collective engine: the ranks of one host, one segment per group.

    rank 0: Segment.create(control page + 2 sets x world x slot)   name ──▶ c10d store
    rank i: Segment.attach(name)   (each rank writes its (pid, start) in its line)

    one round (a chunk of at most ``slot`` bytes per rank), set = round % 2:
      copy in    every rank copies its chunk into its own slot of the set
      arrive     every rank publishes counter = gen, draws a ticket, and waits until
                 the rank that drew the last ticket marks the arrival done
      reduce     rank r reduces its share of the elements across the slots, in
                 place in slot 0 (then a second arrive), or reads what it needs;
                 an all_reduce round of two ranks or few bytes: every rank reduces all
                 of it into its output
      copy out   every rank copies its result out of the set

    a small all_reduce (one round, the whole tensor):
      copy in    every rank copies its tensor into its slot, then draws a ticket
      the last   the rank that drew the last ticket reduces every slot (its own
                 operand from its tensor) into its slot, marks the arrival done, and
                 copies the result into its tensor
      the others wait for that (one wake-up at most), copy the last rank's slot out

An all_reduce of tensors the device allocated shareable (csrc/neuron.cpp: blocks of
a MiB or more are memfds) skips the segment when every rank can map its peers' memfds
(probed once per group):

    post (memfd, serial, offset)   arrive
    claim pieces until none is left (pieces.py; the dtypes and ops its kernels know):
      reduce the piece             reading it in every rank's tensor, writing the
                                   result into every one of them, in one pass
    wait for the done count        (every piece done, every rank checked in: no peer
                                   reads or writes my tensor any more: return)

Each element of each tensor is read once and written once, by whichever rank claimed
its piece: about 2S moved per rank of an S-byte tensor on two ranks, against 5S
through the segment, and the last rank to arrive starts at once while the others
wake.  Other dtypes (float16, bool, complex) take a fixed split with torch's ops:
my 1/n slice a piece at a time, reduced into my tensor and copied into every peer's
while in cache, then a second arrival.  A peer's memfd is opened once
through /proc/<pid>/fd/<n> (checked against the rank's (pid, start) and the memfd's
serial name) and its mapping kept, a bounded number of them per group.

An all_gather of more than a slot skips the segment when the kernel lets a rank read
its peers' memory (process_vm_readv, probed once per group): each rank posts its
input's address in its record, arrives, copies its own part and reads every peer's
straight into the output, and arrives again before returning.  The reduce paths keep
the segment: reading a peer's memory this way costs more CPU than a memcpy, and a
reduce already reads each operand once from the segment (the measurements are in
docs/guides/torchneuron-distributed.md).

Two sets alternate, so a round's copy-out never races the next round's copy-in, and
a small all_reduce makes ONE arrival: the last rank returns as soon as it marked the
arrival done, while a peer may still be copying the result out of the set.  Why that
is safe: rounds r and r + 2 use the same set, and every collective has at least one
arrival per round, made by every rank in the same order (counters only grow).  Rank
A writes the set at round r + 2 only after its arrival at round r + 1 completed,
which needs every peer's ticket of r + 1; peer B drew that after it finished round r
(its reads of the set included), since a rank's calls run in order.  So no rank
writes a set that a peer still reads, and a rank reads only slots its peers wrote
before their tickets of the same round.  tests/torchneuron/collectives/test_group.py
runs many back-to-back all_reduces of distinct values and checks every result and
that each made one arrival (with a single set it fails at once), and all_reduces of
ranks that sleep random whiles before each call.

Arrivals (tickets, the done counter, the waits and their liveness checks) are
arrivals.py's, a base of ShmGroup.  The segment is owned by rank 0
(its name carries rank 0's pid and start), so the liveness sweep removes it when
rank 0 dies; ``close`` unlinks it otherwise.
"""
from __future__ import annotations

import collections
import ctypes
import errno
import logging
import mmap
import os
import struct
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ...errors import CollectiveRankDiedError, CollectiveUsageError
from ...host import procid, settings
from ...shm import _waits
from ...shm.segment import Segment
from . import peermem, pieces
from .arrivals import LINE, SLICE, SYNC_BYTES, Arrivals, line, sweep_dead
from .calls import CALL_BYTES

logger = logging.getLogger(__name__)

_PAGE = 4096
_load = _waits.load
DEFAULT_SLOT = 2 << 20
# Up to slot / _DIRECT bytes a round (any size for two ranks) every rank reduces the
# whole round itself, with no split reduction nor second arrive (DeepSpeed's small path).
_DIRECT = 8
_REC = 32             # a rank's record: address or memfd + 1, bytes, serial, offset
_PIECED = 32          # in a rank's line: the mapped all_reduces whose pieces it ran out of
_PIECE = 1 << 20     # a mapped all_reduce's piece (sizes measured: the guide's Performance)
# Peer tensors kept mapped per group (a step all_reduces the same few buckets again and
# again); bounded, as a mapping keeps its memfd's memory alive after its owner freed it.
_MAPS = 64
#: where a tensor lives for a peer to map it: (memfd, serial, offset, bytes mapped),
#: as the device's allocator reports it (csrc/neuron.cpp shared_block)
Where = Tuple[int, int, int, int]


def slot_bytes() -> int:
    """Bytes per rank per round (NEURONMP_COLLECTIVE_SLOT_KB, default 2048): a bad value
    is the ConfigError every neuronmp variable gives."""
    return settings.get("collective_slot_bytes")


def _record(world: int, rank: int) -> int:
    """Where rank ``rank`` posts where its tensor is (four u64: address or memfd + 1,
    byte count, memfd serial, offset) for a collective that reads it in place."""
    return LINE * (world + 1) + _REC * rank


def _call_at(world: int, parity: int, rank: int) -> int:
    """Where rank ``rank`` announces its call (calls.py) in the arrivals of a parity."""
    return _record(world, world) + CALL_BYTES * (parity * world + rank)


def _stamp_at(world: int, parity: int, rank: int) -> int:
    """Where rank ``rank`` stamps when it arrived (perf_counter_ns: CLOCK_MONOTONIC)."""
    return _call_at(world, 2, 0) + 8 * (parity * world + rank)


def _sync(world: int) -> int:
    """Where the arrivals' two lines are (tickets, done, the waiters' flags)."""
    return -(-_stamp_at(world, 2, 0) // LINE) * LINE


def _pieces_at(world: int) -> int:
    """Where a mapped all_reduce's two lines are: its claims and done counters and a
    shared sleeping flag, then a flag per waiter (pieces.py)."""
    return _sync(world) + SYNC_BYTES


def _ctrl(world: int) -> int:
    """The control area's bytes: the lines, the address records, the announced calls
    (two areas: see barrier), the arrival stamps, the arrivals' and the pieces' lines,
    whole pages."""
    end = _pieces_at(world) + 2 * LINE
    return -(-end // _PAGE) * _PAGE


class ShmGroup(Arrivals):
    """The shared segment of one group of ``world`` ranks on this host."""

    def __init__(self, seg: Segment, rank: int, world: int, slot: int, timeout: float):
        self._init_arrivals(
            seg, rank, world, timeout, _sync(world),
            [[_call_at(world, p, r) for r in range(world)] for p in (0, 1)],
            [[_stamp_at(world, p, r) for r in range(world)] for p in (0, 1)])
        self.slot = slot
        self._bytes = torch.frombuffer(seg.buf, dtype=torch.uint8)
        self._views = {}
        self._round = 0
        self._ctrl = _ctrl(world)
        self._direct = False      # peers' tensors readable in place (see peermem.probe_reads)
        self._mappable = False    # peers' memfds mappable (see peermem.probe_maps)
        self._maps = collections.OrderedDict()   # (rank, serial) -> uint8 tensor
        self._map_views = {}
        self._scratch = None
        #: all_reduces that reduced the ranks' tensors where they live
        self.in_place_reduces = 0
        #: small all_reduces whose whole reduction this rank did, as the last to arrive
        self.reduced_last = 0
        #: pieces of mapped all_reduces this rank reduced (pieces.py), and their calls
        self.pieces_reduced = self._pieced_calls = 0
        self._pieces = pieces.Counters(_pieces_at(world), LINE, rank, world, self._own_flags)
        me = procid.current()
        struct.pack_into("<QQ", seg.buf, line(rank) + 16, me.pid, me.start)

    # -- setup ----------------------------------------------------------------------

    @classmethod
    def create(cls, store, rank: int, world: int, timeout: float, key: str = "nmp_shm"
               ) -> ShmGroup:
        """Rank 0 creates the segment and posts its name in ``store`` under this init's
        key (ranks count their inits there: a group made again finds its own)."""
        slot = slot_bytes()
        generation = (store.add(f"{key}/inits", 1) - 1) // world
        key = f"{key}/{generation}"
        if rank == 0:
            seg = Segment.create(_ctrl(world) + 2 * world * slot)
            store.set(key, seg.name)
        else:
            seg = Segment.attach(store.get(key).decode())
        group = cls(seg, rank, world, slot, timeout)
        group.barrier("init_process_group")   # every rank mapped it: rank 0 may unlink
        group._read_peers()
        group._direct = peermem.probe_reads(group)
        group._mappable = peermem.probe_maps(group)
        if rank == 0:
            seg.unlink()   # nobody attaches later; a crash then leaves nothing behind
        return group

    def _read_peers(self) -> None:
        for r in range(self.world):
            pid, start = struct.unpack_from("<QQ", self.seg.buf, line(r) + 16)
            self._peers[r] = procid.ProcId(pid, start)

    def linger(self, store) -> None:
        """Wait at destroy_process_group until every rank of the world is there too.

        Rank 0 of the world hosts the job's store, and a ``new_group`` that leaves it out
        is made over that store: were it to exit at once, the members would lose the
        store mid-way (TorchNeuron makes its groups with no store, so they do not).
        Counted in the store, not in the segment's arrivals (a rank that refused its
        last call may still be awaited there).  A dead peer or the timeout ends rank
        0's wait, and nothing escapes: shutting down never fails."""
        try:
            n = store.add("nmp_linger", 1)
            end = time.monotonic() + self.timeout
            while self.rank == 0 and n < self.world and time.monotonic() < end:
                if any(p is not None and not p.alive() for p in self._peers):
                    return
                time.sleep(0.01)
                n = store.add("nmp_linger", 0)
        except Exception as exc:   # the store's host gone: nothing left to keep
            logger.debug("destroy_process_group: not every rank met: %s", exc)

    def close(self) -> None:
        """Unmap (and for rank 0 unlink) the segment."""
        self._bytes = None
        self._views.clear()
        self._map_views.clear()
        self._maps.clear()
        self._scratch = None
        self.seg.close()

    # -- reading peers' tensors in place ----------------------------------------------

    def _map_peer(self, r: int, fd: int, serial: int) -> torch.Tensor:
        """Rank ``r``'s memfd ``fd`` mapped here, as bytes; checked to be the memfd the
        rank posted (its serial name) of the rank itself (its pid and start time)."""
        peer = self._peers[r]
        path = f"/proc/{peer.pid}/fd/{fd}"
        own = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            name = os.readlink(path)
            if name != f"/memfd:neuronmp-{serial} (deleted)" or not peer.alive():
                raise OSError(errno.ESTALE, f"{path} is {name!r}, not rank {r}'s "
                                            f"memfd neuronmp-{serial}")
            size = os.fstat(own).st_size
            mm = mmap.mmap(own, size, mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(own)
        return torch.frombuffer(mm, dtype=torch.uint8)

    def _peer_tensor(self, r: int, rec, nbytes: int, dtype: torch.dtype, op: str
                     ) -> torch.Tensor:
        """Rank ``r``'s tensor of ``nbytes`` (as its record says where), mapped here."""
        fd, _, serial, offset = rec
        key = (r, serial, offset, nbytes, dtype)
        view = self._map_views.get(key)
        if view is not None:
            self._maps.move_to_end((r, serial))
            return view
        whole = self._maps.get((r, serial))
        if whole is None:
            whole = self._open_peer(r, fd - 1, serial, op)
        if offset + nbytes > whole.numel():
            raise CollectiveUsageError(op, f"rank {r} posted {nbytes} bytes at {offset} "
                                           f"of a {whole.numel()}-byte block")
        if len(self._map_views) >= 16 * _MAPS:   # views of many shapes: start afresh
            self._map_views.clear()
        view = self._map_views[key] = whole[offset:offset + nbytes].view(dtype)
        return view

    def _open_peer(self, r: int, fd: int, serial: int, op: str) -> torch.Tensor:
        while len(self._maps) >= _MAPS:   # the least recently used goes (and its views)
            (old_r, old_serial), _ = self._maps.popitem(last=False)
            for key in [k for k in self._map_views if k[:2] == (old_r, old_serial)]:
                del self._map_views[key]
        try:
            whole = self._map_peer(r, fd, serial)
        except OSError:
            peer = self._peers[r]
            if not peer.alive():
                self._abort()
                sweep_dead(peer)
                raise CollectiveRankDiedError(r, peer.pid, op) from None
            raise
        self._maps[(r, serial)] = whole
        return whole

    def _post(self, addr: int, nbytes: int, serial: int = 0, offset: int = 0) -> None:
        """Post where my tensor is (the next barrier publishes it)."""
        struct.pack_into("<QQQQ", self.seg.buf, _record(self.world, self.rank), addr, nbytes,
                         serial, offset)

    def _post_word(self, i: int, value: int) -> None:
        """Post word ``i`` of my record alone (a probe's verdict)."""
        struct.pack_into("<Q", self.seg.buf, _record(self.world, self.rank) + 8 * i, value)

    def _record(self, r: int):
        """Rank ``r``'s posted (address or memfd + 1, byte count, serial, offset)."""
        return struct.unpack_from("<QQQQ", self.seg.buf, _record(self.world, r))

    def _swap(self, addr: int, nbytes: int, op: str, serial: int = 0, offset: int = 0):
        """Post mine, arrive, read every rank's record (the arrival compared the
        ranks' calls: their byte counts agree)."""
        self._post(addr, nbytes, serial, offset)
        self.barrier(op)
        return [self._record(r) for r in range(self.world)]

    def _read(self, r: int, dst: int, src: int, nbytes: int, op: str) -> None:
        """Copy ``nbytes`` at ``src`` in rank ``r``'s memory to ``dst`` in mine."""
        if peermem.read(self._peers[r].pid, dst, src, nbytes):
            return
        err = ctypes.get_errno()
        peer = self._peers[r]
        # a rank being killed loses its memory before /proc shows it dead: give its
        # exit a bounded moment to show before calling the failure anything else
        gone = time.monotonic() + 20 * SLICE
        while peer.alive() and time.monotonic() < gone:
            time.sleep(0.005)
        self._abort()
        if not peer.alive():
            sweep_dead(peer)
            raise CollectiveRankDiedError(r, peer.pid, op)
        raise OSError(err or errno.EIO, f"{op}: reading rank {r}'s tensor (pid {peer.pid}): "
                                        f"{os.strerror(err or errno.EIO)}")

    # -- slots ----------------------------------------------------------------------

    def _slot(self, r: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        key = (self._round & 1, r, nbytes, dtype)
        view = self._views.get(key)
        if view is None:   # a training step asks for the same few views again and again
            if len(self._views) > 256:
                self._views.clear()
            base = self._ctrl + (key[0] * self.world + r) * self.slot
            view = self._views[key] = self._bytes[base:base + nbytes].view(dtype)
        return view

    def _rounds(self, nelem: int, per_elem_bytes: int):
        """(start, count) of each round's elements, at most ``slot`` bytes per rank."""
        step = max(1, self.slot // per_elem_bytes)
        for start in range(0, max(nelem, 1), step):
            # a collective of rounds spins in every wait, as the rings do: the ranks do
            # the same work round after round, and its waits did not measure better
            # adaptive (the adaptive spin is for the short, one-wait collectives)
            self._spin_next = True
            yield start, min(step, nelem - start)
            self._round += 1

    # -- collectives on flat, contiguous CPU tensors ----------------------------------

    def all_reduce(self, t: torch.Tensor, reduce: Callable, op: str,
                   root: Optional[int] = None, where: Optional[Where] = None,
                   kind: Optional[int] = None) -> None:
        """Reduce ``t`` across ranks in place (on ``root`` only when given).  ``where``:
        where ``t`` lives if a peer can map it (see ``Where``); ``kind``: the reduce
        op's RedOpType as an int, for the mapped path's kernels (pieces.py)."""
        es, n = t.element_size(), self.world
        nbytes = t.numel() * es
        if self._mappable and root is None and nbytes >= self.map_min:
            if self._all_reduce_mapped(t, nbytes, where, reduce, op, kind):
                return
        if nbytes <= self.slot and (n == 2 or nbytes <= self.slot // _DIRECT):
            self._all_reduce_round(t, nbytes, reduce, op, root)
            return
        for start, cnt in self._rounds(t.numel(), es):
            mine = t[start:start + cnt]
            self._slot(self.rank, cnt * es, t.dtype).copy_(mine)
            self.barrier(op)
            if n == 2 or cnt * es <= self.slot // _DIRECT:
                # two ranks or a small round: every rank reduces the whole round straight
                # into its output (one arrive instead of two, less memory traffic than a
                # split and a copy-out; the same order of operands)
                if root is None or root == self.rank:
                    parts = [self._slot(r, cnt * es, t.dtype) for r in range(n)]
                    if n == 2 or self.rank == 0:
                        # my operand from my own chunk (the same values, likely still in
                        # cache), never read after ``mine`` is overwritten
                        parts[self.rank] = mine
                    self._reduce_round(mine, parts, reduce, op, start + cnt < t.numel())
                continue
            lo, hi = _share(cnt, n, self.rank)
            if hi > lo:
                with self.before_arrival(op):   # the peers copy my share out after it
                    acc = self._slot(0, cnt * es, t.dtype)[lo:hi]
                    for r in range(1, n):
                        reduce(acc, self._slot(r, cnt * es, t.dtype)[lo:hi])
            self.barrier(op)
            if root is None or root == self.rank:
                mine.copy_(self._slot(0, cnt * es, t.dtype))

    def _reduce_round(self, out: torch.Tensor, parts: Sequence[torch.Tensor],
                      reduce: Callable, op: str, follows: bool) -> None:
        """A round's reduction after its last arrival, ``follows``: another round's
        comes.  If it raises, the peers end this round anyway (and meet my refusal
        at the next round's arrival, or return): my round count moves past it as
        theirs does, so the next call's ranks use the same set of slots."""
        try:
            with self.before_arrival(op, follows):
                _reduce_into(out, parts, reduce)
        except Exception:
            self._round += 1
            raise

    #: tensors of this many bytes or more may be shareable (the allocator's threshold):
    #: only then does all_reduce spend an arrival on finding out
    map_min = 1 << 20

    def _all_reduce_mapped(self, t: torch.Tensor, nbytes: int, where: Optional[Where],
                           reduce: Callable, op: str, kind: Optional[int] = None) -> bool:
        """all_reduce reading every rank's tensor where it lives; False (after one
        arrival) when some rank's tensor is not shareable.  The dtypes and ops the
        kernels know go by claimed pieces (pieces.py); the others by a fixed split,
        with torch's ops."""
        full = self._mapped_all(t, nbytes, where, op)
        if full is None:
            return False
        code = pieces.codes(t.dtype, kind)
        if code is not None:
            self._all_reduce_pieces(full, code, op)
            return True
        n, me, cnt = self.world, self.rank, t.numel()
        lo, hi = _share(cnt, n, me)
        # a piece goes into the peers' tensors while it is in this CPU's cache
        step = max(1, _PIECE // t.element_size())
        with self.before_arrival(op):
            for a in range(lo, hi, step):
                b = min(hi, a + step)
                self._reduce_slice([x[a:b] for x in full], me, reduce)
                for r in self._others:
                    full[r][a:b].copy_(t[a:b])
        self.barrier(op)   # no peer touches my tensor any more: the caller may change it
        self.in_place_reduces += 1
        return True

    def _all_reduce_pieces(self, full: Sequence[torch.Tensor], code, op: str) -> None:
        """Every rank's tensor (``full``, mapped here) reduced into all of them, by
        pieces claimed as the ranks run (pieces.py); returns when every piece is done
        and every rank checked in, when no peer touches my tensor any more."""
        c, mm = self._pieces, self._mm
        nelem = full[0].numel()
        piece = max(1, pieces.PIECE_BYTES // full[0].element_size())
        self._pieced_calls += 1
        self.pieces_reduced += c.run(mm, [x.data_ptr() for x in full], nelem, piece, code)
        _waits.store(mm, line(self.rank) + _PIECED, self._pieced_calls)   # my claims ended
        self._await_count(c.done, c.flag, c.target, op, self._still_reducing)
        self.in_place_reduces += 1

    def _still_reducing(self) -> List[int]:
        """The ranks whose loop over a mapped all_reduce's pieces has not ended (for a
        timeout's message: one still reduces a piece, or never came to the loop)."""
        return [r for r in range(self.world)
                if _load(self._mm, line(r) + _PIECED) < self._pieced_calls]

    def _reduce_slice(self, parts: Sequence[torch.Tensor], me: int, reduce: Callable
                      ) -> None:
        """parts[me] = parts[0] op parts[1] op ... in rank order, parts[me] being my own
        tensor: read as an operand before it is written."""
        if me < 2:
            _reduce_into(parts[me], parts, reduce)
            return
        acc = self._scratch_for(parts[0])
        reduce(parts[0], parts[1], out=acc)
        for part in parts[2:me]:
            reduce(acc, part)
        reduce(acc, parts[me], out=parts[me])
        for part in parts[me + 1:]:
            reduce(parts[me], part)

    def _scratch_for(self, like: torch.Tensor) -> torch.Tensor:
        nbytes = like.numel() * like.element_size()
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch[:nbytes].view(like.dtype)

    def _mapped_all(self, mine: torch.Tensor, nbytes: int, where: Optional[Where],
                    op: str) -> Optional[List[torch.Tensor]]:
        """Post where ``mine`` lives (``where`` None: not shareable), arrive, and map
        every rank's tensor of ``nbytes``: all of them in rank order (``mine`` at my
        rank), or None when some rank's is not shareable (every rank sees the same
        records, so all take the segment's way together)."""
        fd, serial, offset, _ = where if where is not None else (-1, 0, 0, 0)
        recs = self._swap(fd + 1, nbytes, op, serial, offset)
        if not all(rec[0] for rec in recs):
            return None
        return [mine if r == self.rank else
                self._peer_tensor(r, recs[r], nbytes, mine.dtype, op)
                for r in range(self.world)]

    def _all_reduce_round(self, t: torch.Tensor, nbytes: int, reduce: Callable, op: str,
                          root: Optional[int]) -> None:
        """all_reduce of one round: the loop below without its per-round slicing, the
        per-call cost that counts for small tensors.  Every rank copies in and draws
        its ticket; the last to arrive reduces the whole round (its own operand from
        its tensor) into its slot and completes the arrival, then copies the result
        into its tensor while the others, which waited for it anyway, copy it out.
        One arrival, whose completion is the result: a rank that came first wakes
        once, to a copy, not to a reduction."""
        dtype, me = t.dtype, self.rank
        mine = self._slot(me, nbytes, dtype)
        mine.copy_(t)
        if root is not None:   # reduce: the root alone reduces, after the arrival
            self.barrier(op)
            if root == me:
                parts = [self._slot(r, nbytes, dtype) for r in range(self.world)]
                if me < 2:   # read before _reduce_into writes t (its first op reads 0, 1)
                    parts[me] = t
                _reduce_into(t, parts, reduce)
            self._round += 1
            return
        gen, last = self._arrive(hold=True)
        if last:
            try:
                self._compare(gen, op)
                # into my slot, my own operand from my tensor (not written meanwhile);
                # the peers may copy the result out while I copy it into my tensor
                parts = [self._slot(r, nbytes, dtype) for r in range(self.world)]
                parts[me] = t
                try:
                    _reduce_into(mine, parts, reduce)
                except Exception as exc:   # the peers must not take my slot as the sum
                    self.fail(gen, op, exc)
                    raise
            finally:   # a mismatch too completes the arrival: the peers raise it as well
                self._complete(gen)
            t.copy_(mine)
            self.reduced_last += 1
        else:
            self._await(gen, op)
            self._compare(gen, op)
            t.copy_(self._slot(_load(self._mm, self._who), nbytes, dtype))
        self._round += 1

    def broadcast(self, t: torch.Tensor, root: int, op: str = "broadcast") -> None:
        es = t.element_size()
        for start, cnt in self._rounds(t.numel(), es):
            part = t[start:start + cnt]
            slot = self._slot(root, cnt * es, t.dtype)
            if self.rank == root:
                slot.copy_(part)
            self.barrier(op)
            if self.rank != root:
                part.copy_(slot)

    def all_gather(self, out: Sequence[torch.Tensor], inp: torch.Tensor,
                   op: str = "all_gather", root: Optional[int] = None) -> None:
        """out[r] = rank r's ``inp`` (every rank, or ``root`` only: gather)."""
        es, me = inp.element_size(), self.rank
        keep = root is None or root == me
        if self._direct and inp.numel() * es > self.slot:
            self._gather_direct(out, inp, keep, op)
            return
        for start, cnt in self._rounds(inp.numel(), es):
            src = inp[start:start + cnt]
            self._slot(me, cnt * es, inp.dtype).copy_(src)
            if keep:   # my own part straight from the input, while a peer may still copy
                out[me][start:start + cnt].copy_(src)
            self.barrier(op)
            if keep:
                for r in self._others:
                    out[r][start:start + cnt].copy_(self._slot(r, cnt * es, inp.dtype))

    def _gather_direct(self, out: Sequence[torch.Tensor], inp: torch.Tensor, keep: bool,
                       op: str) -> None:
        """all_gather reading every peer's input in place: one copy per part, none
        through the segment (the segment's way costs a copy in and a copy out)."""
        nbytes = inp.numel() * inp.element_size()
        recs = self._swap(inp.data_ptr(), nbytes, op)
        if keep:
            out[self.rank].copy_(inp)
            for r in self._others:
                self._read(r, out[r].data_ptr(), recs[r][0], nbytes, op)
        self.barrier(op)   # no peer reads my input any more: the caller may change it

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, where: Optional[Where],
                       reduce: Callable, op: str) -> bool:
        """out = reduce over ranks of their ``inp``'s chunk ``rank`` (``inp`` split
        evenly), read where every rank's input lives; False (after one arrival) when
        some input is not shareable, for the caller to take the segment's way."""
        es, me, cnt = inp.element_size(), self.rank, out.numel()
        nbytes = inp.numel() * es
        lo, hi = inp.data_ptr(), inp.data_ptr() + nbytes
        aliased = out.data_ptr() == lo + me * cnt * es   # FSDP: my chunk of the input
        if not aliased and out.data_ptr() < hi and lo < out.data_ptr() + cnt * es:
            where = None   # an output over a chunk a peer reads: everyone takes the segment
        full = self._mapped_all(inp, nbytes, where, op)
        if full is None:
            return False
        parts = [x[me * cnt:(me + 1) * cnt] for x in full]
        with self.before_arrival(op):
            if aliased:
                self._reduce_slice(parts, me, reduce)
            else:
                _reduce_into(out, parts, reduce)
        self.barrier(op)   # no peer reads my input any more: the caller may change it
        self.in_place_reduces += 1
        return True

    def scatter(self, out: torch.Tensor, inp: Optional[Sequence[torch.Tensor]], root: int,
                op: str = "scatter") -> None:
        es = out.element_size()
        for start, cnt in self._rounds(out.numel(), es):
            if self.rank == root:
                for r in range(self.world):
                    self._slot(r, cnt * es, out.dtype).copy_(inp[r][start:start + cnt])
            self.barrier(op)
            out[start:start + cnt].copy_(self._slot(self.rank, cnt * es, out.dtype))

    def exchange(self, out: Sequence[torch.Tensor], inp: Sequence[torch.Tensor],
                 reduce: Optional[Callable], op: str) -> None:
        """inp[j] of every rank goes to rank j: all_to_all (``reduce`` None: out[i] =
        rank i's inp[me]) or reduce_scatter (out[0] = reduce over i of rank i's inp[me])."""
        n, me, es, dtype = self.world, self.rank, inp[0].element_size(), inp[0].dtype
        # my own part need not go through the segment, except as an operand read after
        # the output (which may be that very input: an in-place reduce_scatter) was
        # written: from rank 1 on, with more than two ranks
        direct = reduce is None or n == 2 or me == 0
        for start, cnt in self._rounds(inp[0].numel(), es * n):
            mine = self._slot(me, n * cnt * es, dtype).view(n, cnt)
            for j in (self._others if direct else range(n)):
                mine[j].copy_(inp[j][start:start + cnt])
            if reduce is None:
                out[me][start:start + cnt].copy_(inp[me][start:start + cnt])
            self.barrier(op)
            parts = [self._slot(r, n * cnt * es, dtype).view(n, cnt)[me] for r in range(n)]
            if direct:
                parts[me] = inp[me][start:start + cnt]
            if reduce is None:
                for r in self._others:
                    out[r][start:start + cnt].copy_(parts[r])
            else:
                self._reduce_round(out[0][start:start + cnt], parts, reduce, op,
                                   start + cnt < inp[0].numel())


def _reduce_into(out: torch.Tensor, parts: Sequence[torch.Tensor], reduce: Callable) -> None:
    """out = parts[0] op parts[1] op ... in rank order; the first op reads two slots and
    writes ``out`` in one pass (no copy of parts[0] first)."""
    if len(parts) == 1:
        out.copy_(parts[0])
        return
    reduce(parts[0], parts[1], out=out)
    for part in parts[2:]:
        reduce(out, part)


def _share(count: int, n: int, rank: int):
    """Rank ``rank``'s contiguous share of ``count`` elements split n ways."""
    per = -(-count // n)
    lo = min(count, rank * per)
    return lo, min(count, lo + per)
