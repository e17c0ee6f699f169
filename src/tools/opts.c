/*
 * One table-driven parser for the subcommands' options, the table of the options that every
 * HTTP-serving command shares (`tandem serve` and `tandem router`), and their shutdown-signal
 * set-up. A command lists its options
 * as data (name, kind, where the value goes, its range); the parser builds getopt_long's table
 * from them, checks each value, and reports errors in one format:
 *   "tandem CMD: unknown or incomplete option 'X'" (then the usage on stderr), or the value
 *   checker's "--name: ..." line. Main thread only.
 */
#include <getopt.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/server.h"
#include "tools/tools_int.h"

#define MAX_OPTS 96

void tdm_tool_http_table(struct tdm_tool_http *h, struct tdm_opt out[TDM_TOOL_HTTP_OPTS])
{
    struct tdm_opt t[TDM_TOOL_HTTP_OPTS] = {
        TDM_OPT_S("host", &h->host),
        TDM_OPT_I("port", &h->port, 0, 65535),
        TDM_OPT_S("port-file", &h->port_file),
        TDM_OPT_S("api-key", &h->api_key),
        TDM_OPT_I("max-body", &h->max_body, 1024, 1 << 30),
        TDM_OPT_I("drain-timeout", &h->drain_s, 0, 3600),
        TDM_OPT_END,
    };
    memcpy(out, t, sizeof t);
}

static bool set_value(const struct tdm_opt *o, const char *arg)
{
    const char *name = o->name;
    switch (o->kind) {
    case TDM_OPT_STR:
        *(const char **)o->dst = arg;
        return true;
    case TDM_OPT_INT:
        return tdm_tool_int(name, arg, (int64_t)o->lo, (int64_t)o->hi, (int64_t *)o->dst);
    case TDM_OPT_FLOAT:
        return tdm_tool_float(name, arg, o->lo, o->hi, (double *)o->dst);
    case TDM_OPT_FLAG:
        *(bool *)o->dst = true;
        return true;
    case TDM_OPT_FN:
        return o->fn(arg, o->dst);
    }
    return false;
}

int tdm_tool_parse(const char *cmd, int argc, char **argv, const struct tdm_opt *const *tables,
                   void (*usage)(FILE *))
{
    const struct tdm_opt *flat[MAX_OPTS];
    struct option lo[MAX_OPTS + 2];
    int n = 0;
    for (int t = 0; tables[t]; t++)
        for (const struct tdm_opt *o = tables[t]; o->name; o++) {
            if (n == MAX_OPTS) {
                fprintf(stderr, "tandem %s: too many options for the parser\n", cmd);
                return 2;
            }
            flat[n] = o;
            lo[n] = (struct option){
                o->name, o->kind == TDM_OPT_FLAG ? no_argument : required_argument, NULL, 256 + n};
            n++;
        }
    lo[n++] = (struct option){"help", no_argument, NULL, 'h'};
    lo[n] = (struct option){0, 0, 0, 0};
    optind = 1;
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        if (c == 'h') {
            usage(stdout);
            return 1;
        }
        if (c < 256 || c >= 256 + n) {
            fprintf(stderr, "tandem %s: unknown or incomplete option '%s'\n", cmd,
                    argv[optind - 1]);
            usage(stderr);
            return 2;
        }
        if (!set_value(flat[c - 256], optarg)) return 2;
    }
    if (optind < argc) {
        fprintf(stderr, "tandem %s: unexpected argument '%s'\n", cmd, argv[optind]);
        return 2;
    }
    return 0;
}

sigset_t tdm_tool_block_shutdown_signals(void)
{
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);
    return sigs;
}
