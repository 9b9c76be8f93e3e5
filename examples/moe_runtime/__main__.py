"""Reference MoE serving runtime: `python -m moescope.examples.moe_runtime [--port 0] [--device cuda] ...`.

Prints on stdout, one per line, then serves until SIGINT/SIGTERM:
    http port: PORT
    control socket: PATH
    nvtx: active|inactive (no NVTX tool attached)|disabled
    ready
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from moescope.errors import ArgumentParser, MoescopeError, UsageError, tcp_port
from moescope.examples.moe_runtime.config import OVERFLOW_POLICIES, PRECISIONS, ModelConfig
from moescope.examples.moe_runtime.runtime import Runtime, RuntimeOptions
from moescope.examples.moe_runtime.server import serve
from moescope.moe_nvtx import CONVENTIONS, DEFAULT_CONVENTION, ROUTING_PLACES


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m moescope.examples.moe_runtime", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = ModelConfig()
    net = p.add_argument_group("serving")
    net.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    net.add_argument("--port", type=tcp_port, default=8000, help="HTTP port; 0 picks a free one (printed)")
    net.add_argument("--max-batch-size", type=int, default=16, help="requests per step (default 16)")
    net.add_argument("--max-wait-ms", type=float, default=5.0,
                     help="an idle engine waits this long to gather a batch (default 5)")
    net.add_argument("--max-waiting", type=int, default=1024, help="queued requests before 503 (default 1024)")
    net.add_argument("--max-tokens-limit", type=int, default=256, help="largest max_tokens accepted (default 256)")
    net.add_argument("--control-socket", default=None,
                     help="control socket path (default /run/moescope/runtime-PID.sock, else "
                          "$XDG_RUNTIME_DIR, else /tmp)")
    net.add_argument("--control-socket-mode", default="0600",
                     help="octal file mode of the control socket (default 0600; the peer uid check "
                          "applies whatever the mode)")
    net.add_argument("--no-nvtx", action="store_true", help="disable NVTX instrumentation entirely")
    net.add_argument("--nvtx-convention", choices=CONVENTIONS, default=DEFAULT_CONVENTION,
                     help="moe/v2: one routing vector and one fused-experts range per layer (default); "
                          "v1: one mark per expert with tokens and one range per expert run")
    net.add_argument("--nvtx-routing", choices=ROUTING_PLACES, default="layer",
                     help="v2: one routing vector per layer inside its router (default), or one per step "
                          "(moe.step.routing: cheapest for a Python producer at many layers)")
    net.add_argument("--nvtx-expert-ranges", action=argparse.BooleanOptionalAction, default=None,
                     help="also emit a moe.expert.ffn range per expert run (default: with v1 only)")
    net.add_argument("--sync-ranges", action="store_true",
                     help="CUDA with an NVTX tool attached: synchronise the device before closing each "
                          "moe.expert.ffn and moe.step range, so they measure GPU time (costs throughput)")
    net.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    net.add_argument("--no-stats-page", action="store_true",
                     help="do not publish the stats page (the per-period part of `stats` in a shared-memory "
                          "file that a policy reads without a control-socket call; docs/control-protocol.md)")
    net.add_argument("-v", "--verbose", action="count", default=0)
    model = p.add_argument_group("model")
    # the routing shape is what the agent sees; the widths only set the compute: production routing
    # shapes run on CPU with small widths (e.g. --layers 58 --experts 256 --top-k 8 --d-model 32
    # --d-ff 32: DeepSeek-V3's routing)
    model.add_argument("--layers", type=int, default=d.layers, help=f"MoE layers (default {d.layers})")
    model.add_argument("--experts", type=int, default=d.experts, help=f"experts per layer (default {d.experts})")
    model.add_argument("--top-k", type=int, default=d.top_k,
                       help=f"experts each token is routed to, 1..experts (default {d.top_k})")
    model.add_argument("--d-model", type=int, default=d.d_model,
                       help=f"hidden width, a multiple of --n-heads (default {d.d_model})")
    model.add_argument("--d-ff", type=int, default=d.d_ff, help=f"each expert's FFN width (default {d.d_ff})")
    model.add_argument("--n-heads", type=int, default=d.n_heads, help=f"attention heads (default {d.n_heads})")
    model.add_argument("--vocab", type=int, default=d.vocab,
                       help=f"vocabulary, >= 258: bytes, BOS and EOS (default {d.vocab})")
    model.add_argument("--max-seq", type=int, default=d.max_seq,
                       help=f"longest sequence, prompt and generation (default {d.max_seq})")
    model.add_argument("--capacity-factor", type=float, default=d.capacity_factor,
                       help=f"an expert's capacity: this x its even share of a step's routed tokens "
                            f"(default {d.capacity_factor})")
    model.add_argument("--overflow", choices=OVERFLOW_POLICIES, default=d.overflow,
                       help="tokens over an expert's capacity: drop, or reroute to the next-best expert")
    model.add_argument("--gumbel-tau", type=float, default=d.gumbel_tau,
                       help="Gumbel noise temperature for expert selection (0 = off, deterministic)")
    model.add_argument("--seed", type=int, default=d.seed, help=f"weights and routing noise (default {d.seed})")
    res = p.add_argument_group("devices, residency, precision")
    res.add_argument("--device", default=None,
                     help="cpu or cuda (shorthand for --devices cpu / cuda:0); default cuda:0 if present else cpu")
    res.add_argument("--devices", default=None,
                     help="comma list of compute devices: cpu, cpu:N (logical host partitions), cuda:N; "
                          "the first is primary")
    res.add_argument("--precision", choices=PRECISIONS, default="fp32")
    res.add_argument("--resident-capacity-experts", type=int, default=None,
                     help="resident pool size per device, in experts (default: all L*E fit)")
    res.add_argument("--initial-resident-experts", type=int, default=None,
                     help="experts placed in each pool at start (default: pool size); the rest live on host")
    res.add_argument("--cache-on-load", action="store_true",
                     help="an on-demand load stays resident while the pool has room (offloaded experts never do)")
    budget = res.add_mutually_exclusive_group()
    budget.add_argument("--device-memory-budget-bytes", type=int, default=None,
                        help="device memory budget per device for used/total (default: all resident = 80%%)")
    budget.add_argument("--device-memory-budget-mb", type=float, default=None, help="same, in MiB")
    return p


def options_from_args(args: argparse.Namespace) -> RuntimeOptions:
    if args.devices:
        devices = tuple(x.strip() for x in args.devices.split(",") if x.strip())
    elif args.device in ("cpu", None):
        devices = ("cuda:0",) if args.device is None and torch.cuda.is_available() else ("cpu",)
    elif args.device == "cuda":
        devices = ("cuda:0",)
    else:
        devices = (args.device,)
    try:
        mode = int(args.control_socket_mode, 8)
    except ValueError as exc:
        raise UsageError(f"--control-socket-mode must be octal, got {args.control_socket_mode!r}") from exc
    if not 0 <= mode <= 0o777:
        raise UsageError(f"--control-socket-mode out of range: {args.control_socket_mode}")
    budget = args.device_memory_budget_bytes
    if args.device_memory_budget_mb is not None:
        budget = int(args.device_memory_budget_mb * 1024 * 1024)
    return RuntimeOptions(
        model=ModelConfig(vocab=args.vocab, d_model=args.d_model, n_heads=args.n_heads, d_ff=args.d_ff,
                          layers=args.layers, experts=args.experts, top_k=args.top_k, max_seq=args.max_seq,
                          capacity_factor=args.capacity_factor, overflow=args.overflow,
                          gumbel_tau=args.gumbel_tau, seed=args.seed),
        devices=devices, precision=args.precision, capacity_experts=args.resident_capacity_experts,
        initial_resident_experts=args.initial_resident_experts, device_memory_budget_bytes=budget,
        cache_on_load=args.cache_on_load, max_batch_size=args.max_batch_size, max_wait_ms=args.max_wait_ms,
        max_waiting=args.max_waiting, max_tokens_limit=args.max_tokens_limit, nvtx=not args.no_nvtx,
        nvtx_convention=args.nvtx_convention, nvtx_expert_ranges=args.nvtx_expert_ranges,
        nvtx_routing=args.nvtx_routing,
        sync_ranges=args.sync_ranges,
        torch_threads=args.threads,
        stats_page=not args.no_stats_page,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2),
                        format="moe_runtime: %(levelname)s: %(message)s")
    try:
        options = options_from_args(args)
        mode = int(args.control_socket_mode, 8)
        runtime = Runtime(options)
    except MoescopeError as exc:
        print(f"moe_runtime: error: {exc}", file=sys.stderr)
        return exc.exit_code
    nvtx_state = (
        "disabled" if args.no_nvtx else ("active" if runtime.ins.active else "inactive (no NVTX tool attached)")
    )
    return serve(runtime, prog="moe_runtime", host=args.host, port=args.port, control_socket=args.control_socket,
                 control_mode=mode, nvtx_state=nvtx_state)


if __name__ == "__main__":
    sys.exit(main())
