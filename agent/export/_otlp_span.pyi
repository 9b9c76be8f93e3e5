"""The native OTLP/JSON span encoder (agent/export/otlp_span.c)."""

from collections.abc import Callable, Sequence
from typing import Any

def encode(spans: Sequence[Any], fallback: Callable[[Any], str], link_text: Callable[[Any], str],
           event_text: Callable[[Any], str], shared_type: type, span_type: type, /) -> str: ...
