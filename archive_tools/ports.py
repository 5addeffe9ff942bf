"""Free local ports for a TorchServe: its REST and gRPC listeners, one set per server."""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: how far below the ephemeral range ports are picked (never below the privileged 1024)
SPAN = 10_000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A free 127.0.0.1 port below the kernel's ephemeral range, so that between this pick
    and TorchServe's bind no client connection can be handed it as its local port (a CI run
    lost a gRPC bind that way); any free port where that range leaves no room."""
    low, rng = _ephemeral_low(), random.SystemRandom()
    for _ in range(50 if low - SPAN >= 1024 else 0):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", rng.randrange(low - SPAN, low)))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
