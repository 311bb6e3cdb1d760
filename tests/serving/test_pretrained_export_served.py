"""A run started from a pretrained Llama folder, whose tokenizer ends text with its own `</s>`,
exports a folder vLLM serves as transformers computes it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
import transformers

from serving.vllm import ReplicaOptions
from tests.serving.conftest import RunningDeployment, start_deployment
from tests.training.test_pretrained import llama_style_folder, spec_from
from tools.check_parity import launch
from training.demo import corpus as demo_corpus
from training.export import export
from training.run_dir import RunDir

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = ["the cat sees", "a dog follows the moon", "12 13 14 15"]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("pretrained-export")
    corpus = demo_corpus.write(tmp / "corpus.txt", n_documents=300)
    spec = spec_from(llama_style_folder(tmp / "llama", corpus), dataset=str(corpus))
    spec.train.steps = 2
    spec.train.warmup_steps = 1
    spec.train.checkpoint_interval = 2
    launch(spec, tmp / "run", 600)
    checkpoint = RunDir(tmp / "run").latest_checkpoint()
    assert checkpoint is not None
    return export(checkpoint, tmp / "exported")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, exported: Path, vllm_python: str) -> Iterator[RunningDeployment]:
    options = ReplicaOptions(max_model_len=64, max_num_seqs=4, kv_cache_gib=1, enforce_eager=True, dtype="float32")
    yield from start_deployment(
        tmp_path_factory.mktemp("served"), exported, vllm_python, name="continued", replicas=1, options=options
    )


async def test_vllm_serves_the_export_of_a_run_from_a_pretrained_folder_as_transformers_computes_it(
    deployment: RunningDeployment, exported: Path
) -> None:
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    assert tokenizer.eos_token == "</s>"
    client = openai.AsyncOpenAI(base_url=f"{deployment.router_url}/v1", api_key="unused", max_retries=0, timeout=120)
    worst_gap = 0.0
    for prompt in PROMPTS:
        ids = tokenizer(prompt).input_ids
        served = await client.completions.create(
            model="continued", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
            extra_body={"prompt_logprobs": 0, "return_token_ids": True},
        )  # fmt: skip
        extra = served.choices[0].model_extra or {}
        with torch.no_grad():
            expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
            greedy = model.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long), eos_token_id=None,
            )  # fmt: skip
        for position in range(1, len(ids)):
            served_logprob = extra["prompt_logprobs"][position][str(ids[position])]["logprob"]
            worst_gap = max(worst_gap, abs(served_logprob - expected[position - 1, ids[position]].item()))
        assert list(extra["token_ids"]) == greedy[0, len(ids) :].tolist()[: len(extra["token_ids"])], prompt
    print(f"worst prompt logprob gap {worst_gap:.2e}")
    assert worst_gap < 1e-3
