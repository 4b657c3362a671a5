"""shm._guard: copies on a file mapping whose file shrinks end with False, not SIGBUS;
any other SIGBUS still kills the process as before."""
import mmap
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from neuronmp.shm import _guard

SIZE = 1 << 20


@pytest.fixture
def mapped(runtime_dir):
    """A 1 MiB file on /dev/shm filled with a pattern: its descriptor, a shared mapping,
    the pattern and the path."""
    made = []

    def make(tag: str = "region"):
        path = os.path.join(runtime_dir, f"guard-{tag}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        data = (np.arange(SIZE, dtype=np.uint32) % 251).astype(np.uint8)
        os.write(fd, data.tobytes())
        mm = mmap.mmap(fd, SIZE)
        made.append((path, fd, mm))
        return fd, mm, data, path

    yield make
    for path, fd, mm in made:
        mm.close()
        os.close(fd)
        os.unlink(path)


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_a_copy_on_a_mapping_whose_file_shrank_returns_false_and_the_process_lives(mapped):
    fd, mm, data, _ = mapped()
    out = np.zeros(SIZE, np.uint8)
    assert _guard.ready()
    assert _guard.read(mm, 0, _addr(out), SIZE) is True
    np.testing.assert_array_equal(out, data)

    os.ftruncate(fd, 4096)   # what a client may do to its region at any moment
    assert _guard.read(mm, 0, _addr(out), SIZE) is False
    assert _guard.write(mm, 4096, _addr(data), SIZE - 4096) is False
    base = _addr(np.frombuffer(mm, np.uint8))
    assert _guard.copy(_addr(out), base + 8192, 4096) is False
    assert _guard.copy(base + 8192, _addr(data), 4096) is False
    out[:] = 0   # what is still in the file is still copied, whole
    assert _guard.read(mm, 0, _addr(out), 4096) is True
    np.testing.assert_array_equal(out[:4096], data[:4096])

    os.ftruncate(fd, SIZE)   # grown back: the mapping reads the file again (zeros past 4096)
    assert _guard.write(mm, 0, _addr(data), SIZE) is True
    assert _guard.read(mm, 0, _addr(out), SIZE) is True
    np.testing.assert_array_equal(out, data)


def test_copies_outside_the_buffer_or_at_address_0_are_refused_by_name(mapped):
    _fd, mm, _data, _ = mapped()
    out = np.zeros(16, np.uint8)
    with pytest.raises(ValueError, match="outside the buffer's 1048576 bytes"):
        _guard.read(mm, SIZE - 8, _addr(out), 16)
    with pytest.raises(ValueError, match="bad address or size -1"):
        _guard.copy(_addr(out), _addr(out), -1)
    with pytest.raises(TypeError, match="copy\\(\\) takes 3 arguments"):
        _guard.copy(0, 0)
    readonly = mmap.mmap(_fd, SIZE, prot=mmap.PROT_READ)
    with pytest.raises(BufferError, match="not writable"):
        _guard.write(readonly, 0, _addr(out), 16)
    readonly.close()


def test_the_guard_works_from_several_threads_at_once(mapped):
    # threads copying at once, each its own guard: those on a shrunk file get False
    # every time, those on an intact one their bytes every time, none is confused
    # by another thread's fault
    shrunk_fd, shrunk, _, _ = mapped("shrunk")
    _fd, intact, data, _ = mapped("intact")
    os.ftruncate(shrunk_fd, 0)
    results = {"shrunk": [], "intact": []}
    errors = []

    def copy(which: str, mm: mmap.mmap) -> None:
        out = np.empty(SIZE, np.uint8)
        try:
            for _ in range(100):
                ok = _guard.read(mm, 0, _addr(out), SIZE)
                results[which].append(ok and bool(np.array_equal(out, data)))
        except Exception as exc:   # reported below: a thread's exception is otherwise lost
            errors.append(exc)

    threads = [threading.Thread(target=copy, args=(w, m))
               for w, m in (("shrunk", shrunk), ("intact", intact)) * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert results["shrunk"] == [False] * 300
    assert results["intact"] == [True] * 300


_UNGUARDED_TOUCH = """
import ctypes, mmap, os, sys
from neuronmp.shm import _guard
path = sys.argv[1]
fd = os.open(path, os.O_RDWR)
mm = mmap.mmap(fd, 1 << 20)
assert _guard.ready()
os.ftruncate(fd, 0)
base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
print("touching", flush=True)
ctypes.string_at(base + 4096, 16)   # outside any guarded copy: a real crash
print("survived", flush=True)
"""


@pytest.mark.parametrize("faulthandler", [False, True])
def test_a_sigbus_outside_a_guarded_copy_still_kills_the_process(mapped, procs, faulthandler):
    path = mapped("crash")[3]
    code = ("import faulthandler; faulthandler.enable()\n" if faulthandler else "") + \
        _UNGUARDED_TOUCH
    p = procs.popen([sys.executable, "-c", code, path], stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=120)
    assert p.returncode == -signal.SIGBUS, (p.returncode, out, err)
    assert "touching" in out and "survived" not in out
    if faulthandler:   # the handler that was there before still runs (its dump)
        assert "Bus error" in err, err


def test_a_sigbus_sent_to_the_process_still_kills_it(procs):
    p = procs.python("import os, signal\nfrom neuronmp.shm import _guard\n"
                     "assert _guard.ready()\nos.kill(os.getpid(), signal.SIGBUS)\n"
                     "print('survived')")
    out, err = p.communicate(timeout=120)
    assert p.returncode == -signal.SIGBUS and "survived" not in out, (p.returncode, out, err)


def test_a_displaced_guard_copies_nothing_and_says_so(procs):
    # another SIGBUS handler installed after the guard's: copying on would mean a fault
    # goes to it, so every copy returns False untouched (the caller's unguarded path)
    p = procs.python(
        "import signal, numpy as np\nfrom neuronmp.shm import _guard\n"
        "assert _guard.ready()\nsignal.signal(signal.SIGBUS, signal.SIG_DFL)\n"
        "a, b = np.ones(64, np.uint8), np.zeros(64, np.uint8)\n"
        "addr = lambda x: x.__array_interface__['data'][0]\n"
        "print(_guard.ready(), _guard.copy(addr(b), addr(a), 64), int(b.sum()))")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert out.split() == ["False", "False", "0"]
