/*
 * What the fuzz targets that need a tokenizer share: the byte-level tokenizer of the seed
 * corpus (tests/fuzz/corpus/tok_json/byte_level_digits.json), found next to the executable's
 * build tree, loaded once per process. Aborts when it cannot be loaded: a target that fuzzes
 * nothing must not pass.
 */
#ifndef TANDEM_FUZZ_LIB_H
#define TANDEM_FUZZ_LIB_H

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tandem/tok.h"

static tdm_tok_t *fuzz_tokenizer(void)
{
    static tdm_tok_t *tok;
    if (tok) return tok;
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) abort();
    exe[n] = '\0';
    /* build-fuzz/fuzz/<target> -> the repository root */
    for (int up = 0; up < 3; up++) {
        char *slash = strrchr(exe, '/');
        if (!slash) abort();
        *slash = '\0';
    }
    char path[PATH_MAX + 64];
    snprintf(path, sizeof path, "%s/tests/fuzz/corpus/tok_json/byte_level_digits.json", exe);
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "fuzz: cannot open %s\n", path);
        abort();
    }
    static char buf[1 << 20];
    size_t len = fread(buf, 1, sizeof buf, f);
    fclose(f);
    if (tdm_tok_from_hf_memory(buf, len, &tok) != TDM_OK) {
        fprintf(stderr, "fuzz: %s: %s\n", path, tdm_err_msg());
        abort();
    }
    return tok;
}

#endif
