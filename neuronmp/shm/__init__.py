"""Shared memory: segments, and the C primitives on shared and client mappings.

    segment    files in <runtime dir>/shm/, reserved, mapped, swept after dead owners
    _waits     (C) atomics and futex waits on shared words, the answer-slot flags
    _guard     (C) copies into client-owned mappings that survive a SIGBUS
    _shm.h     the atomics _waits and the transport's _frames (ipc/) share

The transport (ipc/), the pool, the server's client memory and the collectives
import these by name.  Nothing here imports torch.
"""
