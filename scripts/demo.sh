#!/usr/bin/env bash
# `make demo`: the reference MoE runtime under load, the agent attached with its live view.
#
# The agent launches the runtime (so NVTX capture is on from the first step) and shows the TUI in
# the foreground; a load generator cycles through scenarios that make the policy act and revert:
#   balanced → memory (budget crossed: alert, then coldest experts offloaded) → hotspot (queue
#   soft limit: router penalties; monopoly: expert moved to cpu:1) → balanced (penalties removed).
# Quit with q (or Ctrl-C). Without a terminal it runs DEMO_SECONDS and prints one `agent top` frame.
#
# Knobs: DEMO_PORT (8000), DEMO_SECONDS (600), DEMO_STATE_DIR (/tmp/moescope-demo),
#        DEMO_OTLP (an OTLP endpoint, e.g. http://127.0.0.1:4317 with dashboards/docker-compose.yml).
# On a Hugging Face transformers model instead (docs/transformers.md), observed by moescope.instrument():
#        DEMO_HF=qwen3_moe|mixtral|qwen2_moe   a tiny random-weight model of that architecture, or
#        DEMO_HF_MODEL=PATH_OR_ID             a local model (from_pretrained, local files only).
#   e.g. `make demo DEMO_HF=qwen3_moe`. The policy's router penalties and FP16 fallback act on it;
#   its residency actions are answered "unsupported" (fused experts).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
AGENT=.venv/bin/agent
PORT=${DEMO_PORT:-8000}
SECONDS_TOTAL=${DEMO_SECONDS:-600}
STATE=${DEMO_STATE_DIR:-/tmp/moescope-demo}
mkdir -p "$STATE"
rm -f "$STATE"/agent-*.state.json

if "$PY" - "$PORT" <<'EOF'
import socket, sys
s = socket.socket()
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(0)
sys.exit(1)
EOF
then
    echo "demo: port $PORT is busy; set DEMO_PORT" >&2
    exit 2
fi

# 4 layers x 16 experts, 8 resident at start; experts loaded on demand stay resident (--cache-on-load),
# so traffic fills the 96 MB device budget past 0.95: memory_alert, then expert_offload.
RUNTIME=("$PY" -m moescope.examples.moe_runtime --port "$PORT" --devices cpu,cpu:1
         --initial-resident-experts 8 --cache-on-load --device-memory-budget-bytes 96000000)
if [ -n "${DEMO_HF_MODEL:-}" ]; then
    RUNTIME=("$PY" -m moescope.examples.hf_server --port "$PORT" --model "$DEMO_HF_MODEL")
elif [ -n "${DEMO_HF:-}" ]; then
    RUNTIME=("$PY" -m moescope.examples.hf_server --port "$PORT" --arch "$DEMO_HF" --tiny --layers 4 --experts 16)
fi
AGENT_ARGS=(start --state-dir "$STATE" --policy-audit "$STATE/policy-audit.jsonl"
            --policy-state-dir "$STATE" --metrics-port "${DEMO_METRICS_PORT:-9464}")
[ -n "${DEMO_OTLP:-}" ] && AGENT_ARGS+=(--otlp-endpoint "$DEMO_OTLP")

load_cycle() {
    # Wait for the runtime, then cycle scenarios until the agent (and so the runtime) is gone.
    for _ in $(seq 1 120); do
        "$PY" -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$PORT/healthz', timeout=1)" \
            2>/dev/null && break
        sleep 0.5
    done
    local url="http://127.0.0.1:$PORT"
    while "$PY" -c "import urllib.request; urllib.request.urlopen('$url/healthz', timeout=2)" 2>/dev/null; do
        for scenario in "balanced 15" "memory 30" "hotspot 30" "balanced 30"; do
            set -- $scenario
            "$PY" -m moescope.examples.moe_runtime.loadgen --url "$url" --scenario "$1" --concurrency 6 \
                --duration-s "$2" --json-out "$STATE/loadgen-$1.json" >/dev/null 2>&1 || true
        done
    done
}

load_cycle &
LOAD_PID=$!
cleanup() { kill "$LOAD_PID" 2>/dev/null || true; wait "$LOAD_PID" 2>/dev/null || true; }
trap cleanup EXIT

STARTED=$(date +%s)  # the audit file is appended to across demos: the summary counts this one only
echo "demo: runtime on http://127.0.0.1:$PORT, agent state in $STATE, audit $STATE/policy-audit.jsonl" >&2
if [ -t 1 ] && [ -t 0 ]; then
    "$AGENT" "${AGENT_ARGS[@]}" --tui --duration "$SECONDS_TOTAL" -- "${RUNTIME[@]}" 2>"$STATE/agent.log" || true
    tail -n 8 "$STATE/agent.log" >&2
else
    "$AGENT" "${AGENT_ARGS[@]}" --duration "$SECONDS_TOTAL" -- "${RUNTIME[@]}" >"$STATE/agent.out" 2>"$STATE/agent.log" &
    AGENT_PID=$!
    sleep $(( SECONDS_TOTAL > 40 ? 40 : SECONDS_TOTAL ))
    COLUMNS=120 "$AGENT" top --once --state-dir "$STATE" || true
    wait "$AGENT_PID" || true
    cat "$STATE/agent.out"
fi
echo "demo: policy actions (this run):" >&2
"$PY" - "$STATE/policy-audit.jsonl" "$STARTED" <<'EOF' >&2 || true
import json, sys
from collections import Counter
try:
    lines = open(sys.argv[1], encoding="utf-8").read().splitlines()
except OSError:
    sys.exit(0)
c = Counter()
for line in lines:
    r = json.loads(line)
    if (r.get("ts_unix_s") or 0) >= float(sys.argv[2]):
        c[(r.get("rule"), r.get("decision"), r.get("outcome"))] += 1
for (rule, decision, outcome), n in sorted(c.items(), key=str):
    print(f"  {rule:26} {decision:10} {outcome:28} x{n}")
EOF
echo "demo: traces: .venv/bin/agent traces list --state-dir $STATE" >&2
