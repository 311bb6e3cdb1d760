"""A run started from a pretrained Llama folder, whose tokenizer ends text with its own `</s>`,
exports a folder vLLM serves as transformers computes it; so does a run from a Qwen3 folder
(per-head q/k norms, a head size of its own), exported as a Qwen3."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
import transformers

from serving.vllm import ReplicaOptions
from tests.serving.conftest import RunningDeployment, start_deployment
from tests.training.test_architectures import save_model
from tests.training.test_architectures import spec_from as architecture_spec_from
from tests.training.test_pretrained import llama_style_folder, spec_from
from tools.check_parity import launch
from training.config import RunSpec
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
    return two_step_export(spec_from(llama_style_folder(tmp / "llama", corpus), dataset=str(corpus)), tmp)


def two_step_export(spec: RunSpec, tmp: Path) -> Path:
    """The export of `spec` trained two steps (one checkpoint) in `tmp`."""
    spec.train.steps = 2
    spec.train.warmup_steps = 1
    spec.train.checkpoint_interval = 2
    launch(spec, tmp / "run", 600)
    checkpoint = RunDir(tmp / "run").latest_checkpoint()
    assert checkpoint is not None
    return export(checkpoint, tmp / "exported")


@pytest.fixture(scope="module")
def qwen3_exported(tmp_path_factory: pytest.TempPathFactory, exported: Path) -> Path:
    """The export of a two-step run from a random Qwen3 (head size 32, which vLLM's CPU attention
    computes) that uses the Llama folder's tokenizer."""
    tmp = tmp_path_factory.mktemp("qwen3-export")
    corpus = demo_corpus.write(tmp / "corpus.txt", n_documents=300)
    return two_step_export(architecture_spec_from(save_model("qwen3", tmp / "qwen3", exported), dataset=str(corpus)), tmp)


OPTIONS = ReplicaOptions(max_model_len=64, max_num_seqs=4, kv_cache_gib=1, enforce_eager=True, dtype="float32")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, exported: Path, vllm_python: str) -> Iterator[RunningDeployment]:
    yield from start_deployment(
        tmp_path_factory.mktemp("served"), exported, vllm_python, name="continued", replicas=1, options=OPTIONS
    )


@pytest.fixture(scope="module")
def qwen3_deployment(
    tmp_path_factory: pytest.TempPathFactory, qwen3_exported: Path, vllm_python: str
) -> Iterator[RunningDeployment]:
    yield from start_deployment(
        tmp_path_factory.mktemp("served-qwen3"), qwen3_exported, vllm_python, name="qwen3", replicas=1, options=OPTIONS
    )


async def test_vllm_serves_the_export_of_a_run_from_a_pretrained_folder_as_transformers_computes_it(
    deployment: RunningDeployment, exported: Path
) -> None:
    assert transformers.AutoTokenizer.from_pretrained(exported).eos_token == "</s>"
    await assert_served_as_transformers_computes(deployment, exported, "continued")


async def test_vllm_serves_a_qwen3_export_as_transformers_computes_it(
    qwen3_deployment: RunningDeployment, qwen3_exported: Path
) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(qwen3_exported)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    await assert_served_as_transformers_computes(qwen3_deployment, qwen3_exported, "qwen3")


async def assert_served_as_transformers_computes(deployment: RunningDeployment, exported: Path, name: str) -> None:
    """Greedy continuations equal transformers' and prompt log-probabilities within 1e-3."""
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    client = openai.AsyncOpenAI(base_url=f"{deployment.router_url}/v1", api_key="unused", max_retries=0, timeout=120)
    worst_gap = 0.0
    for prompt in PROMPTS:
        ids = tokenizer(prompt).input_ids
        served = await client.completions.create(
            model=name, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
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
