"""Where traces go: flags, then the standard ``OTEL_EXPORTER_OTLP_*`` variables, then the file default.

Precedence for each setting: command-line flag > ``OTEL_EXPORTER_OTLP_TRACES_<X>`` >
``OTEL_EXPORTER_OTLP_<X>`` > default. Settings (OpenTelemetry specification "OTLP Exporter"):

* ENDPOINT — a URL (``http://`` or ``https://``). For ``grpc`` the host and port are used. For
  ``http/protobuf`` the signal variable ``..._TRACES_ENDPOINT`` is used as is, while the generic
  ``OTEL_EXPORTER_OTLP_ENDPOINT`` and ``--otlp-endpoint`` are base URLs that get ``v1/traces``
  appended. No endpoint anywhere: traces go to OTLP-JSON files under the state directory.
* PROTOCOL — ``grpc`` (default) or ``http/protobuf``; ``http/json`` is refused with a clear error.
* HEADERS — ``key=value,key2=value2`` with percent-encoded values; flags repeat ``--otlp-header K=V``.
* TIMEOUT — milliseconds, as the specification says (the Python SDK's own reading takes seconds;
  we resolve it here and pass seconds explicitly, so the documented unit holds).
* INSECURE — ``true``/``false``: plaintext gRPC; defaults to true for ``http://`` URLs.

State directory for the file default: ``--state-dir``, else ``$MOESCOPE_STATE_DIR/traces``, else
``/var/lib/moescope/traces``.
"""

from __future__ import annotations

import argparse
import os
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from moescope import errors

Protocol = Literal["grpc", "http/protobuf"]
PROTOCOLS: tuple[Protocol, ...] = ("grpc", "http/protobuf")
DEFAULT_PROTOCOL: Protocol = "grpc"
DEFAULT_TIMEOUT_MS = 10_000
DEFAULT_STATE_DIR = Path("/var/lib/moescope")
TRACES_SUBDIR = "traces"
DEFAULT_FILE_MAX_BYTES = 16 * 1024 * 1024
DEFAULT_FILES_KEEP = 8
DEFAULT_QUEUE_SPANS = 8192
DEFAULT_BATCH_SPANS = 512
DEFAULT_SCHEDULE_DELAY_MS = 1000
DEFAULT_SHUTDOWN_TIMEOUT_MS = 5000
HTTP_TRACES_PATH = "v1/traces"


@dataclass(frozen=True, slots=True)
class OtlpTarget:
    """A resolved OTLP destination."""

    endpoint: str  # grpc: http(s)://host:port ; http: full URL of the traces endpoint
    protocol: Protocol
    headers: tuple[tuple[str, str], ...] = ()
    timeout_ms: int = DEFAULT_TIMEOUT_MS
    insecure: bool = True
    source: str = ""  # which flag/variable the endpoint came from (said at start)


@dataclass(frozen=True, slots=True)
class ExportConfig:
    """Everything the trace pipeline needs; ``otlp is None`` means the file default."""

    otlp: OtlpTarget | None
    traces_dir: Path
    file_max_bytes: int = DEFAULT_FILE_MAX_BYTES
    files_keep: int = DEFAULT_FILES_KEEP
    queue_spans: int = DEFAULT_QUEUE_SPANS
    batch_spans: int = DEFAULT_BATCH_SPANS
    schedule_delay_ms: int = DEFAULT_SCHEDULE_DELAY_MS
    shutdown_timeout_ms: int = DEFAULT_SHUTDOWN_TIMEOUT_MS

    def describe(self) -> str:
        """One line for the start banner: where traces are going and why."""
        if self.otlp is None:
            return f"traces: OTLP-JSON files under {self.traces_dir} (no OTLP endpoint configured; `agent traces list`)"
        return f"traces: OTLP/{self.otlp.protocol} to {self.otlp.endpoint} (from {self.otlp.source})"


@dataclass(frozen=True, slots=True)
class ExportFlags:
    """The command-line side; ``None`` means "not given" so the environment decides."""

    endpoint: str | None = None
    protocol: str | None = None
    headers: Sequence[str] = field(default_factory=tuple)
    timeout_ms: int | None = None
    insecure: bool | None = None
    state_dir: str | None = None
    file_max_bytes: int | None = None
    files_keep: int | None = None
    queue_spans: int | None = None


def _env(env: Mapping[str, str], name: str) -> tuple[str | None, str]:
    """Signal-specific variable first, then the generic one; returns (value, variable name)."""
    specific = f"OTEL_EXPORTER_OTLP_TRACES_{name}"
    generic = f"OTEL_EXPORTER_OTLP_{name}"
    for var in (specific, generic):
        value = env.get(var, "").strip()
        if value:
            return value, var
    return None, ""


def parse_headers(text: str, *, source: str) -> list[tuple[str, str]]:
    """``k=v,k2=v2`` (values percent-encoded) as the OTel specification defines it."""
    out: list[tuple[str, str]] = []
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise errors.ConfigError(f"{source}: header {item.strip()!r} is not key=value")
        out.append((urllib.parse.unquote(key).lower(), urllib.parse.unquote(value.strip())))
    return out


def _parse_bool(text: str, *, source: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise errors.ConfigError(f"{source}: expected true or false, got {text!r}")


def _check_url(url: str, *, source: str) -> urllib.parse.SplitResult:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise errors.ConfigError(f"{source}: OTLP endpoint must be a URL like http://localhost:4317, got {url!r}")
    try:
        _ = parts.port
    except ValueError as exc:
        raise errors.ConfigError(f"{source}: bad port in {url!r}") from exc
    return parts


def _http_traces_url(base: str) -> str:
    """Base URL + ``v1/traces`` (the specification's rule for the generic endpoint)."""
    return base.rstrip("/") + "/" + HTTP_TRACES_PATH


def default_traces_dir(env: Mapping[str, str]) -> Path:
    state = env.get("MOESCOPE_STATE_DIR", "").strip()
    return (Path(state) if state else DEFAULT_STATE_DIR) / TRACES_SUBDIR


def resolve_export_config(flags: ExportFlags, env: Mapping[str, str] | None = None) -> ExportConfig:
    """Resolve flags over environment; ``ConfigError`` (exit 2) with one line on any bad value."""
    environ = os.environ if env is None else env

    protocol_text, protocol_var = (flags.protocol, "--otlp-protocol") if flags.protocol else _env(environ, "PROTOCOL")
    protocol = (protocol_text or DEFAULT_PROTOCOL).strip().lower()
    if protocol not in PROTOCOLS:
        raise errors.ConfigError(
            f"{protocol_var}: unsupported OTLP protocol {protocol_text!r} (use grpc or http/protobuf)"
        )

    if flags.endpoint:
        endpoint_text, endpoint_src, is_signal_url = flags.endpoint, "--otlp-endpoint", False
    else:
        specific = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
        generic = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
        if specific:
            endpoint_text, endpoint_src, is_signal_url = specific, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", True
        elif generic:
            endpoint_text, endpoint_src, is_signal_url = generic, "OTEL_EXPORTER_OTLP_ENDPOINT", False
        else:
            endpoint_text, endpoint_src, is_signal_url = "", "", False

    otlp: OtlpTarget | None = None
    if endpoint_text:
        parts = _check_url(endpoint_text, source=endpoint_src)
        if protocol == "grpc":
            endpoint = f"{parts.scheme}://{parts.netloc}"
        else:
            endpoint = endpoint_text if is_signal_url else _http_traces_url(endpoint_text)

        headers: list[tuple[str, str]] = []
        env_headers, headers_var = _env(environ, "HEADERS")
        if flags.headers:
            for item in flags.headers:
                headers.extend(parse_headers(item, source="--otlp-header"))
        elif env_headers:
            headers = parse_headers(env_headers, source=headers_var)

        if flags.timeout_ms is not None:
            timeout_ms, timeout_src = flags.timeout_ms, "--otlp-timeout-ms"
        else:
            env_timeout, timeout_var = _env(environ, "TIMEOUT")
            timeout_src = timeout_var
            try:
                timeout_ms = int(float(env_timeout)) if env_timeout else DEFAULT_TIMEOUT_MS
            except ValueError as exc:
                raise errors.ConfigError(f"{timeout_var}: timeout must be milliseconds, got {env_timeout!r}") from exc
        if timeout_ms <= 0:
            raise errors.ConfigError(f"{timeout_src}: timeout must be > 0 ms, got {timeout_ms}")

        if parts.scheme == "https":
            insecure = False
        elif flags.insecure is not None:
            insecure = flags.insecure
        else:
            env_insecure, insecure_var = _env(environ, "INSECURE")
            insecure = _parse_bool(env_insecure, source=insecure_var) if env_insecure else parts.scheme == "http"

        otlp = OtlpTarget(
            endpoint=endpoint,
            protocol=protocol,
            headers=tuple(headers),
            timeout_ms=timeout_ms,
            insecure=insecure,
            source=endpoint_src,
        )

    traces_dir = Path(flags.state_dir) / TRACES_SUBDIR if flags.state_dir else default_traces_dir(environ)
    config = ExportConfig(
        otlp=otlp,
        traces_dir=traces_dir,
        file_max_bytes=flags.file_max_bytes or DEFAULT_FILE_MAX_BYTES,
        files_keep=flags.files_keep or DEFAULT_FILES_KEEP,
        queue_spans=flags.queue_spans or DEFAULT_QUEUE_SPANS,
    )
    if config.file_max_bytes < 4096:
        raise errors.ConfigError(f"--trace-file-max-bytes must be >= 4096, got {config.file_max_bytes}")
    if config.files_keep < 1:
        raise errors.ConfigError(f"--trace-files-keep must be >= 1, got {config.files_keep}")
    if config.queue_spans < 1:
        raise errors.ConfigError(f"--export-queue-spans must be >= 1, got {config.queue_spans}")
    return config


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """Trace-export flags; each overrides its OTEL_EXPORTER_OTLP_* variable."""
    g = parser.add_argument_group("trace export (flags override OTEL_EXPORTER_OTLP_* variables)")
    g.add_argument("--otlp-endpoint", metavar="URL",
                   help="OTLP endpoint, e.g. http://localhost:4317 (grpc) or http://localhost:4318 (http/protobuf); "
                        "none: OTLP-JSON files under the state directory")
    g.add_argument("--otlp-protocol", choices=PROTOCOLS, help=f"OTLP protocol (default {DEFAULT_PROTOCOL})")
    g.add_argument("--otlp-header", action="append", default=[], metavar="KEY=VALUE",
                   help="header sent with every export (repeatable)")
    g.add_argument("--otlp-timeout-ms", type=int, metavar="MS", help=f"export timeout (default {DEFAULT_TIMEOUT_MS})")
    g.add_argument("--otlp-insecure", action=argparse.BooleanOptionalAction, default=None,
                   help="plaintext gRPC (default: true for http:// endpoints)")
    add_state_dir_argument(g)
    g.add_argument("--trace-file-max-bytes", type=int, metavar="BYTES",
                   help=f"rotate trace files at this size (default {DEFAULT_FILE_MAX_BYTES})")
    g.add_argument("--trace-files-keep", type=int, metavar="N",
                   help=f"keep this many trace files, oldest deleted (default {DEFAULT_FILES_KEEP})")
    g.add_argument(
        "--export-queue-spans",
        type=int,
        metavar="N",
        help=f"spans queued for export before new ones are dropped and counted (default {DEFAULT_QUEUE_SPANS})",
    )
    g.add_argument("--span-detail", choices=("layer", "expert"), default="layer",
                   help="layer (default): one moe.layer span per layer, its router, expert loads and FFNs as "
                        "array attributes (moe.layer.ffn.*); expert: a span for each of them too (~4x the spans, "
                        "more agent CPU)")
    g.add_argument("--trace-layer-spans-per-s", type=_layer_rate, default=None, metavar="N",
                   help="layer spans kept per second on average (default 100; 'all': every step's layers). "
                        "Every step gets its moe.step span; its layer subtree is kept when the step is slow "
                        "(>= the p99 of the last 10 s), then as this budget allows; the rest are counted "
                        "as sampled out (docs/traces-and-metrics.md, \"Sampling\")")


def _layer_rate(text: str) -> float:
    if text == "all":
        return float("inf")
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0 or 'all', got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number >= 0 or 'all', got {text!r}")
    return value


def add_state_dir_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument("--state-dir", metavar="DIR",
                        help=f"state directory; traces go to DIR/{TRACES_SUBDIR} "
                             f"(default $MOESCOPE_STATE_DIR or {DEFAULT_STATE_DIR})")


def flags_from_args(args: argparse.Namespace) -> ExportFlags:
    return ExportFlags(
        endpoint=getattr(args, "otlp_endpoint", None),
        protocol=getattr(args, "otlp_protocol", None),
        headers=tuple(getattr(args, "otlp_header", None) or ()),
        timeout_ms=getattr(args, "otlp_timeout_ms", None),
        insecure=getattr(args, "otlp_insecure", None),
        state_dir=getattr(args, "state_dir", None),
        file_max_bytes=getattr(args, "trace_file_max_bytes", None),
        files_keep=getattr(args, "trace_files_keep", None),
        queue_spans=getattr(args, "export_queue_spans", None),
    )
