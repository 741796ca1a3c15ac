// kbench: per-packet BPF_PROG_TEST_RUN timing of Katran's balancer_ingress, the running
// lb agent's lb_xdp (found through its pinned link) and an empty XDP program, with the
// same packets, interleaved: each round runs every case for the three programs in
// CHUNKS alternating chunks. repeat=1 per call (Katran's tester method: with repeat>1
// Katran would re-read its own IPIP output); the kernel-reported ns of each call.
//
// usage: kbench KATRAN_OBJ EMPTY_OBJ LB_LINK_PIN ROUNDS CALLS CPU OUT_TSV
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <linux/ip.h>
#include <linux/tcp.h>
#include <sched.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define RING_SIZE 65537   // Katran's default ring, = lb's maglev_table_size
#define MAX_VIPS 512      // Katran's default; stats[MAX_VIPS + 2] is its new-conn window
#define NEW_CONN_RATE_CNTR 2
#define REALS 100
#define LRU_TOTAL 1048576 // lb's conntrack_entries default; Katran gets it split per CPU
#define CHUNKS 10         // a case's calls in a round come in chunks, programs alternating
#define WARMUP 50         // untimed calls before each chunk
#define PKT_LEN (14 + 20 + 20)
#define PKT6_LEN (14 + 40 + 20)
#define UDP_LEN (14 + 20 + 8)
#define MAX_PKT PKT6_LEN
#define MAX_ROUNDS 64
// lb_common::stat indices; the count is read from LB_STATS's value size
#define CT_CREATED 21
#define CT_INSERT_SKIPPED 22
#define CT_EMBRYONIC 25   // since the embryonic table, a SYN is counted here, not in CT_CREATED

// Katran's structs (katran/lib/bpf/balancer_structs.h); sizes are checked at load.
struct vip_definition { uint32_t vip[4]; uint16_t port; uint8_t proto; };
struct vip_meta { uint32_t flags, vip_num; };
struct real_definition { uint32_t dst[4]; uint8_t flags; };
struct ctl_value { uint8_t mac[8]; };

enum { P_EMPTY, P_LB, P_KATRAN, NPROGS };
static const char *prog_name[NPROGS] = {"empty", "lb", "katran"};
enum { C_SYN_NEW, C_EST, C_NONVIP, C_SYN_SAME, C_HANDSHAKE, C_EST16K, C_UDP_EST, C_V6_EST, NCASES };
static const char *case_name[NCASES] = {"syn_new_flow", "established", "non_vip", "same_syn",
					 "handshake", "established_16k", "udp_established",
					 "ipv6_established"}; // handshake: a new SYN and its first ACK, the two calls' sum
#define FLOWS16K 16384
static uint64_t next16k[NPROGS]; // each program cycles the same 16k established flows

static int prog_fd[NPROGS];
static int pkt_len = PKT_LEN; // of the frame make_case made last
static int katran_stats_fd, katran_lru_fd, lb_flood_fd = -1, lb_stats_fd = -1, lb_stat_count;
static int ncpus, cpu;
static uint64_t next_flow[NPROGS]; // each program sees the same sequence of new flows

static void die(const char *what) { perror(what); exit(1); }

static int quiet(enum libbpf_print_level level, const char *fmt, va_list args)
{
	return level == LIBBPF_WARN ? vfprintf(stderr, fmt, args) : 0;
}

static uint32_t ip4(const char *s) { struct in_addr a; inet_pton(AF_INET, s, &a); return a.s_addr; }

static uint16_t csum(uint32_t sum, const void *p, int n)
{
	const uint16_t *w = p;
	for (; n > 1; n -= 2) sum += *w++;
	while (sum >> 16) sum = (sum & 0xffff) + (sum >> 16);
	return ~sum;
}

// The Ethernet header (dst MAC irrelevant) of a frame of `len` bytes, zeroed after it.
static void eth(uint8_t *p, int len, uint16_t type)
{
	static const uint8_t macs[12] = {2, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 2};
	memset(p, 0, len);
	memcpy(p, macs, 12);
	p[12] = type >> 8, p[13] = type & 0xff;
	pkt_len = len;
}

// An IPv4 header (DF, TTL 64, checksum) carrying `l4_len` bytes of `proto`.
static struct iphdr *ip4hdr(uint8_t *p, uint8_t proto, int l4_len, uint32_t saddr, uint32_t daddr)
{
	struct iphdr *ip = (void *)(p + 14);
	ip->version = 4, ip->ihl = 5, ip->tot_len = htons(20 + l4_len), ip->frag_off = htons(0x4000);
	ip->ttl = 64, ip->protocol = proto, ip->saddr = saddr, ip->daddr = daddr;
	ip->check = csum(0, ip, 20);
	return ip;
}

// A TCP header without options to port 80; `sum`: its pseudo-header's sum.
static void tcphdr(void *at, uint16_t sport, uint8_t flags, uint32_t sum)
{
	struct tcphdr *th = at;
	th->source = htons(sport), th->dest = htons(80), th->seq = htonl(1), th->doff = 5;
	th->window = htons(65535);
	((uint8_t *)th)[13] = flags; // 0x02 SYN, 0x10 ACK
	if (flags & 0x10) th->ack_seq = htonl(1);
	th->check = csum(sum + htons(20) + htons(IPPROTO_TCP), th, 20);
}

// Ethernet + IPv4 + TCP, valid checksums.
static void make_pkt(uint8_t *p, uint32_t saddr, uint16_t sport, uint32_t daddr, uint8_t flags)
{
	eth(p, PKT_LEN, 0x0800);
	struct iphdr *ip = ip4hdr(p, IPPROTO_TCP, 20, saddr, daddr);
	uint32_t sum = 0;
	for (int i = 0; i < 4; i++) sum += ((uint16_t *)&ip->saddr)[i];
	tcphdr(ip + 1, sport, flags, sum);
}

// Ethernet + IPv6 + TCP, valid checksums.
static void make_pkt6(uint8_t *p, const char *saddr, uint16_t sport, const char *daddr, uint8_t flags)
{
	eth(p, PKT6_LEN, 0x86dd);
	uint8_t *ip = p + 14;
	ip[0] = 0x60, ip[4] = 0, ip[5] = 20, ip[6] = IPPROTO_TCP, ip[7] = 64;
	inet_pton(AF_INET6, saddr, ip + 8);
	inet_pton(AF_INET6, daddr, ip + 24);
	uint32_t sum = 0;
	for (int i = 0; i < 16; i++) sum += ((uint16_t *)(ip + 8))[i];
	tcphdr(ip + 40, sport, flags, sum);
}

// Ethernet + IPv4 + UDP to port 80 with no payload; checksum 0 (none).
static void make_udp(uint8_t *p, uint32_t saddr, uint16_t sport, uint32_t daddr)
{
	eth(p, UDP_LEN, 0x0800);
	uint16_t *udp = (void *)(ip4hdr(p, IPPROTO_UDP, 8, saddr, daddr) + 1);
	udp[0] = htons(sport), udp[1] = htons(80), udp[2] = htons(8), udp[3] = 0;
}

static void make_case(uint8_t *p, int c, int prog, uint8_t flags_override)
{
	uint32_t vip = ip4("10.200.0.1");
	switch (c) {
	case C_SYN_NEW: { // a never-seen (source address, port) every call
		uint64_t k = next_flow[prog]++;
		make_pkt(p, htonl(ntohl(ip4("10.100.0.0")) + k / 60000), 1024 + k % 60000, vip, 0x02);
		break;
	}
	case C_EST: make_pkt(p, ip4("10.99.0.1"), 40000, vip, flags_override ? flags_override : 0x10); break;
	case C_NONVIP: make_pkt(p, ip4("10.99.0.2"), 40001, ip4("10.200.0.9"), 0x10); break;
	case C_SYN_SAME: make_pkt(p, ip4("10.99.0.3"), 40002, vip, 0x02); break;
	case C_EST16K: { // flags_override: the flow k - 1 (priming), else the next in the cycle
		uint64_t k = next16k[prog]++ % FLOWS16K;
		make_pkt(p, ip4("10.98.0.1"), 20000 + k, vip, flags_override ? flags_override : 0x10);
		break;
	}
	case C_UDP_EST: make_udp(p, ip4("10.99.0.4"), 40004, vip); break;
	case C_V6_EST: make_pkt6(p, "fd00:99::1", 40005, "fd00:200::1", flags_override ? flags_override : 0x10); break;
	case C_HANDSHAKE: { // flags_override 0x10: the ACK of the last SYN made
		uint64_t k = flags_override ? next_flow[prog] - 1 : next_flow[prog]++;
		make_pkt(p, htonl(ntohl(ip4("10.101.0.0")) + k / 60000), 1024 + k % 60000, vip,
			 flags_override ? 0x10 : 0x02);
		break;
	}
	}
}

// One call; checks the verdict and the output frame.
static uint32_t run_once(int p, int c, const uint8_t *pkt)
{
	uint8_t out[256];
	LIBBPF_OPTS(bpf_test_run_opts, o, .data_in = pkt, .data_size_in = pkt_len,
		    .data_out = out, .data_size_out = sizeof(out), .repeat = 1);
	if (bpf_prog_test_run_opts(prog_fd[p], &o)) die("BPF_PROG_TEST_RUN");
	int vip = p != P_EMPTY && c != C_NONVIP;
	uint32_t want_ret = vip ? 3 /* XDP_TX */ : 2 /* XDP_PASS */;
	int v6 = c == C_V6_EST;
	uint32_t want_len = pkt_len + (vip && p == P_KATRAN ? (v6 ? 40 /* ip6ip6 */ : 20 /* IPIP */) : 0);
	int ok = o.retval == want_ret && o.data_size_out == want_len;
	// dst MAC := a backend's 02:00:00:00:0N:xx, N = 1 (the TCP VIP), 2 (IPv6), 3 (UDP)
	uint8_t vip_mac = v6 ? 2 : c == C_UDP_EST ? 3 : 1;
	if (ok && vip && p == P_LB)
		ok = !memcmp(out, "\x02\0\0\0", 4) && out[4] == vip_mac && out[5] >= 1 && out[5] <= REALS;
	if (ok && vip && p == P_KATRAN && !v6) { // outer IPv4 to a real 10.200.0.101-200
		uint32_t d = ntohl(*(uint32_t *)(out + 14 + 16)) - ntohl(ip4("10.200.0.100"));
		ok = out[14 + 9] == IPPROTO_IPIP && d >= 1 && d <= REALS;
	}
	if (ok && vip && p == P_KATRAN && v6) // outer IPv6 (ip6ip6) to a real fd00:200::101-200
		ok = out[14 + 6] == IPPROTO_IPV6 && out[14 + 24] == 0xfd && out[14 + 39] >= 1 &&
		     out[14 + 39] <= REALS && out[14 + 38] == 1;
	if (!ok) {
		fprintf(stderr, "%s/%s: unexpected verdict %u, %u bytes\n", prog_name[p], case_name[c],
			o.retval, o.data_size_out);
		exit(1);
	}
	return o.duration;
}

// Zero a per-CPU map's element on every CPU.
static void zero_percpu(int fd, uint32_t key, size_t value_size)
{
	size_t n = ((value_size + 7) & ~7UL) * ncpus;
	void *z = calloc(1, n);
	if (bpf_map_update_elem(fd, &key, z, BPF_ANY)) die("zero per-CPU element");
	free(z);
}

static uint64_t lb_stat(int idx)
{
	static uint64_t v[256 * 256];
	uint64_t sum = 0;
	uint32_t key = 0;
	if (bpf_map_lookup_elem(lb_stats_fd, &key, v)) die("LB_STATS");
	for (int i = 0; i < ncpus; i++) sum += v[i * lb_stat_count + idx];
	return sum;
}

static int cmp_u32(const void *a, const void *b)
{
	uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
	return x < y ? -1 : x > y;
}

static int cmp_dbl(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
	double t[MAX_ROUNDS];
	memcpy(t, v, n * sizeof *v);
	qsort(t, n, sizeof *t, cmp_dbl);
	return n % 2 ? t[n / 2] : (t[n / 2 - 1] + t[n / 2]) / 2;
}

// One chunk of n timed calls. The program's new-conn rate window is reset first, so
// neither flood guard (Katran 125k/s/CPU, lb 100k/s/CPU) trips; both checks still run.
static void chunk(int p, int c, uint32_t *durs, int n)
{
	uint8_t pkt[MAX_PKT];
	if (p == P_KATRAN) zero_percpu(katran_stats_fd, MAX_VIPS + NEW_CONN_RATE_CNTR, 16);
	if (p == P_LB) zero_percpu(lb_flood_fd, 0, 16);
	if (c == C_EST || c == C_V6_EST) { // open the flow with its SYN (untimed); then the same ACK
		make_case(pkt, c, p, 0x02);
		run_once(p, c, pkt);
	}
	if (c == C_UDP_EST) { // open the flow (untimed): lb makes its entry at the second datagram
		make_case(pkt, c, p, 0);
		run_once(p, c, pkt);
		run_once(p, c, pkt);
	}
	make_case(pkt, c, p, 0);
	for (int i = -WARMUP; i < n; i++) {
		if (c == C_SYN_NEW || c == C_HANDSHAKE || c == C_EST16K) make_case(pkt, c, p, 0);
		uint32_t d = run_once(p, c, pkt);
		if (c == C_HANDSHAKE) {
			make_case(pkt, c, p, 0x10);
			d += run_once(p, c, pkt);
		}
		if (i >= 0) durs[i] = d;
	}
}

static void summarize(uint32_t *durs, int n, double *p50, double *mean, double *p99)
{
	double sum = 0;
	for (int i = 0; i < n; i++) sum += durs[i];
	qsort(durs, n, sizeof *durs, cmp_u32);
	*p50 = durs[n / 2], *mean = sum / n, *p99 = durs[(int)(n * 0.99)];
}

static int map_fd(struct bpf_object *obj, const char *name)
{
	struct bpf_map *m = bpf_object__find_map_by_name(obj, name);
	if (!m) { fprintf(stderr, "katran: no map %s\n", name); exit(1); }
	return bpf_map__fd(m);
}

static void check_size(struct bpf_object *obj, const char *name, unsigned k, unsigned v)
{
	struct bpf_map *m = bpf_object__find_map_by_name(obj, name);
	if (bpf_map__key_size(m) != k || bpf_map__value_size(m) != v) {
		fprintf(stderr, "katran: %s is %u/%u bytes, expected %u/%u\n", name,
			bpf_map__key_size(m), bpf_map__value_size(m), k, v);
		exit(1);
	}
}

// Katran as KatranLb sets it up: one VIP, 100 reals (ids 1..100), its ring filled with
// the real ids round-robin (not Katran's Maglev: same lookup cost, another spread),
// the default router's MAC in ctl_array[0], and one LRU per CPU in lru_mapping
// (KatranLb::initLrus), LRU_TOTAL / possible CPUs entries each.
static void setup_katran(const char *path)
{
	struct bpf_object *obj = bpf_object__open_file(path, NULL);
	if (!obj || bpf_object__load(obj)) die("loading Katran's object");
	prog_fd[P_KATRAN] = bpf_program__fd(bpf_object__find_program_by_name(obj, "balancer_ingress"));
	check_size(obj, "vip_map", sizeof(struct vip_definition), sizeof(struct vip_meta));
	check_size(obj, "reals", 4, sizeof(struct real_definition));
	check_size(obj, "ctl_array", 4, sizeof(struct ctl_value));
	check_size(obj, "fallback_cache", 40, 16);

	struct vip_definition vip = {.vip = {ip4("10.200.0.1")}, .port = htons(80), .proto = IPPROTO_TCP};
	struct vip_meta meta = {.flags = 0, .vip_num = 0};
	if (bpf_map_update_elem(map_fd(obj, "vip_map"), &vip, &meta, BPF_ANY)) die("vip_map");
	for (uint32_t id = 1; id <= REALS; id++) {
		struct real_definition r = {.dst = {htonl(ntohl(ip4("10.200.0.100")) + id)}};
		if (bpf_map_update_elem(map_fd(obj, "reals"), &id, &r, BPF_ANY)) die("reals");
	}
	// The UDP VIP (vip_num 1) on the same reals; the IPv6 VIP (vip_num 2) on 100 IPv6
	// reals fd00:200::1:1-100 (ids 101-200, F_IPV6: ip6ip6).
	struct vip_definition udp = {.vip = {ip4("10.200.0.1")}, .port = htons(80), .proto = IPPROTO_UDP};
	struct vip_meta udp_meta = {.flags = 0, .vip_num = 1};
	if (bpf_map_update_elem(map_fd(obj, "vip_map"), &udp, &udp_meta, BPF_ANY)) die("vip_map");
	struct vip_definition v6 = {.port = htons(80), .proto = IPPROTO_TCP};
	inet_pton(AF_INET6, "fd00:200::1", v6.vip);
	struct vip_meta v6_meta = {.flags = 0, .vip_num = 2};
	if (bpf_map_update_elem(map_fd(obj, "vip_map"), &v6, &v6_meta, BPF_ANY)) die("vip_map");
	for (uint32_t id = REALS + 1; id <= 2 * REALS; id++) {
		struct real_definition r = {.dst = {htonl(0xfd000200), 0, 0, htonl(0x100 + id - REALS)},
					    .flags = 1 /* F_IPV6 */};
		if (bpf_map_update_elem(map_fd(obj, "reals"), &id, &r, BPF_ANY)) die("reals");
	}
	int rings = map_fd(obj, "ch_rings");
	for (uint32_t vip_num = 0; vip_num < 3; vip_num++)
		for (uint32_t pos = 0; pos < RING_SIZE; pos++) {
			uint32_t id = pos % REALS + 1 + (vip_num == 2 ? REALS : 0);
			uint32_t key = vip_num * RING_SIZE + pos;
			if (bpf_map_update_elem(rings, &key, &id, BPF_ANY)) die("ch_rings");
		}
	struct ctl_value mac = {.mac = {2, 0, 0, 0, 0, 0xfe}};
	uint32_t zero = 0;
	if (bpf_map_update_elem(map_fd(obj, "ctl_array"), &zero, &mac, BPF_ANY)) die("ctl_array");
	int mapping = map_fd(obj, "lru_mapping");
	for (int c = 0; c < ncpus; c++) {
		int fd = bpf_map_create(BPF_MAP_TYPE_LRU_HASH, "katran_lru", 40, 16, LRU_TOTAL / ncpus, NULL);
		if (fd < 0 || bpf_map_update_elem(mapping, &c, &fd, BPF_ANY)) die("per-CPU LRU");
		if (c == cpu) katran_lru_fd = fd;
	}
	katran_stats_fd = map_fd(obj, "stats");
}

// lb: the program on the agent's pinned link, and its LB_FLOOD and LB_STATS maps.
static void setup_lb(const char *link_pin)
{
	struct bpf_link_info link = {};
	struct bpf_prog_info prog = {};
	uint32_t len = sizeof link, ids[64];
	int fd = bpf_obj_get(link_pin);
	if (fd < 0 || bpf_obj_get_info_by_fd(fd, &link, &len)) die("lb's pinned link");
	prog_fd[P_LB] = bpf_prog_get_fd_by_id(link.prog_id);
	len = sizeof prog;
	prog.nr_map_ids = 64, prog.map_ids = (uint64_t)(uintptr_t)ids;
	if (prog_fd[P_LB] < 0 || bpf_obj_get_info_by_fd(prog_fd[P_LB], &prog, &len)) die("lb's program");
	printf("lb: program id %u (%s), %u maps\n", link.prog_id, prog.name, prog.nr_map_ids);
	for (uint32_t i = 0; i < prog.nr_map_ids; i++) {
		struct bpf_map_info m = {};
		uint32_t mlen = sizeof m;
		int mfd = bpf_map_get_fd_by_id(ids[i]);
		if (mfd < 0 || bpf_obj_get_info_by_fd(mfd, &m, &mlen)) die("lb's maps");
		if (!strcmp(m.name, "LB_FLOOD")) lb_flood_fd = mfd;
		else if (!strcmp(m.name, "LB_STATS")) lb_stats_fd = mfd, lb_stat_count = m.value_size / 8;
	}
	if (lb_flood_fd < 0 || lb_stats_fd < 0) { fprintf(stderr, "lb: LB_FLOOD/LB_STATS not found\n"); exit(1); }
}

static double loadavg(void)
{
	double l = -1;
	FILE *f = fopen("/proc/loadavg", "r");
	if (f) { if (fscanf(f, "%lf", &l) != 1) l = -1; fclose(f); }
	return l;
}

int main(int argc, char **argv)
{
	if (argc != 8) {
		fprintf(stderr, "usage: %s KATRAN_OBJ EMPTY_OBJ LB_LINK_PIN ROUNDS CALLS CPU OUT_TSV\n", argv[0]);
		return 2;
	}
	int rounds = atoi(argv[4]), n = atoi(argv[5]);
	cpu = atoi(argv[6]);
	if (rounds < 1 || rounds > MAX_ROUNDS || n < 100) { fprintf(stderr, "bad ROUNDS/CALLS\n"); return 2; }
	cpu_set_t set;
	CPU_ZERO(&set);
	CPU_SET(cpu, &set);
	if (sched_setaffinity(0, sizeof set, &set)) die("sched_setaffinity");
	setvbuf(stdout, NULL, _IOLBF, 0);
	ncpus = libbpf_num_possible_cpus();
	libbpf_set_print(quiet);

	setup_katran(argv[1]);
	struct bpf_object *empty = bpf_object__open_file(argv[2], NULL);
	if (!empty || bpf_object__load(empty)) die("loading the empty program");
	prog_fd[P_EMPTY] = bpf_program__fd(bpf_object__next_program(empty, NULL));
	setup_lb(argv[3]);

	FILE *tsv = fopen(argv[7], "w");
	if (!tsv) die(argv[7]);
	fprintf(tsv, "round\tcase\tprog\tp50_ns\tmean_ns\tp99_ns\tloadavg1\n");
	static double p50[MAX_ROUNDS][NCASES][NPROGS], mean[MAX_ROUNDS][NCASES][NPROGS];
	int per = n / CHUNKS;
	n = per * CHUNKS;
	uint32_t *durs[NPROGS];
	for (int p = 0; p < NPROGS; p++) durs[p] = malloc(n * sizeof *durs[p]);
	// The 16k flows opened once (untimed): a SYN and its ACK each, the rate windows reset
	// as they go so that no flood guard skips one.
	for (int p = P_LB; p <= P_KATRAN; p++) {
		uint8_t pkt[MAX_PKT];
		for (int k = 0; k < FLOWS16K; k++) {
			if (k % 1000 == 0) {
				zero_percpu(katran_stats_fd, MAX_VIPS + NEW_CONN_RATE_CNTR, 16);
				zero_percpu(lb_flood_fd, 0, 16);
			}
			make_case(pkt, C_EST16K, p, 0x02);
			next16k[p]--;
			run_once(p, C_EST16K, pkt);
			make_case(pkt, C_EST16K, p, 0x10);
			run_once(p, C_EST16K, pkt);
		}
	}
	for (int r = 0; r < rounds; r++) {
		for (int c = 0; c < NCASES; c++) {
			if (getenv("KB_CASE") && atoi(getenv("KB_CASE")) != c) continue;
			uint64_t created = lb_stat(CT_CREATED) + lb_stat(CT_EMBRYONIC);
			for (int j = 0; j < CHUNKS; j++)
				for (int k = 0; k < NPROGS; k++) // the order rotates every chunk and round
					chunk((k + j + r) % NPROGS, c, durs[(k + j + r) % NPROGS] + j * per, per);
			uint64_t made = lb_stat(CT_CREATED) + lb_stat(CT_EMBRYONIC) - created;
			if (c == C_SYN_NEW && made != (uint64_t)CHUNKS * (per + WARMUP)) {
				fprintf(stderr, "lb: new flows were not all remembered (%llu of %d)\n",
					(unsigned long long)made, CHUNKS * (per + WARMUP));
				return 1;
			}
			for (int p = 0; p < NPROGS; p++) {
				double p99;
				summarize(durs[p], n, &p50[r][c][p], &mean[r][c][p], &p99);
				fprintf(tsv, "%d\t%s\t%s\t%.0f\t%.1f\t%.0f\t%.2f\n", r + 1, case_name[c],
					prog_name[p], p50[r][c][p], mean[r][c][p], p99, loadavg());
			}
		}
		fflush(tsv);
		fprintf(stderr, "round %d/%d done (loadavg %.2f)\n", r + 1, rounds, loadavg());
	}
	if (lb_stat(CT_INSERT_SKIPPED)) { fprintf(stderr, "lb: flood guard skipped inserts\n"); return 1; }
	uint8_t key[40], next[40];
	uint32_t entries = 0;
	for (void *k = NULL; !bpf_map_get_next_key(katran_lru_fd, k, next); k = key, entries++)
		memcpy(key, next, sizeof key);
	// The new flows of syn_new_flow and handshake, the established and same-SYN flows,
	// the 16k flows (primed on this CPU too) and the UDP and IPv6 flows (all cases run).
	printf("katran: %u flows in CPU %d's LRU (expected %d)\n", entries, cpu,
	       2 * rounds * CHUNKS * (per + WARMUP) + 2 + FLOWS16K + 2);

	// Medians over rounds of the per-round mean (then of the per-round p50: this VM's
	// clock steps in ~10 ns, so p50s are quantized); net = raw - the empty program's
	// value for the same case in the same round; ratios are medians of per-round ratios.
	for (int m = 0; m < 2; m++) {
		double (*v)[NCASES][NPROGS] = m ? p50 : mean;
		printf("\n%s of per-call ns, median of %d rounds x %d calls (net = raw - empty)\n",
		       m ? "median (p50)" : "mean", rounds, n);
		printf("| case | empty | lb raw / net | Katran raw / net | lb/Katran raw | lb/Katran net |\n");
		printf("|---|---|---|---|---|---|\n");
		for (int c = 0; c < NCASES; c++) {
			double raw[NPROGS], net[NPROGS], t[MAX_ROUNDS], u[MAX_ROUNDS];
			for (int p = 0; p < NPROGS; p++) {
				for (int r = 0; r < rounds; r++) t[r] = v[r][c][p];
				raw[p] = median(t, rounds);
				for (int r = 0; r < rounds; r++) t[r] = v[r][c][p] - v[r][c][P_EMPTY];
				net[p] = median(t, rounds);
			}
			for (int r = 0; r < rounds; r++) {
				double e = v[r][c][P_EMPTY];
				t[r] = v[r][c][P_LB] / v[r][c][P_KATRAN];
				u[r] = (v[r][c][P_LB] - e) / (v[r][c][P_KATRAN] - e);
			}
			printf("| %s | %.1f | %.1f / %.1f | %.1f / %.1f | %.2f | %.2f |\n", case_name[c],
			       raw[P_EMPTY], raw[P_LB], net[P_LB], raw[P_KATRAN], net[P_KATRAN],
			       median(t, rounds), median(u, rounds));
		}
	}
	return 0;
}
