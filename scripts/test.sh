#!/usr/bin/env bash
# Sets up everything (scripts/setup.sh) and runs the whole test suite:
#   - the Release build (build/): C unit tests (cmocka) and the Python tests against the
#     independent references (gguf, safetensors, tokenizers, numpy, jinja2);
#   - the same suite on an ASan+UBSan build (build-asan/; its tandem binary links the CPU's
#     SIMD kernels uninstrumented, the C unit tests instrumented: CMakeLists.txt says why);
#   - short libFuzzer runs of the parsers (build-fuzz/, clang).
# The last line is "N passed, N failed, N skipped" over all of it; the exit status is 0 only if
# nothing failed. Extra arguments go to pytest (e.g. -k tokenizer).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || { echo "0 passed, 1 failed"; exit 1; }

jobs=$(nproc)
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DTDM_SANITIZE=ON -DTDM_CUDA=OFF >/dev/null &&
    cmake --build build-asan -j"$jobs" >/dev/null || { echo "asan build failed"; echo "0 passed, 1 failed"; exit 1; }
CC=clang cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=Debug -DTDM_FUZZ=ON >/dev/null &&
    cmake --build build-fuzz -j"$jobs" >/dev/null || { echo "fuzz build failed"; echo "0 passed, 1 failed"; exit 1; }

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0:halt_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
rm -rf build/test-results && mkdir -p build/test-results

# pytest-xdist: a worker more than the cores, at most 4; a test file stays on one worker (module
# fixtures such as a shared server are then started once). The extra worker fills the time the
# others spend waiting on timeouts, process starts and peers: on 2 cores, 2 workers left the
# cores 15% idle over the Release pass (17:39-18:03), 3 workers 10% (16:10).
workers=$(( jobs + 1 < 4 ? jobs + 1 : 4 ))
echo "=== suite on the Release build ==="
TANDEM_BUILD=build .venv/bin/python -m pytest tests -q -p no:cacheprovider -n "$workers" \
    --dist loadfile --durations=15 --junitxml=build/test-results/release.xml "$@"
echo "=== suite on the ASan+UBSan build ==="
TANDEM_BUILD=build-asan TANDEM_SANITIZED=1 .venv/bin/python -m pytest tests -q -p no:cacheprovider \
    -n "$workers" --dist loadfile --durations=15 --junitxml=build/test-results/asan.xml "$@"

.venv/bin/python - build/test-results/release.xml build/test-results/asan.xml <<'PY'
import sys
import xml.etree.ElementTree as ET
passed = failed = skipped = 0
for path in sys.argv[1:]:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        failed += 1  # a run that left no report counts as a failure
        continue
    for ts in root.iter("testsuite"):
        t, f, e, s = (int(ts.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
        passed += t - f - e - s
        failed += f + e
        skipped += s
print(f"{passed} passed, {failed} failed, {skipped} skipped")
sys.exit(1 if failed or passed == 0 else 0)
PY
