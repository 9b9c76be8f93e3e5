"""The control socket on a real runtime process: every command, malformed input, peer-uid refusal
(a client under another uid), socket mode, and hot-migration under concurrent load with 0 failed
and 0 wrong requests."""

from __future__ import annotations

import http.client
import json
import os
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from peer_probe import connect_as_nobody

from moescope.examples.moe_runtime.config import ModelConfig
from moescope.examples.moe_runtime.control import ControlClient
from moescope.examples.moe_runtime.model import SequenceState
from moescope.examples.moe_runtime.runtime import Runtime, RuntimeOptions
from moescope.examples.moe_runtime.stats import LAYER_FIELDS, PLACEMENT_FIELDS
from tests.runtime.conftest import RunningServer


def raw_exchange(path: str, data: bytes) -> list[dict[str, Any]]:
    """Sends raw bytes, half-closes, returns every reply line."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(path)
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return [json.loads(line) for line in b"".join(chunks).splitlines() if line.strip()]


def test_every_command_and_malformed_input(start_server: Callable[..., RunningServer]) -> None:
    server = start_server("--devices", "cpu,cpu:1", "--resident-capacity-experts", "16",
                          "--initial-resident-experts", "6")
    st = os.stat(server.socket_path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert server.post({"prompt": "warm up the router", "max_tokens": 3})[0] == 200
    with ControlClient(server.socket_path) as c:
        reply = c.request("ping")
        assert reply["ok"] and reply["result"]["pid"] == server.proc.pid
        assert isinstance(reply["elapsed_ms"], float) and reply["id"] == 1
        stats = c.call("stats")
        assert stats["config"]["devices"] == ["cpu", "cpu:1"]
        assert len(stats["layers"]) == 2
        for key in ("tokens", "dropped", "rerouted_in", "queue_depth", "last_step_tokens", "penalty",
                    "device", "tier", "dtype", "precision", "loads", "offloaded"):
            assert len(stats["layers"][0][key]) == 8, key
        assert sum(stats["layers"][0]["tokens"]) == 2 * (19 + 2)  # k=2 x (BOS + 18 bytes prefill, 2 decode)
        mem = stats["memory"]["devices"]
        # 16 experts placed layer-major: 6 on cpu, the next 6 on cpu:1, the last 4 on host.
        assert mem["cpu"]["resident_experts"] == 6 and mem["cpu:1"]["resident_experts"] == 6
        assert stats["layers"][1]["device"][3] == "cpu:1" and stats["layers"][1]["tier"][4:] == ["host"] * 4
        assert stats["layers"][0]["device"][0] == "cpu"

        moved = c.call("migrate_expert", {"layer": 0, "expert": 0, "device": "cpu:1"})
        assert moved["from"]["device"] == "cpu" and moved["to"] == {
            "device": "cpu:1",
            "tier": "device",
            "dtype": "fp32",
        }
        assert moved["bytes_moved"] == 3 * 64 * 128 * 4 and moved["noop"] is False
        assert c.call("migrate_expert", {"layer": 0, "expert": 0, "device": "cpu:1"})["noop"] is True
        off = c.call("offload_expert", {"layer": 0, "expert": 1})
        assert off["to"] == {"device": "host", "tier": "host", "dtype": "fp16"}
        assert c.call("stats")["layers"][0]["offloaded"][:2] == [False, True]
        assert off["bytes_moved"] == 3 * 64 * 128 * 2
        back = c.call("restore_expert", {"layer": 0, "expert": 1})
        assert back["to"] == {"device": "cpu", "tier": "device", "dtype": "fp32"}
        prec = c.call("set_precision", {"precision": "fp16", "experts": [[0, 2], [1, 3]]})
        assert prec["changed"] == 2 and prec["counts"]["fp16"] == 2
        assert c.call("set_precision", {"precision": "fp32"})["counts"] == {"fp32": 16, "bf16": 0, "fp16": 0}
        pen = c.call("set_router_penalty", {"expert": 5, "penalty": 0.3})
        assert pen == {"layers": [0, 1], "expert": 5, "penalty": 0.3}
        assert c.call("set_router_penalty", {"layer": 1, "expert": 5, "penalty": 0})["layers"] == [1]
        pre = c.call("prefetch", {"count": 1, "device": "cpu:1"})
        assert pre["device"] == "cpu:1" and len(pre["loaded"]) == 1 and pre["loaded"][0][0] == 1
        cap = c.call("set_resident_capacity", {"device": "cpu:1", "experts": 20})
        assert cap["capacity_experts"] == 20
        stats = c.call("stats")
        assert stats["layers"][0]["penalty"][5] == 0.3 and stats["layers"][1]["penalty"][5] == 0.0
        assert stats["layers"][0]["device"][0] == "cpu:1"
        assert stats["counters"]["migrations"] >= 3

        errors = {
            ("migrate_expert", json.dumps({"layer": 9, "expert": 0, "device": "cpu"})): "layer 9 out of range",
            ("migrate_expert", json.dumps({"layer": 0, "expert": 0, "device": "gpu7"})): "unknown device",
            ("migrate_expert", json.dumps({"layer": 0, "expert": 0})): "missing argument 'device'",
            ("offload_expert", json.dumps({"layer": "0", "expert": 0})): "must be int",
            ("offload_expert", json.dumps({"layer": 0, "expert": 0, "bogus": 1})): "unknown argument",
            ("set_precision", json.dumps({"precision": "fp8"})): "precision must be one of",
            ("set_precision", json.dumps({"precision": "fp16", "experts": [[0]]})): "pairs",
            ("set_router_penalty", json.dumps({"expert": 1, "penalty": -0.3})): "penalty must be",
            ("set_resident_capacity", json.dumps({"device": "cpu", "experts": 1})): "offload some",
            ("prefetch", json.dumps({"count": -1})): "count must be",
        }
        for (cmd, args), message in errors.items():
            reply = c.request(cmd, json.loads(args))
            assert reply["ok"] is False and message in reply["error"], (cmd, reply)
            assert "\n" not in reply["error"] and isinstance(reply["elapsed_ms"], float)

    replies = raw_exchange(server.socket_path, b'{not json\n[1,2]\n{"id": 5, "cmd": "nope"}\n'
                           b'{"id": 6}\n{"id": 7, "cmd": "ping", "args": []}\n\xff\xfe\n'
                           b'{"id": 8, "cmd": "ping"}\n')
    assert [r["ok"] for r in replies] == [False, False, False, False, False, False, True]
    assert [r["id"] for r in replies] == [None, None, 5, 6, 7, None, 8]
    assert "malformed JSON" in replies[0]["error"] and "unknown cmd 'nope'" in replies[2]["error"]
    assert all(isinstance(r["elapsed_ms"], float) for r in replies)
    too_long = raw_exchange(server.socket_path, b"x" * 70000)
    assert len(too_long) == 1 and "longer than" in too_long[0]["error"]
    # Still serving after all of that.
    assert server.post({"prompt": "still alive", "max_tokens": 2})[0] == 200
    assert ControlClient(server.socket_path).call("ping")["pid"] == server.proc.pid


def test_narrowed_stats_and_the_placement_version(start_server: Callable[..., RunningServer]) -> None:
    # `fields` narrows the per-layer part; the placement comes again exactly when its version moved.
    server = start_server("--devices", "cpu,cpu:1", "--resident-capacity-experts", "16",
                          "--initial-resident-experts", "6", "--cache-on-load")
    with ControlClient(server.socket_path) as c:
        whole = c.call("stats")
        assert list(whole["layers"][0]) == ["layer", *LAYER_FIELDS]  # the whole reply as before
        version = whole["placement_version"]
        narrow = c.call("stats", {"fields": ["queue_depth", "penalty"], "placement_since": version})
        assert [list(layer) for layer in narrow["layers"]] == [["layer", "queue_depth", "penalty"]] * 2
        assert {k: v for k, v in narrow.items() if k not in ("layers", "counters")} == \
            {k: v for k, v in whole.items() if k not in ("layers", "counters")}  # the rest is whole
        assert [list(layer) for layer in c.call("stats", {"fields": []})["layers"]] == [["layer"]] * 2

        def placement_sent(since: int) -> bool:
            layers = c.call("stats", {"fields": ["tokens"], "placement_since": since})["layers"]
            sent = {key for layer in layers for key in layer} & set(PLACEMENT_FIELDS)
            assert sent in (set(), set(PLACEMENT_FIELDS))
            return bool(sent)

        assert not placement_sent(version) and placement_sent(version + 1)
        moves: list[tuple[str, dict[str, Any]]] = [("migrate_expert", {"layer": 0, "expert": 0, "device": "cpu:1"}),
                 ("offload_expert", {"layer": 0, "expert": 1}),
                 ("restore_expert", {"layer": 0, "expert": 1}),
                 ("set_precision", {"precision": "fp16", "experts": [[1, 3]]})]
        for cmd, args in moves:
            before = c.call("stats", {"fields": []})["placement_version"]
            c.call(cmd, args)
            after = c.call("stats", {"fields": [], "placement_since": before})
            assert after["placement_version"] > before, cmd
            assert placement_sent(before) and not placement_sent(after["placement_version"]), cmd
            # the pools' report follows the move at once (it is kept between changes)
            fresh = c.call("stats")
            assert fresh["memory"] == after["memory"], cmd
        assert fresh["layers"][1]["precision"][3] == "fp16" and fresh["layers"][0]["device"][0] == "cpu:1"
        # a penalty is not placement: the version stays, the narrowed reply shows the penalty
        before = c.call("stats", {"fields": []})["placement_version"]
        c.call("set_router_penalty", {"expert": 5, "penalty": 0.3})
        narrow = c.call("stats", {"fields": ["penalty"], "placement_since": before})
        assert narrow["placement_version"] == before and narrow["layers"][0]["penalty"][5] == 0.3
        # the sparse fields: the dense field's non-zero entries as [expert, value] pairs, nothing else
        both = c.call("stats", {"fields": ["queue_depth", "queue_depth_sparse", "penalty", "penalty_sparse"]})
        for layer in both["layers"]:
            assert list(layer) == ["layer", "queue_depth", "penalty", "queue_depth_sparse", "penalty_sparse"]
            for dense in ("queue_depth", "penalty"):
                assert layer[f"{dense}_sparse"] == [[e, v] for e, v in enumerate(layer[dense]) if v]
        assert both["layers"][1]["penalty_sparse"] == [[5, 0.3]]
        assert "queue_depth_sparse" not in c.call("stats")["layers"][0]  # only when named
        # an on-demand load cached into a pool (--cache-on-load) is a placement change too
        hosted = sum(tier == "host" for layer in fresh["layers"] for tier in layer["tier"])
        assert hosted == 4  # layer 1's last four (12 placed on the two pools, layer-major)
        assert server.post({"prompt": "route to the experts on host", "max_tokens": 4})[0] == 200
        after = c.call("stats")
        assert sum(tier == "host" for layer in after["layers"] for tier in layer["tier"]) < hosted
        assert after["placement_version"] > before
        for args, message in (({"fields": ["tokens", "bogus"]}, "unknown field(s) ['bogus']"),
                              ({"fields": [3]}, "unknown field(s) [3]"),
                              ({"fields": "tokens"}, "must be list|null"),
                              ({"placement_since": "1"}, "must be int|null"),
                              ({"since": 1}, "unknown argument")):
            reply = c.request("stats", args)
            assert reply["ok"] is False and message in reply["error"], (args, reply)
            assert "\n" not in reply["error"]


def test_other_uid_is_refused(start_server: Callable[..., RunningServer]) -> None:
    assert os.getuid() == 0, "this test drops to uid 65534 with setpriv: run it as root"
    strict = start_server(name="strict.sock")
    # Mode 0600: the kernel refuses the connect itself.
    assert connect_as_nobody(strict.socket_path) == "EACCES"
    # A looser mode still gets the SO_PEERCRED check: one error reply, then the connection closes.
    loose = start_server("--control-socket-mode", "0666", name="loose.sock")
    assert stat.S_IMODE(os.stat(loose.socket_path).st_mode) == 0o666
    reply = json.loads(connect_as_nobody(loose.socket_path))
    assert reply["ok"] is False and reply["id"] is None
    assert "peer uid 65534 not permitted" in reply["error"]
    # Root (our uid) is still served on the same socket.
    assert ControlClient(loose.socket_path).call("ping")["uid"] == 0


HOT_PROMPTS = [f"prompt {i} about experts" for i in range(6)] + ["xxxxxxxxxxxxxxxxxxxxxxxx", "yyyy yyyy yyyy"]
HOT_ARGS = ("--devices", "cpu,cpu:1", "--capacity-factor", "100", "--max-batch-size", "6")
MAX_TOKENS = 6


def solo_reference() -> dict[str, list[int]]:
    """The same model in-process, one request at a time. With capacity factor 100 nothing is
    dropped, so a request's tokens do not depend on its batch mates (batch shapes change logits
    by ~1e-6; the precondition below proves every greedy choice has a far wider margin)."""
    cfg = ModelConfig(d_model=64, d_ff=128, layers=2, experts=8, n_heads=2, capacity_factor=100.0)
    rt = Runtime(RuntimeOptions(model=cfg, nvtx=False))
    out = {}
    with torch.no_grad():
        for prompt in HOT_PROMPTS:
            seq = SequenceState()
            ids = rt.tokenizer.encode(prompt)
            tokens = []
            for _ in range(MAX_TOKENS):
                logits = rt.model.forward([seq], [ids])[0]
                top2 = torch.topk(logits, 2).values
                assert float(top2[0] - top2[1]) > 1e-4, f"near-tie in reference decoding of {prompt!r}"
                tokens.append(int(logits.argmax()))
                ids = [tokens[-1]]
            out[prompt] = tokens
    return out


class LoadClients:
    """Concurrent keep-alive clients sending HOT_PROMPTS round-robin until stopped."""

    def __init__(self, port: int, *, clients: int) -> None:
        self.port = port
        self.results: list[tuple[str, int, list[int]]] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def _run(self, index: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        i = index
        try:
            while not self._stop.is_set():
                prompt = HOT_PROMPTS[i % len(HOT_PROMPTS)]
                i += 1
                try:
                    conn.request(
                        "POST", "/v1/completions", body=json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS})
                    )
                    response = conn.getresponse()
                    body = json.loads(response.read())
                except (OSError, http.client.HTTPException, ValueError) as exc:
                    with self._lock:
                        self.errors.append(repr(exc))
                    conn.close()
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
                    continue
                with self._lock:
                    self.results.append((prompt, response.status, body.get("tokens", [])))
        finally:
            conn.close()

    def __enter__(self) -> LoadClients:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def count(self) -> int:
        with self._lock:
            return len(self.results)


def test_hot_migration_under_load_no_failed_or_wrong_request(start_server: Callable[..., RunningServer]) -> None:
    reference = solo_reference()
    server = start_server(*HOT_ARGS)
    for prompt in HOT_PROMPTS[:2]:
        assert server.post({"prompt": prompt, "max_tokens": MAX_TOKENS})[1]["tokens"] == reference[prompt]
    commands = 0
    with ControlClient(server.socket_path) as control, LoadClients(server.port, clients=6) as load:
        # Phase 1: dtype-preserving moves under load: every answer must equal the solo reference.
        for layer in range(2):
            for expert in range(8):
                for device in ("cpu:1", "host", "cpu"):
                    control.call("migrate_expert", {"layer": layer, "expert": expert, "device": device})
                    commands += 1
                    if device == "host":
                        # Output-neutral commands under load too: a host expert is prefetched back
                        # at the same precision, a zero penalty changes nothing, stats reads.
                        assert control.call("prefetch", {"count": 1, "layer": layer})["loaded"] == [[layer, expert]]
                        control.call("set_router_penalty", {"layer": layer, "expert": expert, "penalty": 0})
                        assert control.call("stats")["counters"]["requests_failed"] == 0
                        control.call("migrate_expert", {"layer": layer, "expert": expert, "device": "host"})
                    if commands % 8 == 0:
                        # Let traffic run across the swaps (bounded wait, not a timing assertion).
                        target = load.count() + 1
                        for _ in range(600):
                            if load.count() >= target:
                                break
                            threading.Event().wait(0.05)
        phase1 = load.count()
        # Phase 2: fp16 offload and fp16 fallback under load, then back.
        for layer in range(2):
            for expert in range(0, 8, 2):
                control.call("offload_expert", {"layer": layer, "expert": expert})
        control.call("set_precision", {"precision": "fp16"})
        for _ in range(600):
            if load.count() >= phase1 + 6:
                break
            threading.Event().wait(0.05)
        control.call("set_precision", {"precision": "fp32"})
        for layer in range(2):
            for expert in range(0, 8, 2):
                control.call("restore_expert", {"layer": layer, "expert": expert})
        stats = control.call("stats")
    print(
        f"hot-migration: {commands} migrations, {phase1} requests in phase 1, {len(load.results)} total, "
        f"{stats['counters']['expert_loads']} on-demand loads, {stats['counters']['multi_request_steps']} batched steps"
    )
    assert load.errors == []
    assert all(status == 200 and len(tokens) == MAX_TOKENS for _, status, tokens in load.results)
    assert phase1 >= 6 and len(load.results) > phase1
    wrong = [(p, t) for p, _, t in load.results[:phase1] if t != reference[p]]
    assert wrong == []
    assert stats["counters"]["requests_failed"] == 0
    assert stats["counters"]["migrations"] >= 48 + 16
    assert stats["counters"]["multi_request_steps"] > 0
    assert all(d == "cpu" for layer in stats["layers"] for d in layer["device"])
    # After restore and revert: bit-identical to before.
    for prompt in HOT_PROMPTS:
        assert server.post({"prompt": prompt, "max_tokens": MAX_TOKENS})[1]["tokens"] == reference[prompt]


def test_penalty_moves_load_on_a_running_server(start_server: Callable[..., RunningServer]) -> None:
    server = start_server()

    def layer0_tokens() -> list[int]:
        return server.get("/stats")[1]["layers"][0]["tokens"]

    for _ in range(2):
        assert server.post({"prompt": "x" * 40, "max_tokens": 2})[0] == 200
    first = layer0_tokens()
    hot = max(range(8), key=lambda e: first[e])
    assert first[hot] >= 40  # the repeated-character prompt concentrates routing
    with ControlClient(server.socket_path) as c:
        c.call("set_router_penalty", {"layer": 0, "expert": hot, "penalty": 3.0})
        for _ in range(2):
            assert server.post({"prompt": "x" * 40, "max_tokens": 2})[0] == 200
        second = layer0_tokens()
        c.call("set_router_penalty", {"layer": 0, "expert": hot, "penalty": 0})
    assert second[hot] - first[hot] < first[hot] // 2
    assert sum(second) - sum(first) == sum(first)  # same tokens routed, to other experts


@pytest.mark.parametrize("bad", ["0800", "x"])
def test_bad_flags_exit_with_one_line_error(bad: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "moescope.examples.moe_runtime", "--port", "0", "--control-socket-mode", bad],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "control-socket-mode" in out.stderr
