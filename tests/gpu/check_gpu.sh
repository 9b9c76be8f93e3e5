#!/usr/bin/env bash
# moescope GPU check: run on a machine with one (or more) NVIDIA GPUs; finishes in under 5 minutes.
#
#   bash tests/gpu/check_gpu.sh              # uses .venv (or MOESCOPE_PYTHON), makes .venv-gpu if neither
#   MOESCOPE_PYTHON=/opt/py/bin/python bash tests/gpu/check_gpu.sh   # a Python whose torch has CUDA
#
# 1. the fake-NVML unit tests (tests/telemetry) — they must also pass on a GPU host;
# 2. the real NVML collector for a few seconds: memory, utilization, NVLink per link, PCIe, and the
#    per-process GPU memory of a CUDA process it starts (tests/gpu/cuda_alloc.py, driver API only);
# 3. once examples/moe_runtime exists: the reference runtime on CUDA under load, with expert
#    offload/restore/migrate and FP16 fallback (and back) through its control socket, 0 failed requests;
# 4. routing vectors computed on the device with no host sync per layer (tests/gpu/check_device_routing.py).
# Prints a summary; exits non-zero on any failure.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
START=$SECONDS
RUNTIME_DEVICE=${MOESCOPE_GPU_CHECK_DEVICE:-cuda}   # "cpu" only to dry-run the runtime section
LOAD_S=${MOESCOPE_GPU_CHECK_LOAD_S:-20}
status=0

say() { printf '== %s\n' "$*"; }

# ---- Python environment ---------------------------------------------------------------------------
if [[ -n "${MOESCOPE_PYTHON:-}" ]]; then
    PY=$MOESCOPE_PYTHON
elif [[ -x .venv/bin/python ]]; then
    PY=.venv/bin/python
else
    # No project venv: make one that can see a system torch (with CUDA) and install the project.
    say "creating .venv-gpu"
    python3 -m venv --system-site-packages .venv-gpu
    PY=.venv-gpu/bin/python
    "$PY" -m pip install --quiet -e '.[test]' || {
        echo "check_gpu: cannot install the project into .venv-gpu (offline?); set MOESCOPE_PYTHON" >&2
        exit 2
    }
fi
"$PY" - <<'EOF' || { echo "check_gpu: $PY cannot import the project's dependencies" >&2; exit 2; }
import pynvml, moescope.collectors.nvml, moescope.collectors.host  # noqa: F401
EOF
say "python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"

# ---- what the driver says (for the log) ----------------------------------------------------------
if command -v nvidia-smi >/dev/null 2>&1; then
    say "nvidia-smi -L"
    timeout 30 nvidia-smi -L || true
    timeout 30 nvidia-smi nvlink --status 2>/dev/null | head -40 || true
else
    say "nvidia-smi not found (the NVML check below still decides)"
fi

# ---- 1. unit tests with the fake NVML (must pass on GPU hosts too) -------------------------------
say "tests/telemetry (fake NVML)"
if ! timeout 240 "$PY" -m pytest tests/telemetry -q -p no:cacheprovider; then
    echo "check_gpu: tests/telemetry failed" >&2
    status=1
fi

# ---- 2 + 3. real NVML collector, CUDA process, reference runtime ---------------------------------
say "real NVML + reference runtime (device: $RUNTIME_DEVICE)"
if ! timeout 240 "$PY" tests/gpu/check_gpu.py --device "$RUNTIME_DEVICE" --seconds 3 --load-s "$LOAD_S" \
        ${MOESCOPE_GPU_CHECK_ARGS:-}; then
    status=1
fi

# ---- 4. routing vectors on the device: no host sync per layer (reference runtime, instrument()) ----
if [[ $RUNTIME_DEVICE == cuda* ]]; then
    say "device routing: counts right, no sync per layer"
    ROUTING_DEVICE=$RUNTIME_DEVICE
    [[ $ROUTING_DEVICE == cuda ]] && ROUTING_DEVICE=cuda:0
    if ! timeout 240 "$PY" tests/gpu/check_device_routing.py --device "$ROUTING_DEVICE"; then
        status=1
    fi
fi

say "check_gpu: $([[ $status -eq 0 ]] && echo PASS || echo FAIL) in $((SECONDS - START)) s"
exit $status
