"""Fixtures for the ingress tests (defined in ingress_harness.py, which the tests also import)."""

from ingress_harness import c_pair, run_agent, start_server, tracer  # noqa: F401  (pytest fixtures)
