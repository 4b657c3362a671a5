"""Segments written once through their file (``Segment.write_new``): the bytes land
where asked, every page is allocated (no hole a reader's fault must fill), and a
failed write leaves no file; ``maps_large_pages`` tells what their mappings get."""
import os

import pytest

from neuronmp.errors import ShmSpaceError
from neuronmp.shm.segment import MADV_POPULATE_READ, Segment, maps_large_pages


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


def _pmd_kib_of(path):
    """This process's PMD-mapped kB of its mapping of ``path`` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if line.split()[-1:] == [path]:
            total = 0
            for extra in lines[i + 1:]:
                key, _, rest = extra.partition(":")
                if " " in key or not rest.strip():
                    break
                if key in ("FilePmdMapped", "ShmemPmdMapped"):
                    total += int(rest.split()[0])
            return total
    raise AssertionError(f"{path} is not mapped")


@pytest.mark.parametrize("where", ["shm", "temp"])
def test_maps_large_pages_says_what_a_copy_on_write_mapping_gets(runtime_dir, tmp_path, where):
    """The probe against a mapping read on its own: a 4 MiB segment written here and
    mapped as workers map weights is PMD-mapped exactly when the probe says so (both
    answers occur across hosts: tmpfs without ``huge=``, ext4 with large folios)."""
    directory = os.path.join(runtime_dir, "shm") if where == "shm" else str(tmp_path / "w")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    said = maps_large_pages(directory)
    seg = Segment.write_new(4 << 20, [(0, bytes(4 << 20))], directory)
    try:
        mm = Segment.map_copy(seg.name, directory)
        mm.madvise(MADV_POPULATE_READ)
        try:
            assert (_pmd_kib_of(seg.path) >= 2048) == said
        finally:
            mm.close()
    finally:
        seg.close()
    assert [n for n in os.listdir(directory) if not n.endswith(".live")] == []


def test_tmpfs_without_huge_pages_is_said_to_map_small_pages(runtime_dir):
    shm = os.path.join(runtime_dir, "shm")
    os.makedirs(shm, mode=0o700, exist_ok=True)
    with open("/proc/self/mountinfo") as f:   # the mount holding the runtime directory
        mounts = [line.split() for line in f]
    mount = max((m for m in mounts if shm.startswith(m[4].rstrip("/") + "/")),
                key=lambda m: len(m[4]))
    fstype, options = mount[mount.index("-") + 1], mount[-1]
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            forced = "[force]" in f.read()
    except OSError:
        forced = False
    if fstype != "tmpfs" or forced or any(o.startswith("huge=") and o != "huge=never"
                                          for o in options.split(",")):
        pytest.skip(f"the runtime directory is on {fstype} ({options}): it may map huge pages")
    assert maps_large_pages(shm) is False
    assert maps_large_pages(os.path.join(shm, "missing")) is False   # unwritable: no
