// SPDX-License-Identifier: Apache-2.0
/* moescope netsig probe: kernel network signals on the target's listening ports.
 *
 * TCP retransmits (data and SYN-ACK), resets sent and received, and completed handshakes fire in softirq or timer
 * context, not in the target's syscalls, so they are attributed by the socket's local port: the
 * loader writes the target's listening ports into `ports`, and an event counts only when its
 * local port is there. Counts go to the `counts` hash per (port, kind), exact at any rate;
 * retransmits and resets also go to a small ring buffer as events carrying the connection
 * (addresses, ports) and the time, so the agent can tie one to a request span.
 *
 * Only stable tcp:/sock: tracepoints are used; their argument layout comes from tracefs at run
 * time (bcc's TRACEPOINT_PROBE), so no kernel-internal struct is read.
 *
 * Compile-time options (typed -D cflags from the loader): MAX_COUNTS, RINGBUF_PAGES.
 */
#include "netsig.h"

#define MS_AF_INET        2
#define MS_AF_INET6       10
#define MS_IPPROTO_TCP    6
#define MS_TCP_ESTABLISHED 1
#define MS_TCP_SYN_RECV   3

BPF_ARRAY(ports, u32, NETSIG_PORTS); // indexed by port: an array lookup is inlined by the verifier
BPF_HASH(counts, struct netsig_key, u64, MAX_COUNTS);
BPF_PERCPU_ARRAY(drops, u64, NETSIG_DROP_NR);
BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);

static __always_inline int watched(u16 port)
{
	int index = port;
	u32 *on = ports.lookup(&index);
	return on && *on;
}

static __always_inline void count_drop(int index)
{
	u64 *value = drops.lookup(&index);
	if (value)
		*value += 1;
}

static __always_inline void count(u16 port, u32 kind)
{
	struct netsig_key key = {};
	key.port = port;
	key.kind = kind;
	u64 *value = counts.lookup(&key);
	if (!value) {
		u64 zero = 0;
		counts.insert(&key, &zero); // fails when full, or when another CPU inserted it first
		value = counts.lookup(&key);
		if (!value) {
			count_drop(NETSIG_DROP_COUNTS_FULL);
			return;
		}
	}
	__sync_fetch_and_add(value, 1);
}

/* Reserve an event for a counted signal; NULL (and counted) when the ring is full. */
static __always_inline struct netsig_event *event_start(u32 kind, u32 detail, u16 family, u16 local_port,
							u16 remote_port)
{
	struct netsig_event *e = events.ringbuf_reserve(sizeof(struct netsig_event));
	if (!e) {
		count_drop(NETSIG_DROP_RINGBUF_FULL);
		return NULL;
	}
	e->ts_ns = bpf_ktime_get_ns();
	e->kind = kind;
	e->detail = detail;
	e->family = family;
	e->local_port = local_port;
	e->remote_port = remote_port;
	e->pad = 0;
	__builtin_memset(e->local_addr, 0, sizeof(e->local_addr));
	__builtin_memset(e->remote_addr, 0, sizeof(e->remote_addr));
	return e;
}

/* The tcp: tracepoints that carry saddr[4]/daddr[4] and saddr_v6[16]/daddr_v6[16] from the socket:
 * local is s*, remote is d*. */
static __always_inline void copy_addrs(struct netsig_event *e, u16 family, const u8 *saddr, const u8 *daddr,
				       const u8 *saddr_v6, const u8 *daddr_v6)
{
	if (family == MS_AF_INET) {
		bpf_probe_read_kernel(e->local_addr, 4, saddr);
		bpf_probe_read_kernel(e->remote_addr, 4, daddr);
	} else {
		bpf_probe_read_kernel(e->local_addr, 16, saddr_v6);
		bpf_probe_read_kernel(e->remote_addr, 16, daddr_v6);
	}
}

TRACEPOINT_PROBE(tcp, tcp_retransmit_skb)
{
	u16 sport = args->sport;
	if (!watched(sport) || args->err != 0)
		return 0; // a failed retransmit (err != 0) sent nothing
	count(sport, NETSIG_K_RETRANSMIT);
	struct netsig_event *e = event_start(NETSIG_K_RETRANSMIT, (u32)args->state, args->family, sport, args->dport);
	if (!e)
		return 0;
	copy_addrs(e, args->family, args->saddr, args->daddr, args->saddr_v6, args->daddr_v6);
	events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
	return 0;
}

TRACEPOINT_PROBE(tcp, tcp_retransmit_synack)
{
	u16 sport = args->sport;
	if (watched(sport))
		count(sport, NETSIG_K_SYNACK_RETRANSMIT); // counted only: no connection (no request) yet
	return 0;
}

TRACEPOINT_PROBE(tcp, tcp_receive_reset)
{
	u16 sport = args->sport;
	if (!watched(sport))
		return 0;
	count(sport, NETSIG_K_RESET_RECEIVED);
	struct netsig_event *e = event_start(NETSIG_K_RESET_RECEIVED, 0, args->family, sport, args->dport);
	if (!e)
		return 0;
	copy_addrs(e, args->family, args->saddr, args->daddr, args->saddr_v6, args->daddr_v6);
	events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
	return 0;
}

/* bcc declares tcp_send_reset's arguments from tracefs, where `reason` is an `enum sk_rst_reason`
 * (4 bytes in the format); the enum's values are not needed here, only a complete type. */
enum sk_rst_reason { MS_SK_RST_REASON_ANY = 0 };

/* tcp_send_reset carries the addresses as two 28-byte sockaddr_in / sockaddr_in6 blobs, local
 * first (the kernel swaps the incoming segment's tuple when there is no socket). */
struct ms_sockaddr_blob {
	u8 bytes[28];
};

static __always_inline u16 blob_port(const struct ms_sockaddr_blob *blob)
{
	return ((u16)blob->bytes[2] << 8) | blob->bytes[3]; // sin_port / sin6_port: network byte order
}

TRACEPOINT_PROBE(tcp, tcp_send_reset)
{
	struct ms_sockaddr_blob local = {};
	struct ms_sockaddr_blob remote = {};
	bpf_probe_read_kernel(&local, sizeof(local), args->saddr);
	u16 family = (u16)local.bytes[0] | ((u16)local.bytes[1] << 8); // sa_family: host (little) endian
	u16 sport = blob_port(&local);
	if ((family != MS_AF_INET && family != MS_AF_INET6) || !watched(sport))
		return 0;
	bpf_probe_read_kernel(&remote, sizeof(remote), args->daddr);
	count(sport, NETSIG_K_RESET_SENT);
	struct netsig_event *e = event_start(NETSIG_K_RESET_SENT, (u32)args->reason, family, sport, blob_port(&remote));
	if (!e)
		return 0;
	if (family == MS_AF_INET) {
		__builtin_memcpy(e->local_addr, &local.bytes[4], 4);
		__builtin_memcpy(e->remote_addr, &remote.bytes[4], 4);
	} else {
		__builtin_memcpy(e->local_addr, &local.bytes[8], 16);
		__builtin_memcpy(e->remote_addr, &remote.bytes[8], 16);
	}
	events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
	return 0;
}

TRACEPOINT_PROBE(sock, inet_sock_set_state)
{
	if (args->protocol != MS_IPPROTO_TCP || args->oldstate != MS_TCP_SYN_RECV ||
	    args->newstate != MS_TCP_ESTABLISHED)
		return 0;
	u16 sport = args->sport;
	if (watched(sport))
		count(sport, NETSIG_K_ESTABLISHED); // counted only: one per connection needs no event
	return 0;
}
