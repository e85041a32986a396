#!/usr/bin/env bash
# Run the test suite under the newest JAX, Flax and Optax, on Python 3.13.
#
# JAX 0.11 and later need Python 3.12 or newer, while requirements.txt pins JAX 0.10.2 for
# Python 3.11. This builds a Debian 13 (trixie) root file system with its Python 3.13 in a
# folder, installs the newest releases there into a virtual environment, copies the project
# in, and runs pytest inside it (arguments are passed to pytest). Linux, as root (debootstrap,
# chroot, mount); the root file system is built once and reused, the packages are upgraded on
# every run.
#
#   sudo dev/newest_jax.sh                          # the whole suite, about 18 minutes
#   sudo dev/newest_jax.sh test_equivalence.py -x   # the headline proof alone
#   NEWEST_JAX_ROOT=/srv/trixie sudo -E dev/newest_jax.sh
#
# With a Python 3.13 already on the machine (pyenv's, say) no root file system is needed, nor root:
#   NEWEST_PYTHON=~/.pyenv/versions/3.13.0/bin/python3.13 dev/newest_jax.sh
# Either way the newest JAX's libtpu goes into the copy's .tpu/, for tests/test_tpu.py.
set -euo pipefail
project=$(cd "$(dirname "$0")/.." && pwd)
root=${NEWEST_JAX_ROOT:-/var/tmp/newest-jax-root}
packages="jax flax optax orbax-checkpoint tensorflow-datasets importlib_resources pytest pytest-xdist matplotlib"
libtpu='import importlib.metadata as m; print(next(r.split(";")[0] for r in m.requires("jax") if r.startswith("libtpu")))'
versions='import sys, jax, flax, optax, orbax.checkpoint as o, numpy; print("Python", sys.version.split()[0], "| jax", jax.__version__, "| flax", flax.__version__, "| optax", optax.__version__, "| orbax-checkpoint", o.__version__, "| numpy", numpy.__version__)'

if [ -n "${NEWEST_PYTHON:-}" ]; then
  copy=$(mktemp -d)
  trap 'rm -rf "$copy"' EXIT
  (cd "$project" && git ls-files -z | xargs -0 cp --parents -t "$copy")
  "$NEWEST_PYTHON" -m venv "$copy/venv"
  "$copy/venv/bin/pip" install --quiet --upgrade pip $packages
  "$copy/venv/bin/pip" install --quiet --target "$copy/.tpu" "$("$copy/venv/bin/python" -c "$libtpu")"
  "$copy/venv/bin/python" -c "$versions"
  cd "$copy" && "$copy/venv/bin/python" -m pytest "$@"
  exit
fi

if [ ! -x "$root/usr/bin/python3" ]; then
  command -v debootstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq debootstrap; }
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates trixie "$root"
fi
# The host's name resolution and certificates: pip and JAX's distributed runtime (gloo, which
# looks up this host's name) need them.
cp /etc/resolv.conf /etc/hosts "$root/etc/"
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
mountpoint -q "$root/proc" || mount -t proc proc "$root/proc"
mountpoint -q "$root/dev" || mount --bind /dev "$root/dev"
trap 'umount "$root/dev" "$root/proc" 2>/dev/null || true' EXIT

rm -rf "$root/project"
mkdir -p "$root/project"
(cd "$project" && git ls-files -z | xargs -0 cp --parents -t "$root/project")

# A clean environment: the host's pip settings name its own folders and files.
env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 chroot "$root" /bin/bash -s -- "$@" <<EOF
set -euo pipefail
[ -x /venv/bin/python ] || python3 -m venv /venv
/venv/bin/pip install --quiet --upgrade pip $packages
/venv/bin/pip install --quiet --target /project/.tpu "\$(/venv/bin/python -c '$libtpu')"
/venv/bin/python -c '$versions'
cd /project
exec /venv/bin/python -m pytest "\$@"
EOF
