"""Ports for the servers tests start.

A port found free with ``bind(("127.0.0.1", 0))`` comes from the kernel's ephemeral
range, the same range every outgoing connection (an HTTP client, gRPC, a TCPStore)
draws its local port from: between the pick and the server's own bind another
test's connection can take it (CI saw gRPC fail with "Address already in use").
Ports are picked below that range instead, where only an explicit bind lands.
"""
from __future__ import annotations

import random
import socket

_FLOOR = 10000


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port on 127.0.0.1 that no socket holds, outside the ephemeral range if it can."""
    top = _ephemeral_start()
    if top - 1 > _FLOOR:
        for port in random.sample(range(_FLOOR, top), 50):
            if _bindable(port):
                return port
    with socket.socket() as s:    # no room below the range: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
