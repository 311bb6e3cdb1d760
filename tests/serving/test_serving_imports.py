"""`serving` runs where neither Django nor torch is installed: a replica host, a bare router."""

from __future__ import annotations

import subprocess
import sys

MODULES = [
    "serving",
    "serving.vllm",
    "serving.supervisor",
    "serving.router",
    "serving.gateway",
    "serving.openai_requests",
    "serving.state",
    "serving.openai_errors",
    "serving.replica_metrics",
    "serving.app",
    "serving.export_store",
    "serving.quantize",
    "serving.quality",
]


def test_importing_serving_loads_neither_django_nor_torch_nor_the_platform() -> None:
    # Of training, only the stdlib-only port picking (the same ranges rule for every listener) and
    # the field-error base its option errors share with the spec's.
    code = (
        f"import sys\nfor m in {MODULES!r}: __import__(m)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('django', 'torch', 'transformers', 'controlplane', 'training')\n"
        "               and m not in ('training', 'training.ports', 'training.field_error'))\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == ""
