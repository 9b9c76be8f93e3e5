"""A deterministic byte tokenizer: UTF-8 bytes are ids 0..255, then BOS and EOS; higher ids (the
random model may emit them) decode as `<id>`. Nothing is downloaded, nothing is learned."""

from __future__ import annotations

BOS_ID = 256
EOS_ID = 257


class ByteTokenizer:
    def __init__(self, *, vocab: int) -> None:
        self.vocab = vocab

    def encode(self, text: str) -> list[int]:
        """BOS followed by the UTF-8 bytes of text."""
        return [BOS_ID, *text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        out: list[str] = []
        pending = bytearray()
        for token in ids:
            if 0 <= token < 256:
                pending.append(token)
                continue
            if pending:
                out.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
            if token not in (BOS_ID, EOS_ID):
                out.append(f"<{token}>")
        if pending:
            out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)
