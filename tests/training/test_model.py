"""The model's shapes and names, and what pipeline splitting and recompute leave unchanged."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from training.config import ModelConfig, tiny
from training.export import hf_name
from training.hf_format import hf_config
from training.model import Transformer, cross_entropy_loss
from training.parallel.pipeline import split_stage
from training.parallel.recompute import apply_recompute


@pytest.fixture()
def cfg() -> ModelConfig:
    return tiny().model


def test_it_maps_token_ids_to_logits_over_the_vocabulary(cfg: ModelConfig) -> None:
    model = Transformer(cfg)
    logits = model(torch.randint(0, cfg.vocab_size, (3, 17)))
    assert logits.shape == (3, 17, cfg.vocab_size)


def test_its_parameter_count_is_the_configs(cfg: ModelConfig) -> None:
    assert sum(p.numel() for p in Transformer(cfg).parameters()) == cfg.num_params()


def test_parameter_names_and_shapes_are_llamas_after_renaming(cfg: ModelConfig) -> None:
    ours = {hf_name(k): tuple(v.shape) for k, v in Transformer(cfg).state_dict().items()}
    llama = LlamaForCausalLM(LlamaConfig(**hf_config(cfg, "float32", bos=0, eos=0)))
    theirs = {k: tuple(v.shape) for k, v in llama.state_dict().items() if "rotary" not in k}
    assert ours == theirs


def test_pipeline_stages_together_hold_every_parameter_once_under_its_own_name(cfg: ModelConfig) -> None:
    names = [list(split_stage(Transformer(cfg), s, 3).state_dict()) for s in range(3)]
    assert sorted(sum(names, [])) == sorted(Transformer(cfg).state_dict())
    assert "embed_tokens.weight" in names[0] and "lm_head.weight" in names[2]
    assert [n for n in names[1] if n.startswith("layers.")][0].startswith("layers.2.")


def test_a_middle_stage_maps_hidden_states_to_hidden_states(cfg: ModelConfig) -> None:
    h = torch.randn(2, 8, cfg.dim)
    assert split_stage(Transformer(cfg), 1, 3)(h).shape == (2, 8, cfg.dim)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_changes_neither_the_loss_nor_the_gradients(cfg: ModelConfig, mode: str) -> None:
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    y = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    torch.manual_seed(0)
    plain = Transformer(cfg)
    torch.manual_seed(0)
    wrapped = Transformer(cfg)
    apply_recompute(wrapped, mode)  # type: ignore[arg-type]
    assert list(wrapped.state_dict()) == list(plain.state_dict())  # checkpoints keep plain names
    losses = []
    for model in (plain, wrapped):
        loss = cross_entropy_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == losses[1]
    for (name, a), b in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad), name
