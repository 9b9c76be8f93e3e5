// SPDX-License-Identifier: Apache-2.0
/* moescope ingress probe: times every request a target process serves, from its own syscalls.
 *
 * A connection is an fd the target got from accept/accept4 (or one the loader seeded at attach).
 * A request is the first bytes read after the previous response, through the last write of its
 * response; it ends at the next read attempt on the connection or at close. One ingress_event per
 * request goes to a ring buffer without a wake-up; the agent drains it on a timer. Before that
 * record is reserved, the request is added to its target's aggregate (the per-CPU `stats` array:
 * count, bytes, unanswered, latency histogram), so the counts stay exact when the ring is full.
 *
 * Only syscall tracepoints are used (their argument layout comes from tracefs), so the program
 * compiles against the nearest distro headers. Every program filters on the target tgid first.
 *
 * Compile-time options (typed -D cflags from the loader): MAX_TARGETS, INGRESS_TARGET_SLOTS,
 * MAX_CONNS, MAX_INFLIGHT, RINGBUF_PAGES. Targets are added at run time (the targets/target_slots
 * maps), so one loaded program serves several --pid and a relaunched process can be added later.
 */
#include "ingress.h"

#define MS_AF_UNIX  1
#define MS_AF_INET  2
#define MS_AF_INET6 10

BPF_HASH(targets, u32, u32, MAX_TARGETS); // tgid -> its slot in `stats`
// Fast exact filter: slot (tgid mod INGRESS_TARGET_SLOTS) holds the target's tgid, 0, or
// INGRESS_TARGET_SHARED when two targets share it (then the hash decides). An array lookup is
// inlined by the verifier, so every other process on the machine pays almost nothing.
BPF_ARRAY(target_slots, u32, INGRESS_TARGET_SLOTS);
BPF_TABLE("lru_hash", struct ingress_conn_key, struct ingress_conn, conns, MAX_CONNS);
BPF_ARRAY(inflight, struct ingress_inflight, MAX_INFLIGHT); // MAX_INFLIGHT: a power of two
BPF_PERCPU_ARRAY(drops, u64, INGRESS_DROP_NR);
BPF_ARRAY(conn_count, u64, INGRESS_CC_NR);
BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
BPF_PERCPU_ARRAY(stats, struct ingress_stats, MAX_TARGETS);

static __always_inline int is_target(u32 tgid)
{
	int index = tgid & (INGRESS_TARGET_SLOTS - 1);
	u32 *slot = target_slots.lookup(&index);
	if (!slot || *slot == 0)
		return 0;
	if (*slot == tgid)
		return 1;
	return *slot == INGRESS_TARGET_SHARED && targets.lookup(&tgid) != NULL;
}

static __always_inline void count_drop(int index)
{
	u64 *value = drops.lookup(&index);
	if (value)
		*value += 1;
}

static __always_inline u64 conn_count_get(int index)
{
	u64 *value = conn_count.lookup(&index);
	return value ? *value : 0;
}

static __always_inline void conn_count_add(int index)
{
	u64 *value = conn_count.lookup(&index);
	if (value)
		__sync_fetch_and_add(value, 1);
}

/* The in-flight slot of thread `tid`; NULL only if the verifier's bounds say so. */
static __always_inline struct ingress_inflight *inflight_slot(u32 tid)
{
	int index = tid & (MAX_INFLIGHT - 1);
	return inflight.lookup(&index);
}

static __always_inline void inflight_put(u32 tgid, u32 tid, s32 fd, u32 kind, u64 enter_ns, u64 sockaddr_ptr)
{
	struct ingress_inflight *slot = inflight_slot(tid);
	if (!slot)
		return;
	if (slot->kind && slot->tid != tid)
		count_drop(INGRESS_DROP_INFLIGHT_FULL); // two live threads share a slot: one syscall lost
	slot->enter_ns = enter_ns;
	slot->sockaddr_ptr = sockaddr_ptr;
	slot->fd = fd;
	slot->tgid = tgid;
	slot->tid = tid;
	slot->kind = kind;
}

/* floor(log2(v)) for v > 0, without a loop. */
static __always_inline u32 log2_u64(u64 v)
{
	u32 r = 0;
	if (v >> 32) { v >>= 32; r += 32; }
	if (v >> 16) { v >>= 16; r += 16; }
	if (v >> 8) { v >>= 8; r += 8; }
	if (v >> 4) { v >>= 4; r += 4; }
	if (v >> 2) { v >>= 2; r += 2; }
	if (v >> 1) { r += 1; }
	return r;
}

/* The log-linear bucket of a latency (ingress.h; aggregate.py mirrors it). */
static __always_inline u32 latency_bucket(u64 ns)
{
	if (ns < (1ULL << INGRESS_LAT_MIN_SHIFT))
		return 0;
	u32 msb = log2_u64(ns);
	if (msb >= INGRESS_LAT_MAX_SHIFT)
		return INGRESS_LAT_BUCKETS - 1;
	u32 sub = (ns >> (msb - INGRESS_LAT_SUB_BITS)) & (INGRESS_LAT_SUB - 1);
	return 1 + (msb - INGRESS_LAT_MIN_SHIFT) * INGRESS_LAT_SUB + sub;
}

/* Count one completed request in its target's slot (per CPU: no atomics, no shared line). */
static __always_inline void account(struct ingress_conn *c, u32 tgid, u64 end_ns, u32 flags)
{
	u32 *slot = targets.lookup(&tgid);
	if (!slot)
		return; // removed meanwhile: the loader has read its final counts
	int index = *slot;
	struct ingress_stats *s = stats.lookup(&index);
	if (!s)
		return;
	s->requests += 1;
	s->bytes_in += c->bytes_in;
	s->bytes_out += c->bytes_out;
	if (flags & INGRESS_F_NO_RESPONSE) {
		s->unanswered += 1;
		return;
	}
	u64 latency = end_ns > c->start_ns ? end_ns - c->start_ns : 0;
	s->latency_sum_ns += latency;
	u32 bucket = latency_bucket(latency);
	if (bucket < INGRESS_LAT_BUCKETS)
		s->latency[bucket] += 1;
}

static __always_inline void emit(struct ingress_conn *c, struct ingress_conn_key *key, u64 end_ns,
				 u32 flags)
{
	// seq advances even when the record is lost, so gaps in seq show where.
	c->seq += 1;
	account(c, key->tgid, end_ns, flags); // first: the aggregate never depends on ring space
	struct ingress_event *e = events.ringbuf_reserve(sizeof(struct ingress_event));
	if (!e) {
		count_drop(INGRESS_DROP_RINGBUF_FULL);
		return;
	}
	e->start_ns = c->start_ns;
	e->last_read_ns = c->last_read_ns;
	e->first_response_ns = c->first_response_ns;
	e->end_ns = end_ns;
	e->bytes_in = c->bytes_in;
	e->bytes_out = c->bytes_out;
	e->generation = c->generation;
	e->tgid = key->tgid;
	e->tid = c->tid;
	e->fd = key->fd;
	e->seq = c->seq;
	e->family = c->family;
	e->peer_port = c->peer_port;
	e->flags = flags | (c->flags & INGRESS_F_SEEDED);
	__builtin_memcpy(e->peer_addr, c->peer_addr, sizeof(e->peer_addr));
	events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
}

static __always_inline void reset_request(struct ingress_conn *c)
{
	c->start_ns = 0;
	c->last_read_ns = 0;
	c->first_response_ns = 0;
	c->last_write_ns = 0;
	c->bytes_in = 0;
	c->bytes_out = 0;
}

/* ---- accept / accept4: learn connections and their peers ------------------------------------ */

static __always_inline int accept_enter(u64 sockaddr_ptr)
{
	u64 id = bpf_get_current_pid_tgid();
	u32 tgid = id >> 32;
	if (!is_target(tgid))
		return 0;
	inflight_put(tgid, (u32)id, -1, INGRESS_K_ACCEPT, bpf_ktime_get_ns(), sockaddr_ptr);
	return 0;
}

static __always_inline int accept_exit(long ret)
{
	u64 id = bpf_get_current_pid_tgid();
	u32 tgid = id >> 32;
	if (!is_target(tgid))
		return 0;
	struct ingress_inflight *fp = inflight_slot((u32)id);
	if (!fp || !fp->kind || fp->tid != (u32)id)
		return 0;
	u64 sockaddr_ptr = fp->sockaddr_ptr;
	u32 kind = fp->kind;
	fp->kind = 0;
	if (kind != INGRESS_K_ACCEPT || ret < 0)
		return 0;

	struct ingress_conn c = {};
	int gen_index = INGRESS_CC_GENERATION;
	u64 *gen = conn_count.lookup(&gen_index);
	if (gen)
		c.generation = __sync_fetch_and_add(gen, 1) + 1;
	if (sockaddr_ptr) {
		u16 family = 0;
		u16 port_be = 0;
		bpf_probe_read_user(&family, sizeof(family), (void *)sockaddr_ptr);
		bpf_probe_read_user(&port_be, sizeof(port_be), (void *)(sockaddr_ptr + 2));
		if (family == MS_AF_INET) {
			bpf_probe_read_user(c.peer_addr, 4, (void *)(sockaddr_ptr + 4));
			c.peer_port = (port_be >> 8) | ((port_be & 0xff) << 8);
		} else if (family == MS_AF_INET6) {
			bpf_probe_read_user(c.peer_addr, 16, (void *)(sockaddr_ptr + 8));
			c.peer_port = (port_be >> 8) | ((port_be & 0xff) << 8);
		}
		c.family = family;
	}

	struct ingress_conn_key key = {};
	key.tgid = tgid;
	key.fd = (s32)ret;
	if (c.family == MS_AF_UNIX) {
		// UNIX-domain peers (a control socket, local IPC) are not HTTP ingress: never a request.
		if (conns.delete(&key) == 0)
			conn_count_add(INGRESS_CC_KERNEL_DELETES);
		return 0;
	}
	if (!conns.lookup(&key)) {
		// A new key: when the table is already full, the LRU evicts a live entry to make room.
		u64 live = conn_count_get(INGRESS_CC_KERNEL_INSERTS) + conn_count_get(INGRESS_CC_USER_INSERTS) -
			   conn_count_get(INGRESS_CC_KERNEL_DELETES) - conn_count_get(INGRESS_CC_USER_DELETES);
		if (live >= MAX_CONNS)
			count_drop(INGRESS_DROP_CONN_EVICTED);
		else
			conn_count_add(INGRESS_CC_KERNEL_INSERTS);
	}
	conns.update(&key, &c);
	return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_accept)
{
	return accept_enter((u64)args->upeer_sockaddr);
}

TRACEPOINT_PROBE(syscalls, sys_exit_accept)
{
	return accept_exit(args->ret);
}

TRACEPOINT_PROBE(syscalls, sys_enter_accept4)
{
	return accept_enter((u64)args->upeer_sockaddr);
}

TRACEPOINT_PROBE(syscalls, sys_exit_accept4)
{
	return accept_exit(args->ret);
}

/* ---- reads and writes on tracked connections ------------------------------------------------ */

static __always_inline int rw_enter(s32 fd, u32 kind)
{
	u64 id = bpf_get_current_pid_tgid();
	u32 tgid = id >> 32;
	if (!is_target(tgid))
		return 0;
	struct ingress_conn_key key = {};
	key.tgid = tgid;
	key.fd = fd;
	struct ingress_conn *c = conns.lookup(&key);
	if (!c)
		return 0; // files, pipes, stdout, outbound sockets: not requests
	u64 enter_ns = 0;
	if (kind == INGRESS_K_READ) {
		if (c->start_ns && c->bytes_out) {
			// The server reads again after responding: the previous request is complete.
			emit(c, &key, c->last_write_ns, 0);
			reset_request(c);
		}
	} else if (c->start_ns && !c->first_response_ns) {
		enter_ns = bpf_ktime_get_ns(); // only the first write of a response needs its time
	}
	inflight_put(tgid, (u32)id, fd, kind, enter_ns, 0);
	return 0;
}

static __always_inline int rw_exit(long ret)
{
	u64 id = bpf_get_current_pid_tgid();
	u32 tgid = id >> 32;
	if (!is_target(tgid))
		return 0;
	struct ingress_inflight *fp = inflight_slot((u32)id);
	if (!fp || !fp->kind || fp->tid != (u32)id)
		return 0;
	u64 enter_ns = fp->enter_ns;
	s32 fd = fp->fd;
	u32 kind = fp->kind;
	fp->kind = 0;
	if (ret <= 0 || kind == INGRESS_K_ACCEPT)
		return 0; // EOF, EAGAIN and errors carry no bytes
	struct ingress_conn_key key = {};
	key.tgid = tgid;
	key.fd = fd;
	struct ingress_conn *c = conns.lookup(&key);
	if (!c)
		return 0;
	if (kind == INGRESS_K_READ) {
		u64 now_ns = bpf_ktime_get_ns();
		if (c->start_ns == 0) {
			reset_request(c);
			c->start_ns = now_ns;
			c->tid = (u32)id;
		}
		// The request's last bytes in: receive ends here (agent/request_phases.py). A read after
		// the response began starts the next request in rw_enter, so this guard only documents it.
		if (c->first_response_ns == 0)
			c->last_read_ns = now_ns;
		c->bytes_in += ret;
	} else {
		if (c->start_ns == 0)
			return 0; // bytes written before any request (a greeting) belong to no request
		if (c->first_response_ns == 0)
			c->first_response_ns = enter_ns ? enter_ns : bpf_ktime_get_ns();
		c->bytes_out += ret;
		c->last_write_ns = bpf_ktime_get_ns();
	}
	return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_read)
{
	return rw_enter((s32)args->fd, INGRESS_K_READ);
}

TRACEPOINT_PROBE(syscalls, sys_exit_read)
{
	return rw_exit(args->ret);
}

TRACEPOINT_PROBE(syscalls, sys_enter_readv)
{
	return rw_enter((s32)args->fd, INGRESS_K_READ);
}

TRACEPOINT_PROBE(syscalls, sys_exit_readv)
{
	return rw_exit(args->ret);
}

TRACEPOINT_PROBE(syscalls, sys_enter_recvfrom)
{
	return rw_enter((s32)args->fd, INGRESS_K_READ);
}

TRACEPOINT_PROBE(syscalls, sys_exit_recvfrom)
{
	return rw_exit(args->ret);
}

TRACEPOINT_PROBE(syscalls, sys_enter_recvmsg)
{
	return rw_enter((s32)args->fd, INGRESS_K_READ);
}

TRACEPOINT_PROBE(syscalls, sys_exit_recvmsg)
{
	return rw_exit(args->ret);
}

TRACEPOINT_PROBE(syscalls, sys_enter_write)
{
	return rw_enter((s32)args->fd, INGRESS_K_WRITE);
}

TRACEPOINT_PROBE(syscalls, sys_exit_write)
{
	return rw_exit(args->ret);
}

TRACEPOINT_PROBE(syscalls, sys_enter_writev)
{
	return rw_enter((s32)args->fd, INGRESS_K_WRITE);
}

TRACEPOINT_PROBE(syscalls, sys_exit_writev)
{
	return rw_exit(args->ret);
}

TRACEPOINT_PROBE(syscalls, sys_enter_sendto)
{
	return rw_enter((s32)args->fd, INGRESS_K_WRITE);
}

TRACEPOINT_PROBE(syscalls, sys_exit_sendto)
{
	return rw_exit(args->ret);
}

TRACEPOINT_PROBE(syscalls, sys_enter_sendmsg)
{
	return rw_enter((s32)args->fd, INGRESS_K_WRITE);
}

TRACEPOINT_PROBE(syscalls, sys_exit_sendmsg)
{
	return rw_exit(args->ret);
}

/* ---- close: the open request ends, the connection is forgotten ------------------------------ */

TRACEPOINT_PROBE(syscalls, sys_enter_close)
{
	u64 id = bpf_get_current_pid_tgid();
	u32 tgid = id >> 32;
	if (!is_target(tgid))
		return 0;
	struct ingress_conn_key key = {};
	key.tgid = tgid;
	key.fd = (s32)args->fd;
	struct ingress_conn *c = conns.lookup(&key);
	if (!c)
		return 0;
	if (c->start_ns) {
		if (c->bytes_out)
			emit(c, &key, c->last_write_ns, 0);
		else
			emit(c, &key, bpf_ktime_get_ns(), INGRESS_F_NO_RESPONSE);
	}
	if (conns.delete(&key) == 0)
		conn_count_add(INGRESS_CC_KERNEL_DELETES);
	return 0;
}
