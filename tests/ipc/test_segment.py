"""Segments written once through their file (``Segment.write_new``): the bytes land
where asked, every page is allocated (no hole a reader's fault must fill), and a
failed write leaves no file."""
import os

import pytest

from neuronmp.errors import ShmSpaceError
from neuronmp.ipc import Segment


def _files(runtime_dir):
    """The segments (the owner's .live file beside them is liveness.py's)."""
    shm = os.path.join(runtime_dir, "shm")
    names = sorted(os.listdir(shm)) if os.path.isdir(shm) else []
    return [n for n in names if not n.endswith(".live")]


def test_pieces_land_at_their_offsets_with_zeros_between(runtime_dir):
    page = os.sysconf("SC_PAGE_SIZE")
    pieces = [(0, b"head"), (100, bytearray(b"mid")), (3 * page + 5, memoryview(b"tail"))]
    seg = Segment.write_new(3 * page + 9, pieces)
    try:
        assert seg.buf is None and seg.owner and seg.size == 4 * page
        with open(seg.path, "rb") as f:
            data = f.read()
        want = bytearray(4 * page)
        for offset, piece in pieces:
            want[offset:offset + len(piece)] = bytes(piece)
        assert data == bytes(want)
        # every page is backed: a reader's fault never allocates (or SIGBUSes)
        assert os.stat(seg.path).st_blocks * 512 >= seg.size
        copy = Segment.map_copy(seg.name)
        assert copy[100:103] == b"mid" and len(copy) == seg.size
        copy.close()
    finally:
        seg.close()
    assert _files(runtime_dir) == []


def test_a_write_that_fails_leaves_no_file(runtime_dir):
    with pytest.raises(ValueError, match="overlap or are out of order at 2"):
        Segment.write_new(4096, [(0, b"abcd"), (2, b"x")])
    with pytest.raises(ValueError, match="past its size"):
        Segment.write_new(4096, [(4000, bytes(200))])
    with pytest.raises(TypeError):
        Segment.write_new(4096, [(0, b"ok"), (10, 12345)])
    with pytest.raises(ValueError, match="size"):
        Segment.write_new(0, [])
    assert _files(runtime_dir) == []


def test_a_segment_bigger_than_the_free_space_is_a_clear_error(runtime_dir):
    st = os.statvfs(runtime_dir)
    free = st.f_bavail * st.f_frsize
    with pytest.raises(ShmSpaceError) as err:
        Segment.write_new(free + (1 << 30), [(0, b"x")])
    assert err.value.requested >= free + (1 << 30)
    assert _files(runtime_dir) == []
