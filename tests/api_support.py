"""Helpers shared by the API tests: which core's worker served a call, small models."""
from __future__ import annotations

import time

import torch

from neuronmp.host import runtime
from neuronmp.session import session


def pool():
    """This process's worker pool (its session's)."""
    return session.current().pool


def settled():
    """Per-core completed requests, once the workers have counted all they answered."""
    deadline = time.monotonic() + 5
    while True:
        stats = pool().stats()
        if all(s.in_flight == 0 for s in stats) or time.monotonic() > deadline:
            return {s.core: s.done for s in stats}
        time.sleep(0.001)


def served(fn):
    """(fn(), {global core: requests its worker served during fn})."""
    before = settled()
    out = fn()
    after = settled()
    return out, {c: after[c] - before[c] for c in after if after[c] != before[c]}


def ran_on(fn):
    """The local index (nc:i) of the one core that served fn(), and fn()'s result."""
    out, cores = served(fn)
    assert len(cores) == 1 and sum(cores.values()) == 1, cores
    return runtime.get_runtime().cores.index(next(iter(cores))), out


class Net(torch.nn.Module):
    """The SDK pages' example: a 3x3 convolution plus one."""

    def __init__(self, channels: int = 1):
        super().__init__()
        self.conv = torch.nn.Conv2d(channels, channels, 3)

    def forward(self, x):
        return self.conv(x) + 1
