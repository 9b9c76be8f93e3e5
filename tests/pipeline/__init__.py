"""Tests for agent/pipeline.py (a package so its module names cannot clash with other test folders)."""
