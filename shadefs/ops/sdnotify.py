"""Minimal sd_notify(3) client: tell systemd that the mount is up or going down.

``Type=notify`` units wait for ``READY=1`` on the datagram socket named by
``$NOTIFY_SOCKET``. This module speaks that protocol directly instead of depending on
libsystemd or python-systemd, which are not available in every training image. Every
function returns False instead of raising when there is nothing to notify or the socket is
gone: losing a notification must never take the filesystem down with it.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)

__all__ = ["notify", "ready", "status", "stopping"]


def _address(raw: str) -> str | None:
    """Turn a ``$NOTIFY_SOCKET`` value into an AF_UNIX address, or None if unsupported."""
    if raw.startswith("/"):
        return raw
    if raw.startswith("@") and len(raw) > 1:
        # systemd writes abstract-namespace sockets with a leading '@' in place of the NUL
        # byte that the kernel expects.
        return "\0" + raw[1:]
    # Other forms (e.g. ``vsock:CID:PORT`` from systemd >= 254) only matter inside VMs
    # managed by a host systemd, which shadefs does not target.
    return None


def notify(message: str) -> bool:
    """Send *message* (``KEY=value`` lines) to ``$NOTIFY_SOCKET``.

    Return True if the datagram was sent, False if no socket is configured or sending
    failed. Never raises for a missing, refused or broken socket.
    """
    raw = os.environ.get("NOTIFY_SOCKET", "")
    if not raw:
        return False
    address = _address(raw)
    if address is None:
        log.debug("unsupported NOTIFY_SOCKET %r, not notifying", raw)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(message.encode(), address)
    except OSError as exc:
        log.debug("cannot notify %r: %s", raw, exc)
        return False
    log.debug("notified %r: %r", raw, message)
    return True


def ready(status: str = "mounted") -> bool:
    """Tell systemd that start-up finished (``READY=1``), with a human-readable status."""
    return notify(f"READY=1\nSTATUS={status}")


def status(text: str) -> bool:
    """Update the status line shown by ``systemctl status``."""
    return notify(f"STATUS={text}")


def stopping() -> bool:
    """Tell systemd that shutdown has begun (``STOPPING=1``)."""
    return notify("STOPPING=1")
