"""Tests for shadefs.ops.sdnotify against real AF_UNIX datagram sockets."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from shadefs.ops import sdnotify


def _bind(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    # Every test sends before it receives, so a timeout only guards against a hung test.
    sock.settimeout(5)
    return sock


@pytest.fixture
def path_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    address = str(tmp_path / "notify.sock")
    with _bind(address) as sock:
        monkeypatch.setenv("NOTIFY_SOCKET", address)
        yield sock


@pytest.fixture
def abstract_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    name = f"shadefs-test-{os.getpid()}-{os.urandom(4).hex()}"
    with _bind("\0" + name) as sock:
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        yield sock


def test_unset_returns_false(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False
    assert sdnotify.ready() is False
    assert sdnotify.stopping() is False


def test_ready_on_path_socket(path_socket: socket.socket) -> None:
    assert sdnotify.ready("serving /mnt/shade") is True
    assert path_socket.recv(4096) == b"READY=1\nSTATUS=serving /mnt/shade"


def test_ready_on_abstract_socket(abstract_socket: socket.socket) -> None:
    assert sdnotify.ready() is True
    message = abstract_socket.recv(4096)
    assert message.startswith(b"READY=1\nSTATUS=")


def test_stopping_and_status(path_socket: socket.socket) -> None:
    assert sdnotify.status("evicting") is True
    assert sdnotify.stopping() is True
    assert path_socket.recv(4096) == b"STATUS=evicting"
    assert path_socket.recv(4096) == b"STOPPING=1"


def test_missing_socket_does_not_raise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone.sock"))
    assert sdnotify.ready() is False


def test_stale_socket_file_does_not_raise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A socket file whose receiver has closed: connect gives ECONNREFUSED.
    address = str(tmp_path / "stale.sock")
    _bind(address).close()
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    assert sdnotify.notify("READY=1") is False


def test_unbound_abstract_socket_does_not_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", f"@shadefs-test-nobody-{os.urandom(4).hex()}")
    assert sdnotify.notify("READY=1") is False


@pytest.mark.parametrize("value", ["relative.sock", "@", "vsock:2:1234"])
def test_unsupported_address_returns_false(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    assert sdnotify.notify("READY=1") is False
