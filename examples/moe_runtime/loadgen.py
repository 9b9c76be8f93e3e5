"""Load generator for the reference MoE runtime (any server speaking POST /v1/completions).

    python -m moescope.examples.moe_runtime.loadgen --url http://127.0.0.1:8000 --scenario hotspot \
        --concurrency 8 --duration-s 10 [--rate 20] [--json-out result.json]

Concurrent keep-alive clients; a fixed request count (--requests) or a duration (--duration-s);
closed loop by default (each client sends its next request when the previous one is answered), or
open loop at --rate requests/s (latency counted from the scheduled send time, so a slow server is
not hidden by clients that wait). Scenarios:

  balanced (alias uniform)  varied random word prompts: routing spreads over all experts
  hotspot   prompts that repeat one character ("x"): every position routes to the same few
            experts (the prompts alone concentrate routing; the server is told nothing)
  burst     balanced prompts fired in bursts (--burst-size at once every --burst-interval-s)
  long      prompts close to the server's max_seq (prefill-heavy steps, deep queues per expert)
  memory    balanced prompts covering all experts while /stats is polled for device memory
            used/total; with --control-socket the hottest host-tier experts are also prefetched
            each second. Crosses the budget when the server holds experts on host and caches
            on-demand loads (e.g. --initial-resident-experts 16 --cache-on-load
            --device-memory-budget-mb 64); reports start/max/end used ratio.

Prints one JSON summary on stdout: requests, failures (by kind), throughput, client-side latency
p50/p95/p99, and server-side batching and routing deltas from /stats.

--stream asks for streamed answers (`"stream": true`, server-sent events) and adds, measured on
the client: time to first token (TTFT: the request's send -> its first `data:` event read) and
time per output token (TPOT: (last token event - first token event) / (tokens - 1), for answers
of at least 2 tokens), p50/p95/p99 in `ttft_ms` / `tpot_ms`, and `per_request`: one entry per
streamed answer with the `request_key` of its final event and CLOCK_MONOTONIC times in ns
(`sent_ns`, `first_token_ns`, `last_token_ns`), so a test can match each request with what an
observer of the same host saw (a key is a connection's fd: it repeats on a keep-alive connection,
the times tell the requests apart). TTFT counts from the actual send, also in open loop.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import random
import sys
import threading
import time
import urllib.parse
from typing import Any

from moescope.errors import ArgumentParser, ControlError, MoescopeError, UsageError
from moescope.latency import nearest_rank

SCENARIOS = ("balanced", "uniform", "hotspot", "burst", "long", "memory")
HOTSPOT_CHAR = "x"
WORDS = ("expert", "router", "token", "batch", "gate", "layer", "memory", "device", "tensor", "queue",
         "kernel", "socket", "trace", "model", "weight", "cache", "prefill", "decode", "sample", "latency",
         "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")


def make_prompt(scenario: str, rng: random.Random, *, long_bytes: int) -> str:
    if scenario == "hotspot":
        # One repeated character: every position gets nearly the same hidden state, so the router
        # sends nearly all tokens to the same k experts per layer (measured: ~0.45 of a layer's
        # tokens on its busiest expert at k=2, vs ~0.16 for balanced prompts).
        return HOTSPOT_CHAR * rng.randint(24, 48)
    if scenario == "long":
        text = ""
        while len(text) < long_bytes:
            text += rng.choice(WORDS) + " "
        return text[:long_bytes]
    n = rng.randint(3, 10)
    return " ".join(rng.choice(WORDS) + str(rng.randint(0, 99)) for _ in range(n))


def _latency_ms(sorted_latencies_ms: list[float], q: float) -> float:
    """The summary's nearest-rank ``q``-quantile (moescope.latency), rounded; 0 when nothing succeeded."""
    return round(nearest_rank(sorted_latencies_ms, q), 3) if sorted_latencies_ms else 0.0


def _quantiles_ms(values_ms: list[float]) -> dict[str, float]:
    ordered = sorted(values_ms)
    return {"p50": _latency_ms(ordered, 0.50), "p95": _latency_ms(ordered, 0.95), "p99": _latency_ms(ordered, 0.99),
            "max": round(ordered[-1], 3) if ordered else 0.0,
            "mean": round(sum(ordered) / len(ordered), 3) if ordered else 0.0}


class StreamFailed(Exception):
    """A streamed answer that was not a complete stream (its kind is counted as the failure)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamedAnswer:
    """One streamed completion as the client saw it; times are time.monotonic_ns()."""

    request_key: int
    sent_ns: int
    first_token_ns: int
    last_token_ns: int
    token_events: int
    usage: dict[str, int]
    tokens: list[int]
    text: str

    @property
    def ttft_ms(self) -> float:
        return (self.first_token_ns - self.sent_ns) / 1e6

    @property
    def tpot_ms(self) -> float | None:
        if self.token_events < 2:
            return None
        return (self.last_token_ns - self.first_token_ns) / 1e6 / (self.token_events - 1)


@dataclasses.dataclass
class Results:
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    latencies_ms: list[float] = dataclasses.field(default_factory=list)
    errors: dict[str, int] = dataclasses.field(default_factory=dict)
    completion_tokens: int = 0
    streamed: list[tuple[int, StreamedAnswer]] = dataclasses.field(default_factory=list)  # (request index, answer)

    def ok(self, latency_ms: float, tokens: int) -> None:
        with self.lock:
            self.latencies_ms.append(latency_ms)
            self.completion_tokens += tokens

    def ok_stream(self, latency_ms: float, index: int, answer: StreamedAnswer) -> None:
        with self.lock:
            self.latencies_ms.append(latency_ms)
            self.completion_tokens += answer.usage.get("completion_tokens", 0)
            self.streamed.append((index, answer))

    def fail(self, kind: str) -> None:
        with self.lock:
            self.errors[kind] = self.errors.get(kind, 0) + 1


class Client:
    """One keep-alive connection; reconnects after a failure."""

    def __init__(self, host: str, port: int, *, timeout_s: float) -> None:
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.conn: http.client.HTTPConnection | None = None

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        try:
            self.conn.request(method, path, body=data, headers=headers)
            response = self.conn.getresponse()
            payload = json.loads(response.read() or b"{}")
            return response.status, payload
        except (OSError, http.client.HTTPException, ValueError):
            self.close()
            raise

    def stream(self, path: str, body: dict[str, Any]) -> StreamedAnswer | tuple[int, dict[str, Any]]:
        """POSTs body with "stream": true and reads the events as they arrive. A non-200 answer
        comes back as (status, payload); a broken stream raises StreamFailed."""
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        data = json.dumps({**body, "stream": True}).encode()
        try:
            sent_ns = time.monotonic_ns()
            self.conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
            response = self.conn.getresponse()
            if response.status != 200:
                return response.status, json.loads(response.read() or b"{}")
            if response.getheader("Content-Type", "").split(";")[0].strip() != "text/event-stream":
                raise StreamFailed("not an event stream")
            return self._events(response, sent_ns=sent_ns)
        except (OSError, http.client.HTTPException, ValueError, StreamFailed):
            self.close()
            raise

    @staticmethod
    def _events(response: http.client.HTTPResponse, *, sent_ns: int) -> StreamedAnswer:
        times_ns: list[int] = []
        tokens: list[int] = []
        text: list[str] = []
        final: dict[str, Any] | None = None
        done = False
        while True:
            line = response.readline(1 << 20)  # the server's events are one line each
            if not line:
                break
            if not line.startswith(b"data: "):
                continue  # the blank line that ends each event
            arrived_ns = time.monotonic_ns()
            data = line[6:].strip()
            if data == b"[DONE]":
                done = True
                continue
            event = json.loads(data)
            if "error" in event:
                raise StreamFailed("stream error event")
            choice = event["choices"][0]
            times_ns.append(arrived_ns)
            tokens.extend(event.get("tokens", []))
            text.append(choice["text"])
            if choice.get("finish_reason") is not None:
                final = event
        if not done or final is None or not times_ns:
            raise StreamFailed("stream ended early")
        return StreamedAnswer(request_key=int(final["request_key"]), sent_ns=sent_ns, first_token_ns=times_ns[0],
                              last_token_ns=times_ns[-1], token_events=len(times_ns), usage=dict(final["usage"]),
                              tokens=tokens, text="".join(text))

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class Schedule:
    """Hands out request indices and, in open loop, their send times."""

    def __init__(self, *, requests: int | None, duration_s: float | None, rate_per_s: float | None,
                 burst_size: int | None, burst_interval_s: float) -> None:
        self.requests, self.duration_s = requests, duration_s
        self.rate_per_s, self.burst_size, self.burst_interval_s = rate_per_s, burst_size, burst_interval_s
        self.start = time.monotonic()
        self._next = 0
        self._lock = threading.Lock()

    def next(self) -> tuple[int, float | None] | None:
        with self._lock:
            index = self._next
            if self.requests is not None and index >= self.requests:
                return None
            self._next += 1
        if self.burst_size:
            at: float | None = self.start + (index // self.burst_size) * self.burst_interval_s
        elif self.rate_per_s:
            at = self.start + index / self.rate_per_s
        else:
            at = None
        now = time.monotonic()
        if self.duration_s is not None and (at if at is not None else now) >= self.start + self.duration_s:
            return None
        return index, at


def worker(client: Client, schedule: Schedule, results: Results, *, scenario: str, seed: int,
           max_tokens: int, long_bytes: int, stream: bool = False) -> None:
    while True:
        item = schedule.next()
        if item is None:
            return
        index, at = item
        rng = random.Random(seed * 1_000_003 + index)
        prompt = make_prompt(scenario, rng, long_bytes=long_bytes)
        if at is not None:
            delay = at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        t0 = at if at is not None else time.monotonic()
        body = {"prompt": prompt, "max_tokens": max_tokens}
        try:
            if stream:
                answer = client.stream("/v1/completions", body)
                if isinstance(answer, StreamedAnswer):
                    results.ok_stream((time.monotonic() - t0) * 1000.0, index, answer)
                    continue
                status, payload = answer
            else:
                status, payload = client.request("POST", "/v1/completions", body)
        except StreamFailed as exc:
            results.fail(str(exc))
            continue
        except (OSError, http.client.HTTPException, ValueError) as exc:
            results.fail(type(exc).__name__)
            continue
        if status != 200:
            results.fail(f"http {status}")
            continue
        results.ok((time.monotonic() - t0) * 1000.0, int(payload.get("usage", {}).get("completion_tokens", 0)))


class MemoryDriver:
    """memory scenario: polls /stats every 200 ms; with a control socket, prefetches each second."""

    def __init__(self, host: str, port: int, *, control_socket: str | None) -> None:
        self.client = Client(host, port, timeout_s=30.0)
        self.control_socket = control_socket
        self.ratios: list[float] = []
        self.prefetched = 0
        self.control_errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _ratio(self) -> float | None:
        try:
            status, stats = self.client.request("GET", "/stats")
        except (OSError, http.client.HTTPException, ValueError):
            return None
        if status != 200:
            return None
        return max(float(d["used_ratio"]) for d in stats["memory"]["devices"].values())

    def _run(self) -> None:
        from moescope.examples.moe_runtime.control import ControlClient

        control = None
        if self.control_socket:
            try:
                control = ControlClient(self.control_socket)
            except ControlError as exc:
                self.control_errors.append(str(exc))
        last_prefetch = 0.0
        try:
            while not self._stop.wait(0.2):
                ratio = self._ratio()
                if ratio is not None:
                    self.ratios.append(ratio)
                if control is not None and time.monotonic() - last_prefetch >= 1.0:
                    last_prefetch = time.monotonic()
                    try:
                        self.prefetched += len(control.call("prefetch", {"count": 4})["loaded"])
                    except (ControlError, OSError, ValueError) as exc:
                        self.control_errors.append(str(exc))
        finally:
            if control is not None:
                control.close()

    def start(self) -> None:
        ratio = self._ratio()
        if ratio is not None:
            self.ratios.append(ratio)
        self._thread.start()

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(10)
        ratio = self._ratio()
        if ratio is not None:
            self.ratios.append(ratio)
        self.client.close()
        return {
            "start_used_ratio": self.ratios[0] if self.ratios else None,
            "max_used_ratio": max(self.ratios) if self.ratios else None,
            "end_used_ratio": self.ratios[-1] if self.ratios else None,
            "crossed_budget": bool(self.ratios) and max(self.ratios) > 1.0,
            "experts_prefetched": self.prefetched,
            "control_errors": self.control_errors[:5],
        }


def _server_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    cb, ca = before["counters"], after["counters"]
    steps = ca["steps"] - cb["steps"]
    shares = []
    for lb, la in zip(before["layers"], after["layers"]):
        delta = [a - b for a, b in zip(la["tokens"], lb["tokens"])]
        total = sum(delta)
        if total:
            shares.append(max(delta) / total)
    return {
        "steps": steps,
        "multi_request_steps": ca["multi_request_steps"] - cb["multi_request_steps"],
        "max_batch_requests": ca["max_batch_requests"],
        "expert_loads": ca["expert_loads"] - cb["expert_loads"],
        "requests_failed": ca["requests_failed"] - cb["requests_failed"],
        # Mean over layers of the busiest expert's share of routed tokens (1/E when perfectly even).
        "hottest_expert_token_share": round(sum(shares) / len(shares), 4) if shares else None,
    }


def run(*, url: str, scenario: str, concurrency: int, requests: int | None, duration_s: float | None,
        rate_per_s: float | None, max_tokens: int, seed: int, burst_size: int | None,
        burst_interval_s: float, control_socket: str | None, timeout_s: float,
        stream: bool = False) -> dict[str, Any]:
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme != "http" or not parsed.hostname:
        raise UsageError(f"--url must be http://HOST:PORT, got {url!r}")
    host, port = parsed.hostname, parsed.port or 80
    probe = Client(host, port, timeout_s=timeout_s)
    try:
        status, before = probe.request("GET", "/stats")
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise ControlError(f"cannot reach {url}/stats: {exc}") from exc
    if status != 200:
        raise ControlError(f"{url}/stats answered HTTP {status}")
    max_seq = int(before.get("config", {}).get("max_seq", 512))
    long_bytes = max(16, min(480, max_seq - max_tokens - 8))
    if scenario == "burst" and not burst_size:
        burst_size = 2 * concurrency
    memory = MemoryDriver(host, port, control_socket=control_socket) if scenario == "memory" else None
    schedule = Schedule(requests=requests, duration_s=duration_s, rate_per_s=rate_per_s,
                        burst_size=burst_size if scenario == "burst" else None, burst_interval_s=burst_interval_s)
    results = Results()
    if memory is not None:
        memory.start()
    clients = [Client(host, port, timeout_s=timeout_s) for _ in range(concurrency)]
    threads = [
        threading.Thread(
            target=worker,
            args=(c, schedule, results),
            daemon=True,
            kwargs={
                "scenario": "balanced" if scenario in ("uniform", "memory", "burst") else scenario,
                "seed": seed,
                "max_tokens": max_tokens,
                "long_bytes": long_bytes,
                "stream": stream,
            },
        )
        for c in clients
    ]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed_s = time.monotonic() - t0
    for c in clients:
        c.close()
    memory_summary = memory.stop() if memory is not None else None
    try:
        _, after = probe.request("GET", "/stats")
        server = _server_delta(before, after)
    except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
        server = {"error": str(exc)}
    probe.close()
    lat = sorted(results.latencies_ms)
    failures = sum(results.errors.values())
    summary: dict[str, Any] = {
        "scenario": scenario, "url": url, "concurrency": concurrency,
        "mode": "open" if (rate_per_s or scenario == "burst") else "closed",
        "rate_per_s": rate_per_s, "requests": len(lat) + failures, "ok": len(lat), "failures": failures,
        "errors": results.errors, "duration_s": round(elapsed_s, 3),
        "throughput_rps": round(len(lat) / elapsed_s, 3) if elapsed_s > 0 else 0.0,
        "tokens_per_s": round(results.completion_tokens / elapsed_s, 3) if elapsed_s > 0 else 0.0,
        "latency_ms": {"p50": _latency_ms(lat, 0.50), "p95": _latency_ms(lat, 0.95),
                       "p99": _latency_ms(lat, 0.99), "max": round(lat[-1], 3) if lat else 0.0,
                       "mean": round(sum(lat) / len(lat), 3) if lat else 0.0},
        "server": server,
    }
    if stream:
        summary["stream"] = True
        summary.update(stream_summary(results.streamed))
    if memory_summary is not None:
        summary["memory"] = memory_summary
    return summary


def stream_summary(streamed: list[tuple[int, StreamedAnswer]]) -> dict[str, Any]:
    """Client-side TTFT / TPOT quantiles and the per-request list, in request order."""
    streamed = sorted(streamed, key=lambda item: item[0])
    tpots = [a.tpot_ms for _, a in streamed if a.tpot_ms is not None]
    per_request = [{
        "index": index, "request_key": a.request_key, "sent_ns": a.sent_ns, "first_token_ns": a.first_token_ns,
        "last_token_ns": a.last_token_ns, "ttft_ms": round(a.ttft_ms, 3),
        "tpot_ms": round(a.tpot_ms, 3) if a.tpot_ms is not None else None, "token_events": a.token_events,
        "prompt_tokens": a.usage.get("prompt_tokens"), "completion_tokens": a.usage.get("completion_tokens"),
    } for index, a in streamed]
    return {"ttft_ms": _quantiles_ms([a.ttft_ms for _, a in streamed]), "tpot_ms": _quantiles_ms(tpots),
            "per_request": per_request}


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m moescope.examples.moe_runtime.loadgen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--scenario", choices=SCENARIOS, default="balanced")
    p.add_argument("--concurrency", type=int, default=8, help="keep-alive clients (default 8)")
    stop = p.add_mutually_exclusive_group()
    stop.add_argument("--requests", type=int, default=None, help="total requests (default 100 if no duration)")
    stop.add_argument("--duration-s", type=float, default=None, help="run this long")
    p.add_argument("--rate", type=float, default=None, help="open loop at this many requests/s (default: closed loop)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--burst-size", type=int, default=None, help="burst: requests per burst (default 2x concurrency)")
    p.add_argument("--burst-interval-s", type=float, default=1.0)
    p.add_argument("--control-socket", default=None, help="memory: prefetch through this control socket")
    p.add_argument("--timeout-s", type=float, default=120.0, help="per-request timeout")
    p.add_argument("--json-out", default=None, help="also write the summary to this file")
    p.add_argument("--stream", action="store_true",
                   help="streamed answers (server-sent events); adds client-side TTFT/TPOT and per_request")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.concurrency < 1:
            raise UsageError("--concurrency must be >= 1")
        if args.rate is not None and args.rate <= 0:
            raise UsageError("--rate must be > 0")
        if args.max_tokens < 1:
            raise UsageError("--max-tokens must be >= 1")
        requests = args.requests if args.requests is not None or args.duration_s is not None else 100
        summary = run(url=args.url, scenario=args.scenario, concurrency=args.concurrency, requests=requests,
                      duration_s=args.duration_s, rate_per_s=args.rate, max_tokens=args.max_tokens,
                      seed=args.seed, burst_size=args.burst_size, burst_interval_s=args.burst_interval_s,
                      control_socket=args.control_socket, timeout_s=args.timeout_s, stream=args.stream)
    except MoescopeError as exc:
        print(f"loadgen: error: {exc}", file=sys.stderr)
        return exc.exit_code
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0 if summary["failures"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
