"""Serve a transformers MoE causal LM: `python -m moescope.examples.hf_server --model ID_OR_PATH`
(from_pretrained, local files only) or `--arch qwen3_moe|mixtral|qwen2_moe|deepseek_v3 --tiny` (random tiny
weights from the config class: tests and demos). Same API and banner as the reference runtime:

    http port: PORT
    control socket: PATH
    nvtx: active|inactive (...)
    ready
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from moescope.errors import ArgumentParser, ConfigError, MoescopeError, UsageError, tcp_port
from moescope.examples.moe_runtime.server import Tokenizer, serve
from moescope.examples.moe_runtime.tokenizer import EOS_ID, ByteTokenizer

TINY_ARCHS = ("qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3")  # moescope.hf.tiny builds each
TINY_VOCAB = 512  # the byte tokenizer needs ids 0..257


class PretrainedTokenizer:
    """A transformers tokenizer as the server's encode/decode."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self._tok.encode(text)]

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m moescope.examples.hf_server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_argument_group("model")
    what.add_argument("--model", help="a local model directory or a Hugging Face id already in the local cache")
    what.add_argument("--arch", choices=TINY_ARCHS, help="with --tiny: the architecture to build")
    what.add_argument("--tiny", action="store_true", help="random tiny weights from the config class of --arch")
    what.add_argument("--layers", type=int, default=2, help="--tiny: layers (default 2)")
    what.add_argument("--experts", type=int, default=8, help="--tiny: experts per layer (default 8)")
    what.add_argument("--top-k", type=int, default=2, help="--tiny: experts per token (default 2)")
    what.add_argument("--hidden", type=int, default=64, help="--tiny: width (default 64)")
    what.add_argument("--seed", type=int, default=0)
    what.add_argument("--device", default="cpu", help="torch device (default cpu)")
    net = p.add_argument_group("serving")
    net.add_argument("--host", default="127.0.0.1")
    net.add_argument("--port", type=tcp_port, default=8000, help="HTTP port; 0 picks a free one (printed)")
    net.add_argument("--max-batch-size", type=int, default=16)
    net.add_argument("--max-wait-ms", type=float, default=5.0)
    net.add_argument("--max-waiting", type=int, default=1024)
    net.add_argument("--max-tokens-limit", type=int, default=256)
    net.add_argument("--max-seq", type=int, default=512, help="longest sequence served (prompt + completion)")
    net.add_argument("--control-socket", default=None)
    net.add_argument("--control-socket-mode", default="0600")
    net.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    net.add_argument("-v", "--verbose", action="count", default=0)
    return p


def load(args: argparse.Namespace) -> tuple[Any, Tokenizer, str, int]:
    """(model, tokenizer, description, pad id)."""
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: CUDA is not available to this torch")
    if args.tiny:
        from moescope.hf.tiny import TINY_HEADS, tiny_model

        if not args.arch or args.model:
            raise UsageError("--tiny needs --arch (and no --model)")
        for flag, value in (("--layers", args.layers), ("--experts", args.experts), ("--top-k", args.top_k)):
            if value < 1:
                raise UsageError(f"{flag} must be >= 1, got {value}")
        if args.top_k > args.experts:  # (it served, then answered every request 500)
            raise UsageError(f"--top-k {args.top_k} is more than --experts {args.experts}")
        if args.hidden < 2 * TINY_HEADS or args.hidden % (2 * TINY_HEADS):  # (--hidden 3: a ZeroDivisionError)
            raise UsageError(f"--hidden must be a multiple of {2 * TINY_HEADS} ({TINY_HEADS} attention heads of an "
                             f"even width), got {args.hidden}")

        model = tiny_model(args.arch, seed=args.seed, vocab=TINY_VOCAB, layers=args.layers, experts=args.experts,
                           top_k=args.top_k, hidden=args.hidden, max_positions=args.max_seq)
        return model.to(args.device), ByteTokenizer(vocab=TINY_VOCAB), f"tiny {args.arch}", EOS_ID
    if not args.model or args.arch:
        raise UsageError("give --model ID_OR_PATH, or --arch NAME --tiny")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # A path, not a hub id ("org/name"): say so when it is missing (transformers said "Repo id must be
    # in the form 'repo_name' or 'namespace/repo_name'" for /nonexistent/x)
    looks_like_path = args.model.startswith((".", "/", "~")) or args.model.count("/") > 1
    if looks_like_path and not Path(args.model).expanduser().is_dir():
        raise ConfigError(f"--model {args.model}: no such directory")
    try:
        model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True, dtype="auto")
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"cannot load {args.model!r} from local files: {first}") from exc
    model = model.to(args.device).eval()
    torch.set_grad_enabled(False)
    try:
        tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    except (OSError, ValueError) as exc:
        if int(model.config.vocab_size) < 258:
            raise ConfigError(f"{args.model!r} has no tokenizer files ({exc}) and too small a vocabulary "
                              "for the byte tokenizer") from exc
        return model, ByteTokenizer(vocab=int(model.config.vocab_size)), args.model, EOS_ID
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    return model, PretrainedTokenizer(tok), args.model, int(pad)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2),
                        format="hf_server: %(levelname)s: %(message)s")
    try:
        mode = int(args.control_socket_mode, 8)
    except ValueError:
        print(f"hf_server: error: --control-socket-mode must be octal, got {args.control_socket_mode!r}",
              file=sys.stderr)
        return 2
    try:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        from moescope.examples.hf_server.runtime import HfOptions, HfRuntime

        model, tokenizer, description, pad_id = load(args)
        runtime = HfRuntime(model=model, tokenizer=tokenizer, description=description, pad_id=pad_id,
                            options=HfOptions(max_batch_size=args.max_batch_size, max_wait_ms=args.max_wait_ms,
                                              max_waiting=args.max_waiting, max_tokens_limit=args.max_tokens_limit,
                                              max_seq=args.max_seq))
    except MoescopeError as exc:
        print(f"hf_server: error: {exc}", file=sys.stderr)
        return exc.exit_code
    for line in runtime.ins.describe().splitlines():
        print(f"hf_server: {line}", file=sys.stderr, flush=True)
    nvtx_state = "active" if runtime.ins.active else f"inactive ({runtime.ins.nvtx_state})"
    return serve(runtime, prog="hf_server", host=args.host, port=args.port, control_socket=args.control_socket,
                 control_mode=mode, nvtx_state=nvtx_state)


if __name__ == "__main__":
    sys.exit(main())
