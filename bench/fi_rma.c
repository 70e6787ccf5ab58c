/*
 * libfabric's tcp provider (FI_EP_RDM: tcp;ofi_rxm) doing what softrdma's
 * perf tests do, as a peer for bench/compare.py: RMA WRITE or READ
 * bandwidth one direction at a time, 8-byte send/recv ping-pong latency
 * (fabtests' rdm_pingpong), and the 8-byte WRITE message rate with many
 * writes outstanding.
 *
 *   fi_rma -p PORT [-o write|read|pingpong|rate] [-S size] [-n iters] [-W window]
 *                                      (server, on 127.0.0.1)
 *   fi_rma -p PORT ... 127.0.0.1       (client)
 *
 * Both sides bind 127.0.0.1 only. Endpoint names, the buffer's address and
 * its key go over a TCP socket on PORT. The client drives the test and
 * prints one line, "RESULT <op> <size> <value> <unit>"; the server calls the
 * completion queue until the client's closing SEND arrives, because the tcp
 * provider makes progress only inside libfabric calls.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define LOOPBACK "127.0.0.1"

static struct fi_info *info;
static struct fid_fabric *fabric;
static struct fid_domain *domain;
static struct fid_ep *ep;
static struct fid_av *av;
static struct fid_cq *cq;
static struct fid_mr *mr;
static void *desc;
static char *buf;
static size_t buf_len;
static fi_addr_t peer;

struct peer_info {
	uint64_t addr, key, name_len;
	char name[128];
};

static void die(const char *what, long rc)
{
	fprintf(stderr, "fi_rma: %s: %s (%ld)\n", what,
		rc < 0 ? fi_strerror((int)-rc) : strerror(errno), rc);
	exit(1);
}

#define CHECK(call)                      \
	do {                             \
		long rc_ = (call);       \
		if (rc_)                 \
			die(#call, rc_); \
	} while (0)

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec * 1e-9;
}

static void full(int fd, void *p, size_t n, int out)
{
	char *c = p;
	while (n) {
		ssize_t k = out ? write(fd, c, n) : read(fd, c, n);
		if (k <= 0)
			die(out ? "out-of-band write" : "out-of-band read", 0);
		c += k;
		n -= (size_t)k;
	}
}

/* The out-of-band socket: the server listens on 127.0.0.1:port, the client
 * connects there. */
static int oob(const char *connect_to, int port)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port) };
	int one = 1, fd = socket(AF_INET, SOCK_STREAM, 0);
	inet_pton(AF_INET, LOOPBACK, &a.sin_addr);
	if (fd < 0)
		die("socket", 0);
	if (!connect_to) {
		int c;
		setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
		if (bind(fd, (void *)&a, sizeof a) || listen(fd, 1))
			die("bind/listen", 0);
		c = accept(fd, NULL, NULL);
		close(fd);
		fd = c;
	} else {
		for (int i = 0; connect(fd, (void *)&a, sizeof a); i++) {
			if (i == 100)
				die("connect", 0);
			usleep(50000);
		}
	}
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
	return fd;
}

static void setup(void)
{
	struct fi_info *hints = fi_allocinfo();
	struct fi_cq_attr cq_attr = { .format = FI_CQ_FORMAT_CONTEXT, .size = 1024 };
	struct fi_av_attr av_attr = { .type = FI_AV_TABLE };

	hints->ep_attr->type = FI_EP_RDM;
	hints->caps = FI_MSG | FI_RMA;
	hints->mode = FI_CONTEXT;
	hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED |
				      FI_MR_PROV_KEY | FI_MR_ENDPOINT;
	hints->domain_attr->threading = FI_THREAD_DOMAIN;
	hints->fabric_attr->prov_name = strdup("tcp");
	/* Bound to loopback: port 0, the provider picks one. */
	CHECK(fi_getinfo(FI_VERSION(1, 17), LOOPBACK, "0", FI_SOURCE, hints, &info));
	fi_freeinfo(hints);
	CHECK(fi_fabric(info->fabric_attr, &fabric, NULL));
	CHECK(fi_domain(fabric, info, &domain, NULL));
	CHECK(fi_endpoint(domain, info, &ep, NULL));
	CHECK(fi_cq_open(domain, &cq_attr, &cq, NULL));
	CHECK(fi_av_open(domain, &av_attr, &av, NULL));
	CHECK(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV));
	CHECK(fi_ep_bind(ep, &av->fid, 0));
	CHECK(fi_enable(ep));
	if (posix_memalign((void **)&buf, 4096, buf_len))
		die("posix_memalign", 0);
	memset(buf, 0, buf_len);
	CHECK(fi_mr_reg(domain, buf, buf_len,
			FI_SEND | FI_RECV | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE,
			0, 0, 0, &mr, NULL));
	if (info->domain_attr->mr_mode & FI_MR_ENDPOINT) {
		CHECK(fi_mr_bind(mr, &ep->fid, 0));
		CHECK(fi_mr_enable(mr));
	}
	desc = fi_mr_desc(mr);
}

/* Swaps endpoint names and buffer keys; returns the peer's buffer. */
static struct peer_info exchange(int fd)
{
	struct peer_info me = { 0 }, them;
	size_t len = sizeof me.name;
	CHECK(fi_getname(&ep->fid, me.name, &len));
	me.name_len = len;
	me.key = fi_mr_key(mr);
	me.addr = (info->domain_attr->mr_mode & FI_MR_VIRT_ADDR) ? (uintptr_t)buf : 0;
	full(fd, &me, sizeof me, 1);
	full(fd, &them, sizeof them, 0);
	if (fi_av_insert(av, them.name, 1, &peer, 0, NULL) != 1)
		die("fi_av_insert", 0);
	return them;
}

static long outstanding, recvs;
static struct fi_context recv_ctx;

/* Reads what completions there are (libfabric's tcp progress runs in
 * here); counts receives apart. */
static void progress(void)
{
	struct fi_cq_entry e[64];
	ssize_t n = fi_cq_read(cq, e, 64);
	if (n == -FI_EAVAIL) {
		struct fi_cq_err_entry err = { 0 };
		fi_cq_readerr(cq, &err, 0);
		fprintf(stderr, "fi_rma: completion error: %s\n",
			fi_cq_strerror(cq, err.prov_errno, err.err_data, NULL, 0));
		exit(1);
	}
	if (n == -FI_EAGAIN)
		return;
	if (n < 0)
		die("fi_cq_read", n);
	outstanding -= n;
	for (ssize_t i = 0; i < n; i++)
		recvs += e[i].op_context == &recv_ctx;
}

/* Spins until at most `level` operations are outstanding. */
static void drain_to(long level)
{
	while (outstanding > level)
		progress();
}

static void wait_recvs(long n)
{
	while (recvs < n)
		progress();
}

/* Posts one operation ('w'rite, 'r'ead, 's'end, rec'v'), reading
 * completions while the provider pushes back. */
static void post(int op, size_t size, uint64_t raddr, uint64_t key, struct fi_context *ctx)
{
	for (;;) {
		ssize_t rc = op == 'w' ? fi_write(ep, buf, size, desc, peer, raddr, key, ctx)
			     : op == 'r' ? fi_read(ep, buf, size, desc, peer, raddr, key, ctx)
			     : op == 's' ? fi_send(ep, buf, size, desc, peer, ctx)
					 : fi_recv(ep, buf + buf_len / 2, size, desc, peer, &recv_ctx);
		if (rc == 0)
			break;
		if (rc != -FI_EAGAIN)
			die("post", rc);
		progress();
	}
	outstanding++;
}

static int cmp(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
	const char *connect_to = NULL, *op = "write";
	long iters = 1000, window = 64;
	size_t size = 65536;
	int port = 0, c;
	static struct fi_context ctx[1024];

	while ((c = getopt(argc, argv, "p:o:S:n:W:")) != -1) {
		switch (c) {
		case 'p': port = atoi(optarg); break;
		case 'o': op = optarg; break;
		case 'S': size = strtoul(optarg, NULL, 0); break;
		case 'n': iters = atol(optarg); break;
		case 'W': window = atol(optarg); break;
		default:
			fprintf(stderr, "usage: fi_rma -p PORT [-o write|read|pingpong|rate] "
					"[-S size] [-n iters] [-W window] [127.0.0.1]\n");
			return 2;
		}
	}
	if (optind < argc)
		connect_to = argv[optind];
	if (port <= 0 || port > 65535 || size == 0 || iters <= 0 || window <= 0 || window > 1024 ||
	    (strcmp(op, "write") && strcmp(op, "read") && strcmp(op, "pingpong") &&
	     strcmp(op, "rate"))) {
		fprintf(stderr, "fi_rma: bad arguments (see the usage at the top of fi_rma.c)\n");
		return 2;
	}
	if (connect_to && strcmp(connect_to, LOOPBACK)) {
		fprintf(stderr, "fi_rma: loopback only (%s)\n", LOOPBACK);
		return 2;
	}
	buf_len = 2 * (size < 4096 ? 4096 : size);
	setup();
	int fd = oob(connect_to, port);
	struct peer_info them = exchange(fd);
	int pingpong = !strcmp(op, "pingpong");
	char go = 1;

	if (!connect_to) {
		/* The server: answer pings, or wait for the closing SEND. */
		long n = pingpong ? iters : 1;
		post('v', pingpong ? size : 1, 0, 0, NULL);
		full(fd, &go, 1, 1);
		for (long i = 0; i < n; i++) {
			wait_recvs(i + 1);
			if (pingpong) {
				if (i + 1 < n)
					post('v', size, 0, 0, NULL);
				post('s', size, 0, 0, &ctx[0]);
			}
		}
		drain_to(0);
		full(fd, &go, 1, 1);
		return 0;
	}

	full(fd, &go, 1, 0); /* the server's receive is posted */
	if (pingpong) {
		double *t = malloc(sizeof(double) * (size_t)iters);
		for (long i = 0; i < iters; i++) {
			double t0 = now();
			post('v', size, 0, 0, NULL);
			post('s', size, 0, 0, &ctx[0]);
			wait_recvs(i + 1);
			t[i] = (now() - t0) / 2 * 1e6;
		}
		drain_to(0);
		qsort(t, (size_t)iters, sizeof *t, cmp);
		printf("RESULT pingpong %zu %.3f us_half_rtt_p50\n", size, t[iters / 2]);
		printf("RESULT pingpong %zu %.3f us_half_rtt_p99\n", size, t[iters * 99 / 100]);
	} else {
		int o = !strcmp(op, "read") ? 'r' : 'w';
		long posted = 0;
		/* Ten untimed operations first (connection set-up, warm caches). */
		for (int i = 0; i < 10; i++)
			post(o, size, them.addr, them.key, &ctx[i]);
		drain_to(0);
		double t0 = now();
		while (posted < iters) {
			while (outstanding < window && posted < iters)
				post(o, size, them.addr, them.key, &ctx[posted++ % 1024]);
			progress();
		}
		drain_to(0);
		double secs = now() - t0;
		if (!strcmp(op, "rate"))
			printf("RESULT rate %zu %.4f Mmsg/s\n", size, iters / secs / 1e6);
		else
			printf("RESULT %s %zu %.4f GB/s\n", op, size, (double)size * iters / secs / 1e9);
		post('s', 1, 0, 0, &ctx[0]);
		drain_to(0);
	}
	full(fd, &go, 1, 0); /* the server is done */
	fi_close(&mr->fid);
	fi_close(&ep->fid);
	fi_close(&av->fid);
	fi_close(&cq->fid);
	fi_close(&domain->fid);
	fi_close(&fabric->fid);
	fi_freeinfo(info);
	return 0;
}
