#!/usr/bin/env bash
# Build (once) the virtualenv that runs `python -m serving.quantize` (llmcompressor), and print its python.
#
# llmcompressor pins its own transformers (and would take a CUDA torch from PyPI), so it lives in
# a venv of its own beside vLLM's (tools/vllm_env.sh), at a path that names the version. torch is
# installed first from the CPU build and held there by a constraint, so that nothing in
# llmcompressor's requirements replaces it. The env counts as ready only when the marker file
# exists, written after an import check that also checks torch's build.
#
#   tools/quantize_env.sh            # build if needed; the last line printed is the env's python
#   FATHOM_QUANTIZE_ENV=/path FATHOM_QUANTIZE_TORCH='torch==2.13.0+cpu' tools/quantize_env.sh
set -euo pipefail

LLMCOMPRESSOR_PACKAGE="llmcompressor==0.14.0.1"
TORCH_PACKAGE="${FATHOM_QUANTIZE_TORCH:-torch==2.13.0+cpu}"
ENV_DIR="${FATHOM_QUANTIZE_ENV:-$HOME/.cache/fathom/llmcompressor-0.14.0.1}"
MARKER="$ENV_DIR/.fathom-ready"
BASE_PYTHON="${FATHOM_QUANTIZE_BASE_PYTHON:-python3.11}"

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

echo "building the quantizer env in $ENV_DIR (a minute or two)" >&2
rm -rf "$ENV_DIR"
"$BASE_PYTHON" -m venv "$ENV_DIR"
"$ENV_DIR/bin/pip" install --quiet --upgrade pip 2>&1 | { grep -v "is ignored: it is neither" || true; } >&2
# (grep drops the notices about local index folders this machine lacks)
"$ENV_DIR/bin/pip" install --quiet "$TORCH_PACKAGE" 2>&1 | { grep -v "is ignored: it is neither" || true; } >&2
echo "$TORCH_PACKAGE" > "$ENV_DIR/torch-constraint.txt"
"$ENV_DIR/bin/pip" install --quiet -c "$ENV_DIR/torch-constraint.txt" "$LLMCOMPRESSOR_PACKAGE" 2>&1 \
    | { grep -v "is ignored: it is neither" || true; } >&2

OMP_NUM_THREADS=1 "$ENV_DIR/bin/python" - "$TORCH_PACKAGE" >&2 <<'PY'
import sys

import compressed_tensors
import llmcompressor
import torch
from llmcompressor import oneshot  # noqa: F401  (what serving.quantize calls)

wanted = sys.argv[1].split("==", 1)[1]
assert torch.__version__ == wanted, f"torch {torch.__version__} was installed, not {wanted}"
print("llmcompressor", llmcompressor.__version__, "compressed-tensors", compressed_tensors.__version__,
      "torch", torch.__version__, "import")
PY
touch "$MARKER"
echo "$ENV_DIR/bin/python"
