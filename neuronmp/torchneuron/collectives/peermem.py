"""Reaching a peer rank's memory: process_vm_readv through libc (one system call per
copy, no segment in between), for the collectives' direct paths, and the probes a
group runs once when it is made (may every rank read every peer's memory? map every
peer's memfds?); where either is missing or refused, the group copies through its
segment instead.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import struct
from typing import Any

__all__ = ["AVAILABLE", "read", "probe_reads", "probe_maps"]


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc_readv():
    """libc's process_vm_readv, or None where there is none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                   ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    return fn


_vm_readv = _libc_readv()
#: whether this libc has process_vm_readv (whether the kernel allows it is probed)
AVAILABLE = _vm_readv is not None


def read(pid: int, dst: int, src: int, nbytes: int) -> bool:
    """Copy ``nbytes`` at address ``src`` in process ``pid`` to ``dst`` in this one;
    False on failure, the reason in ``ctypes.get_errno()``."""
    while nbytes:
        local, remote = _Iovec(dst, nbytes), _Iovec(src, nbytes)
        got = _vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            return False
        dst, src, nbytes = dst + got, src + got, nbytes - got
    return True


def probe_reads(group: Any) -> bool:
    """(``group``: the shm.ShmGroup being made, which imports this module.)  Can
    every rank read every peer's memory (process_vm_readv: same user, no
    ptrace restriction, a kernel and seccomp policy that allow it)?  Each rank posts
    the address of a known word, reads every peer's, and posts its verdict; the
    group reads in place only if every rank could."""
    if not AVAILABLE or group.world == 1:
        return False
    word = ctypes.c_uint64(group.rank + 1)   # alive until every peer has read it
    group._post(ctypes.addressof(word), 8)
    group.barrier("init_process_group")
    ok = 1
    for r in group._others:
        got = ctypes.c_uint64(0)
        addr = group._record(r)[0]
        done = read(group._peers[r].pid, ctypes.addressof(got), addr, 8)
        if not done or got.value != r + 1:
            ok = 0
    group._post_word(1, ok)   # the verdict; a slow peer may still read word 0
    group.barrier("init_process_group")
    every = all(group._record(r)[1] == 1 for r in range(group.world))
    group.barrier("init_process_group")   # all verdicts read before a record changes
    return every


def probe_maps(group: Any) -> bool:
    """Can every rank map every peer's memfds through /proc/<pid>/fd (same user,
    a /proc that shows them)?  Each rank posts a one-page memfd holding a known
    word, maps every peer's, and posts its verdict; all must succeed."""
    if group.world == 1:
        return False
    fd, serial = os.memfd_create("neuronmp-0", os.MFD_CLOEXEC), 0
    try:
        os.ftruncate(fd, mmap.PAGESIZE)
        os.pwrite(fd, struct.pack("<Q", group.rank + 1), 0)
        group._post(fd + 1, 8, serial, 0)
        group.barrier("init_process_group")
        ok = 1
        for r in group._others:
            addr, _, theirs, _ = group._record(r)
            try:
                got = group._map_peer(r, addr - 1, theirs)
                ok &= int(struct.unpack_from("<Q", got.numpy())[0] == r + 1)
            except OSError:
                ok = 0
            group._maps.clear()
        group._post_word(1, ok)   # the verdict; a slow peer may still read word 0
        group.barrier("init_process_group")
        every = all(group._record(r)[1] == 1 for r in range(group.world))
        group.barrier("init_process_group")   # every peer is done with my memfd
    finally:
        os.close(fd)
    return every
