"""What a deployment serves is the checkpoint: vLLM (float32, through Fathom's router and the
official openai client) against `transformers` on the same weights and tokenizer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
import transformers

from serving.vllm import ReplicaOptions
from tests.serving.conftest import RunningDeployment, start_deployment

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [
    "the cat sees",
    "a dog follows the moon",
    "my friend draws three apples",
    "the robot carries a red box near",
    "12 13 14 15",
    "the teacher finds",
    "a child counts the river under the tree. the bird",
    "7 8 9",
    "the bird likes a small boat",
    "the cat sees a dog at home. my friend",
]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def deployment(
    tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path, vllm_python: str
) -> Iterator[RunningDeployment]:
    options = ReplicaOptions(max_model_len=1024, max_num_seqs=16, kv_cache_gib=1, enforce_eager=True, dtype="float32")
    yield from start_deployment(
        tmp_path_factory.mktemp("parity"), tiny_checkpoint, vllm_python, name="tiny", replicas=1, options=options
    )


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    model.eval()
    return model, transformers.AutoTokenizer.from_pretrained(tiny_checkpoint)


async def test_prompt_logprobs_and_greedy_completions_match_transformers(
    deployment: RunningDeployment, reference
) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = reference
    client = openai.AsyncOpenAI(base_url=f"{deployment.router_url}/v1", api_key="unused", max_retries=0, timeout=120)
    worst_logprob_gap = 0.0
    same_completion = 0
    for prompt in PROMPTS:
        ids = tokenizer(prompt).input_ids
        served = await client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=NEW_TOKENS,
            temperature=0,
            extra_body={"prompt_logprobs": 0, "return_token_ids": True},
        )
        choice = served.choices[0]
        extra = choice.model_extra or {}
        served_prompt_logprobs = extra["prompt_logprobs"]
        assert served_prompt_logprobs[0] is None and len(served_prompt_logprobs) == len(ids)

        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
            expected = torch.log_softmax(logits.double(), dim=-1)
            greedy = model.generate(
                torch.tensor([ids]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            )
        for position in range(1, len(ids)):
            token = ids[position]
            entry = served_prompt_logprobs[position][str(token)]  # keyed by the prompt's own token id
            gap = abs(entry["logprob"] - expected[position - 1, token].item())
            worst_logprob_gap = max(worst_logprob_gap, gap)

        reference_tokens = greedy[0, len(ids) :].tolist()
        served_tokens = list(extra["token_ids"])
        if served_tokens == reference_tokens[: len(served_tokens)] and len(served_tokens) == len(reference_tokens):
            same_completion += 1
    await client.close()
    print(
        f"worst prompt logprob gap {worst_logprob_gap:.2e}; {same_completion}/{len(PROMPTS)} greedy completions identical"
    )
    assert worst_logprob_gap < 1e-3
    assert same_completion >= 9, f"{same_completion} of {len(PROMPTS)} greedy completions matched"
