/*
 * Status strings, the per-thread error message, logging and the assertion handler.
 *
 * The error message is thread-local: the function that detects a problem writes it, and the
 * caller on the same thread reads it. Logging writes whole lines with one fprintf, so lines
 * from different threads do not interleave.
 */
#include "tandem/core.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

const char *tdm_mem_kind_name(enum tdm_mem_kind k)
{
    switch (k) {
    case TDM_MEM_HOST:
        return "host";
    case TDM_MEM_HOST_PINNED:
        return "pinned";
    case TDM_MEM_DEVICE:
        return "device";
    }
    return "unknown";
}

const char *tdm_status_str(tdm_status st)
{
    switch (st) {
    case TDM_OK:
        return "ok";
    case TDM_EINVAL:
        return "invalid argument";
    case TDM_ENOMEM:
        return "out of memory";
    case TDM_EIO:
        return "I/O error";
    case TDM_ENOTFOUND:
        return "not found";
    case TDM_EFORMAT:
        return "malformed input";
    case TDM_EUNSUPPORTED:
        return "unsupported";
    case TDM_ERANGE:
        return "out of range";
    case TDM_EAGAIN:
        return "try again";
    case TDM_ETIMEDOUT:
        return "timed out";
    case TDM_ECANCELED:
        return "canceled";
    case TDM_EPEER:
        return "peer error";
    case TDM_EINTERNAL:
        return "internal error";
    case TDM_EUNREACHABLE:
        return "unreachable";
    }
    return "unknown status";
}

static _Thread_local char err_buf[512];

tdm_status tdm_err_set(tdm_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err_buf, sizeof err_buf, fmt, ap);
    va_end(ap);
    return st;
}

const char *tdm_err_msg(void)
{
    return err_buf;
}

static int log_level = -1;

static int log_level_get(void)
{
    if (log_level < 0) {
        const char *e = getenv("TANDEM_LOG");
        int lvl = TDM_LOG_INFO;
        if (e) {
            if (!strcasecmp(e, "error"))
                lvl = TDM_LOG_ERROR;
            else if (!strcasecmp(e, "warn"))
                lvl = TDM_LOG_WARN;
            else if (!strcasecmp(e, "debug"))
                lvl = TDM_LOG_DEBUG;
        }
        log_level = lvl;
    }
    return log_level;
}

void tdm_log_set_level(enum tdm_log_level lvl)
{
    log_level = (int)lvl;
}

bool tdm_log_enabled(enum tdm_log_level lvl)
{
    return (int)lvl <= log_level_get();
}

void tdm_log(enum tdm_log_level lvl, const char *fmt, ...)
{
    static const char *names[] = {"error", "warn", "info", "debug"};
    if (!tdm_log_enabled(lvl)) return;
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    fprintf(stderr, "%02d:%02d:%02d.%03ld [%s] %s\n", tm.tm_hour, tm.tm_min, tm.tm_sec,
            ts.tv_nsec / 1000000, names[lvl], line);
}

_Noreturn void tdm_assert_fail(const char *expr, const char *file, int line)
{
    fprintf(stderr, "tandem: assertion failed: %s (%s:%d)\n", expr, file, line);
    abort();
}
