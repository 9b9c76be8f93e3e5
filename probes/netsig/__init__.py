"""Kernel network signals of a target's listening ports: TCP retransmits, resets, handshakes."""
