#!/bin/sh
# Install pyfuse3 3.5.0 with the project's no-open patch (patches/pyfuse3-no-open.patch) into the
# Python environment of PYTHON, so that `shadefs mount --kernel-hits` can take warm opens off
# the daemon (README: Kernel hits).
#
#     tools/install-pyfuse3.sh [PYTHON]        (default: python3 on PATH)
#
# The sdist comes from the package index, or from PYFUSE3_SDIST (a path to
# pyfuse3-3.5.0.tar.gz, for a machine without one); either way its SHA-256 must match the pin
# below. Building needs a C compiler, pkg-config and libfuse3's headers (Debian: gcc
# pkg-config libfuse3-dev); pip's build isolation brings Cython. Exit status: 0 installed,
# 1 failed (the environment's pyfuse3 is then unchanged).
set -eu

PYTHON=${1:-python3}
VERSION=3.5.0
SHA256=88399a9494b88603230bba300f4ba9ad63fece5ed514ca3633d555a0c6a42b24
here=$(cd "$(dirname "$0")/.." && pwd)
patch_file=$here/patches/pyfuse3-no-open.patch

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [ -n "${PYFUSE3_SDIST:-}" ]; then
    sdist=$PYFUSE3_SDIST
else
    "$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$work" "pyfuse3==$VERSION"
    sdist=$work/pyfuse3-$VERSION.tar.gz
fi
got=$(sha256sum "$sdist" | cut -d' ' -f1)
if [ "$got" != "$SHA256" ]; then
    echo "install-pyfuse3: $sdist has SHA-256 $got, expected $SHA256" >&2
    exit 1
fi

tar -xzf "$sdist" -C "$work"
src=$work/pyfuse3-$VERSION
(cd "$src" && patch -p1 -s < "$patch_file")
rm -f "$src/src/pyfuse3/__init__.c"  # generated from the .pyx: Cython makes it anew
"$PYTHON" -m pip install -q --no-deps --force-reinstall "$src"
"$PYTHON" -c 'import pyfuse3, sys; sys.exit(not getattr(pyfuse3, "NO_OPEN_FH_IS_INODE", False))' || {
    echo "install-pyfuse3: the installed pyfuse3 is not the patched build" >&2
    exit 1
}
echo "pyfuse3 $VERSION with the no-open patch installed for $PYTHON"
