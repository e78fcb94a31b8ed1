"""Tests for the systemd units, the mount(8) helper and mount/install.sh.

The units are checked with ``systemd-analyze verify`` (Debian/Ubuntu package
``systemd``), the helper and installer by running them with a fake ``shadefs`` that
records how it was called.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNITS = ROOT / "systemd"
HELPER = ROOT / "mount" / "mount.fuse.shadefs"
INSTALL = ROOT / "mount" / "install.sh"
SERVICE = "shadefs@.service"
MOUNT = "mnt-shade.mount"
SHADEFS = "/usr/local/bin/shadefs"

FAKE_SHADEFS = """#!/bin/sh
# Record argv, one argument per line, then exit with the status the test asked for.
printf '%s\\n' "$@" > "$FAKE_ARGV"
exit "${FAKE_STATUS:-0}"
"""


def _require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        reason = f"{name} not installed (apt-get install systemd)"
        # CI must install it rather than go green by skipping.
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return path


def _directives(path: Path) -> list[tuple[str, str, str]]:
    """Parse a unit file into (section, key, value), keeping repeated keys."""
    section = ""
    result = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        result.append((section, key.strip(), value.strip()))
    return result


def _values(path: Path, section: str, key: str) -> list[str]:
    return [v for s, k, v in _directives(path) if (s, k) == (section, key)]


# -- systemd units -------------------------------------------------------------------


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = _require_tool("systemd-analyze")
    # verify checks that ExecStart= binaries exist: point the copies at a stub so that
    # the check passes on machines where shadefs is not installed, and change nothing
    # else. mnt-shade.mount requires mnt-nfs.mount, which a stub unit next to it
    # provides (verify searches the directories of the units it is given).
    stub = tmp_path / "shadefs"
    stub.write_text("#!/bin/sh\n")
    stub.chmod(0o755)
    for name in (SERVICE, MOUNT):
        text = (UNITS / name).read_text()
        assert SHADEFS in text or name == MOUNT
        (tmp_path / name).write_text(text.replace(SHADEFS, str(stub)))
    (tmp_path / "mnt-nfs.mount").write_text(
        "[Unit]\nDescription=stub\n[Mount]\nWhat=server:/export\nWhere=/mnt/nfs\nType=nfs\n"
    )
    result = subprocess.run(
        [
            analyze,
            "verify",
            "--man=no",
            # Judge our units, not the host's.
            "--recursive-errors=no",
            str(tmp_path / SERVICE),
            str(tmp_path / MOUNT),
        ],
        capture_output=True,
        text=True,
    )
    # verify exits 0 after warnings such as "Unknown key ..., ignoring", so any line
    # about our units counts as a failure too.
    ours = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if re.search(r"shadefs@|mnt-shade|mnt-nfs|" + re.escape(str(tmp_path)), line)
    ]
    assert result.returncode == 0 and not ours, result.stdout + result.stderr


def test_unit_names_match_their_mount_points() -> None:
    escape = _require_tool("systemd-escape")

    def run(*args: str) -> str:
        return subprocess.run(
            [escape, *args], capture_output=True, text=True, check=True
        ).stdout.strip()

    # A .mount unit must be named after Where=.
    where = _values(UNITS / MOUNT, "Mount", "Where")
    assert [run("--path", "--suffix=mount", w) for w in where] == [MOUNT]
    # The template's instance is the escaped mount point, and %f undoes the escaping.
    assert run("--path", "/mnt/shade") == "mnt-shade"
    assert run("--unescape", "--path", "mnt-shade") == "/mnt/shade"


def test_service_is_notify_and_mounts_instance_path() -> None:
    unit = UNITS / SERVICE
    assert _values(unit, "Service", "Type") == ["notify"]
    assert _values(unit, "Service", "NotifyAccess") == ["main"]
    assert _values(unit, "Service", "EnvironmentFile") == ["/etc/shadefs/%i.conf"]
    assert _values(unit, "Service", "ExecStart") == [
        f"{SHADEFS} mount --systemd ${{SHADEFS_SRC}} %f -o ${{SHADEFS_OPTS}}"
    ]
    assert _values(unit, "Service", "ExecStop") == [f"{SHADEFS} umount %f"]
    assert _values(unit, "Service", "KillMode") == ["mixed"]


def test_service_hardening_keeps_the_mount_visible() -> None:
    # Each of these gives the service its own mount namespace (or closes /dev/fuse):
    # the FUSE mount would then exist only inside the service.
    forbidden = {
        "ProtectSystem",
        "ProtectHome",
        "PrivateTmp",
        "PrivateDevices",
        "PrivateMounts",
        "PrivateNetwork",
        "ProtectKernelTunables",
        "ProtectKernelModules",
        "ProtectKernelLogs",
        "ProtectControlGroups",
        "ProtectClock",
        "ProtectProc",
        "ReadOnlyPaths",
        "ReadWritePaths",
        "InaccessiblePaths",
        "TemporaryFileSystem",
        "BindPaths",
        "BindReadOnlyPaths",
        "RootDirectory",
        "MountFlags",
        "DevicePolicy",
        "DeviceAllow",
    }
    keys = {k for s, k, _ in _directives(UNITS / SERVICE) if s == "Service"}
    assert not keys & forbidden
    bounding = " ".join(_values(UNITS / SERVICE, "Service", "CapabilityBoundingSet"))
    assert "CAP_SYS_ADMIN" in bounding.split()


def test_mount_unit_is_fuse_shadefs_after_nfs() -> None:
    unit = UNITS / MOUNT
    assert _values(unit, "Mount", "Type") == ["fuse.shadefs"]
    assert _values(unit, "Mount", "What") == ["/mnt/nfs/imagenet"]
    options = _values(unit, "Mount", "Options")[0].split(",")
    assert {"ram=16G", "ssd=/var/cache/shadefs:400G", "_netdev", "nofail"} <= set(options)
    assert "mnt-nfs.mount" in _values(unit, "Unit", "Requires")
    assert "mnt-nfs.mount" in _values(unit, "Unit", "After")


# -- mount(8) helper -----------------------------------------------------------------


@pytest.fixture
def fake_shadefs(tmp_path: Path) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "shadefs"
    fake.write_text(FAKE_SHADEFS)
    fake.chmod(0o755)
    return fake


def run_helper(
    fake: Path, *args: str, status: int = 0
) -> tuple[subprocess.CompletedProcess[str], list[str] | None]:
    """Run the helper with the fake shadefs first on PATH; return (result, its argv)."""
    record = fake.parent / "argv"
    record.unlink(missing_ok=True)
    env = {
        **os.environ,
        "PATH": f"{fake.parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "FAKE_ARGV": str(record),
        "FAKE_STATUS": str(status),
    }
    env.pop("SHADEFS_BIN", None)
    result = subprocess.run([str(HELPER), *args], capture_output=True, text=True, env=env)
    argv = record.read_text().splitlines() if record.exists() else None
    return result, argv


def test_helper_drops_fstab_words(fake_shadefs: Path) -> None:
    # What mount(8) passes for the documented fstab line (libmount has already removed
    # the x-systemd.* option and added rw).
    result, argv = run_helper(
        fake_shadefs,
        "/mnt/nfs/imagenet",
        "/mnt/shade",
        "-o",
        "rw,ram=16G,ssd=/var/cache/shadefs:400G,_netdev,nofail",
    )
    assert result.returncode == 0, result.stderr
    assert argv == [
        "mount",
        "/mnt/nfs/imagenet",
        "/mnt/shade",
        "-o",
        "ram=16G,ssd=/var/cache/shadefs:400G",
    ]


def test_helper_drops_every_fstab_only_word(fake_shadefs: Path) -> None:
    words = (
        "defaults,auto,noauto,nofail,_netdev,user,users,rw,ro,nosuid,nodev,noexec,suid,dev,"
        "exec,x-systemd.requires=/mnt/nfs,x-systemd.automount,comment=systemd.automount,,"
    )
    result, argv = run_helper(fake_shadefs, "/src", "/mnt", "-o", words)
    assert result.returncode == 0, result.stderr
    assert argv == ["mount", "/src", "/mnt"]


def test_helper_keeps_shadefs_options_in_order(fake_shadefs: Path) -> None:
    # Flags that mount(8) may add are accepted and ignored; repeated -o accumulate; a
    # '*' in a value is not globbed; a source with spaces stays one argument.
    result, argv = run_helper(
        fake_shadefs,
        "/data/my set",
        "/mnt",
        "-s",
        "-n",
        "-v",
        "-t",
        "fuse.shadefs",
        "-o",
        "policy=lru,allow_other,nofail",
        "-o",
        "log_level=debug,ssd=/cache/*:1T",
    )
    assert result.returncode == 0, result.stderr
    assert argv == [
        "mount",
        "/data/my set",
        "/mnt",
        "-o",
        "policy=lru,allow_other,log_level=debug,ssd=/cache/*:1T",
    ]


def test_helper_returns_shadefs_status(fake_shadefs: Path) -> None:
    result, argv = run_helper(fake_shadefs, "/src", "/mnt", "-o", "rw", status=32)
    assert result.returncode == 32
    assert argv == ["mount", "/src", "/mnt"]


def test_helper_fake_mount_runs_nothing(fake_shadefs: Path) -> None:
    # mount -f ("fake") passes -f: only pretend to mount.
    result, argv = run_helper(fake_shadefs, "/src", "/mnt", "-f", "-o", "rw,ram=1G")
    assert result.returncode == 0
    assert argv is None


@pytest.mark.parametrize("args", [[], ["/src"], ["/src", "/mnt", "extra"], ["/s", "/m", "-x"]])
def test_helper_rejects_bad_usage(fake_shadefs: Path, args: list[str]) -> None:
    result, argv = run_helper(fake_shadefs, *args)
    assert result.returncode == 1
    assert "usage" in result.stderr
    assert argv is None


# -- install.sh ----------------------------------------------------------------------


def _install(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sh", str(INSTALL), *args, str(root)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )


def _tree(root: Path) -> dict[str, str]:
    """Map each path under *root* to its mode and, for links, target."""
    tree = {}
    for path in sorted(root.rglob("*")):
        info = oct(path.lstat().st_mode)
        if path.is_symlink():
            info += " -> " + os.readlink(path)
        tree[str(path.relative_to(root))] = info
    return tree


def test_install_is_idempotent_and_uninstalls(tmp_path: Path, fake_shadefs: Path) -> None:
    root = tmp_path / "root"
    result = _install(root, SHADEFS_BIN=str(fake_shadefs))
    assert result.returncode == 0, result.stderr
    unit = root / "etc/systemd/system" / SERVICE
    helper = root / "sbin/mount.fuse.shadefs"
    link = root / "usr/local/bin/shadefs"
    assert unit.read_text() == (UNITS / SERVICE).read_text()
    assert helper.read_bytes() == HELPER.read_bytes()
    assert os.access(helper, os.X_OK)
    assert os.readlink(link) == str(fake_shadefs)
    assert (root / "etc/shadefs").is_dir()
    installed = _tree(root)

    again = _install(root, SHADEFS_BIN=str(fake_shadefs))
    assert again.returncode == 0, again.stderr
    assert _tree(root) == installed

    (root / "etc/shadefs/mnt-shade.conf").write_text("SHADEFS_SRC=/mnt/nfs/imagenet\n")
    removed = _install(root, "--uninstall")
    assert removed.returncode == 0, removed.stderr
    assert not unit.exists() and not helper.exists() and not link.is_symlink()
    # The administrator's configuration survives.
    assert (root / "etc/shadefs/mnt-shade.conf").exists()


def test_install_keeps_a_real_shadefs(tmp_path: Path) -> None:
    root = tmp_path / "root"
    real = root / "usr/local/bin/shadefs"
    real.parent.mkdir(parents=True)
    real.write_text("#!/bin/sh\n")
    result = _install(root, SHADEFS_BIN="/nonexistent")
    assert result.returncode == 0, result.stderr
    assert not real.is_symlink() and real.read_text() == "#!/bin/sh\n"
    assert _install(root, "--uninstall").returncode == 0
    assert real.exists()


def test_install_refuses_without_shadefs(tmp_path: Path) -> None:
    root = tmp_path / "root"
    result = _install(root, SHADEFS_BIN=str(tmp_path / "missing"))
    assert result.returncode == 1
    assert "pip install" in result.stderr
    # Nothing half-installed.
    assert not root.exists()
