"""IngressProbe.health(): the last drain of the real eBPF ring, timed (needs BPF)."""

from __future__ import annotations

from collections.abc import Callable

from ingress_harness import HttpClient, Server, Tracer

from moescope.collectors.registry import SourceHealth


def test_health_is_the_last_drain(tracer: Tracer, start_server: Callable[..., Server]) -> None:
    assert tracer.probe.health() == SourceHealth()  # loaded, never polled
    server = start_server("threaded")
    tracer.probe.add_target(server.pid)
    HttpClient(server.port).request(path="/size/10")
    tracer.wait_count(server.pid, 1)  # polls until the request's record is drained
    health = tracer.probe.health()
    assert health.last_success is True and health.last_error is None
    assert health.last_duration_ns is not None and health.last_duration_ns > 0
