"""Overhead benchmarks: A/B alternating runs, medians, ratios, JSON under bench-results/."""
