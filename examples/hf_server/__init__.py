"""Serve any transformers MoE causal LM with the reference runtime's HTTP API, batching, request-key
convention and control socket, observed by `moescope.instrument()`: docs/transformers.md."""
