/*
 * `tandem bench xfer`: bandwidth of paged writes over page sizes 4 KiB..1 MiB and the latency of
 * a small write, per libfabric provider, each printed next to a reference measured in the same
 * run: iperf3 loopback TCP throughput for tcp (iperf3 -s -1 and iperf3 -c ... -J as child
 * processes, the JSON parsed with jansson), and single-thread memcpy bandwidth for shm.
 *
 * Shape: one process, two engines (a writer and a target) joined over the provider, so both
 * progress threads run as they would in two nodes. A paged write moves --pages-per-write pages
 * chosen at random (no two contiguous, so no merging helps: the worst case of a real KV pool)
 * and carries an immediate; the target's counter fires when every write of the round has
 * landed, and that instant ends the timing (bytes landed, not bytes posted: the one-way rate,
 * as fabtests' fi_rma_bw -o writedata counts it). Up to --window writes are in flight. Like
 * fabtests, each page size first runs an untimed warm-up round, then --rounds timed rounds; the
 * median is shown. Latency: ping-pong of 8-byte writes with immediates, each side's counter
 * callback posting the next write (as fi_rdm_pingpong's two processes do, no third thread in
 * the loop); the one-way figure is half the median round trip. --busy-poll makes the progress
 * threads spin (the engine's busy_poll), as fabtests' own loops do. Its reference is libfabric's
 * own ping-pong, fi_pingpong (Debian's libfabric-bin) over the same provider, RDM endpoints,
 * 8-byte messages, as two child processes stopped by PID: its usec/xfer, the time of a round
 * trip over its two transfers, is the same one-way figure.
 *
 * Output check: after the last round the target's pages are compared with the writer's source
 * pages and a checksum of the destination region is printed, so a fast wrong answer shows.
 * The CUDA IPC transport is measured by tests/tools/xfer_cuda_check.cu on a two-GPU machine.
 *
 * Rails (--rails N, tcp): each side is a rail set of N endpoints on --node (src/xfer/rails.c),
 * and the bandwidth rounds go through its transport, spread round-robin over the rails; each
 * rail's share of the writes is printed. The latency row stays on rail 0.
 */
#include <fcntl.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tandem/xfer.h"
#include "tools/tools_int.h"

struct bx_opts {
    const char *providers; /* comma-separated */
    const char *node;
    int64_t region_mib;
    int64_t pages_per_write;
    int64_t window;
    int64_t round_mib;
    int64_t rounds;
    int64_t pings;
    int64_t iperf_seconds;
    bool busy_poll;
    bool show_rounds;
    int64_t rails;
    const char *fi_pingpong; /* the latency reference's binary ("none": skipped) */
};

struct bx_fire {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int fired;
    bool waiting; /* the callback wakes only a thread that waits */
    tdm_status st;
};

static void bx_on_fire(void *ctx, uint32_t slot, uint32_t epoch, tdm_status st)
{
    struct bx_fire *f = ctx;
    pthread_mutex_lock(&f->mu);
    f->fired++;
    f->st = st;
    if (f->waiting) pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
}

static tdm_status bx_wait_fire(struct bx_fire *f, int want, int timeout_ms)
{
    struct timespec ts = tdm_deadline_ms(CLOCK_REALTIME, timeout_ms);
    pthread_mutex_lock(&f->mu);
    f->waiting = true;
    while (f->fired < want)
        if (pthread_cond_timedwait(&f->cv, &f->mu, &ts) != 0) break;
    f->waiting = false;
    tdm_status st = f->fired >= want ? f->st : TDM_ETIMEDOUT;
    pthread_mutex_unlock(&f->mu);
    return st;
}

/* ---- references ---- */

static double bx_memcpy_gbs(void)
{
    size_t n = (size_t)64 << 20;
    uint8_t *a = tdm_alloc_aligned(n), *b = tdm_alloc_aligned(n);
    double best = 0;
    if (!a || !b) goto out;
    memset(a, 1, n);
    memset(b, 2, n);
    for (int i = 0; i < 5; i++) {
        uint64_t t0 = tdm_now_ns();
        memcpy(i & 1 ? a : b, i & 1 ? b : a, n);
        double gbs = (double)n / ((double)(tdm_now_ns() - t0) * 1e-9) / 1e9;
        if (gbs > best) best = gbs;
    }
out:
    tdm_free_aligned(a);
    tdm_free_aligned(b);
    return best;
}

/* A reference tool on loopback, as its own server and client (child processes stopped by
 * PID): the server's output dropped, the client's stdout read (at most cap bytes) until it
 * exits or timeout_s passes, returned malloc'd and NUL-terminated; NULL when the server
 * exited at once (not installed, or its port taken) or the client could not be started. The
 * server then has a second to exit, a TERM (which lets shm unlink its region), a second more,
 * and a KILL. */
static char *bx_run_ref(char *const server_argv[], char *const client_argv[], int timeout_s,
                        size_t cap)
{
    pid_t server = fork();
    if (server < 0) return NULL;
    if (server == 0) {
        int devnull = open("/dev/null", O_WRONLY);
        if (devnull >= 0) dup2(devnull, 1), dup2(devnull, 2);
        execvp(server_argv[0], server_argv);
        _exit(127);
    }
    usleep(300000);
    char *buf = NULL;
    int fds[2] = {-1, -1};
    pid_t client = -1;
    if (waitpid(server, NULL, WNOHANG) == server) {
        fprintf(stderr, "tandem: bench xfer: %s's server exited at once\n", server_argv[0]);
        return NULL;
    }
    if (pipe(fds) == 0 && (client = fork()) == 0) {
        dup2(fds[1], 1);
        int devnull = open("/dev/null", O_WRONLY);
        if (devnull >= 0) dup2(devnull, 2);
        close(fds[0]);
        execvp(client_argv[0], client_argv);
        _exit(127);
    }
    if (client > 0 && (buf = malloc(cap + 1))) {
        close(fds[1]);
        size_t len = 0;
        const uint64_t deadline = tdm_now_ns() + (uint64_t)timeout_s * 1000000000ull;
        fcntl(fds[0], F_SETFL, fcntl(fds[0], F_GETFL) | O_NONBLOCK);
        while (len < cap && tdm_now_ns() < deadline) {
            ssize_t n = read(fds[0], buf + len, cap - len);
            if (n == 0) break;
            if (n > 0)
                len += (size_t)n;
            else
                usleep(10000);
        }
        buf[len] = '\0';
        close(fds[0]);
    } else if (fds[0] >= 0) {
        close(fds[0]);
        close(fds[1]);
    }
    if (client > 0) {
        kill(client, SIGKILL); /* gone already, or past the deadline */
        waitpid(client, NULL, 0);
    }
    for (int i = 0; i < 200 && waitpid(server, NULL, WNOHANG) == 0; i++) {
        if (i == 100) kill(server, SIGTERM);
        usleep(10000);
    }
    if (kill(server, SIGKILL) == 0) waitpid(server, NULL, 0);
    return buf;
}

/* Runs iperf3 server and client on loopback; returns received GB/s, or 0 when unavailable. */
static double bx_iperf3_gbs(int seconds)
{
    char port_s[16], secs_s[16];
    snprintf(port_s, sizeof(port_s), "%d", 20000 + (int)(getpid() % 20000));
    snprintf(secs_s, sizeof(secs_s), "%d", seconds);
    char *const server[] = {"iperf3", "-s", "-1", "-p", port_s, NULL};
    char *const client[] = {"iperf3", "-c", "127.0.0.1", "-p", port_s, "-t", secs_s, "-J", NULL};
    char *out = bx_run_ref(server, client, seconds + 60, 1 << 20);
    double gbs = 0;
    if (out) {
        json_error_t jerr;
        json_t *root = json_loads(out, 0, &jerr);
        json_t *bps = json_object_get(json_object_get(json_object_get(root, "end"), "sum_received"),
                                      "bits_per_second");
        if (json_is_number(bps)) gbs = json_number_value(bps) / 8e9;
        json_decref(root);
    }
    free(out);
    return gbs;
}

/* Runs libfabric's fi_pingpong (server and client, RDM endpoints, `bytes`-byte messages,
 * `iters` round trips) over provider `prov` on loopback; *us: its usec/xfer (half a round trip).
 * false when it is not installed or did not report in time. */
static bool bx_fi_pingpong(const char *path, const char *prov, int bytes, int iters, double *us)
{
    static int turn;
    char port_s[16], size_s[16], iters_s[16], path_s[512], prov_s[64];
    snprintf(port_s, sizeof port_s, "%d", 30000 + (int)((getpid() * 7 + turn++) % 20000));
    snprintf(size_s, sizeof size_s, "%d", bytes);
    snprintf(iters_s, sizeof iters_s, "%d", iters);
    snprintf(path_s, sizeof path_s, "%s", path);
    snprintf(prov_s, sizeof prov_s, "%s", prov);
    char *const server[] = {path_s,  "-p", prov_s, "-e", "rdm",  "-I",
                            iters_s, "-S", size_s, "-B", port_s, NULL};
    char *const client[] = {path_s, "-p",   prov_s, "-e",   "rdm",       "-I", iters_s,
                            "-S",   size_s, "-P",   port_s, "127.0.0.1", NULL};
    char *out = bx_run_ref(server, client, 60, 4095);
    bool ok = false;
    /* bytes #sent #ack total time MB/sec usec/xfer Mxfers/sec: the line of our size */
    char *save = NULL;
    for (char *line = out ? strtok_r(out, "\n", &save) : NULL; line && !ok;
         line = strtok_r(NULL, "\n", &save)) {
        char b[32], f[5][32];
        double v;
        if (sscanf(line, "%31s %31s %31s %31s %31s %31s %lf", b, f[0], f[1], f[2], f[3], f[4],
                   &v) == 7 &&
            atoi(b) == bytes && v > 0) {
            *us = v;
            ok = true;
        }
    }
    free(out);
    return ok;
}

/* ---- one provider ---- */

struct bx_pair {
    tdm_xfer_t *w, *t;         /* writer, target (with rails: the sets' rail 0) */
    tdm_xfer_rails_t *wr, *tr; /* --rails > 1: the rail sets, else NULL */
    /* what the bandwidth rounds write through: the writer's fabric engine, or its rail set */
    struct tdm_xfer_transport wtp, ttp;
    struct tdm_xfer_region src_reg, dst_reg;
    struct tdm_xfer_rmem dst_rrmem;
    uint32_t w_to_t, t_to_w;
    uint8_t *src, *dst;
    size_t region_bytes;
    tdm_xfer_mr_t *src_mr, *dst_mr;
    struct tdm_xfer_rmem dst_rmem, src_rmem; /* src_rmem: the writer's region, for pongs */
};

static void bx_pair_free(struct bx_pair *p)
{
    tdm_xfer_mr_dereg(p->src_mr);
    tdm_xfer_mr_dereg(p->dst_mr);
    if (p->wtp.iface) p->wtp.iface->mr_dereg(p->wtp.t, &p->src_reg);
    if (p->ttp.iface) p->ttp.iface->mr_dereg(p->ttp.t, &p->dst_reg);
    if (p->wr) {
        tdm_xfer_rails_destroy(p->wr);
        tdm_xfer_rails_destroy(p->tr);
    } else {
        tdm_xfer_destroy(p->w);
        tdm_xfer_destroy(p->t);
    }
    tdm_free_aligned(p->src);
    tdm_free_aligned(p->dst);
}

static tdm_status bx_pair_open(const char *provider, const char *node, size_t region_bytes,
                               const struct bx_opts *o, struct bx_pair *p)
{
    memset(p, 0, sizeof(*p));
    struct tdm_xfer_config cfg;
    tdm_xfer_config_default(&cfg);
    cfg.provider = provider;
    cfg.node = !strcmp(provider, "shm") ? NULL : node;
    cfg.faults = "";
    cfg.op_timeout_ms = 30000;
    cfg.peer_timeout_ms = 10000; /* a loaded machine must not fake a death mid-run */
    cfg.window_writes = (int)o->window;
    cfg.window_pages = (int)o->pages_per_write;
    cfg.busy_poll = o->busy_poll;
    tdm_status st;
    if (o->rails > 1) {
        struct tdm_xfer_rails_config rc = {.base = cfg, .n_rails = (int)o->rails};
        for (int r = 0; r < rc.n_rails; r++)
            rc.nics[r] = cfg.node;
        if ((st = tdm_xfer_rails_create(&rc, &p->wr)) != TDM_OK) return st;
        if ((st = tdm_xfer_rails_create(&rc, &p->tr)) != TDM_OK) return st;
        p->w = tdm_xfer_rails_control(p->wr);
        p->t = tdm_xfer_rails_control(p->tr);
        p->wtp = tdm_xfer_rails_transport(p->wr);
        p->ttp = tdm_xfer_rails_transport(p->tr);
    } else {
        if ((st = tdm_xfer_create(&cfg, &p->w)) != TDM_OK) return st;
        if ((st = tdm_xfer_create(&cfg, &p->t)) != TDM_OK) return st;
        p->wtp = tdm_xfer_fabric_transport(p->w);
        p->ttp = tdm_xfer_fabric_transport(p->t);
    }
    p->region_bytes = region_bytes;
    p->src = tdm_alloc_aligned(region_bytes);
    p->dst = tdm_alloc_aligned(region_bytes);
    if (!p->src || !p->dst) return tdm_err_set(TDM_ENOMEM, "bench xfer: out of memory");
    for (size_t i = 0; i < region_bytes; i += 8) {
        uint64_t v = (i + 1) * 0x9E3779B97F4A7C15ull;
        memcpy(p->src + i, &v, 8);
    }
    memset(p->dst, 0, region_bytes);
    if ((st = tdm_xfer_mr_reg(p->w, p->src, region_bytes, TDM_XFER_MEM_HOST, &p->src_mr)) ||
        (st = tdm_xfer_mr_reg(p->t, p->dst, region_bytes, TDM_XFER_MEM_HOST, &p->dst_mr)))
        return st;
    tdm_xfer_mr_remote(p->dst_mr, &p->dst_rmem);
    tdm_xfer_mr_remote(p->src_mr, &p->src_rmem);
    if ((st = p->wtp.iface->mr_reg(p->wtp.t, p->src, region_bytes, TDM_XFER_MEM_HOST,
                                   &p->src_reg)) ||
        (st = p->ttp.iface->mr_reg(p->ttp.t, p->dst, region_bytes, TDM_XFER_MEM_HOST, &p->dst_reg)))
        return st;
    p->ttp.iface->mr_remote(p->ttp.t, &p->dst_reg, &p->dst_rrmem);
    char addr[TDM_XFER_ADDR_MAX];
    if ((st = tdm_xfer_addr(p->t, addr, sizeof(addr))) ||
        (st = tdm_xfer_peer_add(p->w, addr, &p->w_to_t)) ||
        (st = tdm_xfer_peer_wait(p->w, p->w_to_t, 5000)))
        return st;
    if ((st = tdm_xfer_addr(p->w, addr, sizeof(addr))) ||
        (st = tdm_xfer_peer_add(p->t, addr, &p->t_to_w)) ||
        (st = tdm_xfer_peer_wait(p->t, p->t_to_w, 5000)))
        return st;
    for (int i = 0; p->wr && tdm_xfer_rails_peer_rails(p->wr, p->w_to_t) < o->rails; i++) {
        if (i == 1000)
            return tdm_err_set(TDM_ETIMEDOUT, "bench xfer: the rails did not pair in 10 s");
        usleep(10000);
    }
    return TDM_OK;
}

static uint64_t bx_rand(uint64_t *s)
{
    *s ^= *s << 13, *s ^= *s >> 7, *s ^= *s << 17;
    return *s;
}

/* Bandwidth in GB/s for one page size; *verified says whether the last round's pages match. */
static tdm_status bx_bandwidth(struct bx_pair *p, const struct bx_opts *o, size_t page, double *gbs,
                               bool *verified, uint64_t *checksum, char *rounds_text, size_t cap)
{
    uint32_t region_pages = (uint32_t)(p->region_bytes / page);
    uint32_t per_write = (uint32_t)TDM_MIN((int64_t)region_pages, o->pages_per_write);
    size_t round_bytes = (size_t)o->round_mib << 20;
    uint32_t writes = (uint32_t)TDM_MAX(1, round_bytes / (page * per_write));
    if (writes > 4000) writes = 4000;
    uint32_t *sp = malloc(sizeof(uint32_t) * region_pages);
    uint32_t *dp = malloc(sizeof(uint32_t) * region_pages);
    if (!sp || !dp) {
        free(sp);
        free(dp);
        return tdm_err_set(TDM_ENOMEM, "bench xfer: out of memory");
    }
    uint64_t rs = 0x1234567ull + page;
    /* a permutation where no two consecutive entries are consecutive pages (no merging) */
    for (uint32_t i = 0; i < region_pages; i++)
        sp[i] = dp[i] = i;
    for (uint32_t i = 0; i + 1 < region_pages; i++) {
        uint32_t j = i + (uint32_t)(bx_rand(&rs) % (region_pages - i)), t = sp[i];
        sp[i] = sp[j], sp[j] = t;
        j = i + (uint32_t)(bx_rand(&rs) % (region_pages - i)), t = dp[i];
        dp[i] = dp[j], dp[j] = t;
    }
    tdm_status st = TDM_OK;
    double rates[101];
    int n_rates = 0;
    struct tdm_xfer_sync sync;
    tdm_xfer_sync_init(&sync);
    /* round 0 is the warm-up: untimed */
    for (int64_t round = 0; round <= o->rounds && st == TDM_OK; round++) {
        struct bx_fire f = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, false, TDM_OK};
        uint32_t epoch = (uint32_t)(round + 1) & 0xff;
        st = tdm_xfer_counters_arm(tdm_xfer_get_counters(p->t), 1, epoch, writes, p->t_to_w, 60000,
                                   bx_on_fire, &f);
        if (st != TDM_OK) break;
        uint64_t t0 = tdm_now_ns();
        for (uint32_t w = 0; w < writes && st == TDM_OK; w++) {
            uint32_t off = (uint32_t)(((uint64_t)w * per_write) % (region_pages - per_write + 1));
            struct tdm_xfer_pages pages = {sp + off, dp + off, per_write, page, page, page, 0, 0};
            struct tdm_xfer_imm imm = {1, epoch, w};
            /* every accepted write's done fires: no hang */
            if ((st = tdm_xfer_sync_wait_below(&sync, (int)o->window, 60000)) != TDM_OK) break;
            tdm_xfer_sync_add(&sync, 1);
            while ((st = p->wtp.iface->write_pages(p->wtp.t, p->w_to_t, &p->src_reg, &p->dst_rrmem,
                                                   &pages, &imm, 0, tdm_xfer_sync_done, &sync)) ==
                   TDM_EAGAIN)
                ;
            if (st != TDM_OK) tdm_xfer_sync_done(&sync, st);
        }
        if (st == TDM_OK) st = bx_wait_fire(&f, 1, 60000);
        double sec = (double)(tdm_now_ns() - t0) * 1e-9;
        tdm_status st2 = tdm_xfer_sync_wait(&sync, 60000);
        if (st == TDM_OK) st = st2;
        double r = (double)writes * per_write * page / sec / 1e9;
        if (st == TDM_OK && round > 0) rates[n_rates++] = r;
    }
    tdm_xfer_sync_destroy(&sync);
    /* the final state: every destination page written in the last round holds its source */
    bool ok = st == TDM_OK;
    for (uint32_t w = 0; w < writes && ok; w++) {
        uint32_t off = (uint32_t)(((uint64_t)w * per_write) % (region_pages - per_write + 1));
        for (uint32_t i = 0; i < per_write && ok; i++)
            ok = !memcmp(p->dst + (size_t)dp[off + i] * page, p->src + (size_t)sp[off + i] * page,
                         page);
    }
    uint64_t h = 1469598103934665603ull; /* FNV-1a over every 8-byte word of the destination */
    for (size_t i = 0; i + 8 <= p->region_bytes; i += 8) {
        uint64_t v;
        memcpy(&v, p->dst + i, 8);
        h = (h ^ v) * 1099511628211ull;
    }
    size_t used = 0;
    rounds_text[0] = '\0';
    for (int i = 0; i < n_rates && used < cap; i++)
        used += (size_t)snprintf(rounds_text + used, cap - used, " %.2f", rates[i]);
    for (int i = 1; i < n_rates; i++) /* the median of the timed rounds */
        for (int k = i; k > 0 && rates[k] < rates[k - 1]; k--) {
            double t = rates[k];
            rates[k] = rates[k - 1], rates[k - 1] = t;
        }
    *gbs = n_rates ? (n_rates & 1 ? rates[n_rates / 2]
                                  : (rates[n_rates / 2 - 1] + rates[n_rates / 2]) / 2)
                   : 0;
    *verified = ok;
    *checksum = h;
    free(sp);
    free(dp);
    return st;
}

/* Ping-pong: each side's counter callback posts the next write (on its progress thread), so
 * the loop runs between the two engines alone; the main thread waits once. */
struct bx_ping {
    struct bx_pair *p;
    int total, done; /* round trips wanted, and completed */
    uint64_t *t;     /* [total + 1] when each ping was posted */
    tdm_status st;
    struct bx_fire end;
};

static void bx_ping_fire(void *ctx, uint32_t slot, uint32_t epoch, tdm_status st);

static tdm_status bx_ping_post(struct bx_ping *g)
{
    struct bx_pair *p = g->p;
    uint32_t epoch = (uint32_t)g->done & 0xff;
    tdm_status st = tdm_xfer_counters_arm(tdm_xfer_get_counters(p->w), 2, epoch, 1, p->w_to_t,
                                          10000, bx_ping_fire, g);
    if (st != TDM_OK) return st;
    struct tdm_xfer_imm imm = {2, epoch, 0};
    g->t[g->done] = tdm_now_ns();
    return tdm_xfer_write(p->w, p->w_to_t, p->src_mr, 0, &p->dst_rmem, 0, 8, &imm, 0, NULL, NULL);
}

static void bx_ping_fire(void *ctx, uint32_t slot, uint32_t epoch, tdm_status st)
{
    struct bx_ping *g = ctx;
    if (st == TDM_OK && ++g->done < g->total) st = bx_ping_post(g);
    if (st != TDM_OK || g->done >= g->total) {
        if (g->done >= g->total) g->t[g->total] = tdm_now_ns();
        g->st = st;
        bx_on_fire(&g->end, slot, epoch, st);
    }
}

static void bx_pong_fire(void *ctx, uint32_t slot, uint32_t epoch, tdm_status st)
{
    struct bx_pair *p = ctx;
    if (st != TDM_OK) return;
    struct tdm_xfer_imm imm = {2, epoch, 0};
    tdm_xfer_counters_arm(tdm_xfer_get_counters(p->t), 2, (epoch + 1) & 0xff, 1, p->t_to_w, 10000,
                          bx_pong_fire, p);
    tdm_xfer_write(p->t, p->t_to_w, p->dst_mr, 64, &p->src_rmem, 64, 8, &imm, 0, NULL, NULL);
}

static int bx_cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static tdm_status bx_latency(struct bx_pair *p, int pings, double *one_way_us)
{
    int warm = pings / 10 + 10;
    struct bx_ping g = {.p = p, .total = pings + warm};
    g.end = (struct bx_fire){PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, false, TDM_OK};
    g.t = malloc(sizeof(uint64_t) * (size_t)(g.total + 1));
    if (!g.t) return tdm_err_set(TDM_ENOMEM, "bench xfer: out of memory");
    tdm_status st = tdm_xfer_counters_arm(tdm_xfer_get_counters(p->t), 2, 0, 1, p->t_to_w, 10000,
                                          bx_pong_fire, p);
    if (st == TDM_OK) st = bx_ping_post(&g);
    if (st == TDM_OK) st = bx_wait_fire(&g.end, 1, 10000 + g.total * 10);
    if (st == TDM_OK) st = g.st;
    tdm_xfer_counters_cancel(tdm_xfer_get_counters(p->t), 2, (uint32_t)g.total & 0xff);
    if (st == TDM_OK) {
        uint64_t *rtt = g.t; /* round trip i: from ping i to ping i + 1, in place */
        for (int i = 0; i < pings; i++)
            rtt[i] = g.t[warm + i + 1] - g.t[warm + i];
        qsort(rtt, (size_t)pings, sizeof(uint64_t), bx_cmp_u64);
        *one_way_us = (double)rtt[pings / 2] / 2e3;
    } else {
        tdm_xfer_counters_cancel(tdm_xfer_get_counters(p->w), 2, (uint32_t)g.done & 0xff);
    }
    free(g.t);
    return st;
}

static void bx_usage_to(FILE *f)
{
    fprintf(f, "usage: tandem bench xfer [options]\n"
               "  --provider LIST      comma-separated libfabric providers (default "
               "\"tcp;ofi_rxm,shm\")\n"
               "  --node ADDR          local address for tcp (default 127.0.0.1)\n"
               "  --region-mib N       registered region per side (default 256)\n"
               "  --pages-per-write N  pages in one paged write (default 64)\n"
               "  --window N           paged writes in flight (default 16)\n"
               "  --round-mib N        bytes moved per timed round (default 512)\n"
               "  --rounds N           timed rounds per page size, after a warm-up round; the\n"
               "                       median is shown (default 3)\n"
               "  --pings N            latency round trips (default 2000)\n"
               "  --fi-pingpong PATH   the latency's same-run reference, libfabric's own\n"
               "                       ping-pong (default fi_pingpong; none: skip it)\n"
               "  --iperf-seconds N    iperf3 reference duration (default 3)\n"
               "  --busy-poll          progress threads spin instead of sleeping when idle\n"
               "  --show-rounds        print every timed round's rate under its row\n"
               "  --rails N            tcp: N endpoints a side on --node, writes spread over\n"
               "                       them round-robin (several NICs; default 1)\n"
               "The CUDA IPC transport: tests/tools/xfer_cuda_check.cu on a two-GPU machine.\n");
}

int tdm_cmd_bench_xfer(int argc, char **argv)
{
    struct bx_opts o = {
        "tcp;ofi_rxm,shm", "127.0.0.1", 256, 64, 16, 512, 3, 2000, 3, false, false, 1,
        "fi_pingpong"};
    const char *transport = NULL;
    const struct tdm_opt own[] = {
        TDM_OPT_S("provider", &o.providers),
        TDM_OPT_S("node", &o.node),
        TDM_OPT_I("region-mib", &o.region_mib, 4, 4096),
        TDM_OPT_I("pages-per-write", &o.pages_per_write, 1, 16384),
        TDM_OPT_I("window", &o.window, 1, 512),
        TDM_OPT_I("round-mib", &o.round_mib, 1, 1 << 16),
        TDM_OPT_I("rounds", &o.rounds, 1, 100),
        TDM_OPT_I("pings", &o.pings, 10, 1000000),
        TDM_OPT_I("iperf-seconds", &o.iperf_seconds, 1, 60),
        TDM_OPT_B("busy-poll", &o.busy_poll),
        TDM_OPT_B("show-rounds", &o.show_rounds),
        TDM_OPT_I("rails", &o.rails, 1, TDM_XFER_MAX_RAILS),
        TDM_OPT_S("transport", &transport),
        TDM_OPT_S("fi-pingpong", &o.fi_pingpong),
        TDM_OPT_END,
    };
    const struct tdm_opt *const tables[] = {own, NULL};
    int prc = tdm_tool_parse("bench xfer", argc, argv, tables, bx_usage_to);
    if (prc) return prc == 1 ? 0 : 2;
    if (transport && strcmp(transport, "fabric") != 0) {
        fprintf(stderr, "tandem: the cuda-ipc transport is measured by "
                        "tests/tools/xfer_cuda_check.cu (needs GPUs)\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    static const size_t sizes[] = {4096, 16384, 65536, 262144, 1048576};
    char provs[256];
    snprintf(provs, sizeof(provs), "%s", o.providers);
    int rc = 0;
    char *save = NULL;
    for (char *prov = strtok_r(provs, ",", &save); prov; prov = strtok_r(NULL, ",", &save)) {
        bool tcp = strstr(prov, "tcp") != NULL;
        double ref = tcp ? bx_iperf3_gbs((int)o.iperf_seconds) : bx_memcpy_gbs();
        const char *ref_name = tcp ? "iperf3 loopback TCP" : "memcpy, 1 thread";
        struct bx_pair p;
        tdm_status st = bx_pair_open(prov, o.node, (size_t)o.region_mib << 20, &o, &p);
        if (st != TDM_OK) {
            fprintf(stderr, "tandem: bench xfer: %s: %s\n", prov, tdm_err_msg());
            bx_pair_free(&p);
            rc = 1;
            continue;
        }
        struct tdm_xfer_caps caps;
        tdm_xfer_get_caps(p.w, &caps);
        printf("provider %s (%d-bit immediates, delivery-complete %s, ordered writes %s%s, %d "
               "rail%s); reference: %s %.2f GB/s%s\n",
               caps.provider, caps.imm_bits, caps.delivery_complete ? "yes" : "no",
               caps.ordered_writes ? "yes" : "no", o.busy_poll ? ", busy-poll" : "",
               p.wr ? (int)o.rails : 1, p.wr ? "s" : "", ref_name, ref,
               ref > 0 ? "" : " (unavailable)");
        printf("  %-9s %8s %10s %10s %7s  %s\n", "page", "pages/wr", "GB/s", "ref GB/s", "ratio",
               "check");
        for (size_t i = 0; i < TDM_ARRAY_LEN(sizes) && st == TDM_OK; i++) {
            double gbs = 0;
            bool verified = false;
            uint64_t sum = 0;
            char rounds_text[1024];
            st = bx_bandwidth(&p, &o, sizes[i], &gbs, &verified, &sum, rounds_text,
                              sizeof rounds_text);
            if (st != TDM_OK) break;
            char pg[32];
            snprintf(pg, sizeof(pg), "%zu KiB", sizes[i] >> 10);
            printf("  %-9s %8lld %10.2f %10.2f %6.0f%%  %s %016llx\n", pg,
                   (long long)TDM_MIN(o.pages_per_write, (int64_t)(p.region_bytes / sizes[i])), gbs,
                   ref, ref > 0 ? 100 * gbs / ref : 0.0, verified ? "verified" : "MISMATCH",
                   (unsigned long long)sum);
            if (o.show_rounds) {
                struct tdm_xfer_stats xs;
                tdm_xfer_get_stats(p.w, &xs);
                printf("    rounds (GB/s, in order):%s; writer so far: %llu provider push-backs, "
                       "%llu refused\n",
                       rounds_text, (unsigned long long)xs.eagain_retries,
                       (unsigned long long)xs.writes_refused);
            }
            if (!verified) rc = 1;
        }
        if (p.wr && st == TDM_OK) {
            printf("  writes per rail:");
            for (int r = 0; r < (int)o.rails; r++) {
                struct tdm_xfer_rail_stats rs;
                tdm_xfer_rails_get_stats(p.wr, r, &rs);
                printf(" %d: %llu (%.0f MiB)", r, (unsigned long long)rs.writes,
                       (double)rs.bytes / (1 << 20));
            }
            printf("\n");
        }
        double us = 0;
        if (st == TDM_OK) st = bx_latency(&p, (int)o.pings, &us);
        if (st == TDM_OK) {
            printf("  8-byte write + immediate, one-way latency (median of %lld): %.1f us\n",
                   (long long)o.pings, us);
        } else {
            fprintf(stderr, "tandem: bench xfer: %s: %s\n", prov, tdm_err_msg());
            rc = 1;
        }
        fflush(stdout);
        bx_pair_free(&p);
        /* the reference once this pair's progress threads are gone (they would share the
         * cores with its two processes) */
        double ref_us = 0;
        if (st == TDM_OK && strcmp(o.fi_pingpong, "none") != 0) {
            if (bx_fi_pingpong(o.fi_pingpong, prov, 8, (int)o.pings, &ref_us))
                printf("  reference: %s, RDM, 8-byte messages, %lld round trips: %.1f us "
                       "one-way; tandem / reference %.2fx\n",
                       o.fi_pingpong, (long long)o.pings, ref_us, us / ref_us);
            else
                printf("  reference: %s unavailable (Debian's libfabric-bin has it)\n",
                       o.fi_pingpong);
            fflush(stdout);
        }
    }
    return rc;
}
