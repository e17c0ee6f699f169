/*
 * libfabric is opened with the first transfer engine (src/xfer/fabric/libfabric.c), not linked:
 * a process that never creates one does not load it (nor the PSM libraries whose constructor
 * sleeps 0.2 s). In a process of its own:
 *   - before the first tdm_xfer_create, neither libfabric nor libinfinipath is mapped;
 *   - an engine on tcp;ofi_rxm is created, its provider named in its caps, and destroyed;
 *   - afterwards libfabric is mapped (so the first check can fail), and a second engine works.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "tandem/core.h"
#include "tandem/xfer.h"
#include "lib/proc_maps.h"

static void engine_round(void)
{
    struct tdm_xfer_config cfg;
    tdm_xfer_config_default(&cfg);
    cfg.provider = "tcp;ofi_rxm";
    cfg.node = "127.0.0.1";
    tdm_xfer_t *x = NULL;
    if (tdm_xfer_create(&cfg, &x) != TDM_OK) fail_msg("%s", tdm_err_msg());
    struct tdm_xfer_caps caps;
    tdm_xfer_get_caps(x, &caps);
    assert_string_equal(caps.provider, "tcp;ofi_rxm");
    tdm_xfer_destroy(x);
}

static void test_opened_with_the_first_engine(void **state)
{
    (void)state;
    assert_false(tdm_test_mapped("libfabric"));
    assert_false(tdm_test_mapped("libinfinipath"));
    engine_round();
    assert_true(tdm_test_mapped("libfabric"));
    engine_round();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_opened_with_the_first_engine),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
