/* Shared between netsig.bpf.c (kernel side) and loader.py (ctypes mirrors; a test checks sizes).
 * Plain fixed-width types only, explicit padding, so the layout is the same for clang -target bpf
 * and for gcc on the host. */
#ifndef MOESCOPE_NETSIG_H
#define MOESCOPE_NETSIG_H

#include <linux/types.h>

/* Key of the `counts` hash: one counter per (local port, kind). */
struct netsig_key {
	__u16 port; /* local port of the socket, host byte order */
	__u16 kind; /* NETSIG_K_* */
};

/* One retransmit or reset, sent through the ring buffer so it can be tied to a request span by
 * its connection (local and remote address and port) and its time. */
struct netsig_event {
	__u64 ts_ns;       /* CLOCK_MONOTONIC (bpf_ktime_get_ns), like the ingress probe's times */
	__u32 kind;        /* NETSIG_K_* */
	__u32 detail;      /* retransmit: TCP state; reset sent: enum sk_rst_reason; else 0 */
	__u16 family;      /* AF_INET or AF_INET6 */
	__u16 local_port;  /* host byte order */
	__u16 remote_port; /* host byte order */
	__u16 pad;
	__u8 local_addr[16];  /* IPv4 in the first 4 bytes, IPv6 in all 16; network byte order */
	__u8 remote_addr[16];
};

#define NETSIG_K_RETRANSMIT     1 /* tcp:tcp_retransmit_skb with err == 0 */
#define NETSIG_K_RESET_SENT     2 /* tcp:tcp_send_reset */
#define NETSIG_K_RESET_RECEIVED 3 /* tcp:tcp_receive_reset */
#define NETSIG_K_ESTABLISHED    4 /* sock:inet_sock_set_state TCP SYN_RECV -> ESTABLISHED */
#define NETSIG_K_SYNACK_RETRANSMIT 5 /* tcp:tcp_retransmit_synack (the handshake's reply resent) */
#define NETSIG_K_NR             6

/* Indexes of the per-CPU `drops` array: every loss is counted. */
#define NETSIG_DROP_COUNTS_FULL  0 /* `counts` hash full: a new (port, kind) could not be counted */
#define NETSIG_DROP_RINGBUF_FULL 1 /* ring buffer reservation failed: an event record lost (still counted) */
#define NETSIG_DROP_NR           2

/* The `ports` array has one slot per port number: 1 = a target's listening port. */
#define NETSIG_PORTS 65536

#endif /* MOESCOPE_NETSIG_H */
