#!/bin/bash
# Sharded KV transfers' bandwidth (issue 17, item 2): every (p, d) pair of prefill and decode TP
# in {1, 2, 4}, against the unsharded pair (p = d = 1) whose rounds alternate with each pair's
# in the same run, over tcp;ofi_rxm and shm. tests/tools/xfer_shard_bench.c says what is
# measured; each line's destination pages are checked against the source pattern and
# checksummed.
#
#   bench/xfer_shard.sh [BUILD_DIR] [extra xfer_shard_bench options]
#
# Defaults: a 2048-token request of 8 layers and 8 KV heads of 128 (f32 pages of 16 tokens:
# 128 MiB of KV), chunks of 512 tokens, median of 5 rounds.
set -euo pipefail
build=${1:-build}
shift || true
bin="$build/tests/tools/xfer_shard_bench"
[ -x "$bin" ] || { echo "no $bin: build first (cmake --build $build)" >&2; exit 1; }
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(uptime | sed 's/.*load/load/')"
for provider in "tcp;ofi_rxm" shm; do
    "$bin" --provider "$provider" "$@"
    echo "# after $provider: $(uptime | sed 's/.*load/load/')"
done
