"""A run started from a pretrained Qwen3 folder (per-head q/k norms, a head size of its own) with
a pretrained Llama folder's tokenizer, which ends text with its own `</s>`, exports a Qwen3 folder
vLLM serves as transformers computes it.

One replica serves it: a run from the Llama folder exports through the same code (its export is
this one's tokenizer source, checked here in transformers), and a Llama export on vLLM is
tests/serving/test_deployment.py's. The same replica serves a LoRA run's adapter on that export,
attached while it runs and detached again, as transformers computes the merged model."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import torch
import transformers

from serving.replica_adapters import request_adapters
from serving.state import read_events, read_state
from serving.vllm import ReplicaOptions
from tests.serving.conftest import RunningDeployment, lora_checkpoint_on, start_deployment
from tests.training.test_architectures import save_model
from tests.training.test_architectures import spec_from as architecture_spec_from
from tests.training.test_pretrained import llama_style_folder, spec_from
from tools.check_parity import launch
from training.config import RunSpec
from training.demo import corpus as demo_corpus
from training.export import export, export_adapter
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


# LoRA on, so that adapters can be attached to the running replica.
OPTIONS = ReplicaOptions(
    max_model_len=64, max_num_seqs=4, kv_cache_gib=1, enforce_eager=True, dtype="float32", max_loras=1, max_lora_rank=8
)


@dataclass(frozen=True)
class Tuned:
    adapter: Path  # the PEFT folder of a LoRA run on the Qwen3 export
    merged: Path  # the same checkpoint merged into a whole model


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory, qwen3_exported: Path) -> Tuned:
    """A LoRA run's checkpoint on the Qwen3 export, exported both ways."""
    tmp = tmp_path_factory.mktemp("lora-on-qwen3")
    checkpoint = lora_checkpoint_on(qwen3_exported, tmp)
    return Tuned(adapter=export_adapter(checkpoint, tmp / "adapter"), merged=export(checkpoint, tmp / "merged"))


@pytest.fixture(scope="module")
def qwen3_deployment(
    tmp_path_factory: pytest.TempPathFactory, qwen3_exported: Path, vllm_python: str
) -> Iterator[RunningDeployment]:
    yield from start_deployment(
        tmp_path_factory.mktemp("served-qwen3"), qwen3_exported, vllm_python, name="qwen3", replicas=1, options=OPTIONS
    )


async def test_vllm_serves_the_qwen3_export_of_a_run_from_pretrained_folders_as_transformers_computes_it(
    qwen3_deployment: RunningDeployment, qwen3_exported: Path, exported: Path
) -> None:
    # The Llama run's export, whose tokenizer this one took: a Llama that ends text with `</s>`.
    assert type(transformers.AutoModelForCausalLM.from_pretrained(exported)).__name__ == "LlamaForCausalLM"
    assert transformers.AutoTokenizer.from_pretrained(exported).eos_token == "</s>"
    assert transformers.AutoTokenizer.from_pretrained(qwen3_exported).eos_token == "</s>"
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


async def test_an_adapter_attached_to_a_running_replica_serves_the_merged_models_output_until_detached(
    qwen3_deployment: RunningDeployment, qwen3_exported: Path, tuned: Tuned
) -> None:
    state_dir = qwen3_deployment.state_dir
    (replica,) = read_state(state_dir).replicas  # type: ignore[union-attr]
    assert replica.adapters == []
    assert request_adapters(state_dir, {"tuned": str(tuned.adapter)})
    await _until(lambda: read_state(state_dir).replicas[0].adapters == ["tuned"], "the adapter to load")  # type: ignore[union-attr]
    (now,) = read_state(state_dir).replicas  # type: ignore[union-attr]
    assert (now.pid, now.restarts) == (replica.pid, replica.restarts)  # no restart
    client = openai.AsyncOpenAI(base_url=f"{qwen3_deployment.router_url}/v1", api_key="unused", max_retries=0, timeout=120)
    listed = {m.id: (m.model_extra or {}).get("parent") for m in (await client.models.list()).data}
    assert listed == {"qwen3": None, "tuned": "qwen3"}

    gap_to_base = await _logprob_gap(client, "tuned", qwen3_exported)  # the base's outputs are not the adapter's
    assert gap_to_base > 0.1, gap_to_base
    await assert_served_as_transformers_computes(qwen3_deployment, tuned.merged, "tuned")

    assert request_adapters(state_dir, {})
    await _until(lambda: read_state(state_dir).replicas[0].adapters == [], "the adapter to unload")  # type: ignore[union-attr]
    with pytest.raises(openai.NotFoundError, match="tuned"):
        await client.completions.create(model="tuned", prompt="the cat sees", max_tokens=2)
    events = [e for e in read_events(state_dir)[0] if e.kind == "replica_adapters"]
    assert [(e.loaded, e.unloaded, e.message) for e in events] == [(["tuned"], [], ""), ([], ["tuned"], "")]
    await client.close()


async def _until(condition, what: str, timeout: float = 120) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


async def _logprob_gap(client: openai.AsyncOpenAI, name: str, other: Path) -> float:
    """The largest gap between the served prompt log-probabilities of `name` and transformers' on `other`."""
    model = transformers.AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(other)
    gap = 0.0
    for prompt in PROMPTS:
        ids = tokenizer(prompt).input_ids
        served = await client.completions.create(
            model=name, prompt=prompt, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 0}
        )
        extra = served.choices[0].model_extra or {}
        with torch.no_grad():
            expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
        for position in range(1, len(ids)):
            served_logprob = extra["prompt_logprobs"][position][str(ids[position])]["logprob"]
            gap = max(gap, abs(served_logprob - expected[position - 1, ids[position]].item()))
    return gap
