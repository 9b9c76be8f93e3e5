/* Shared between ingress.bpf.c (kernel side) and loader.py (ctypes mirrors; a test checks sizes).
 * Plain fixed-width types only, explicit padding, so the layout is the same for clang -target bpf
 * and for gcc on the host. */
#ifndef MOESCOPE_INGRESS_H
#define MOESCOPE_INGRESS_H

#include <linux/types.h>

/* One completed request, sent through the ring buffer. */
struct ingress_event {
	__u64 start_ns;          /* CLOCK_MONOTONIC: return of the first read of the request */
	__u64 last_read_ns;      /* return of its last read before the first response byte */
	__u64 first_response_ns; /* entry of the first write of the response (0: none) */
	__u64 end_ns;            /* return of the last write of the response (close time if none) */
	__u64 bytes_in;          /* bytes read for this request */
	__u64 bytes_out;         /* bytes written for its response */
	__u64 generation;        /* connection identity on {tgid, fd}; 0 = opened before attach */
	__u32 tgid;
	__u32 tid;               /* thread that read the request's first bytes */
	__s32 fd;
	__u32 seq;               /* 1-based index of this request on its connection */
	__u16 family;            /* AF_INET, AF_INET6, AF_UNIX, or 0 when unknown */
	__u16 peer_port;         /* host byte order; 0 when unknown */
	__u32 flags;             /* INGRESS_F_* */
	__u8 peer_addr[16];      /* IPv4 in the first 4 bytes, IPv6 in all 16; network byte order */
};

#define INGRESS_F_NO_RESPONSE 0x1 /* the connection closed before any response byte */
#define INGRESS_F_SEEDED      0x2 /* connection learned from /proc at attach, not from accept */
#define INGRESS_F_FLUSHED     0x4 /* emitted by the loader at target exit / agent stop */

/* Per-connection state, LRU hash keyed by {tgid, fd}. */
struct ingress_conn_key {
	__u32 tgid;
	__s32 fd;
};

struct ingress_conn {
	__u64 generation;
	__u64 start_ns;          /* 0: no request open */
	__u64 last_read_ns;      /* latest read of the open request while no response byte was written */
	__u64 first_response_ns;
	__u64 last_write_ns;
	__u64 bytes_in;
	__u64 bytes_out;
	__u32 tid;
	__u32 seq;               /* requests completed on this connection */
	__u16 family;
	__u16 peer_port;
	__u32 flags;
	__u8 peer_addr[16];
};

/* A traced syscall between its enter and exit tracepoints. An array slot per thread (index
 * tid & (MAX_INFLIGHT - 1)): no insert or delete on the hot path, just a tid check. */
struct ingress_inflight {
	__u64 enter_ns;
	__u64 sockaddr_ptr;      /* accept: user pointer to the peer sockaddr (0: none) */
	__s32 fd;
	__u32 kind;              /* INGRESS_K_*; 0 = slot free */
	__u32 tgid;
	__u32 tid;
};

#define INGRESS_K_ACCEPT 1
#define INGRESS_K_READ   2
#define INGRESS_K_WRITE  3

/* Indexes of the per-CPU `drops` array: every loss is counted. */
#define INGRESS_DROP_RINGBUF_FULL  0 /* ring buffer reservation failed: record lost */
#define INGRESS_DROP_CONN_EVICTED  1 /* connection table full: an entry was evicted (LRU) */
#define INGRESS_DROP_INFLIGHT_FULL 2 /* another thread held this thread's in-flight slot: its syscall lost */
#define INGRESS_DROP_NR            3

/* Indexes of the `conn_count` array, kept to know when the LRU table is full. Kernel and loader
 * each write only their own slots, so no slot has two writers. */
#define INGRESS_CC_KERNEL_INSERTS 0
#define INGRESS_CC_KERNEL_DELETES 1
#define INGRESS_CC_USER_INSERTS   2
#define INGRESS_CC_USER_DELETES   3
#define INGRESS_CC_GENERATION     4 /* last connection generation handed out by accept */
#define INGRESS_CC_NR             5

/* Per-target aggregate, one slot per target in the per-CPU `stats` array (the `targets` hash maps
 * a tgid to its slot). Updated at every request's completion before its ring record is reserved,
 * so a full ring never loses a count. The latency histogram is log-linear over ns: bucket 0 holds
 * everything below 2^INGRESS_LAT_MIN_SHIFT ns (1.024 us); then INGRESS_LAT_SUB linear sub-buckets
 * per power of two up to 2^INGRESS_LAT_MAX_SHIFT ns (137 s); the last bucket also holds anything
 * longer. A value's bucket is at most 1/16 of its lower bound wide (probes/ingress/aggregate.py). */
#define INGRESS_LAT_SUB_BITS  4
#define INGRESS_LAT_SUB       (1 << INGRESS_LAT_SUB_BITS)
#define INGRESS_LAT_MIN_SHIFT 10
#define INGRESS_LAT_MAX_SHIFT 37
#define INGRESS_LAT_BUCKETS   (1 + (INGRESS_LAT_MAX_SHIFT - INGRESS_LAT_MIN_SHIFT) * INGRESS_LAT_SUB)

struct ingress_stats {
	__u64 requests;          /* completed requests, answered or not */
	__u64 unanswered;        /* of them: closed before any response byte (INGRESS_F_NO_RESPONSE) */
	__u64 bytes_in;          /* request bytes read */
	__u64 bytes_out;         /* response bytes written */
	__u64 latency_sum_ns;    /* sum of end_ns - start_ns over answered requests */
	__u64 latency[INGRESS_LAT_BUCKETS]; /* answered requests by end_ns - start_ns */
};

/* Slots of the `target_slots` filter array (a power of two), and the value of a shared slot. */
#ifndef INGRESS_TARGET_SLOTS
#define INGRESS_TARGET_SLOTS  16384 /* the loader passes its option as -DINGRESS_TARGET_SLOTS */
#endif
#define INGRESS_TARGET_SHARED 0xFFFFFFFFu

#endif /* MOESCOPE_INGRESS_H */
