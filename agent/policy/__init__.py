"""Policy engine: fixed-threshold rules over the pipeline's signals, actuating the runtime's control socket.

config.py loads and validates rules (TOML); rules.py holds the signal/action tables and the per-target
state machine; engine.py evaluates every sample period; actuator.py talks to the control socket off the
evaluation thread; audit.py records every decision; publish.py feeds the TUI, metrics and traces;
stats_source.py reads signals from the runtime's stats; wiring.py builds it from `agent start` options.
See docs/policy.md.
"""
