"""Every request field vLLM's OpenAI server takes has been decided on: passed through, or closed
with a reason (serving.openai_requests). Read from vLLM's own request classes in its environment, so an
upgrade that adds a field fails here until someone decides."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from serving.openai_requests import CLOSED_FIELDS, PASSED_FIELDS

pytestmark = pytest.mark.vllm

# The body fields the gateway reads itself.
READ_BY_THE_GATEWAY = {"model", "messages", "prompt"}

LIST_FIELDS = """
import json
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
print(json.dumps({"chat": sorted(ChatCompletionRequest.model_fields), "completions": sorted(CompletionRequest.model_fields)}))
"""


def test_every_field_of_vllms_requests_is_passed_or_closed(vllm_python: str) -> None:
    out = subprocess.run(
        [vllm_python, "-c", LIST_FIELDS],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1", VLLM_NO_USAGE_STATS="1"),
    )
    fields = json.loads(out.stdout.strip().splitlines()[-1])
    decided = PASSED_FIELDS | set(CLOSED_FIELDS) | READ_BY_THE_GATEWAY
    for endpoint, names in fields.items():
        assert not set(names) - decided, f"undecided {endpoint} fields: {sorted(set(names) - decided)}"
    # Nothing decided that vLLM no longer has.
    assert not decided - set(fields["chat"]) - set(fields["completions"])
