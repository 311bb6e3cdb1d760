#!/usr/bin/env bash
# Build (once) the virtualenv that runs `python -m serving.quantize` (llmcompressor), and print
# its python (tools/tool_env.sh builds it).
#
# llmcompressor pins its own transformers and would take a CUDA torch from PyPI: torch is
# installed first from the CPU build and held there by a constraint, so that nothing in
# llmcompressor's requirements replaces it, and the import check checks torch's build too.
#
#   tools/quantize_env.sh            # build if needed; the last line printed is the env's python
#   FATHOM_QUANTIZE_ENV=/path FATHOM_QUANTIZE_TORCH='torch==2.13.0+cpu' tools/quantize_env.sh
set -euo pipefail

LLMCOMPRESSOR_PACKAGE="llmcompressor==0.14.0.1"
TORCH_PACKAGE="${FATHOM_QUANTIZE_TORCH:-torch==2.13.0+cpu}"
ENV_DIR="${FATHOM_QUANTIZE_ENV:-$HOME/.cache/fathom/llmcompressor-0.14.0.1}"
BASE_PYTHON="${FATHOM_QUANTIZE_BASE_PYTHON:-python3.11}"

install_tool() {
    quiet_pip install --quiet "$TORCH_PACKAGE"
    echo "$TORCH_PACKAGE" > "$ENV_DIR/torch-constraint.txt"
    quiet_pip install --quiet -c "$ENV_DIR/torch-constraint.txt" "$LLMCOMPRESSOR_PACKAGE"
}

check_tool() {
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
}

source "$(dirname "${BASH_SOURCE[0]}")/tool_env.sh"
build_tool_env quantizer "a minute or two"
