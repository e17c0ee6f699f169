/*
 * llama.cpp's side of `tandem bench model --compare-llama-cpp PATH`: runs the user's llama-bench
 * binary (and llama-batched-bench, when one lies beside it) on the same GGUF and reads their
 * figures. The project never builds or ships llama.cpp; bench.c interleaves these runs with its
 * own and prints the ratios.
 *
 * The three figures, each to match one of `tandem bench model`'s:
 *   prefill   llama-bench -p PROMPT_LEN -n 0: pp tokens/s from an empty context;
 *   batch 1   llama-bench -p 0 -n GEN -d CONTEXT: tg tokens/s after CONTEXT tokens of context
 *             (tandem's decode also starts after --context tokens);
 *   batch 8   llama-batched-bench -npp CONTEXT -ntg GEN -npl 8: its S_TG, the tokens/s of 8
 *             sequences decoding together (llama-bench decodes one sequence only). Without that
 *             binary the figure is absent (NaN) and the table says so.
 * Each run is one repetition (-r 1, after llama-bench's own warm-up); the rounds are bench.c's.
 * Output: llama-bench's `-o json` (an array of test objects: avg_ts, build_commit,
 * build_number), llama-batched-bench's `--output-format jsonl` (a line per test: pl,
 * speed_tg). Their logs go to stderr, which is discarded unless a run fails.
 */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tools/tools_int.h"

#define OUT_MAX (4u << 20) /* the most stdout read from one run */

/* Whether path names an executable regular file; if not, prints why (under who) and returns
 * false. */
static bool executable(const char *who, const char *path)
{
    struct stat st;
    if (stat(path, &st) != 0) {
        fprintf(stderr, "%s: %s: %s\n", who, path, strerror(errno));
        return false;
    }
    if (!S_ISREG(st.st_mode) || access(path, X_OK) != 0) {
        fprintf(stderr, "%s: %s is not an executable file\n", who, path);
        return false;
    }
    return true;
}

bool tdm_llama_bench_check(const char *path)
{
    return executable("tandem bench model: --compare-llama-cpp", path);
}

/* Runs argv[0] with argv, stdout captured (NUL-terminated, malloc'd) and stderr into a
 * temporary file that is printed if the run fails. NULL (after saying why) on failure. */
static char *run_capture(char *const argv[])
{
    int out[2];
    char errpath[] = "/tmp/tandem-llama-XXXXXX";
    const int errfd = mkstemp(errpath);
    if (errfd < 0 || pipe(out) != 0) {
        fprintf(stderr, "tandem bench model: cannot run %s: %s\n", argv[0], strerror(errno));
        if (errfd >= 0) close(errfd), unlink(errpath);
        return NULL;
    }
    unlink(errpath); /* the open descriptor keeps it */
    fflush(stdout);
    const pid_t pid = fork();
    if (pid == 0) {
        dup2(out[1], STDOUT_FILENO);
        dup2(errfd, STDERR_FILENO);
        close(out[0]);
        close(out[1]);
        close(errfd);
        execv(argv[0], argv);
        fprintf(stderr, "exec %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    close(out[1]);
    size_t len = 0, cap = 1 << 16;
    char *buf = pid > 0 ? malloc(cap) : NULL;
    bool too_long = false;
    for (ssize_t r = 1; buf && r > 0;) {
        if (len + 1 == cap) {
            char *nb = cap < OUT_MAX ? realloc(buf, cap * 2) : NULL;
            if (!nb) { /* keep draining so the child is not blocked */
                too_long = true;
                char sink[4096];
                while (read(out[0], sink, sizeof sink) > 0) {
                }
                break;
            }
            buf = nb;
            cap *= 2;
        }
        r = read(out[0], buf + len, cap - 1 - len);
        if (r > 0) len += (size_t)r;
        if (r < 0 && errno == EINTR) r = 1;
    }
    close(out[0]);
    int status = 0;
    if (pid > 0)
        while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
        }
    const bool ok = pid > 0 && buf && !too_long && WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (!ok) {
        fprintf(stderr, "tandem bench model: %s failed (%s", argv[0],
                pid < 0    ? strerror(errno)
                : too_long ? "over 4 MiB of output"
                           : "exit status");
        if (pid > 0 && WIFEXITED(status)) fprintf(stderr, " %d", WEXITSTATUS(status));
        if (pid > 0 && WIFSIGNALED(status)) fprintf(stderr, ", signal %d", WTERMSIG(status));
        fprintf(stderr, "); the command was:\n ");
        for (int i = 0; argv[i]; i++)
            fprintf(stderr, " %s", argv[i]);
        fprintf(stderr, "\n  its last output on stderr:\n");
        char tail[2048];
        const off_t end = lseek(errfd, 0, SEEK_END);
        const off_t from = end > (off_t)sizeof tail - 1 ? end - (off_t)sizeof tail + 1 : 0;
        const ssize_t n = pread(errfd, tail, sizeof tail - 1, from);
        tail[n > 0 ? n : 0] = '\0';
        fprintf(stderr, "%s\n", tail);
        free(buf);
        buf = NULL;
    } else {
        buf[len] = '\0';
    }
    close(errfd);
    return buf;
}

/* The avg_ts of llama-bench's one test in its `-o json` output, and its build. */
static bool parse_llama_bench(const char *out, double *ts, char *build, size_t build_len)
{
    json_error_t err;
    json_t *root = json_loads(out, 0, &err);
    json_t *t = json_is_array(root) && json_array_size(root) == 1 ? json_array_get(root, 0) : NULL;
    json_t *avg = t ? json_object_get(t, "avg_ts") : NULL;
    const bool ok = avg && json_is_number(avg) && json_number_value(avg) > 0;
    if (ok) {
        *ts = json_number_value(avg);
        const char *commit = json_string_value(json_object_get(t, "build_commit"));
        json_t *num = json_object_get(t, "build_number");
        snprintf(build, build_len, "%s (build %lld)", commit ? commit : "?",
                 json_is_integer(num) ? (long long)json_integer_value(num) : -1LL);
    } else {
        fprintf(stderr,
                "tandem bench model: llama-bench's output is not one test's -o json (an array "
                "of one object with a positive avg_ts)%s%s; it began:\n%.300s\n",
                root ? "" : ": ", root ? "" : err.text, out);
    }
    json_decref(root);
    return ok;
}

/* The speed_tg of the line with pl == 8 in llama-batched-bench's jsonl output. */
static bool parse_batched(const char *out, double *tg)
{
    for (const char *line = out; *line;) {
        const char *nl = strchr(line, '\n');
        const size_t n = nl ? (size_t)(nl - line) : strlen(line);
        json_t *o = line[0] == '{' ? json_loadb(line, n, 0, NULL) : NULL;
        json_t *pl = o ? json_object_get(o, "pl") : NULL,
               *s = o ? json_object_get(o, "speed_tg") : NULL;
        const bool hit = json_is_integer(pl) && json_integer_value(pl) == 8 && json_is_number(s) &&
                         json_number_value(s) > 0;
        if (hit) *tg = json_number_value(s);
        json_decref(o);
        if (hit) return true;
        line += n + (nl != NULL);
    }
    fprintf(stderr,
            "tandem bench model: llama-batched-bench's output has no jsonl line with pl 8 and a "
            "positive speed_tg; it began:\n%.300s\n",
            out);
    return false;
}

/* llama-batched-bench beside the llama-bench binary, or NULL (malloc'd). */
static char *batched_beside(const char *bench)
{
    const char *slash = strrchr(bench, '/');
    const size_t dir = slash ? (size_t)(slash - bench + 1) : 0;
    char *p = malloc(dir + sizeof "llama-batched-bench");
    if (!p) return NULL;
    memcpy(p, bench, dir);
    strcpy(p + dir, "llama-batched-bench");
    if (access(p, X_OK) != 0) {
        free(p);
        return NULL;
    }
    return p;
}

void tdm_llama_bench_commands(const char *bench, const char *model, int threads, int64_t prompt_len,
                              int64_t gen, int64_t context)
{
    char *batched = batched_beside(bench);
    printf("  llama.cpp: %s -m %s -t %d -r 1 -o json -p %lld -n 0\n", bench, model, threads,
           (long long)prompt_len);
    printf("             %s -m %s -t %d -r 1 -o json -p 0 -n %lld -d %lld\n", bench, model, threads,
           (long long)gen, (long long)context);
    if (batched)
        printf("             %s -m %s -t %d -c %lld -npp %lld -ntg %lld -npl 8 "
               "--output-format jsonl\n",
               batched, model, threads, (long long)(8 * (context + gen) + 64), (long long)context,
               (long long)gen);
    else
        printf("             (no llama-batched-bench beside it: no batch-8 figure)\n");
    free(batched);
}

int tdm_llama_bench_run(const char *bench, const char *model, int threads, int64_t prompt_len,
                        int64_t gen, int64_t context, struct tdm_bench_figures *out)
{
    char t[16], p[32], n[32], d[32], c[32];
    snprintf(t, sizeof t, "%d", threads);
    snprintf(p, sizeof p, "%lld", (long long)prompt_len);
    snprintf(n, sizeof n, "%lld", (long long)gen);
    snprintf(d, sizeof d, "%lld", (long long)context);
    snprintf(c, sizeof c, "%lld", (long long)(8 * (context + gen) + 64));
    *out = (struct tdm_bench_figures){.prefill = NAN, .decode1 = NAN, .decode8 = NAN};
    char *const pp[] = {(char *)bench, "-m",   (char *)model, "-t", t,    "-r", "1",
                        "-o",          "json", "-p",          p,    "-n", "0",  NULL};
    char *const tg[] = {(char *)bench, "-m", (char *)model, "-t", t, "-r", "1", "-o",
                        "json",        "-p", "0",           "-n", n, "-d", d,   NULL};
    char *s = run_capture(pp);
    bool ok = s && parse_llama_bench(s, &out->prefill, out->build, sizeof out->build);
    free(s);
    s = ok ? run_capture(tg) : NULL;
    ok = s && parse_llama_bench(s, &out->decode1, out->build, sizeof out->build);
    free(s);
    char *batched = ok ? batched_beside(bench) : NULL;
    if (batched) {
        char *const bb[] = {batched, "-m", (char *)model, "-t", t,      "-c", c,
                            "-npp",  d,    "-ntg",        n,    "-npl", "8",  "--output-format",
                            "jsonl", NULL};
        s = run_capture(bb);
        ok = s && parse_batched(s, &out->decode8);
        free(s);
        free(batched);
    }
    return ok ? 0 : 1;
}
