/*
 * The tool-call scanner (src/server/tools.c): fed the text in pieces, as the reader releases
 * it, it must give exactly what it gives fed the whole text at once (content and calls), for
 * every way of cutting the text; and the whole-text answers are checked against what the
 * formats say (expected content and calls written out here).
 */
#include <jansson.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "server/server_int.h"

struct result {
    char content[1024];
    char calls[1024]; /* the calls as compact JSON */
};

static void run(int format, const char *text, const size_t *cuts, int n_cuts, struct result *out)
{
    struct api_tool_scan ts = {0};
    struct api_text content = {0};
    json_t *calls = json_array();
    size_t len = strlen(text);
    for (int i = 0; i < n_cuts; i++)
        tdm_api_tools_scan(&ts, format, text, cuts[i], false, &content, calls);
    tdm_api_tools_scan(&ts, format, text, len, true, &content, calls);
    assert_false(content.oom);
    snprintf(out->content, sizeof out->content, "%.*s", (int)content.n, content.p ? content.p : "");
    char *c = json_dumps(calls, JSON_COMPACT);
    snprintf(out->calls, sizeof out->calls, "%s", c);
    assert_int_equal((int)json_array_size(calls), ts.n_calls);
    free(c);
    free(content.p);
    json_decref(calls);
}

static const struct {
    int format;
    const char *text, *content, *calls;
} CASES[] = {
    {TDM_TOOLS_HERMES, "Hello there.", "Hello there.", "[]"},
    {TDM_TOOLS_HERMES,
     "Sure.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>", "Sure.",
     "[{\"name\":\"f\",\"arguments\":\"{\\\"a\\\":1}\"}]"},
    {TDM_TOOLS_HERMES,
     "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": "
     "\"g\", \"arguments\": \"{\\\"x\\\": 2}\"}\n</tool_call>",
     "",
     "[{\"name\":\"f\",\"arguments\":\"{}\"},{\"name\":\"g\",\"arguments\":\"{\\\"x\\\": 2}\"}]"},
    {TDM_TOOLS_HERMES, "<tool_call>\nbroken\n</tool_call> tail",
     "<tool_call>\nbroken\n</tool_call> tail", "[]"},
    {TDM_TOOLS_HERMES, "text <tool_call>{\"name\": \"f\"", "text <tool_call>{\"name\": \"f\"",
     "[]"},
    {TDM_TOOLS_HERMES, "a <tool_ca", "a <tool_ca", "[]"},
    {TDM_TOOLS_HERMES, "  spaced  ", "  spaced  ", "[]"},
    {TDM_TOOLS_LLAMA3, "{\"name\": \"f\", \"parameters\": {\"q\": \"x\"}}", "",
     "[{\"name\":\"f\",\"arguments\":\"{\\\"q\\\":\\\"x\\\"}\"}]"},
    {TDM_TOOLS_LLAMA3, " <|python_tag|>{\"name\": \"f\", \"parameters\": {}}", "",
     "[{\"name\":\"f\",\"arguments\":\"{}\"}]"},
    {TDM_TOOLS_LLAMA3, "{not a call}", "{not a call}", "[]"},
    {TDM_TOOLS_LLAMA3, "The answer is {x}.", "The answer is {x}.", "[]"},
};

static void test_whole_texts(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof CASES / sizeof *CASES; i++) {
        struct result r;
        run(CASES[i].format, CASES[i].text, NULL, 0, &r);
        if (strcmp(r.content, CASES[i].content) || strcmp(r.calls, CASES[i].calls))
            fail_msg("case %zu: content '%s' calls %s; want '%s' %s", i, r.content, r.calls,
                     CASES[i].content, CASES[i].calls);
    }
}

static void test_every_cut_gives_the_same(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof CASES / sizeof *CASES; i++) {
        struct result whole;
        run(CASES[i].format, CASES[i].text, NULL, 0, &whole);
        size_t len = strlen(CASES[i].text);
        for (size_t a = 0; a <= len; a++)
            for (size_t b = a; b <= len; b += 3) { /* two cuts: a and b */
                size_t cuts[2] = {a, b};
                struct result r;
                run(CASES[i].format, CASES[i].text, cuts, 2, &r);
                if (strcmp(r.content, whole.content) || strcmp(r.calls, whole.calls))
                    fail_msg("case %zu cut at %zu,%zu: '%s' %s; whole: '%s' %s", i, a, b, r.content,
                             r.calls, whole.content, whole.calls);
            }
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_whole_texts),
                                       cmocka_unit_test(test_every_cut_gives_the_same)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
