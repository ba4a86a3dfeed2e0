"""Loopback ports for the processes flagdeploy starts itself (parallel ranks' rendezvous, launched
engines behind the gateway)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (the OS picks it; the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
