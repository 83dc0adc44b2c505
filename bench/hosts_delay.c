/* The delay line and switch of bench/hosts.py: one TUN device in each host's network namespace, and
 * every IPv4 packet a host sends into its TUN written into the TUN of the host it is addressed to, a
 * fixed delay later, at most at the switch port's rate. Built by bench/hosts_net.py with gcc at run time.
 *
 * Note [A delay line between two TUN devices]
 * This kernel has no sch_netem, so no qdisc can hold a packet back for a time. A TUN device hands every
 * packet its host sends (after the host's qdisc: tbf, the NIC's rate) to the process that holds its file
 * descriptor, and a packet that process writes into a TUN is received by that TUN's host, as from a
 * wire. So the delay is this process: it reads a packet, stamps it with the time it is due (now + the
 * one-way delay), keeps it in the destination's ring (a byte ring of [header | packet] records, FIFO),
 * and writes it when due, sleeping in ppoll until the earliest head is due (timer slack 1 ns, so the
 * sleep ends on time; SCHED_FIFO when granted, so that a loaded machine delays the wire no more than a
 * wakeup). The destination is the port whose address is the packet's IPv4 destination: with one port
 * per host this is a switch, the same for 2 hosts (a wire) as for 3 or more. The switch's output ports
 * send at most at the link's rate (departure = max(due, the port's previous departure + its packet's
 * time on the wire)): the host's tbf shapes what it sends, the port what it receives when several
 * hosts send to one at once; a ring that would pass --queue-bytes drops the packet (drop-tail, as a
 * switch's buffer does). A late write (a wakeup that came late) is counted, never made up for: the
 * delay is a lower bound, the lateness the stats report is what it adds.
 * The parent's death ends this process (PR_SET_PDEATHSIG), and the TUNs are not persistent: they vanish
 * with it, so a killed benchmark leaves no device behind.
 *
 * Usage: hosts_delay --tag T --delay-ns D --rate-bps R --queue-bytes Q --mtu M --parent PID [--rt PRIO]
 *                    --port NETNS_FILE:IFNAME:A.B.C.D [--port ...]
 * Prints "ready" on stdout once every TUN exists; on SIGTERM/SIGINT prints one line of stats (JSON) and
 * exits 0. Errors: a message on stderr naming what failed, exit 2.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#define MAX_PORTS 16
#define HDR 16u
#define WRAP 0xffffffffu
#define READS_PER_WAKE 64  /* packets read from one port before the others get a turn */

struct rec { uint64_t dep_ns; uint32_t len; uint32_t pad; };

struct port {
    int fd;
    uint32_t addr;                 /* network byte order */
    char ifname[IFNAMSIZ];
    unsigned char *ring;           /* records [rec | packet, padded to 16] */
    size_t cap, head, tail, bytes; /* bytes: queued packet bytes (the --queue-bytes limit) */
    uint64_t count, free_at_ns;
    uint64_t pkts, wire_bytes, drop_queue, drop_write;
};

static struct port ports[MAX_PORTS];
static int nports;
static volatile sig_atomic_t stop;
static uint64_t delay_ns, rate_bps, queue_bytes, mtu = 65535;
static uint64_t late_sum_ns, late_max_ns, late_n, late_over_50us, drop_noroute;

static void die(const char *what) {
    fprintf(stderr, "hosts_delay: %s: %s\n", what, strerror(errno));
    exit(2);
}

static void bad(const char *what) {
    fprintf(stderr, "hosts_delay: %s\n", what);
    exit(2);
}

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static void on_signal(int sig) { (void)sig; stop = 1; }

static size_t padded(size_t len) { return HDR + ((len + 15u) & ~(size_t)15u); }

/* Room for a record of `need` bytes at the tail, wrapping to the start when the end is too short.
 * Returns the offset or (size_t)-1 when the ring is full. */
static size_t ring_reserve(struct port *p, size_t need) {
    if (p->count == 0) p->head = p->tail = 0;
    if (p->count == 0 || p->tail > p->head) {
        if (p->cap - p->tail >= need) return p->tail;
        if (p->count != 0 && p->head <= need) return (size_t)-1;   /* the start is still in use */
        if (p->count == 0 && p->cap < need) return (size_t)-1;
        if (p->cap - p->tail >= HDR) {                             /* mark the skipped end */
            struct rec w = {0, WRAP, 0};
            memcpy(p->ring + p->tail, &w, sizeof w);
        }
        p->tail = 0;
        return 0;
    }
    /* wrapped: the free space is [tail, head) */
    return p->head - p->tail > need ? p->tail : (size_t)-1;
}

static struct rec *ring_head(struct port *p) {
    if (p->count == 0) return NULL;
    if (p->cap - p->head < HDR || ((struct rec *)(p->ring + p->head))->len == WRAP) p->head = 0;
    return (struct rec *)(p->ring + p->head);
}

static void enqueue(struct port *dst, const unsigned char *pkt, size_t len, uint64_t now) {
    if (queue_bytes && dst->bytes + len > queue_bytes) { dst->drop_queue++; return; }
    size_t need = padded(len), at = ring_reserve(dst, need);
    if (at == (size_t)-1) { dst->drop_queue++; return; }
    uint64_t dep = now + delay_ns;
    if (rate_bps) {   /* the switch port: one packet on the wire at a time, at the link's rate */
        if (dep < dst->free_at_ns) dep = dst->free_at_ns;
        dst->free_at_ns = dep + (uint64_t)len * 8u * 1000000000ull / rate_bps;
    }
    struct rec r = {dep, (uint32_t)len, 0};
    memcpy(dst->ring + at, &r, sizeof r);
    memcpy(dst->ring + at + HDR, pkt, len);
    dst->tail = at + need;
    dst->count++;
    dst->bytes += len;
}

static struct port *route(const unsigned char *pkt, size_t len) {
    if (len < 20 || (pkt[0] >> 4) != 4) return NULL;   /* IPv4 only (IPv6 is off on the TUNs) */
    uint32_t dst;
    memcpy(&dst, pkt + 16, 4);
    for (int i = 0; i < nports; i++)
        if (ports[i].addr == dst) return &ports[i];
    return NULL;
}

/* Writes every packet of p that is due; returns the departure time of the next one (0: none). */
static uint64_t send_due(struct port *p, uint64_t now) {
    struct rec *r;
    while ((r = ring_head(p)) != NULL) {
        if (r->dep_ns > now) return r->dep_ns;
        uint64_t late = now - r->dep_ns;
        late_sum_ns += late; late_n++;
        if (late > late_max_ns) late_max_ns = late;
        if (late > 50000) late_over_50us++;
        if (write(p->fd, (unsigned char *)r + HDR, r->len) == (ssize_t)r->len) {
            p->pkts++; p->wire_bytes += r->len;
        } else {
            p->drop_write++;
        }
        p->bytes -= r->len;
        p->head += padded(r->len);
        if (--p->count == 0) p->head = p->tail = 0;
        now = now_ns();
    }
    return 0;
}

static void open_port(struct port *p, const char *spec, int home_ns) {
    char buf[512];
    if (strlen(spec) >= sizeof buf) bad("--port: too long");
    strcpy(buf, spec);
    char *c1 = strchr(buf, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
    if (!c1 || !c2) bad("--port: expected NETNS_FILE:IFNAME:A.B.C.D");
    *c1 = *c2 = '\0';
    if (strlen(c1 + 1) == 0 || strlen(c1 + 1) >= IFNAMSIZ) bad("--port: IFNAME must have 1 to 15 characters");
    strcpy(p->ifname, c1 + 1);
    struct in_addr a;
    if (inet_pton(AF_INET, c2 + 1, &a) != 1) bad("--port: not an IPv4 address");
    p->addr = a.s_addr;
    int ns = open(buf, O_RDONLY | O_CLOEXEC);
    if (ns < 0) die(buf);
    if (setns(ns, CLONE_NEWNET) != 0) die("setns into the host's namespace");
    close(ns);
    p->fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (p->fd < 0) die("/dev/net/tun");
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    ifr.ifr_flags = IFF_TUN | IFF_NO_PI;
    strncpy(ifr.ifr_name, p->ifname, IFNAMSIZ - 1);
    if (ioctl(p->fd, TUNSETIFF, &ifr) != 0) die("TUNSETIFF");
    if (setns(home_ns, CLONE_NEWNET) != 0) die("setns back");   /* hold no host namespace */
    p->cap = 2 * (size_t)(queue_bytes ? queue_bytes : (64u << 20)) + 64 * padded(mtu);
    p->ring = malloc(p->cap);
    if (!p->ring) bad("out of memory for a ring");
}

static uint64_t number(const char *flag, const char *v) {
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (errno || *end || !*v) { fprintf(stderr, "hosts_delay: %s: not a number: %s\n", flag, v); exit(2); }
    return x;
}

int main(int argc, char **argv) {
    const char *port_specs[MAX_PORTS];
    long parent = 0;
    int rt = 0;
    for (int i = 1; i < argc; i++) {
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) { fprintf(stderr, "hosts_delay: %s needs a value\n", f); return 2; }
        i++;
        if (!strcmp(f, "--tag")) continue;   /* names the run in `ps` (leftover detection) */
        else if (!strcmp(f, "--delay-ns")) delay_ns = number(f, v);
        else if (!strcmp(f, "--rate-bps")) rate_bps = number(f, v);
        else if (!strcmp(f, "--queue-bytes")) queue_bytes = number(f, v);
        else if (!strcmp(f, "--mtu")) mtu = number(f, v);
        else if (!strcmp(f, "--parent")) parent = (long)number(f, v);
        else if (!strcmp(f, "--rt")) rt = (int)number(f, v);
        else if (!strcmp(f, "--port")) {
            if (nports == MAX_PORTS) bad("--port: too many ports");
            port_specs[nports++] = v;
        } else { fprintf(stderr, "hosts_delay: unknown flag %s\n", f); return 2; }
    }
    if (nports < 2) bad("--port: at least two ports");
    if (mtu < 68 || mtu > 65535) bad("--mtu: 68 to 65535");
    /* the parent's death ends us; if it died before this call, end now */
    if (prctl(PR_SET_PDEATHSIG, SIGTERM) != 0) die("PR_SET_PDEATHSIG");
    if (parent && getppid() != parent) return 0;
    prctl(PR_SET_TIMERSLACK, 1UL);
    /* the stop signals are blocked except inside ppoll, so one that comes between the loop's test of
       `stop` and the sleep ends the sleep instead of being missed */
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    sigset_t stops;
    sigemptyset(&stops);
    sigaddset(&stops, SIGTERM);
    sigaddset(&stops, SIGINT);
    sigprocmask(SIG_BLOCK, &stops, NULL);
    int home = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
    if (home < 0) die("/proc/self/ns/net");
    for (int i = 0; i < nports; i++) open_port(&ports[i], port_specs[i], home);
    close(home);
    const char *sched = "other";
    if (rt > 0) {
        struct sched_param sp = {.sched_priority = rt};
        sched = sched_setscheduler(0, SCHED_FIFO, &sp) == 0 ? "fifo" : "other (SCHED_FIFO refused)";
    }
    uint64_t t_start = now_ns();
    printf("ready sched=%s\n", sched);
    fflush(stdout);

    struct pollfd pfd[MAX_PORTS];
    for (int i = 0; i < nports; i++) pfd[i] = (struct pollfd){ports[i].fd, POLLIN, 0};
    unsigned char *pkt = malloc(65536);
    if (!pkt) bad("out of memory");
    sigset_t none;
    sigemptyset(&none);
    while (!stop) {
        uint64_t now = now_ns(), next = 0;
        for (int i = 0; i < nports; i++) {
            uint64_t d = send_due(&ports[i], now);
            if (d && (!next || d < next)) next = d;
        }
        struct timespec ts, *tp = NULL;
        if (next) {
            now = now_ns();
            uint64_t wait = next > now ? next - now : 0;
            ts.tv_sec = (time_t)(wait / 1000000000ull);
            ts.tv_nsec = (long)(wait % 1000000000ull);
            tp = &ts;
        }
        int n = ppoll(pfd, (nfds_t)nports, tp, &none);
        if (n < 0) {
            if (errno == EINTR) continue;
            die("ppoll");
        }
        for (int i = 0; i < nports && n > 0; i++) {
            if (!(pfd[i].revents & POLLIN)) continue;
            for (int k = 0; k < READS_PER_WAKE; k++) {
                ssize_t len = read(ports[i].fd, pkt, 65536);
                if (len <= 0) break;   /* EAGAIN: drained */
                struct port *dst = route(pkt, (size_t)len);
                if (dst == NULL || dst == &ports[i]) { drop_noroute++; continue; }
                enqueue(dst, pkt, (size_t)len, now_ns());
            }
        }
    }
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double cpu_s = (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
                   (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-6;
    printf("{\"cpu_s\": %.3f, \"wall_s\": %.3f, \"late_n\": %llu, \"late_mean_ns\": %llu, "
           "\"late_max_ns\": %llu, \"late_over_50us\": %llu, "
           "\"drop_noroute\": %llu, \"sched\": \"%s\", \"ports\": [",
           cpu_s, (double)(now_ns() - t_start) * 1e-9,
           (unsigned long long)late_n, (unsigned long long)(late_n ? late_sum_ns / late_n : 0),
           (unsigned long long)late_max_ns, (unsigned long long)late_over_50us,
           (unsigned long long)drop_noroute, sched);
    for (int i = 0; i < nports; i++)
        printf("%s{\"ifname\": \"%s\", \"pkts\": %llu, \"bytes\": %llu, \"drop_queue\": %llu, "
               "\"drop_write\": %llu}", i ? ", " : "", ports[i].ifname, (unsigned long long)ports[i].pkts,
               (unsigned long long)ports[i].wire_bytes, (unsigned long long)ports[i].drop_queue,
               (unsigned long long)ports[i].drop_write);
    printf("]}\n");
    fflush(stdout);
    return 0;
}
