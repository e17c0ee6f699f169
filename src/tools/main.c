/*
 * The `tandem` binary: one executable, one subcommand per job.
 */
#include <stdio.h>
#include <string.h>

#include "tools/tools_int.h"

static void usage(FILE *f)
{
    fprintf(f,
            "tandem %s: an LLM inference engine\n"
            "\n"
            "usage: tandem <command> [options]\n"
            "\n"
            "commands:\n"
            "  generate   generate text or token ids from a prompt (streams to stdout)\n"
            "  chat       chat with the model (one --prompt, or interactive on a terminal)\n"
            "  info       print a model's configuration, tensor types and sizes\n"
            "  serve      serve the OpenAI-compatible HTTP API\n"
            "  router     one OpenAI endpoint over several `tandem serve` nodes\n"
            "  bench      benchmarks (`tandem bench model|serve|xfer|spec`)\n"
            "  checkpoint write a random-weight HF checkpoint (`--shape llama-3.1-8b --out DIR`)\n"
            "  train-mtp  train a speculation head on the model's own continuations\n"
            "  topo       where N ranks would run: GPU, NUMA node, cores, nearest NICs\n"
            "\n"
            "Every command takes --model PATH (a .gguf file or a Hugging Face checkpoint folder);\n"
            "without it the default model is used: $TANDEM_MODEL, or\n"
            "~/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf (scripts/fetch_model.sh).\n"
            "Run `tandem <command> --help` for a command's options.\n",
            TDM_VERSION);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "-h") || !strcmp(cmd, "--help") || !strcmp(cmd, "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(cmd, "--version") || !strcmp(cmd, "version")) {
        printf("tandem %s\n", TDM_VERSION);
        return 0;
    }
    if (!strcmp(cmd, "generate")) return tdm_cmd_generate(argc - 1, argv + 1);
    if (!strcmp(cmd, "chat")) return tdm_cmd_chat(argc - 1, argv + 1);
    if (!strcmp(cmd, "info")) return tdm_cmd_info(argc - 1, argv + 1);
    if (!strcmp(cmd, "bench")) return tdm_cmd_bench(argc - 1, argv + 1);
    if (!strcmp(cmd, "train-mtp")) return tdm_cmd_train_mtp(argc - 1, argv + 1);
    if (!strcmp(cmd, "serve")) return tdm_cmd_serve(argc - 1, argv + 1);
    if (!strcmp(cmd, "router")) return tdm_cmd_router(argc - 1, argv + 1);
    if (!strcmp(cmd, "checkpoint")) return tdm_cmd_checkpoint(argc - 1, argv + 1);
    if (!strcmp(cmd, "topo")) return tdm_cmd_topo(argc - 1, argv + 1);
    fprintf(stderr, "tandem: unknown command '%s'\n\n", cmd);
    usage(stderr);
    return 2;
}
