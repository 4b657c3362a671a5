"""Reading a peer rank's memory: process_vm_readv through libc (one system call per
copy, no segment in between), for the collectives' direct paths (shm.py probes it
once per group; where it is missing or refused, the group copies through its
segment instead).
"""
from __future__ import annotations

import ctypes

__all__ = ["AVAILABLE", "read"]


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
