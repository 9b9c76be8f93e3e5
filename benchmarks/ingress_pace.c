/* Paced HTTP/1.1 keep-alive client for benchmarks/ingress_load.py (wrk paces by connections only;
 * Debian has no wrk2):
 *   ingress_pace PORT RATE SECONDS [CONNECTIONS]
 * sends GET / on CONNECTIONS (default 4) keep-alive connections, one thread each, one request
 * after the other on each, holding each thread's total by time t at RATE / CONNECTIONS * t (it
 * catches up by at most what it fell behind), for SECONDS, then prints "<requests completed>
 * <elapsed ns>". A response is read up to its Content-Length. */
#define _GNU_SOURCE /* strcasestr */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static const char REQUEST[] = "GET / HTTP/1.1\r\nHost: bench\r\n\r\n";

static long long now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Read one response (headers, then Content-Length body bytes); 0 on success. */
static int read_response(int fd, char *buf, size_t size)
{
	size_t have = 0;
	char *end = NULL;
	while (!end) {
		ssize_t n = read(fd, buf + have, size - 1 - have);
		if (n <= 0)
			return -1;
		have += n;
		buf[have] = 0;
		end = strstr(buf, "\r\n\r\n");
		if (!end && have >= size - 1)
			return -1;
	}
	long length = 0;
	char *field = strcasestr(buf, "\r\nContent-Length:");
	if (field)
		length = atol(field + 17);
	size_t body = have - (size_t)(end + 4 - buf);
	while ((long)body < length) {
		ssize_t n = read(fd, buf, size - 1);
		if (n <= 0)
			return -1;
		body += n;
	}
	return 0;
}

struct pacer {
	int port;
	double rate;
	long long duration;
	long done;
	long long elapsed;
	int failed;
};

static void *pace(void *arg)
{
	struct pacer *p = arg;
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	int one = 1;
	struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons(p->port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof(addr))) {
		perror("connect");
		p->failed = 1;
		return NULL;
	}
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	static __thread char buf[65536];
	long long start = now_ns(), elapsed = 0;
	while ((elapsed = now_ns() - start) < p->duration) {
		long due = (long)(p->rate * elapsed / 1e9);
		if (p->done >= due) {
			struct timespec pause = {0, 50000}; /* 50 us */
			nanosleep(&pause, NULL);
			continue;
		}
		if (write(fd, REQUEST, sizeof(REQUEST) - 1) != sizeof(REQUEST) - 1 || read_response(fd, buf, sizeof(buf))) {
			perror("request");
			p->failed = 1;
			break;
		}
		p->done++;
	}
	p->elapsed = elapsed;
	close(fd);
	return NULL;
}

int main(int argc, char **argv)
{
	if (argc != 4 && argc != 5) {
		fprintf(stderr, "usage: %s PORT RATE SECONDS [CONNECTIONS]\n", argv[0]);
		return 2;
	}
	int connections = argc == 5 ? atoi(argv[4]) : 4;
	if (connections < 1 || connections > 256) {
		fprintf(stderr, "CONNECTIONS must be 1..256\n");
		return 2;
	}
	struct pacer pacers[256];
	pthread_t threads[256];
	for (int i = 0; i < connections; i++) {
		pacers[i] = (struct pacer){.port = atoi(argv[1]), .rate = atof(argv[2]) / connections,
					   .duration = (long long)(atof(argv[3]) * 1e9)};
		if (pthread_create(&threads[i], NULL, pace, &pacers[i])) {
			perror("pthread_create");
			return 1;
		}
	}
	long done = 0;
	long long elapsed = 0;
	int failed = 0;
	for (int i = 0; i < connections; i++) {
		pthread_join(threads[i], NULL);
		done += pacers[i].done;
		elapsed = pacers[i].elapsed > elapsed ? pacers[i].elapsed : elapsed;
		failed |= pacers[i].failed;
	}
	printf("%ld %lld\n", done, elapsed);
	return failed;
}
