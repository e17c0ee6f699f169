/*
 * xfer_peer: one side of a two-process transfer test (tests/xfer/test_xfer_peers.py drives it).
 *
 *   target:     registers a region of --region-pages pages, prints "ADDR <addr>", waits for the
 *               initiator's hello, arms an immediate counter (slot 5, --epoch, --expect or
 *               --writes) bound to that peer, sends the region's descriptor as a control
 *               message, and reports each counter firing ("FIRED code=<tdm_status> n=<k>"). After
 *               --linger-ms (to catch a second firing) it dumps the region (--dump), sends "FIN",
 *               prints counter stats and exits.
 *   initiator:  connects to --peer, waits for the descriptor, posts --writes paged writes of
 *               --pages-per-write random pages (destinations distinct across the run), each with
 *               immediate (5, epoch, i); the first --stale of them carry epoch+1 and are then
 *               re-sent with the right epoch. Dumps its source region and page lists, waits for
 *               FIN, prints "WRITES ok=<n> err=<n> code=<tdm_status>" and exits.
 *
 *   flood:      a hostile peer for the failure campaign (tests/campaign/): connects to --peer
 *               (with --fabric-key FILE or without), prints "PEER up=<0|1>" (with --no-wait it
 *               does not wait for the handshake, and sends while it is unanswered), then with
 *               --prefill-geometry L,H,D,PS,DM,V sends a PREFILL for a 16-token prompt whose KV
 *               and context are to land in a region of its own (free compute; with
 *               --prefill-kv-kind cuda the request claims that region is GPU memory), and for
 *               --flood-ms sends immediates with random slots, epochs and indices (half of them
 *               in the first 8 slots with epochs under 16, where guessing once worked) and, every
 *               64th, a control message of random bytes. After --linger-ms it prints
 *               "FLOOD up=<0|1> imm=<n> msg=<n> err=<n> got=<n> written=<bytes>": messages it
 *               received, and the bytes of its region that were written.
 *
 * The byte-for-byte check is done by the Python test from the dumps, independently of this code.
 * Output lines are "KEY value..." on stdout; diagnostics go to stderr.
 */
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tandem/disagg.h"
#include "tandem/xfer.h"

#define SLOT 5

static struct {
    const char *role, *provider, *node, *peer_addr, *faults, *dump, *key_file, *geometry;
    bool kv_cuda; /* --prefill-kv-kind cuda: the PREFILL says its KV region is GPU memory */
    int flood_ms;
    bool no_wait;
    int writes, pages_per_write, expect, stale, interval_ms, linger_ms, counter_timeout_ms;
    int op_timeout_ms, peer_timeout_ms, heartbeat_ms, run_timeout_ms;
    uint64_t page_bytes, region_pages, seed;
    uint32_t epoch;
} opt = {.provider = "tcp;ofi_rxm",
         .writes = 8,
         .pages_per_write = 16,
         .page_bytes = 4096,
         .region_pages = 256,
         .seed = 1,
         .epoch = 3,
         .linger_ms = 300,
         .counter_timeout_ms = 5000,
         .op_timeout_ms = 5000,
         .peer_timeout_ms = 3000,
         .heartbeat_ms = 100,
         .run_timeout_ms = 30000};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static struct tdm_xfer_rmem remote;
static bool have_remote, have_fin;
static int fired;
static tdm_status fired_status;
static uint32_t the_peer = UINT32_MAX;
static tdm_xfer_t *engine;

static void wait_for(bool *flag, int timeout_ms)
{
    uint64_t until = tdm_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    pthread_mutex_lock(&mu);
    while (!*flag && tdm_now_ns() < until) {
        pthread_mutex_unlock(&mu);
        usleep(2000);
        pthread_mutex_lock(&mu);
    }
    pthread_mutex_unlock(&mu);
}

static void on_counter(void *ctx, uint32_t slot, uint32_t epoch, tdm_status st)
{
    pthread_mutex_lock(&mu);
    fired++;
    fired_status = st;
    printf("FIRED code=%d n=%d msg=%s\n", (int)st, fired, st == TDM_OK ? "" : tdm_err_msg());
    fflush(stdout);
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
}

static tdm_xfer_mr_t *region_mr;

static void on_peer(void *ctx, uint32_t peer, bool up)
{
    printf("PEER %u %s\n", peer, up ? "up" : "down");
    fflush(stdout);
    if (!up || strcmp(opt.role, "target") != 0 || the_peer != UINT32_MAX) return;
    the_peer = peer;
    uint32_t expect = (uint32_t)(opt.expect ? opt.expect : opt.writes);
    if (tdm_xfer_counters_arm(tdm_xfer_get_counters(engine), SLOT, opt.epoch, expect, peer,
                              opt.counter_timeout_ms, on_counter, NULL) != TDM_OK) {
        fprintf(stderr, "xfer_peer: arm: %s\n", tdm_err_msg());
        exit(1);
    }
    struct tdm_xfer_rmem r;
    uint8_t wire[TDM_XFER_RMEM_WIRE];
    tdm_xfer_mr_remote(region_mr, &r);
    tdm_xfer_rmem_pack(&r, wire);
    if (tdm_xfer_send(engine, peer, wire, sizeof(wire), 0, NULL, NULL) != TDM_OK)
        fprintf(stderr, "xfer_peer: send: %s\n", tdm_err_msg());
}

static int got_msgs; /* flood: messages received */

static void on_msg(void *ctx, uint32_t peer, const void *data, size_t bytes)
{
    pthread_mutex_lock(&mu);
    got_msgs++;
    if (bytes == 3 && !memcmp(data, "FIN", 3)) {
        have_fin = true;
    } else if (!have_remote && tdm_xfer_rmem_unpack(data, bytes, &remote) == TDM_OK) {
        have_remote = true;
        the_peer = peer;
    }
    pthread_mutex_unlock(&mu);
}

static void dump(const char *suffix, const void *p, size_t n)
{
    if (!opt.dump) return;
    char path[512];
    snprintf(path, sizeof(path), "%s.%s", opt.dump, suffix);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, n, f) != n) {
        fprintf(stderr, "xfer_peer: cannot write %s\n", path);
        exit(1);
    }
    fclose(f);
}

static uint64_t rng_state;
static uint64_t next_rand(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static void print_stats(void)
{
    struct tdm_xfer_counter_stats cs;
    struct tdm_xfer_stats s;
    tdm_xfer_counters_get_stats(tdm_xfer_get_counters(engine), &cs);
    tdm_xfer_get_stats(engine, &s);
    printf("COUNTERS delivered=%llu counted=%llu stale=%llu duplicate=%llu invalid=%llu "
           "fired_ok=%llu fired_error=%llu\n",
           (unsigned long long)cs.delivered, (unsigned long long)cs.counted,
           (unsigned long long)cs.stale, (unsigned long long)cs.duplicate,
           (unsigned long long)cs.invalid, (unsigned long long)cs.fired_ok,
           (unsigned long long)cs.fired_error);
    printf("STATS imm_received=%llu imm_dropped=%llu imm_duplicated=%llu imm_delayed=%llu "
           "imm_reordered=%llu injected_failures=%llu cq_errors=%llu writes_posted=%llu\n",
           (unsigned long long)s.imm_received, (unsigned long long)s.imm_dropped,
           (unsigned long long)s.imm_duplicated, (unsigned long long)s.imm_delayed,
           (unsigned long long)s.imm_reordered, (unsigned long long)s.injected_failures,
           (unsigned long long)s.cq_errors, (unsigned long long)s.writes_posted);
    fflush(stdout);
}

static int run_target(void)
{
    size_t bytes = opt.region_pages * opt.page_bytes;
    uint8_t *region = tdm_alloc_aligned(bytes);
    if (!region) return 1;
    memset(region, 0, bytes);
    if (tdm_xfer_mr_reg(engine, region, bytes, TDM_XFER_MEM_HOST, &region_mr) != TDM_OK) {
        fprintf(stderr, "xfer_peer: mr_reg: %s\n", tdm_err_msg());
        return 1;
    }
    char addr[TDM_XFER_ADDR_MAX];
    tdm_xfer_addr(engine, addr, sizeof(addr));
    printf("ADDR %s\n", addr);
    fflush(stdout);
    uint64_t until = tdm_now_ns() + (uint64_t)opt.run_timeout_ms * 1000000ull;
    while (!__atomic_load_n(&fired, __ATOMIC_SEQ_CST) && tdm_now_ns() < until)
        usleep(2000);
    if (!fired) {
        printf("NOFIRE\n");
        return 1;
    }
    usleep((useconds_t)opt.linger_ms * 1000);
    dump("dst", region, bytes);
    if (the_peer != UINT32_MAX && tdm_xfer_peer_alive(engine, the_peer)) {
        struct tdm_xfer_sync s;
        tdm_xfer_sync_init(&s);
        tdm_xfer_sync_add(&s, 1);
        if (tdm_xfer_send(engine, the_peer, "FIN", 3, 2000, tdm_xfer_sync_done, &s) == TDM_OK)
            tdm_xfer_sync_wait(&s, 3000);
        else
            tdm_xfer_sync_done(&s, TDM_OK);
        tdm_xfer_sync_destroy(&s);
    }
    print_stats();
    pthread_mutex_lock(&mu);
    printf("DONE fired=%d last=%d\n", fired, (int)fired_status);
    pthread_mutex_unlock(&mu);
    tdm_xfer_mr_dereg(region_mr);
    tdm_free_aligned(region);
    return 0;
}

static int run_initiator(void)
{
    uint32_t peer;
    if (tdm_xfer_peer_add(engine, opt.peer_addr, &peer) != TDM_OK) {
        fprintf(stderr, "xfer_peer: peer_add: %s\n", tdm_err_msg());
        return 1;
    }
    size_t bytes = opt.region_pages * opt.page_bytes;
    uint8_t *region = tdm_alloc_aligned(bytes);
    if (!region) return 1;
    rng_state = opt.seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < bytes; i += 8) {
        uint64_t v = next_rand();
        memcpy(region + i, &v, TDM_MIN(8, bytes - i));
    }
    tdm_xfer_mr_t *mr;
    if (tdm_xfer_mr_reg(engine, region, bytes, TDM_XFER_MEM_HOST, &mr) != TDM_OK) {
        fprintf(stderr, "xfer_peer: mr_reg: %s\n", tdm_err_msg());
        return 1;
    }
    dump("src", region, bytes);
    wait_for(&have_remote, 10000);
    if (!have_remote) {
        printf("NOREMOTE\n");
        return 1;
    }
    int k = opt.pages_per_write, n_posts = opt.writes + opt.stale;
    uint32_t *src = malloc(sizeof(uint32_t) * (size_t)k * (size_t)n_posts);
    uint32_t *dst = malloc(sizeof(uint32_t) * (size_t)k * (size_t)n_posts);
    uint32_t *perm = malloc(sizeof(uint32_t) * opt.region_pages);
    if (!src || !dst || !perm) return 1;
    /* destinations distinct across the whole run (writes complete in any order); in blocks of
     * 4 pages when k % 4 == 0, and odd writes keep their first block contiguous on both sides so
     * run merging is exercised */
    if ((uint64_t)opt.writes * (uint64_t)k > opt.region_pages) {
        fprintf(stderr, "xfer_peer: writes x pages-per-write exceeds region pages\n");
        return 2;
    }
    uint32_t unit = k % 4 == 0 && opt.region_pages % 4 == 0 ? 4 : 1;
    uint32_t n_units = (uint32_t)(opt.region_pages / unit);
    for (uint32_t i = 0; i < n_units; i++)
        perm[i] = i;
    for (uint32_t i = 0; i + 1 < n_units; i++) {
        uint32_t j = i + (uint32_t)(next_rand() % (n_units - i));
        uint32_t t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    for (int r = 0; r < opt.writes; r++) {
        uint32_t *d = &dst[(size_t)(r + opt.stale) * k], *sp = &src[(size_t)(r + opt.stale) * k];
        for (int i = 0; i < k; i++) {
            uint32_t flat = (uint32_t)(r * k + i);
            d[i] = perm[flat / unit] * unit + flat % unit;
            sp[i] = (uint32_t)(next_rand() % opt.region_pages);
        }
        bool keep_block = (r & 1) && unit == 4;
        if (keep_block) {
            uint32_t s0 = (uint32_t)(next_rand() % (opt.region_pages - 3));
            for (int i = 0; i < 4; i++)
                sp[i] = s0 + (uint32_t)i;
        }
        for (int i = keep_block ? 4 : 0; i + 1 < k; i++) { /* break the other blocks' order */
            int j = i + (int)(next_rand() % (uint64_t)(k - i));
            uint32_t t = d[i];
            d[i] = d[j], d[j] = t;
        }
    }
    /* stale twins: same pages as the real write they precede */
    for (int w = 0; w < opt.stale; w++) {
        memcpy(&dst[(size_t)w * k], &dst[(size_t)(w + opt.stale) * k], sizeof(uint32_t) * k);
        memcpy(&src[(size_t)w * k], &src[(size_t)(w + opt.stale) * k], sizeof(uint32_t) * k);
    }
    dump("srcpages", src, sizeof(uint32_t) * (size_t)k * (size_t)n_posts);
    dump("dstpages", dst, sizeof(uint32_t) * (size_t)k * (size_t)n_posts);
    printf("POSTING %d\n", n_posts);
    fflush(stdout);

    struct tdm_xfer_sync s;
    tdm_xfer_sync_init(&s);
    int ok = 0, err = 0;
    for (int w = 0; w < n_posts; w++) {
        struct tdm_xfer_pages p = {.src_pages = &src[(size_t)w * k],
                                   .dst_pages = &dst[(size_t)w * k],
                                   .n_pages = (uint32_t)k,
                                   .page_bytes = opt.page_bytes,
                                   .src_stride = opt.page_bytes,
                                   .dst_stride = opt.page_bytes};
        int idx = w < opt.stale ? w : w - opt.stale;
        struct tdm_xfer_imm imm = {SLOT, w < opt.stale ? opt.epoch + 1 : opt.epoch, (uint32_t)idx};
        tdm_xfer_sync_add(&s, 1);
        tdm_status st;
        while ((st = tdm_xfer_write_pages(engine, peer, mr, &remote, &p, &imm, 0,
                                          tdm_xfer_sync_done, &s)) == TDM_EAGAIN)
            usleep(100);
        if (st != TDM_OK) {
            tdm_xfer_sync_done(&s, st);
            err++;
            fprintf(stderr, "xfer_peer: write %d: %s\n", w, tdm_err_msg());
            if (st == TDM_EPEER) break;
        }
        if (w < opt.stale) tdm_xfer_sync_wait(&s, opt.op_timeout_ms + 1000);
        if (opt.interval_ms) usleep((useconds_t)opt.interval_ms * 1000);
    }
    tdm_status st = tdm_xfer_sync_wait(&s, opt.op_timeout_ms + 2000);
    if (st == TDM_OK)
        ok = n_posts - err;
    else
        err = n_posts;
    printf("WRITES ok=%d err=%d code=%d msg=%s\n", ok, err, (int)st,
           st == TDM_OK ? "" : tdm_err_msg());
    fflush(stdout);
    wait_for(&have_fin, opt.counter_timeout_ms + 3000);
    print_stats();
    printf("DONE fin=%d\n", have_fin);
    tdm_xfer_sync_destroy(&s);
    tdm_xfer_mr_dereg(mr);
    tdm_free_aligned(region);
    free(src);
    free(dst);
    free(perm);
    return 0;
}

/* --fabric-key FILE as tandem serve reads it: 16 to 256 bytes, trailing whitespace dropped */
static bool read_key(const char *path, uint8_t key[256], size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f) return false;
    *n = fread(key, 1, 256, f);
    fclose(f);
    while (*n && (key[*n - 1] == '\n' || key[*n - 1] == '\r' || key[*n - 1] == ' ' ||
                  key[*n - 1] == '\t'))
        (*n)--;
    return *n >= 16;
}

static int run_flood(void)
{
    uint32_t peer;
    if (tdm_xfer_peer_add(engine, opt.peer_addr, &peer) != TDM_OK) {
        fprintf(stderr, "xfer_peer: peer_add: %s\n", tdm_err_msg());
        return 1;
    }
    /* --no-wait: send at once, while the hello is still unanswered (what an attacker without
     * the key can do: the receiver must drop it unread) */
    bool up = !opt.no_wait && tdm_xfer_peer_wait(engine, peer, 3000) == TDM_OK;
    if (!opt.no_wait) printf("PEER up=%d\n", up);
    fflush(stdout);
    rng_state = opt.seed * 0x9E3779B97F4A7C15ull + 7;
    int n_imm = 0, n_msg = 0, n_err = 0;
    uint8_t *region = NULL;
    size_t region_bytes = 0;
    tdm_xfer_mr_t *mr = NULL;
    unsigned L, H, D, PS, DM, V;
    if (opt.geometry && sscanf(opt.geometry, "%u,%u,%u,%u,%u,%u", &L, &H, &D, &PS, &DM, &V) == 6) {
        /* a PREFILL of 16 tokens into one page of our own, and a context buffer */
        const uint64_t page = 2ull * H * PS * D * sizeof(float), ctx = (uint64_t)(DM + V) * 4 + 64;
        region_bytes = (size_t)(page * L + ctx);
        region = tdm_alloc_aligned(region_bytes);
        if (!region) return 1;
        memset(region, 0, region_bytes);
        if (tdm_xfer_mr_reg(engine, region, region_bytes, TDM_XFER_MEM_HOST, &mr) != TDM_OK) {
            fprintf(stderr, "xfer_peer: mr_reg: %s\n", tdm_err_msg());
            return 1;
        }
        int32_t tokens[16];
        for (int i = 0; i < 16; i++)
            tokens[i] = (int32_t)(100 + next_rand() % (V - 100));
        uint32_t pages[1] = {0};
        struct tdm_disagg_msg m = {.type = TDM_DMSG_PREFILL};
        struct tdm_disagg_prefill_msg *pm = &m.prefill;
        *pm = (struct tdm_disagg_prefill_msg){.req_id = next_rand(),
                                              .slot = 1,
                                              .epoch = 1,
                                              .n_tokens = 16,
                                              .chunk = 16,
                                              .n_layers = L,
                                              .n_kv_heads = H,
                                              .head_dim = D,
                                              .page_size = PS,
                                              .elem_bytes = 4,
                                              .kv_head_begin = 0,
                                              .kv_head_end = H,
                                              .dst_layer_stride = page,
                                              .ctx_offset = page * L,
                                              .d_model = DM,
                                              .vocab = V,
                                              .want_logits = 1,
                                              .n_pages = 1,
                                              .tokens = tokens,
                                              .pages = pages};
        tdm_xfer_mr_remote(mr, &pm->kv);
        pm->ctx = pm->kv;
        if (opt.kv_cuda) pm->kv.kind = TDM_XFER_MEM_CUDA; /* a lie: it is host memory */
        uint8_t buf[4096];
        size_t n = tdm_disagg_msg_encode(&m, buf, sizeof buf);
        if (n && tdm_xfer_send(engine, peer, buf, n, 0, NULL, NULL) == TDM_OK)
            n_msg++;
        else
            n_err++;
    }
    const uint64_t end = tdm_now_ns() + (uint64_t)opt.flood_ms * 1000000ull;
    for (uint64_t i = 0; tdm_now_ns() < end; i++) {
        tdm_status st;
        if (i % 64 == 63) {
            uint8_t junk[256];
            for (size_t j = 0; j < sizeof junk; j++)
                junk[j] = (uint8_t)next_rand();
            if (i % 128 == 127) memcpy(junk, "TDMD\x01", 5); /* a header, then garbage */
            st = tdm_xfer_send(engine, peer, junk, 8 + next_rand() % 248, 0, NULL, NULL);
            n_msg += st == TDM_OK;
        } else {
            /* half of them where guessing used to work (the first slots, small epochs) */
            bool low = i & 1;
            struct tdm_xfer_imm imm = {(uint32_t)(next_rand() % (low ? 8 : 4096)),
                                       (uint32_t)(1 + next_rand() % (low ? 16 : 65536)),
                                       (uint32_t)(next_rand() % 64)};
            st = tdm_xfer_send_imm(engine, peer, &imm, 0, NULL, NULL);
            n_imm += st == TDM_OK;
        }
        if (st == TDM_EAGAIN)
            usleep(200);
        else if (st != TDM_OK)
            n_err++, usleep(1000);
    }
    usleep((useconds_t)opt.linger_ms * 1000);
    if (opt.no_wait) up = tdm_xfer_peer_wait(engine, peer, 0) == TDM_OK;
    size_t written = 0;
    for (size_t i = 0; i < region_bytes; i++)
        written += region[i] != 0;
    pthread_mutex_lock(&mu);
    int got = got_msgs;
    pthread_mutex_unlock(&mu);
    printf("FLOOD up=%d imm=%d msg=%d err=%d got=%d written=%zu\n", up, n_imm, n_msg, n_err, got,
           written);
    fflush(stdout);
    tdm_xfer_mr_dereg(mr);
    tdm_free_aligned(region);
    return 0;
}

int main(int argc, char **argv)
{
    static const struct option lo[] = {{"role", 1, 0, 'r'},
                                       {"provider", 1, 0, 'p'},
                                       {"node", 1, 0, 'n'},
                                       {"peer", 1, 0, 'a'},
                                       {"faults", 1, 0, 'f'},
                                       {"dump", 1, 0, 'd'},
                                       {"writes", 1, 0, 'w'},
                                       {"pages-per-write", 1, 0, 'k'},
                                       {"page-bytes", 1, 0, 'b'},
                                       {"region-pages", 1, 0, 'P'},
                                       {"seed", 1, 0, 's'},
                                       {"epoch", 1, 0, 'e'},
                                       {"expect", 1, 0, 'x'},
                                       {"stale", 1, 0, 'S'},
                                       {"interval-ms", 1, 0, 'i'},
                                       {"linger-ms", 1, 0, 'l'},
                                       {"counter-timeout-ms", 1, 0, 'c'},
                                       {"op-timeout-ms", 1, 0, 'o'},
                                       {"peer-timeout-ms", 1, 0, 't'},
                                       {"heartbeat-ms", 1, 0, 'h'},
                                       {"run-timeout-ms", 1, 0, 'R'},
                                       {"fabric-key", 1, 0, 'K'},
                                       {"prefill-geometry", 1, 0, 'G'},
                                       {"prefill-kv-kind", 1, 0, 'J'},
                                       {"flood-ms", 1, 0, 'F'},
                                       {"no-wait", 0, 0, 'W'},
                                       {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (c) {
        case 'r':
            opt.role = optarg;
            break;
        case 'p':
            opt.provider = optarg;
            break;
        case 'n':
            opt.node = optarg;
            break;
        case 'a':
            opt.peer_addr = optarg;
            break;
        case 'f':
            opt.faults = optarg;
            break;
        case 'd':
            opt.dump = optarg;
            break;
        case 'w':
            opt.writes = atoi(optarg);
            break;
        case 'k':
            opt.pages_per_write = atoi(optarg);
            break;
        case 'b':
            opt.page_bytes = strtoull(optarg, NULL, 10);
            break;
        case 'P':
            opt.region_pages = strtoull(optarg, NULL, 10);
            break;
        case 's':
            opt.seed = strtoull(optarg, NULL, 10);
            break;
        case 'e':
            opt.epoch = (uint32_t)atoi(optarg);
            break;
        case 'x':
            opt.expect = atoi(optarg);
            break;
        case 'S':
            opt.stale = atoi(optarg);
            break;
        case 'i':
            opt.interval_ms = atoi(optarg);
            break;
        case 'l':
            opt.linger_ms = atoi(optarg);
            break;
        case 'c':
            opt.counter_timeout_ms = atoi(optarg);
            break;
        case 'o':
            opt.op_timeout_ms = atoi(optarg);
            break;
        case 't':
            opt.peer_timeout_ms = atoi(optarg);
            break;
        case 'h':
            opt.heartbeat_ms = atoi(optarg);
            break;
        case 'R':
            opt.run_timeout_ms = atoi(optarg);
            break;
        case 'K':
            opt.key_file = optarg;
            break;
        case 'G':
            opt.geometry = optarg;
            break;
        case 'J':
            if (strcmp(optarg, "host") && strcmp(optarg, "cuda")) {
                fprintf(stderr, "xfer_peer: --prefill-kv-kind host|cuda\n");
                return 2;
            }
            opt.kv_cuda = !strcmp(optarg, "cuda");
            break;
        case 'F':
            opt.flood_ms = atoi(optarg);
            break;
        case 'W':
            opt.no_wait = true;
            break;
        default:
            return 2;
        }
    }
    if (!opt.role || opt.writes <= 0 || opt.pages_per_write <= 0 || opt.page_bytes == 0 ||
        opt.page_bytes % 8 || (uint64_t)opt.pages_per_write > opt.region_pages ||
        (strcmp(opt.role, "target") && !opt.peer_addr)) {
        fprintf(stderr, "usage: xfer_peer --role target|initiator|flood [--peer ADDR] ...\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    struct tdm_xfer_config cfg;
    tdm_xfer_config_default(&cfg);
    cfg.provider = opt.provider;
    cfg.node = opt.node;
    cfg.faults = opt.faults ? opt.faults : "";
    cfg.op_timeout_ms = opt.op_timeout_ms;
    cfg.peer_timeout_ms = opt.peer_timeout_ms;
    cfg.heartbeat_ms = opt.heartbeat_ms;
    cfg.on_msg = on_msg;
    cfg.on_peer = on_peer;
    uint8_t key[256];
    size_t key_n = 0;
    if (opt.key_file) {
        if (!read_key(opt.key_file, key, &key_n)) {
            fprintf(stderr, "xfer_peer: --fabric-key %s: unreadable or under 16 bytes\n",
                    opt.key_file);
            return 2;
        }
        cfg.fabric_key = key;
        cfg.fabric_key_bytes = key_n;
    }
    if (tdm_xfer_create(&cfg, &engine) != TDM_OK) {
        fprintf(stderr, "xfer_peer: create: %s\n", tdm_err_msg());
        return 1;
    }
    int rc = !strcmp(opt.role, "target")  ? run_target()
             : !strcmp(opt.role, "flood") ? run_flood()
                                          : run_initiator();
    tdm_xfer_destroy(engine);
    return rc;
}
