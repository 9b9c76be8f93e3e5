"""Kernel-timed request ingress: eBPF syscall tracepoints on a target's accepted connections."""
