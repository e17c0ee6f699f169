/*
 * cuBLASLt is opened on first use (src/backend/cuda/cuda_lt.c), not linked: a process that
 * never creates a GPU GEMM does not map the library. Checked here without a GPU (opening the
 * library and finding its entry points needs the toolkit, not a device):
 *   - before the first tdm_cu_lt(), no libcublasLt is mapped into this process;
 *   - tdm_cu_lt() opens it and finds every entry point; a second call returns the same table;
 *   - afterwards the library is mapped, so the check above can fail.
 * A build without CUDA skips with a message.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#ifdef TDM_HAVE_CUDA
#include "backend/cuda/cuda_int.h"
#include "lib/proc_maps.h"

static void test_opened_on_first_use(void **state)
{
    (void)state;
    assert_false(tdm_test_mapped("libcublasLt"));
    const struct tdm_cu_lt *lt = tdm_cu_lt();
    if (!lt) fail_msg("%s", tdm_err_msg());
    const void *fns[] = {
        (const void *)lt->create,         (const void *)lt->destroy,
        (const void *)lt->desc_create,    (const void *)lt->desc_destroy,
        (const void *)lt->desc_set,       (const void *)lt->layout_create,
        (const void *)lt->layout_destroy, (const void *)lt->pref_create,
        (const void *)lt->pref_destroy,   (const void *)lt->pref_set,
        (const void *)lt->heuristic,      (const void *)lt->matmul,
    };
    for (size_t i = 0; i < sizeof fns / sizeof fns[0]; i++)
        assert_non_null(fns[i]);
    assert_ptr_equal(tdm_cu_lt(), lt);
    assert_true(tdm_test_mapped("libcublasLt"));
}
#else
static void test_opened_on_first_use(void **state)
{
    (void)state;
    skip(); /* this build has no CUDA backend */
}
#endif

int main(void)
{
#ifndef TDM_HAVE_CUDA
    printf("test_cuda_lt: skipped: built without CUDA\n");
#endif
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_opened_on_first_use),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
