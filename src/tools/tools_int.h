/*
 * Private declarations shared by the `tandem` subcommands (src/tools/).
 *
 * Each subcommand is `int tdm_cmd_<name>(int argc, char **argv)` returning a process exit code:
 * 0 on success, 1 on a runtime failure, 2 on a usage error. Messages go to stderr; stdout is
 * reserved for the command's output (generated text, token ids, JSON).
 */
#ifndef TANDEM_TOOLS_INT_H
#define TANDEM_TOOLS_INT_H

#include "tandem/engine.h"
#include "tandem/model.h"
#include "tandem/sample.h"
#include "tandem/tok.h"

int tdm_cmd_generate(int argc, char **argv);
int tdm_cmd_chat(int argc, char **argv);
int tdm_cmd_info(int argc, char **argv);
int tdm_cmd_bench(int argc, char **argv);
int tdm_cmd_bench_model_cuda(int argc, char **argv); /* bench_gpu.c: --backend cuda */
int tdm_cmd_bench_xfer(int argc, char **argv);       /* bench_xfer.c: transfer-engine bandwidth */
int tdm_cmd_bench_serve(int argc, char **argv);      /* bench_serve.c: HTTP load generator */
int tdm_cmd_serve(int argc, char **argv);            /* serve.c: the OpenAI-compatible server */
int tdm_cmd_router(int argc, char **argv);           /* router.c: one endpoint over serve nodes */
int tdm_cmd_checkpoint(int argc, char **argv); /* checkpoint.c: random-weight HF checkpoints */

/* Loads --model (or the default model), drawing a progress bar on stderr when it is a terminal.
 * On failure prints the reason and returns NULL. */
struct tdm_model *tdm_tool_load_model(const char *path);
/* Loads the model's tokenizer: GGUF metadata, or tokenizer.json in the checkpoint folder.
 * Returns NULL (after printing why, unless quiet) when there is none. */
tdm_tok_t *tdm_tool_load_tokenizer(const struct tdm_model *m, bool quiet);
/* Parses "5,17,3" into a malloc'd array; false (after printing why) on junk or an empty list. */
bool tdm_tool_parse_ids(const char *s, int32_t **ids, int *n);
/* Strict numeric option parsing: prints "--name: ..." and returns false on junk. */
bool tdm_tool_int(const char *name, const char *s, int64_t lo, int64_t hi, int64_t *out);
bool tdm_tool_float(const char *name, const char *s, double lo, double hi, double *out);
void tdm_tool_fail(const char *what);
/* Writes `text` and a newline to path through a temporary file and a rename, so a reader (a
 * script waiting for a --port-file) never sees a partial file; prints why and returns false on
 * failure. */
bool tdm_tool_write_file_atomic(const char *path,
                                const char *text); /* prints "tandem: what: <tdm_err_msg()>" */

#endif
