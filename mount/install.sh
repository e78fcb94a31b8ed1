#!/bin/sh
# install.sh - install shadefs's systemd unit and mount(8) helper.
#
# usage: mount/install.sh [--uninstall] [ROOT]
#
# ROOT (default /) is the root of the target tree, e.g. a staging directory or a
# container image. Installs:
#   ROOT/etc/systemd/system/shadefs@.service     template unit, see the file's header
#   ROOT/sbin/mount.fuse.shadefs                 helper for mount -t fuse.shadefs / fstab
#   ROOT/usr/local/share/shadefs/mnt-shade.mount example .mount unit (not active)
#   ROOT/etc/shadefs/                            per-instance configuration directory
#   ROOT/usr/local/bin/shadefs                   symlink to the shadefs script of the
#                                                current Python ($PYTHON, default python3),
#                                                unless a real file is already there
# Running it again is harmless. --uninstall removes the same files (the symlink only if
# it is one) and keeps configuration in /etc/shadefs.
#
# Environment: PYTHON picks the interpreter whose shadefs is linked; SHADEFS_BIN names
# the shadefs executable directly.

set -eu

here=$(cd "$(dirname "$0")/.." && pwd)
uninstall=0
root=
for arg in "$@"; do
    case $arg in
        --uninstall) uninstall=1 ;;
        -h | --help)
            sed -n '2,20s/^# \{0,1\}//p' "$0"
            exit 0
            ;;
        -*)
            echo "install.sh: unknown option $arg" >&2
            exit 1
            ;;
        *) root=${arg%/} ;;
    esac
done

unitdir=$root/etc/systemd/system
# mount(8) looks for helpers in /sbin, /sbin/fs.d and /sbin/fs only (libmount's
# FS_SEARCH_PATH). On merged-/usr systems /sbin is a symlink to usr/sbin, so the helper
# lands in /usr/sbin and is found through the link.
sbindir=$root/sbin
sharedir=$root/usr/local/share/shadefs
confdir=$root/etc/shadefs
link=$root/usr/local/bin/shadefs

say() {
    echo "install.sh: $*"
}

reload_systemd() {
    # Only for the running system, and only if systemd is what runs it.
    if [ -z "$root" ] && [ -d /run/systemd/system ]; then
        systemctl daemon-reload
    fi
}

if [ "$uninstall" -eq 1 ]; then
    rm -f "$unitdir/shadefs@.service" "$sbindir/mount.fuse.shadefs" \
        "$sharedir/mnt-shade.mount"
    rmdir "$sharedir" 2>/dev/null || true
    if [ -L "$link" ]; then
        rm -f "$link"
    fi
    # Configuration is the administrator's: keep it, but drop the directory if empty.
    rmdir "$confdir" 2>/dev/null || true
    for wanted in "$unitdir"/*.wants/shadefs@*.service; do
        if [ -L "$wanted" ]; then
            say "still enabled, run systemctl disable: ${wanted##*/}"
        fi
    done
    reload_systemd
    say "uninstalled"
    exit 0
fi

# Find the shadefs to link before touching anything, so a failure leaves no half-install.
target=
if [ -e "$link" ] && [ ! -L "$link" ]; then
    say "keeping $link (not a symlink)"
elif [ -n "${SHADEFS_BIN:-}" ]; then
    target=$SHADEFS_BIN
else
    python=${PYTHON:-python3}
    # The scripts directory of the interpreter itself: a pyenv shim or a venv's
    # activation would not survive in a systemd unit.
    scripts=$("$python" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
    target=$scripts/shadefs
fi
if [ "$target" = "${link#"$root"}" ]; then
    target=  # already there: linking it to itself would make a loop
elif [ -n "$target" ] && [ ! -x "$target" ]; then
    echo "install.sh: $target is missing; pip install shadefs into this environment" \
        "first, or set PYTHON or SHADEFS_BIN" >&2
    exit 1
fi

install -d -m 0755 "$unitdir" "$sbindir" "$sharedir" "$confdir"
install -m 0644 "$here/systemd/shadefs@.service" "$unitdir/shadefs@.service"
# The example is named for a real path: installed into the unit directory it would
# override an fstab line for /mnt/shade, so it stays a template to copy.
install -m 0644 "$here/systemd/mnt-shade.mount" "$sharedir/mnt-shade.mount"
install -m 0755 "$here/mount/mount.fuse.shadefs" "$sbindir/mount.fuse.shadefs"
if [ -n "$target" ]; then
    install -d -m 0755 "${link%/*}"
    ln -sfn "$target" "$link"
    say "$link -> $target"
fi
reload_systemd
say "installed into ${root:-/}"
