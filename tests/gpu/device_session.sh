#!/usr/bin/env bash
# One prepared session on a lent GPU machine (the `device` tool's `run`), with no package registry:
# installs the project into the machine's own Python (its torch, transformers and numpy; the other
# pinned packages come from wheels carried in .whl/), then runs, each under its own time limit and
# most valuable first:
#   1. what the machine is (GPU, driver, kernel, and whether eBPF could be compiled there);
#   2. tests/gpu/check_gpu.py: the real NVML collector (memory, NVLink per link, PCIe, a CUDA
#      process's own memory) and the reference runtime on CUDA under load with expert offload /
#      restore / migrate and FP16 fallback through its control socket;
#   3. tests/gpu/check_agent_cuda.py: agent start --no-collector.ingress beside the reference runtime and a
#      transformers Qwen3-MoE server on CUDA, both at 48 layers x 128 experts, top-8;
#   4. benchmarks/hf_cuda_cost.py: instrument()'s cost at Qwen3-30B-A3B's shape in bf16;
#   5. tests/gpu/check_device_routing.py and the fake-NVML unit tests (tests/telemetry);
#   hf_cuda_profile (only when PARTS names it): where an instrumented forward's host time goes.
# Logs and JSON land in $OUT (or ./gpu-out). Exits non-zero if any part failed.
#
#   bash tests/gpu/device_session.sh            # on the GPU machine, from the repository root
#   PARTS="agent_cuda hf_cuda_cost" bash tests/gpu/device_session.sh   # some parts only
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${MOESCOPE_PYTHON:-python3}
START=$SECONDS
status=0
say() { printf '== [%4d s] %s\n' $((SECONDS - START)) "$*"; }
PARTS=${PARTS:-nvml_runtime agent_cuda hf_cuda_cost device_routing telemetry_tests}  # a subset: PARTS="a b"
part() {  # part NAME LIMIT_S CMD...: one part, its output in $OUT/NAME.log, its status counted
    local name=$1 limit=$2; shift 2
    [[ " $PARTS " == *" $name "* ]] || return 0
    say "$name (limit $limit s)"
    timeout --kill-after=10 "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1
    local rc=$?
    say "$name: exit $rc"
    [[ $rc -eq 0 ]] || status=1
}

say "install"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "device_session: carried wheels did not install" >&2; exit 2; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1; then
    # the image's environment not writable: a venv of our own that sees the image's packages
    tail -5 "$OUT/install.log"
    say "install into the image's Python failed; a venv beside it"
    image_site=$("$PY" -c 'import site; print(site.getsitepackages()[0])')
    "$PY" -m venv --without-pip /tmp/venv && echo "$image_site" > "$(/tmp/venv/bin/python -c 'import site; print(site.getsitepackages()[0])')/image.pth"
    PY=/tmp/venv/bin/python
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . >> "$OUT/install.log" 2>&1 \
        || { tail -30 "$OUT/install.log"; echo "device_session: pip install -e . failed" >&2; exit 2; }
fi
ls agent/native/*.so collectors/nvtx_inject/*.so moescope/hf/*.so agent/export/_otlp_span*.so 2>&1
"$PY" -c 'import torch, transformers, numpy, moescope.agent.observe; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "transformers", transformers.__version__, "numpy", numpy.__version__)' \
    || { echo "device_session: the project does not import" >&2; exit 2; }

say "machine"
{
    nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
    nvidia-smi nvlink --status 2>&1 | head -20
    nvidia-smi topo -m 2>&1 | head -10
    uname -a; nproc; grep MemTotal /proc/meminfo
    echo "kernel headers: $(ls -d /lib/modules/$(uname -r)/build 2>&1)"
    echo "BTF: $(ls -la /sys/kernel/btf/vmlinux 2>&1)"; echo "kheaders: $(ls /sys/kernel/kheaders.tar.xz 2>&1)"
    (zcat /proc/config.gz 2>/dev/null || cat "/boot/config-$(uname -r)" 2>/dev/null) | grep -E '^CONFIG_(BPF|BPF_SYSCALL|BPF_JIT|DEBUG_INFO_BTF|IKHEADERS|FTRACE_SYSCALLS)=' || echo "kernel config: not readable"
    echo "tracefs syscalls: $(ls /sys/kernel/tracing/events/syscalls 2>/dev/null | head -3 | tr '\n' ' ')"
    "$PY" -c 'import bcc' 2>&1 | tail -1
} > "$OUT/machine.log" 2>&1
cat "$OUT/machine.log"

part nvml_runtime 150 "$PY" tests/gpu/check_gpu.py --device cuda --seconds 3 --load-s 10
part agent_cuda 200 "$PY" tests/gpu/check_agent_cuda.py --device cuda --load-s 10
part hf_cuda_cost 200 "$PY" -m benchmarks.hf_cuda_cost --pairs 6 --forwards 6 --json-out "$OUT/hf_cuda_cost.json"
part device_routing 120 "$PY" tests/gpu/check_device_routing.py --device cuda:0
part hf_cuda_profile 150 "$PY" -m benchmarks.hf_cuda_cost --profile --layers 48
part telemetry_tests 90 "$PY" -m pytest tests/telemetry -q -p no:cacheprovider

say "device_session: $([[ $status -eq 0 ]] && echo PASS || echo FAIL)"
exit $status
