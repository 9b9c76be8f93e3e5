"""The transformers server's runtime in process: the reference batching engine and control layer
on a tiny random-weight model; routing statistics, router penalty, precision fallback and the
"unsupported" answers, each checked against what the model itself does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from moescope.examples.hf_server.__main__ import TINY_ARCHS, TINY_VOCAB
from moescope.examples.hf_server.backend import HfSequence
from moescope.examples.hf_server.runtime import CAPABILITIES, HfOptions, HfRuntime
from moescope.examples.moe_runtime.batcher import Request
from moescope.examples.moe_runtime.control import COMMAND_ARGS, ControlServer
from moescope.examples.moe_runtime.tokenizer import EOS_ID, ByteTokenizer
from moescope.hf.tiny import tiny_model

WAIT_S = 90.0


@pytest.fixture
def runtime() -> Iterator[HfRuntime]:
    model = tiny_model("qwen3_moe", vocab=TINY_VOCAB, layers=2)
    rt = HfRuntime(model=model, tokenizer=ByteTokenizer(vocab=TINY_VOCAB), options=HfOptions(max_wait_ms=0.0),
                   description="tiny qwen3_moe", pad_id=EOS_ID)
    rt.engine.start()
    try:
        yield rt
    finally:
        rt.engine.stop()
        rt.ins.close()


def complete(rt: HfRuntime, prompt: str, max_tokens: int) -> Request:
    request = Request(request_key=5, prompt_ids=rt.tokenizer.encode(prompt), max_tokens=max_tokens)
    rt.engine.submit(request)
    assert request.done.wait(WAIT_S) and request.error is None, request.error
    return request


def test_stats_count_k_assignments_for_every_token_each_step(runtime: HfRuntime) -> None:
    request = complete(runtime, "abcd", 3)
    prompt = len(runtime.tokenizer.encode("abcd"))
    step_tokens = [prompt, prompt + 1, prompt + 2]  # each step recomputes the whole sequence
    stats = runtime.stats_dict()
    assert request.steps == 3 and stats["counters"]["steps"] == 3
    assert stats["config"]["layers"] == 2 and stats["config"]["experts"] == 8 and stats["config"]["top_k"] == 2
    assert stats["config"]["capabilities"] == list(CAPABILITIES)
    for layer in stats["layers"]:
        assert sum(layer["tokens"]) == 2 * sum(step_tokens)
        assert sum(layer["last_step_tokens"]) == 2 * step_tokens[-1]
        assert 0.0 < layer["entropy_bits"] <= 3.0


def test_router_penalty_moves_tokens_off_the_expert_and_is_removed_at_zero(runtime: HfRuntime) -> None:
    complete(runtime, "warm up", 1)
    before = [layer["last_step_tokens"] for layer in runtime.stats_dict()["layers"]]
    hot = int(np.argmax(np.sum(before, axis=0)))  # the expert these tokens use most
    assert runtime.cmd_set_router_penalty(expert=hot, penalty=1000.0) == {"layers": [0, 1], "expert": hot,
                                                                           "penalty": 1000.0}
    complete(runtime, "warm up", 1)
    stats = runtime.stats_dict()
    assert [layer["last_step_tokens"][hot] for layer in stats["layers"]] == [0, 0]
    assert [sum(layer["last_step_tokens"]) for layer in stats["layers"]] == [sum(b) for b in before]
    assert all(layer["penalty"][hot] == 1000.0 for layer in stats["layers"])
    runtime.cmd_set_router_penalty(expert=hot, penalty=0.0)
    assert runtime.backend._modes == [None, None]  # no penalty: the router runs as loaded
    complete(runtime, "warm up", 1)
    assert [layer["last_step_tokens"] for layer in runtime.stats_dict()["layers"]] == before


def test_precision_fallback_and_back_restores_outputs_exactly(runtime: HfRuntime) -> None:
    backend = runtime.backend

    def logits() -> torch.Tensor:
        return backend.forward([HfSequence()], [[256, 104, 105]])

    native = logits()
    assert runtime.cmd_set_precision(precision="bf16")["changed"] == 16
    assert [p.dtype for b in runtime.ins.blocks for p in b.experts.parameters(recurse=False)] == [torch.bfloat16] * 4
    reduced = logits()
    assert not torch.equal(native, reduced) and torch.allclose(native, reduced, atol=0.1)
    assert runtime.stats_dict()["precision"] == {"default": "bf16", "counts": {"fp32": 0, "bf16": 16, "fp16": 0}}
    runtime.cmd_set_precision(precision="fp32")
    assert torch.equal(native, logits())


def test_residency_commands_answer_unsupported_through_the_control_layer(runtime: HfRuntime, tmp_path: object) -> None:
    handlers = {n.removeprefix("cmd_"): getattr(runtime, n) for n in dir(runtime) if n.startswith("cmd_")}
    assert set(handlers) == set(COMMAND_ARGS)  # every protocol command answers, one way or the other
    server = ControlServer(path=f"{tmp_path}/control.sock", handlers=handlers)
    try:
        calls = {
            "migrate_expert": {"layer": 0, "expert": 1, "device": "cpu"}, "offload_expert": {"layer": 0, "expert": 1},
            "restore_expert": {"layer": 0, "expert": 1}, "prefetch": {}, "set_resident_capacity": {"device": "cpu",
                                                                                                  "experts": 4},
            "set_precision": {"precision": "fp16", "experts": [[0, 1]]},
        }
        for cmd, args in calls.items():
            reply = server.handle_line(json.dumps({"id": 1, "cmd": cmd, "args": args}).encode())
            assert reply["ok"] is False and reply["error"].startswith("unsupported: "), reply
        assert server.handle_line(b'{"cmd": "ping"}')["result"]["capabilities"] == list(CAPABILITIES)
        assert runtime.stats_dict()["precision"]["default"] == "fp32"  # the refused set_precision changed nothing
    finally:
        server.close()


def test_a_model_without_moe_blocks_is_refused_with_the_reason() -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from moescope.errors import ConfigError

    dense = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=32, num_hidden_layers=1,
                                                         num_attention_heads=2, intermediate_size=64))
    with pytest.raises(ConfigError, match="no MoE blocks"):
        HfRuntime(model=dense, tokenizer=ByteTokenizer(vocab=TINY_VOCAB), options=HfOptions(), description="dense")


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_batched_left_padded_steps_give_each_request_its_own_greedy_tokens(arch: str) -> None:
    """Every family the server builds (deepseek_v3's tiny config once failed every padded batch:
    HTTP 500 for each request that shared a step)."""
    runtime = HfRuntime(model=tiny_model(arch, vocab=TINY_VOCAB, layers=2), tokenizer=ByteTokenizer(vocab=TINY_VOCAB),
                        options=HfOptions(max_wait_ms=0.0), description=f"tiny {arch}", pad_id=EOS_ID)
    runtime.engine.start()
    prompts = ("a", "a longer prompt")
    try:
        alone = [complete(runtime, p, 2).generated for p in prompts]
    finally:
        runtime.engine.stop()
    model = runtime.backend.model
    batched = HfRuntime(model=model, tokenizer=runtime.tokenizer, description="batched", pad_id=EOS_ID,
                        options=HfOptions(max_wait_ms=60_000.0, max_batch_size=2))  # waits for both
    runtime.ins.close()  # one instrumentation on the model at a time
    batched.engine.start()
    try:
        requests = [Request(request_key=k, prompt_ids=batched.tokenizer.encode(p), max_tokens=2)
                    for k, p in zip((8, 9), prompts)]
        for r in requests:
            batched.engine.submit(r)
        for r in requests:
            assert r.done.wait(WAIT_S) and r.error is None, r.error
    finally:
        batched.engine.stop()
        batched.ins.close()
    assert [r.generated for r in requests] == alone
    counters = batched.stats_dict()["counters"]
    assert counters["steps"] == 2 and counters["multi_request_steps"] == 2


def test_model_from_local_files_is_served_and_a_missing_one_is_one_line(tmp_path: Path) -> None:
    from moescope.errors import ConfigError
    from moescope.examples.hf_server.__main__ import build_parser, load

    saved: Any = tiny_model("mixtral", vocab=TINY_VOCAB, layers=2)  # a transformers model: untyped attributes
    saved.save_pretrained(tmp_path / "tiny-mixtral")  # weights and config, no tokenizer files
    model, tokenizer, description, pad_id = load(build_parser().parse_args(["--model", str(tmp_path / "tiny-mixtral")]))
    assert isinstance(tokenizer, ByteTokenizer) and description.endswith("tiny-mixtral") and pad_id == EOS_ID
    rt = HfRuntime(model=model, tokenizer=tokenizer, options=HfOptions(max_wait_ms=0.0), description=description)
    rt.engine.start()
    try:
        request = complete(rt, "hi", 2)
    finally:
        rt.engine.stop()
        rt.ins.close()
    with torch.no_grad():  # greedy, recomputed by hand from the loaded model
        ids = torch.tensor([tokenizer.encode("hi")])
        first = int(model(ids).logits[0, -1].argmax())
    assert request.generated[0] == first and [b.path for b in rt.ins.blocks] == ["model.layers.0.mlp",
                                                                                 "model.layers.1.mlp"]
    with pytest.raises(ConfigError) as missing:
        load(build_parser().parse_args(["--model", str(tmp_path / "nothing-here")]))
    assert str(missing.value) == f"--model {tmp_path / 'nothing-here'}: no such directory"
    (tmp_path / "empty").mkdir()  # a directory without a model: transformers' own reason, one line
    with pytest.raises(ConfigError) as empty:
        load(build_parser().parse_args(["--model", str(tmp_path / "empty")]))
    assert "cannot load" in str(empty.value) and "\n" not in str(empty.value)
