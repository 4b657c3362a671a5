"""A mapped all_reduce's work, claimed piece by piece by whichever rank runs.

    shm.py      every rank mapped every rank's tensor (one arrival: the records)
    reduce()    check in on the done counter, then claim the next piece (a fetch-and-add
                on the claims counter), reduce it across every tensor in rank order and
                write it into every one of them (_pieces.c: one pass, each element of
                each tensor read once and written once), count it done; until none is
                left
    wait        until the done counter reaches the call's target: every piece done and
                every rank checked in (so none still reads the records)

A fixed split (rank r its 1/n) makes a rank that finished its share wait for a peer
the scheduler has not run yet, and for the wake-up of a peer that arrived first and
sleeps; claimed pieces go to whoever is on a CPU: the last rank to arrive starts at
once and the others join when they wake.

The two counters only grow.  A call of P pieces takes claims base .. base + P - 1 and
each of the n ranks draws one claim past them (the one that tells it none is left), so
the next call's base is base + P + n; the done counter grows by P + n (the pieces and
the check-ins).  Every rank counts the same calls alike, so all agree on both.  No
rank draws a claim of the next call before every rank drew its last of this one: the
next call's first arrival needs every rank's ticket, drawn after its loop ended.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from . import _pieces

#: bytes a piece holds: small enough that a rank left alone takes over most of a
#: descheduled peer's share, large enough that its two atomics are noise
PIECE_BYTES = 256 << 10

_RO = dist.ReduceOp.RedOpType
# the kernels' codes (_pieces.c's KERNELS table)
_DTYPES = {torch.float32: 0, torch.float64: 1, torch.int8: 2, torch.uint8: 3,
           torch.int16: 4, torch.int32: 5, torch.int64: 6, torch.bfloat16: 7}
_OPS = {int(_RO.SUM): 0, int(_RO.AVG): 0, int(_RO.PREMUL_SUM): 0, int(_RO.PRODUCT): 1,
        int(_RO.MIN): 2, int(_RO.MAX): 3, int(_RO.BAND): 4, int(_RO.BOR): 5,
        int(_RO.BXOR): 6}
_FLOATS = (torch.float32, torch.float64, torch.bfloat16)


def codes(dtype: torch.dtype, kind: Optional[int]) -> Optional[Tuple[int, int]]:
    """The kernel's (dtype, op) codes for a reduce op's kind on ``dtype``, or None when
    there is no kernel (float16, bool, complex: the fixed split, with torch's ops)."""
    if kind is None or dtype not in _DTYPES or kind not in _OPS:
        return None
    op = _OPS[kind]
    if op >= 4 and dtype in _FLOATS:
        return None
    return _DTYPES[dtype], op


class Counters:
    """Where a group's claims and done counters are, and this rank's view of them:
    the next call's claims base and done target (the same on every rank)."""

    def __init__(self, at: int, line: int, rank: int, world: int, own_flags: bool):
        self.claims, self.done = at, at + 8
        #: the sleeping flags the completing rank looks at, and mine
        self.flags, self.nflags = (at + line, world) if own_flags else (at + 16, 1)
        self.flag = at + line + 4 * rank if own_flags else at + 16
        self.base = self.target = 0
        self.world = world

    def run(self, mm, addrs, nelem: int, piece: int, code: Tuple[int, int]) -> int:
        """Check in and reduce pieces until none is left; the pieces this rank did.
        Afterwards ``target`` is the done count that completes this call."""
        pieces = -(-nelem // piece)
        self.target += pieces + self.world
        mine = _pieces.reduce(mm, self.claims, self.done, self.flags, self.nflags,
                              self.base, self.target, tuple(addrs), nelem, piece, *code)
        self.base += pieces + self.world
        return mine
