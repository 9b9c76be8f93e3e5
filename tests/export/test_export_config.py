"""Flags > OTEL_EXPORTER_OTLP_TRACES_* > OTEL_EXPORTER_OTLP_* > file default; bad values are one-line errors."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TypedDict, Unpack

import pytest

from moescope import errors
from moescope.agent.export import (
    ExportConfig,
    ExportFlags,
    add_export_arguments,
    flags_from_args,
    resolve_export_config,
)


class FlagValues(TypedDict, total=False):
    """ExportFlags' fields, to pass as keyword arguments."""

    endpoint: str | None
    protocol: str | None
    headers: Sequence[str]
    timeout_ms: int | None
    insecure: bool | None
    state_dir: str | None
    file_max_bytes: int | None
    files_keep: int | None
    queue_spans: int | None


def resolve(env: dict[str, str], **flags: Unpack[FlagValues]) -> ExportConfig:
    return resolve_export_config(ExportFlags(**flags), env=env)


def test_no_endpoint_means_file_default_under_state_dir() -> None:
    assert resolve({}).otlp is None
    assert resolve({}).traces_dir == Path("/var/lib/moescope/traces")
    assert resolve({"MOESCOPE_STATE_DIR": "/srv/m"}).traces_dir == Path("/srv/m/traces")
    assert resolve({"MOESCOPE_STATE_DIR": "/srv/m"}, state_dir="/x").traces_dir == Path("/x/traces")


def test_grpc_endpoint_and_insecure() -> None:
    cfg = resolve({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4317"})
    assert cfg.otlp is not None
    assert (cfg.otlp.endpoint, cfg.otlp.protocol, cfg.otlp.insecure) == ("http://jaeger:4317", "grpc", True)
    assert cfg.otlp.source == "OTEL_EXPORTER_OTLP_ENDPOINT"
    tls = resolve({"OTEL_EXPORTER_OTLP_ENDPOINT": "https://jaeger:4317", "OTEL_EXPORTER_OTLP_INSECURE": "true"})
    assert tls.otlp is not None and tls.otlp.insecure is False  # https always means TLS
    forced = resolve({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://j:4317", "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "false"})
    assert forced.otlp is not None and forced.otlp.insecure is False


def test_signal_specific_beats_generic_and_flags_beat_both() -> None:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://generic:4318",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://specific:4318/custom/traces",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "2500",
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "700",
        "OTEL_EXPORTER_OTLP_HEADERS": "a=1",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "b=2, c = x%3Dy ",
    }
    cfg = resolve(env)
    assert cfg.otlp is not None
    assert cfg.otlp.endpoint == "http://specific:4318/custom/traces"  # signal URL used as is
    assert cfg.otlp.timeout_ms == 700
    assert cfg.otlp.headers == (("b", "2"), ("c", "x=y"))
    flagged = resolve(env, endpoint="http://flag:9999/base/", protocol="http/protobuf", timeout_ms=42,
                      headers=("k=v",))
    assert flagged.otlp is not None
    assert flagged.otlp.endpoint == "http://flag:9999/base/v1/traces"  # base URL: v1/traces appended
    assert (flagged.otlp.timeout_ms, flagged.otlp.headers, flagged.otlp.source) == (
        42,
        (("k", "v"),),
        "--otlp-endpoint",
    )
    generic_http = resolve(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://g:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    )
    assert generic_http.otlp is not None and generic_http.otlp.endpoint == "http://g:4318/v1/traces"
    grpc_flag = resolve(env, endpoint="http://flag:4317", protocol="grpc")
    assert grpc_flag.otlp is not None and grpc_flag.otlp.endpoint == "http://flag:4317"


@pytest.mark.parametrize(
    ("env", "flags", "message"),
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "localhost:4317"}, {}, "must be a URL"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, {},
         "unsupported OTLP protocol"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4317", "OTEL_EXPORTER_OTLP_TIMEOUT": "soon"}, {}, "milliseconds"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4317", "OTEL_EXPORTER_OTLP_HEADERS": "novalue"}, {}, "key=value"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4317", "OTEL_EXPORTER_OTLP_INSECURE": "maybe"}, {},
         "true or false"),
        ({}, {"endpoint": "http://h:99999"}, "bad port"),
        ({}, {"endpoint": "http://h:1", "timeout_ms": 0}, "> 0 ms"),
        ({}, {"queue_spans": -1}, "--export-queue-spans"),
    ],
)
def test_bad_values_are_config_errors(env: dict[str, str], flags: FlagValues, message: str) -> None:
    with pytest.raises(errors.ConfigError, match=message) as info:
        resolve(env, **flags)
    assert info.value.exit_code == errors.EXIT_USAGE
    assert "\n" not in str(info.value)


def test_argparse_flags_round_trip() -> None:
    parser = argparse.ArgumentParser()
    add_export_arguments(parser)
    args = parser.parse_args([
        "--otlp-endpoint", "http://h:4318", "--otlp-protocol", "http/protobuf", "--otlp-header", "a=b",
        "--otlp-header", "c=d", "--otlp-timeout-ms", "900", "--no-otlp-insecure", "--state-dir", "/s",
    ])
    cfg = resolve_export_config(flags_from_args(args), env={"OTEL_EXPORTER_OTLP_HEADERS": "z=1"})
    assert cfg.otlp is not None
    assert cfg.otlp.endpoint == "http://h:4318/v1/traces"
    assert cfg.otlp.headers == (("a", "b"), ("c", "d"))
    assert cfg.otlp.timeout_ms == 900 and cfg.otlp.insecure is False
    assert cfg.traces_dir == Path("/s/traces")
    assert resolve_export_config(flags_from_args(parser.parse_args([])), env={}).otlp is None
