#!/usr/bin/env bash
# Sets up everything tandem needs on a fresh Debian 12 machine (run as root), idempotently:
#   1. Debian packages (compilers, CMake, and the libraries tandem links),
#   2. a Python virtual environment (.venv) with the pinned test/tool packages,
#   3. the default model (scripts/fetch_model.sh),
#   4. a Release build in build/.
# Set TANDEM_SKIP_MODEL=1 to skip step 3 and TANDEM_SKIP_BUILD=1 to skip step 4.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
    build-essential cmake pkg-config git ca-certificates
    binutils                            # readelf: libfabric's soname and symbol versions (CMake)
    clang libclang-rt-14-dev            # libFuzzer targets
    libfabric-dev libmicrohttpd-dev libjansson-dev libpcre2-dev libhwloc-dev
    libgnutls28-dev                     # HMAC-SHA256, random bytes, the HTTPS client
    libzmq3-dev                         # KV cache events (vLLM's ZMQ stream)
    openssl                             # tests make their own TLS certificates
    libopenblas-dev libcmocka-dev
    iproute2 iperf3 curl
    libfabric-bin                       # fi_pingpong: bench xfer's same-run latency reference
    python3 python3-venv python3-pip
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing ${missing[*]}"
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Python test tools, pinned (requirements-test.txt). Rebuilt when the pins change.
PY=${PYTHON:-python3}
stamp=.venv/.requirements.sha256
want=$(sha256sum requirements-test.txt | cut -d' ' -f1)
if [ ! -x .venv/bin/python ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "setup: creating .venv with the pinned test packages"
    rm -rf .venv
    "$PY" -m venv .venv
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -r requirements-test.txt
    echo "$want" > "$stamp"
fi

if [ "${TANDEM_SKIP_MODEL:-0}" != 1 ]; then
    PYTHON=.venv/bin/python scripts/fetch_model.sh
fi

if [ "${TANDEM_SKIP_BUILD:-0}" != 1 ]; then
    cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
    cmake --build build -j"$(nproc)"
fi
