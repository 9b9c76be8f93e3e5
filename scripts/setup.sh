#!/usr/bin/env bash
# One idempotent setup for a fresh Debian/Ubuntu machine, run as root by `make test` and `make demo`:
# distro bcc, compiler, kernel headers (exact, or the nearest mapped with a warning), tracefs,
# a venv that sees Debian's bcc and nothing else of Debian's, the project and its pinned deps.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${VENV:-$ROOT/.venv}
say()  { printf 'setup: %s\n' "$*"; }
warn() { printf 'setup: WARNING: %s\n' "$*" >&2; }
die()  { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "run as root (eBPF needs it): sudo make ..."
command -v apt-get >/dev/null || die "apt-get not found: setup supports Debian/Ubuntu only"

ARCH=$(dpkg --print-architecture)
KREL=$(uname -r)
PKGS=(python3-bpfcc libbpfcc gcc make tmux iproute2 python3-venv ca-certificates libcap2-bin systemd util-linux prometheus nginx-light wrk nftables)

missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
apt_updated=0
apt_install() {
    if [ "$apt_updated" -eq 0 ]; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq; apt_updated=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}
# prometheus and nginx: tests and benchmarks run their own binaries (own config, tmp storage, a
# free port), never the packages' services. So those services must not start on install: a
# policy-rc.d that refuses every start while apt runs (works with or without systemd as PID 1),
# then the units disabled.
SERVICE_PKGS=(prometheus nginx-light)
new_services=()
for p in "${SERVICE_PKGS[@]}"; do
    case " ${missing[*]} " in *" $p "*) new_services+=("${p%-light}") ;; esac
done
own_policy_rc=0
if [ "${#new_services[@]}" -gt 0 ] && [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\n# written by moescope scripts/setup.sh while apt runs: start no service\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    own_policy_rc=1
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi
if [ "${#missing[@]}" -gt 0 ]; then
    say "installing ${missing[*]}"
    apt_install "${missing[@]}"
fi
if [ "$own_policy_rc" -eq 1 ]; then
    rm -f /usr/sbin/policy-rc.d
    trap - EXIT
fi
for svc in "${new_services[@]}"; do
    # Not started at boot either (the packages enable their units); only when we installed them.
    if [ -d /run/systemd/system ]; then
        systemctl disable --now "$svc.service" >/dev/null 2>&1 || true
    elif command -v update-rc.d >/dev/null; then
        update-rc.d "$svc" disable >/dev/null 2>&1 || true
    fi
    say "installed $svc (its service left disabled: tests and benchmarks start their own)"
done

# --- kernel headers -------------------------------------------------------------------------
# bcc compiles against /lib/modules/$KREL/build. Probes only use tracepoints and uprobes (stable
# interfaces), so the nearest distro headers work when the exact ones do not exist.
MOD=/lib/modules/$KREL
if [ ! -e "$MOD/build/include/generated/autoconf.h" ]; then
    # The exact package exists for distro kernels; VM kernels have none (apt says so at once).
    apt_install "linux-headers-$KREL" 2>/dev/null && say "installed linux-headers-$KREL" || true
fi
if [ ! -e "$MOD/build/include/generated/autoconf.h" ]; then
    if ! ls -d /usr/src/linux-headers-*-"$ARCH" >/dev/null 2>&1; then
        say "installing linux-headers-$ARCH (no headers package for $KREL)"
        apt_install "linux-headers-$ARCH"
    fi
    best=$(ls -d /usr/src/linux-headers-*-"$ARCH" | sort -V | tail -n 1)
    [ -n "$best" ] || die "no kernel headers found under /usr/src"
    common=${best%-"$ARCH"}-common
    mkdir -p "$MOD"
    ln -sfn "$best" "$MOD/build"
    if [ -d "$common" ]; then ln -sfn "$common" "$MOD/source"; else ln -sfn "$best" "$MOD/source"; fi
fi
mapped=$(readlink -f "$MOD/build")
case "$mapped" in
    *"$KREL"*) ;;
    *) warn "no headers for kernel $KREL; using nearest $(basename "$mapped") mapped under $MOD (probes use only stable tracepoint/uprobe interfaces)" ;;
esac

# --- tracefs / debugfs: syscall tracepoint formats are read from here -------------------------
if [ ! -e /sys/kernel/tracing/events ] && [ ! -e /sys/kernel/debug/tracing/events ]; then
    mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null || true
fi
if ! mountpoint -q /sys/kernel/debug; then
    mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null || true
fi
[ -e /sys/kernel/tracing/events/syscalls ] || [ -e /sys/kernel/debug/tracing/events/syscalls ] \
    || die "syscall tracepoints not available (tracefs has no events/syscalls)"

# --- venv -----------------------------------------------------------------------------------
PYBIN=${PYTHON:-}
if [ -z "$PYBIN" ]; then
    for c in python3.11 python3; do command -v "$c" >/dev/null && { PYBIN=$(command -v "$c"); break; }; done
fi
"$PYBIN" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || die "Python >= 3.11 required ($PYBIN)"
if [ ! -x "$VENV/bin/python" ]; then
    say "creating venv $VENV with $PYBIN"
    "$PYBIN" -m venv "$VENV"
fi
# Debian's bcc is pure Python over libbcc.so: expose only it, via a folder holding one symlink.
BCC_SRC=$(ls -d /usr/lib/python3/dist-packages/bcc 2>/dev/null || true)
[ -n "$BCC_SRC" ] || die "Debian's bcc Python package not found (python3-bpfcc)"
mkdir -p "$VENV/debian-bcc"
ln -sfn "$BCC_SRC" "$VENV/debian-bcc/bcc"
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$VENV/debian-bcc" > "$SITE/moescope-debian-bcc.pth"

# --- project --------------------------------------------------------------------------------
stamp_src=$(cat pyproject.toml setup.py 2>/dev/null; find agent collectors probes moescope -name '*.c' -o -name '*.h' 2>/dev/null | sort | xargs -r cat)
stamp=$(printf '%s' "$stamp_src" | sha256sum | cut -d' ' -f1)
PIP=("$VENV/bin/python" -m pip -q --disable-pip-version-check install)
# Machines of this kind keep the pinned CPU torch wheel here; elsewhere pip uses its index.
[ -d /opt/wheels ] && PIP+=(--find-links /opt/wheels)
if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
    say "installing torch==2.13.0"
    "${PIP[@]}" "torch==2.13.0"
fi
if [ "$(cat "$VENV/.moescope-stamp" 2>/dev/null)" != "$stamp" ] || ! "$VENV/bin/python" -c 'import moescope.agent' 2>/dev/null \
        || [ ! -f agent/native/libmoescope_health.so ] || [ ! -f collectors/nvtx_inject/libmoescope_nvtx.so ] \
        || [ ! -f moescope/hf/libmoescope_hf.so ] || ! compgen -G "agent/export/_otlp_span*.so" >/dev/null \
        || ! compgen -G "moescope/_page_busy*.so" >/dev/null; then
    say "installing moescope (editable) and pinned dependencies"
    "${PIP[@]}" -e ".[test,hf]"
    echo "$stamp" > "$VENV/.moescope-stamp"
fi
# The agent's hot path compiled with mypyc (moescope/compiled.py): rebuilt only when its sources change.
"$VENV/bin/python" scripts/compile_hot.py || die "compiling the hot path with mypyc failed (scripts/compile_hot.py)"
"$VENV/bin/python" -c 'import bcc' || die "bcc not importable from the venv"
say "ready: $VENV (kernel $KREL, headers $(readlink -f "$MOD/build"))"
