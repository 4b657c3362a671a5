"""Fixtures of the transport tests: a ring pair, frame comparison, the next frame's
kind, the shm folder."""
import os

import pytest
import torch

from neuronmp.ipc import codec
from neuronmp.ipc.ring import Ring


@pytest.fixture
def pair():
    """A 64 KiB ring and the same ring attached (one process plays both sides)."""
    owner = Ring.create(64 << 10)
    peer = Ring.attach(owner.name)
    yield owner, peer
    peer.close()
    owner.close()


@pytest.fixture
def shm_files(runtime_dir):
    """The names in this test's shared-memory folder, sorted."""
    def listing():
        path = os.path.join(runtime_dir, "shm")
        return sorted(os.listdir(path)) if os.path.isdir(path) else []
    return listing


@pytest.fixture
def next_kind():
    """The layout kind (codec.ARENA, PACKED, ...) of the frame a ring receives next."""
    return _next_kind


def _next_kind(ring):
    cap, read = ring.capacity, ring._read
    while True:
        length, kind = codec.REC.unpack_from(ring._buf, 4096 + read % cap)[:2]
        if kind != codec.PAD:   # pads are skipped, as the reader skips them
            return kind
        read += length


@pytest.fixture
def same():
    """Assert that a received value equals the sent one: types, structure, bytes."""
    return _same


def _same(a, b):
    if isinstance(a, torch.Tensor):
        assert type(b) is torch.Tensor, type(b)
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
        if a.numel():  # compared as bytes: no dtype lacks a uint8 view
            assert torch.equal(_bytes(a.resolve_conj().resolve_neg()), _bytes(b))
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (tuple, list)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert type(a) is type(b) and (a == b or (a != a and b != b)), (a, b)  # NaN too


def _bytes(t):
    # a fresh dense copy: .contiguous() keeps the odd stride of a 1-element view
    return t.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)
