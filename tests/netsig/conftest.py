"""Fixtures for the netsig tests (defined in netsig_harness.py, which the tests also import)."""

from netsig_harness import netns, probe  # noqa: F401  (pytest fixtures)
