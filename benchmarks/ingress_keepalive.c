/* Keep-alive HTTP/1.1 microbenchmark pair for benchmarks/ingress_overhead.py.
 *   ingress_keepalive server            listen on 127.0.0.1 (ephemeral), print the port, answer
 *                                       every read with one fixed response, one connection at a time
 *   ingress_keepalive client PORT N     N requests on one connection; prints the elapsed
 *                                       CLOCK_MONOTONIC ns and the client's own CPU ns
 * Written in C so the per-request cost is ~10 us and the probe's added ns are measurable. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static const char REQUEST[] = "GET / HTTP/1.1\r\nHost: bench\r\n\r\n";
static const char RESPONSE[] = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";

static int serve(void)
{
	int listener = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in addr = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	socklen_t len = sizeof(addr);
	if (listener < 0 || bind(listener, (struct sockaddr *)&addr, sizeof(addr)) || listen(listener, 16) ||
	    getsockname(listener, (struct sockaddr *)&addr, &len)) {
		perror("server");
		return 1;
	}
	printf("PORT %d\n", ntohs(addr.sin_port));
	fflush(stdout);
	char buf[4096];
	for (;;) {
		struct sockaddr_in peer;
		socklen_t peer_len = sizeof(peer);
		int fd = accept(listener, (struct sockaddr *)&peer, &peer_len);
		if (fd < 0)
			continue;
		for (;;) {
			ssize_t n = read(fd, buf, sizeof(buf));
			if (n <= 0)
				break;
			if (write(fd, RESPONSE, sizeof(RESPONSE) - 1) < 0)
				break;
		}
		close(fd);
	}
}

static long long clock_ns(clockid_t clock)
{
	struct timespec ts;
	clock_gettime(clock, &ts);
	return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int client(int port, long requests)
{
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	int one = 1;
	struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof(addr))) {
		perror("client");
		return 1;
	}
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	char buf[4096];
	long long start = clock_ns(CLOCK_MONOTONIC);
	long long cpu_start = clock_ns(CLOCK_PROCESS_CPUTIME_ID);
	for (long i = 0; i < requests; i++) {
		if (write(fd, REQUEST, sizeof(REQUEST) - 1) != sizeof(REQUEST) - 1) {
			perror("write");
			return 1;
		}
		size_t got = 0;
		while (got < sizeof(RESPONSE) - 1) {
			ssize_t n = read(fd, buf, sizeof(buf));
			if (n <= 0) {
				perror("read");
				return 1;
			}
			got += n;
		}
	}
	long long elapsed = clock_ns(CLOCK_MONOTONIC) - start;
	long long cpu = clock_ns(CLOCK_PROCESS_CPUTIME_ID) - cpu_start;
	close(fd);
	printf("%lld %lld\n", elapsed, cpu);
	return 0;
}

int main(int argc, char **argv)
{
	if (argc == 2 && !strcmp(argv[1], "server"))
		return serve();
	if (argc == 4 && !strcmp(argv[1], "client"))
		return client(atoi(argv[2]), atol(argv[3]));
	fprintf(stderr, "usage: %s server | client PORT N\n", argv[0]);
	return 2;
}
