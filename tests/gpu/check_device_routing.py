"""GPU check (run on a machine with CUDA; nothing here runs without one): routing vectors are
computed on the device with no host sync per layer, and are right.

  1. the reference runtime (examples/moe_runtime/model.py) on CUDA takes its device routing path;
     its step gives the host path's per-layer counts, drops and entropies (the same model on the
     same GPU routed on the host), the same NVTX events, and `moe.step.device` with L times;
  2. its synchronising CUDA calls per forward (counted with torch.cuda.set_sync_debug_mode("warn"))
     are the same at 2 and at 8 layers — none per layer — while the host path's grow with layers
     (so the counter is seen to work);
  3. `moescope.instrument()` on a tiny transformers Qwen3-MoE on CUDA: counts equal the model's own
     router outputs, entropy within 1e-5, and the syncs it adds per forward do not grow with layers.

    python tests/gpu/check_device_routing.py [--device cuda:0]

Prints PASS/FAIL per check and exits 1 if any failed; without CUDA it prints one SKIP line and
exits 0 (this script is for the GPU machine; tests/runtime/test_device_routing.py and
tests/hf/test_hf_instrument.py run the same paths on a CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from moescope.examples.moe_runtime.config import ModelConfig  # noqa: E402
from moescope.examples.moe_runtime.model import SequenceState  # noqa: E402
from moescope.examples.moe_runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from moescope.moe_nvtx import NvtxInstrumentation  # noqa: E402

CFG = ModelConfig(d_model=128, d_ff=256, layers=2, experts=16, n_heads=4, capacity_factor=0.75)


class Domain:
    """A recording NVTX domain: (kind, message, category, payload) per event."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, Any, Any]] = []
        self._stack: list[str] = []

    def get_registered_string(self, string: str) -> str:
        return string

    def get_event_attributes(self, message: Any = None, color: Any = None, category: Any = None,
                             payload: Any = None) -> Any:
        return argparse.Namespace(message=message, category=category, payload=payload)

    def push_range(self, attributes: Any = None) -> None:
        self.events.append(("push", attributes.message, attributes.category, _copy(attributes.payload)))
        self._stack.append(attributes.message)

    def pop_range(self) -> None:
        self.events.append(("pop", self._stack.pop(), None, None))

    def mark(self, attributes: Any = None) -> None:
        self.events.append(("mark", attributes.message, attributes.category, _copy(attributes.payload)))

    def payloads(self, message: str, kind: str) -> list[Any]:
        return [p for k, m, _, p in self.events if m == message and k == kind]


def _copy(payload: Any) -> Any:
    return payload.copy() if isinstance(payload, np.ndarray) else payload


def count_syncs(run: Callable[[], object]) -> int:
    """Synchronising CUDA calls made by run(), as torch's sync debug mode reports them."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum(1 for w in caught if "synchroniz" in str(w.message))


class Report:
    def __init__(self) -> None:
        self.failed = 0

    def check(self, ok: bool, what: str, detail: str = "") -> None:
        self.failed += 0 if ok else 1
        print(f"[{'PASS' if ok else 'FAIL'}] {what}{': ' + detail if detail else ''}", flush=True)


def reference_step(device: str, *, layers: int, device_routing: bool
                   ) -> tuple[Runtime, Domain, Callable[[], torch.Tensor]]:
    domain = Domain()
    cfg = dataclasses.replace(CFG, layers=layers)
    rt = Runtime(RuntimeOptions(model=cfg, devices=(device,)),
                 instrumentation=NvtxInstrumentation(domain=domain, convention="v2"))
    rt.model.device_routing = device_routing
    prompts = [rt.tokenizer.encode(p) for p in ("a prompt on the GPU", "another one", "x" * 40)]

    def step() -> torch.Tensor:
        seqs = [SequenceState() for _ in prompts]
        rt.ins.step_push(sum(len(p) for p in prompts))
        logits = rt.model.forward(seqs, prompts)
        rt.ins.step_pop()
        return logits

    return rt, domain, step


def check_reference(device: str, report: Report) -> None:
    rt_dev, dom_dev, step_dev = reference_step(device, layers=CFG.layers, device_routing=True)
    rt_host, dom_host, step_host = reference_step(device, layers=CFG.layers, device_routing=False)
    report.check(rt_dev.model._device_step(rt_dev.store.snapshot()), "reference model on CUDA takes the device path")
    logits_dev, logits_host = step_dev(), step_host()
    s_dev, s_host = rt_dev.stats.snapshot(), rt_host.stats.snapshot()
    same = all(np.array_equal(np.asarray(s_dev[k]), np.asarray(s_host[k])) for k in ("tokens", "dropped", "capacity"))
    report.check(same and int(np.asarray(s_host["dropped"]).sum()) > 0, "device-path counts and drops = host path",
                 f"tokens {np.asarray(s_dev['tokens']).sum()} dropped {np.asarray(s_dev['dropped']).sum()}")
    err = float(np.max(np.abs(np.asarray(s_dev["entropy_bits"]) - np.asarray(s_host["entropy_bits"]))))
    report.check(err < 1e-5, "device-path entropies = host path", f"max error {err:.1e} bits")
    close = torch.allclose(logits_dev, logits_host, rtol=1e-3, atol=1e-3)
    report.check(close, "device-path logits = host path (padded dispatch)",
                 f"max |d| {float((logits_dev - logits_host).abs().max()):.1e}")
    routing_dev = [p.tolist() for p in dom_dev.payloads("moe.routing", "mark")]
    routing_host = [p.tolist() for p in dom_host.payloads("moe.routing", "mark")]
    report.check(routing_dev == routing_host and len(routing_dev) == CFG.layers, "moe.routing vectors = host path")
    device_us = dom_dev.payloads("moe.step.device", "mark")
    report.check(len(device_us) == 1 and len(device_us[0]) == CFG.layers and bool((device_us[0] > 0).all()),
                 "moe.step.device: one positive device time per layer", str(device_us[0].tolist() if device_us else ""))
    syncs = {}
    for layers in (2, 8):
        for device_routing in (True, False):
            _, _, step = reference_step(device, layers=layers, device_routing=device_routing)
            step()  # warm-up: first calls allocate and pick kernels
            syncs[(layers, device_routing)] = count_syncs(step)
    detail = (f"device path {syncs[(2, True)]} at L=2, {syncs[(8, True)]} at L=8; "
              f"host path {syncs[(2, False)]} at L=2, {syncs[(8, False)]} at L=8")
    # per layer would be >= 6 more at L=8; the count is not fixed (the H200 run saw 5 at L=2, 4 at L=8)
    report.check(syncs[(8, True)] <= syncs[(2, True)] and syncs[(8, False)] > syncs[(2, False)],
                 "reference model: no host sync per layer on the device path (not more at L=8 than at L=2)",
                 detail)


def check_hf(device: str, report: Report) -> None:
    try:
        import moescope
        from moescope.hf.tiny import tiny_model
    except ImportError as exc:
        report.check(False, "transformers importable for the moescope.instrument() check", str(exc))
        return
    added = {}
    for layers in (2, 6):
        model: Any = tiny_model("qwen3_moe", layers=layers).to(device)
        ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(layers)).to(device)

        def forward(model: Any = model, ids: torch.Tensor = ids) -> Any:
            with torch.no_grad():
                return model(input_ids=ids, output_router_logits=True)

        forward()
        plain = count_syncs(forward)
        domain = Domain()
        ins = moescope.instrument(model, domain=domain, routing="layer")
        forward()  # the first call of each router decides its scoring (one sync per router, once)
        domain.events.clear()
        instrumented = count_syncs(forward)
        out = forward()
        ins.close()
        added[layers] = instrumented - plain
        counts = [p.tolist()[:8] for p in domain.payloads("moe.routing", "mark")]
        entropies = domain.payloads("moe.router", "push")
        want_counts, want_entropy = [], []
        for logits in out.router_logits:
            s = logits.detach().double()
            want_counts.append(torch.bincount(s.topk(2, dim=-1).indices.reshape(-1), minlength=8).tolist())
            p = torch.softmax(s, -1)
            want_entropy.append(float((-(p * torch.log(p)).sum(-1) / math.log(2.0)).mean()))
        last = slice(-layers, None)  # the last forward's layers
        report.check(counts[last] == want_counts, f"instrument() counts = the model's router outputs (L={layers})")
        err = max(abs(a - b) for a, b in zip(entropies[last], want_entropy, strict=True))
        report.check(err < 1e-5, f"instrument() entropies (L={layers})", f"max error {err:.1e} bits")
        device_us = domain.payloads("moe.step.device", "mark")
        report.check(bool(device_us) and len(device_us[-1]) == layers and bool((device_us[-1] > 0).all()),
                     f"instrument() moe.step.device per layer (L={layers})")
    report.check(added[2] == added[6] and added[2] <= 2, "instrument(): no host sync per layer",
                 f"syncs added per forward: {added[2]} at L=2, {added[6]} at L=6")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("[SKIP] check_device_routing: no CUDA device here; run this on the GPU machine", flush=True)
        return 0
    torch.set_grad_enabled(False)
    report = Report()
    check_reference(args.device, report)
    check_hf(args.device, report)
    print(f"check_device_routing: {'FAIL' if report.failed else 'PASS'} ({report.failed} failed)", flush=True)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
