/* Unit tests for the topology module's thread pinning and its refusals (the placement itself is
 * checked against an XML-reading reference in tests/topo/test_topo.py): a thread pinned to one of
 * its allowed cores runs only there, as the OS reports it; malformed lists are refused without
 * touching the thread; an empty list leaves it as it was. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>

#include "tandem/topo.h"

static void *pin_and_report(void *arg)
{
    int *cpu = arg;
    char list[16];
    snprintf(list, sizeof list, "%d", *cpu);
    if (tdm_thread_pin(list) != TDM_OK) {
        *cpu = -2;
        return NULL;
    }
    cpu_set_t now;
    CPU_ZERO(&now);
    pthread_getaffinity_np(pthread_self(), sizeof now, &now);
    *cpu = CPU_COUNT(&now) == 1 && CPU_ISSET(*cpu, &now) ? *cpu : -1;
    return NULL;
}

static void test_pin_to_each_allowed_core(void **state)
{
    (void)state;
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    assert_int_equal(sched_getaffinity(0, sizeof allowed, &allowed), 0);
    int tried = 0;
    for (int c = 0; c < CPU_SETSIZE && tried < 8; c++) {
        if (!CPU_ISSET(c, &allowed)) continue;
        int cpu = c;
        pthread_t t;
        assert_int_equal(pthread_create(&t, NULL, pin_and_report, &cpu), 0);
        pthread_join(t, NULL);
        assert_int_equal(cpu, c);
        tried++;
    }
    assert_true(tried > 0);
}

static void test_refusals_leave_the_thread_alone(void **state)
{
    (void)state;
    cpu_set_t before, after;
    pthread_getaffinity_np(pthread_self(), sizeof before, &before);
    const char *bad[] = {"x", "3-", "-1", "0,,", "99999999", "1-0x", "0-4096"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_int_equal(tdm_thread_pin(bad[i]), TDM_EINVAL);
    assert_int_equal(tdm_thread_pin(""), TDM_OK);
    assert_int_equal(tdm_thread_pin(NULL), TDM_OK);
    pthread_getaffinity_np(pthread_self(), sizeof after, &after);
    assert_true(CPU_EQUAL(&before, &after));
}

static void test_place_refuses_bad_counts(void **state)
{
    (void)state;
    tdm_topo_t *t = NULL;
    assert_int_equal(tdm_topo_open(NULL, &t), TDM_OK);
    struct tdm_placement p[65];
    assert_int_equal(tdm_topo_place(t, 0, NULL, p), TDM_EINVAL);
    assert_int_equal(tdm_topo_place(t, 65, NULL, p), TDM_EINVAL);
    assert_int_equal(tdm_topo_place(t, 3, NULL, p), TDM_OK);
    for (int r = 0; r < 3; r++) {
        assert_int_equal(p[r].rank, r);
        assert_true(p[r].cpus[0] != '\0');
        char line[512];
        assert_true(tdm_placement_describe(&p[r], line, sizeof line) > 0);
    }
    tdm_topo_close(t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pin_to_each_allowed_core),
        cmocka_unit_test(test_refusals_leave_the_thread_alone),
        cmocka_unit_test(test_place_refuses_bad_counts),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
