"""An exported checkpoint is a Hugging Face Llama: same logits, loadable tokenizer, chat template."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from tools.check_parity import launch, parity_spec
from training.config import DataConfig, RunSpec
from training.export import export, load_model
from training.run_dir import RunDir

PROMPTS = [
    "Ada arrived at the harbour with a lantern.",
    "12 plus 7 is 19. 40 minus 3 is",
    "User: Why is the sky blue?\nAssistant:",
    "Fog rolled in from the sea when Nora",
]


@pytest.fixture(scope="module")
def checkpoint(tiny_data: DataConfig, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint written by a tensor-parallel run, so export must gather shards."""
    spec = parity_spec(3, tp=2)
    spec = RunSpec.from_dict({**spec.to_dict(), "data": vars(tiny_data)})
    run_dir = tmp_path_factory.mktemp("run")
    launch(spec, run_dir, timeout=600)
    found = RunDir(run_dir).latest_checkpoint()
    assert found is not None
    return found


def token_batch(out_dir: Path) -> torch.Tensor:
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    n = min(len(i) for i in ids)
    return torch.tensor([i[:n] for i in ids])


def test_the_export_loads_in_transformers_with_fathoms_logits(checkpoint: Path, tmp_path: Path) -> None:
    out = export(checkpoint, tmp_path / "hf")
    _, fathom = load_model(checkpoint)
    llama = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    batch = token_batch(out)
    with torch.no_grad():
        ours, theirs = fathom(batch), llama(batch).logits
    assert theirs.shape == (len(PROMPTS), batch.shape[1], fathom.cfg.vocab_size)
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_the_exported_tokenizer_round_trips_text_and_renders_the_chat_template(
    checkpoint: Path, tmp_path: Path
) -> None:
    out = export(checkpoint, tmp_path / "hf")
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.decode(tokenizer(PROMPTS[0])["input_ids"]) == PROMPTS[0]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why do ships float?"}]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhy do ships float?<|im_end|>\n<|im_start|>assistant\n"
    )
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer(rendered)["input_ids"].count(im_end) == 2  # special tokens stay single tokens


def test_a_bfloat16_export_stores_bfloat16_weights(checkpoint: Path, tmp_path: Path) -> None:
    out = export(checkpoint, tmp_path / "hf", dtype="bfloat16")
    llama = LlamaForCausalLM.from_pretrained(out)
    assert llama.config.dtype == torch.bfloat16
    assert llama.model.embed_tokens.weight.dtype == torch.bfloat16
    _, fathom = load_model(checkpoint)
    assert fathom.lm_head is not None
    assert torch.equal(llama.lm_head.weight, fathom.lm_head.weight.to(torch.bfloat16))


def test_export_refuses_a_folder_that_was_never_committed(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a committed checkpoint"):
        export(tmp_path, tmp_path / "hf")
