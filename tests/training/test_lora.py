"""LoRA fine-tunes of a pretrained base: the spec's `lora` section and its refusals, a dp2×tp2
(FSDP) run that starts at the base model's loss, learns, trains as one process does and resumes
bitwise, its adapters-only checkpoint, and its exports (a PEFT adapter folder, a merged model)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh

from tests.training.test_architectures import (
    TIMEOUT,
    TOLERANCE,
    first_loss_of_transformers,
    reference,
    save_model,
    spec_from,
    token_ids,
)
from tests.training.test_checkpoint import resume_from
from tools.check_parity import launch, reference_spec, step_values
from training.checkpoint import read_metadata
from training.config import LORA_TARGETS, DataConfig, LoraConfig, RunSpec, SpecError
from training.export import export, export_adapter, load_model, main
from training.initial_weights import build_meta, initial_weights, materialize
from training.memory_snapshot import MemorySnapshots
from training.model import is_adapter
from training.parallel.tensor import apply_tp, keep_embedding_grad_sharded
from training.run_dir import RunDir
from training.trainer import build_optimizer

STEPS = 4
RESUME_AT = 2
LORA = LoraConfig(rank=4, alpha=8.0, targets=list(LORA_TARGETS))


@dataclass(frozen=True)
class LoraRuns:
    folder: Path  # the pretrained base
    spec: RunSpec  # the dp2×tp2 run's
    parallel: list[dict[str, Any]]
    single: list[dict[str, Any]]  # the same run on one process
    resumed: list[dict[str, Any]]  # the dp2×tp2 run again, from its checkpoint of step RESUME_AT
    checkpoint: Path  # the dp2×tp2 run's last


@pytest.fixture(scope="module")
def runs(tiny_data: DataConfig, tmp_path_factory: pytest.TempPathFactory) -> LoraRuns:
    """The one multi-rank pair of this file (an uninterrupted dp2×tp2 zero-3 run and its resume),
    and the one-process run they are compared with."""
    work = tmp_path_factory.mktemp("lora")
    folder = save_model("qwen2", work / "base", Path(tiny_data.tokenizer).parent)
    spec = spec_from(folder, dataset=tiny_data.dataset, dp=2, tp=2, zero=3)
    spec.lora = LORA
    spec.train.steps = STEPS
    spec.train.warmup_steps = 1
    spec.train.checkpoint_interval = RESUME_AT
    spec = RunSpec.from_dict(spec.to_dict())  # as the control plane and the ranks read it
    parallel = launch(spec, work / "parallel", TIMEOUT)
    single = launch(reference_spec(spec), work / "single", TIMEOUT)
    resume_from(work / "parallel", RESUME_AT, work / "resumed")
    resumed = launch(spec, work / "resumed", TIMEOUT)
    checkpoint = RunDir(work / "parallel").latest_checkpoint()
    assert checkpoint is not None
    return LoraRuns(folder, spec, parallel, single, resumed, checkpoint)


# --- The spec ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lora", "data", "layout", "field"),
    [
        ({"rank": 8}, {}, {}, "data.pretrained"),
        ({"rank": 8, "targets": ["q_proj", "qkv_proj"]}, {"pretrained": "/models/base"}, {}, "lora.targets"),
        ({"rank": 8, "targets": "q_proj"}, {"pretrained": "/models/base"}, {}, "lora.targets"),
        ({"rank": 8, "targets": []}, {"pretrained": "/models/base"}, {}, "lora.targets"),
        ({"rank": -1}, {"pretrained": "/models/base"}, {}, "lora.rank"),
        ({"rank": 8, "alpha": 0}, {"pretrained": "/models/base"}, {}, "lora.alpha"),
        ({"rank": 8, "dropout": 1.0}, {"pretrained": "/models/base"}, {}, "lora.dropout"),
        ({"rank": 8, "dropout": 0.1}, {"pretrained": "/models/base"}, {"tp": 2}, "lora.dropout"),
        ({"rank": 8, "scaling": 2}, {"pretrained": "/models/base"}, {}, "lora.scaling"),
    ],
)
def test_a_lora_spec_fathom_cannot_train_is_refused_naming_the_field(
    lora: dict[str, Any], data: dict[str, Any], layout: dict[str, Any], field: str
) -> None:
    with pytest.raises(SpecError) as refused:
        RunSpec.from_dict({"lora": lora, "data": data, "layout": layout})
    assert refused.value.field == field


def test_lora_is_off_by_default_and_a_full_fine_tunes_spec_reads_as_before() -> None:
    spec = RunSpec.from_dict({})
    assert not spec.lora.enabled and "lora" not in spec.to_dict()
    lora = RunSpec.from_dict({"lora": {"rank": 8, "targets": ["v_proj", "q_proj"]}, "data": {"pretrained": "/m"}})
    assert lora.lora.targets == ["q_proj", "v_proj"]  # the model's order, whatever the spec's
    assert RunSpec.from_dict(lora.to_dict()).lora == lora.lora


# --- Training -----------------------------------------------------------------------------------


def test_under_tp_only_the_adapters_train_and_the_model_starts_as_its_base(
    tiny_data: DataConfig, tmp_path: Path, one_rank_group: None
) -> None:
    """In-process, on a one-rank tp mesh: the styles apply, distributing does not thaw the base,
    and the hooks of a TP run without FSDP skip the frozen embedding."""
    folder = save_model("qwen2", tmp_path / "base", Path(tiny_data.tokenizer).parent)
    spec = spec_from(folder)
    spec.lora = LORA
    model = build_meta(spec.model, spec.lora)
    apply_tp(model, init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))["tp"])
    model.freeze_base()
    materialize([model], torch.device("cpu"), initial_weights(spec))
    keep_embedding_grad_sharded(model)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and trainable == {name for name, _ in model.named_parameters() if is_adapter(name)}

    ids = token_ids(spec.model.vocab_size)
    logits = model(ids)
    with torch.no_grad():
        assert (logits - reference(folder)(ids).logits).abs().max().item() <= TOLERANCE  # B = 0
    logits.float().pow(2).mean().backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == trainable
    # B = 0 passes no gradient back to A on the first step; B's own gradient is A·x's.
    assert all(grads[n].full_tensor().abs().max() > 0 for n in grads if n.endswith("lora_B.weight"))




def test_a_dp2_tp2_lora_run_starts_at_the_base_loss_learns_as_one_process_and_resumes_bitwise(
    runs: LoraRuns, tmp_path: Path
) -> None:
    losses, expected = step_values(runs.parallel), step_values(runs.single)
    assert sorted(losses) == list(range(1, STEPS + 1))
    # B starts at zero: the first loss is the untouched base model's.
    assert abs(losses[1] - first_loss_of_transformers(runs.folder, runs.spec, tmp_path / "data")) <= TOLERANCE
    assert losses[STEPS] < losses[1]
    # Later steps see the adapters' gradients: A's of column-parallel layers and B's of row-parallel
    # ones summed over tp, the rest split with their layers, all reduce-scattered over dp.
    assert max(abs(losses[s] - expected[s]) for s in expected) <= TOLERANCE, (losses, expected)
    norms, expected_norms = step_values(runs.parallel, "grad_norm"), step_values(runs.single, "grad_norm")
    assert max(abs(norms[s] - expected_norms[s]) / expected_norms[s] for s in expected_norms) <= TOLERANCE

    assert runs.resumed[0]["kind"] == "resumed" and runs.resumed[0]["step"] == RESUME_AT
    assert step_values(runs.resumed) == {s: v for s, v in losses.items() if s > RESUME_AT}  # bitwise


def test_a_lora_checkpoint_holds_the_adapters_and_names_its_base(runs: LoraRuns) -> None:
    stored = dcp.FileSystemReader(str(runs.checkpoint)).read_metadata().state_dict_metadata
    model_keys = [k.removeprefix("model.") for k in stored if k.startswith("model.")]
    layers, targets = runs.spec.model.n_layers, len(LORA.targets)
    assert len(model_keys) == layers * targets * 2 and all(is_adapter(k) for k in model_keys)
    # Optimizer state for the adapters only: AdamW's two moments and step of each.
    optim_keys = [k for k in stored if k.startswith("optim.state.")]
    assert optim_keys and all(is_adapter(k.removeprefix("optim.state.")) for k in optim_keys)
    assert read_metadata(runs.checkpoint)["lora_base"] == str(runs.folder)


def test_an_in_memory_snapshot_of_a_lora_rank_holds_the_adapters_and_restores_them(
    tiny_data: DataConfig, tmp_path: Path
) -> None:
    folder = save_model("qwen2", tmp_path / "base", Path(tiny_data.tokenizer).parent)
    spec = spec_from(folder)
    spec.lora = LORA
    model = build_meta(spec.model, spec.lora)
    materialize([model], torch.device("cpu"), initial_weights(spec))
    optimizer = build_optimizer(model, spec.train)
    model(token_ids(spec.model.vocab_size)).float().pow(2).mean().backward()
    optimizer.step()
    snapshots = MemorySnapshots(RunDir(tmp_path / "run"), rank=0, identity={}, parts=[model], optimizers=[optimizer])
    snapshots.take(1, {})
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapters.values())
    # Each adapter with AdamW's two moments (and step counts), never the frozen base.
    assert snapshots._data_file(0).stat().st_size < 4 * adapter_bytes
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(1.0)
    snapshots.restore(1)
    assert all(torch.equal(p, adapters[n]) for n, p in model.named_parameters() if p.requires_grad)
    snapshots.close()


# --- Exports ------------------------------------------------------------------------------------


def test_a_lora_checkpoint_exports_a_peft_adapter_folder_naming_its_base(runs: LoraRuns, tmp_path: Path) -> None:
    out = export_adapter(runs.checkpoint, tmp_path / "adapter")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["base_model_name_or_path"] == str(runs.folder)
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 8.0, 0.0)
    assert config["target_modules"] == list(LORA_TARGETS)
    assert (out / "tokenizer.json").is_file()

    _, model = load_model(runs.checkpoint)
    ours = {k: v for k, v in model.state_dict().items() if is_adapter(k)}
    tensors = load_file(str(out / "adapter_model.safetensors"))
    expected_names = {
        f"base_model.model.model.layers.{n}.{'mlp' if t.endswith(('gate_proj', 'up_proj', 'down_proj')) else 'self_attn'}"
        f".{t}.lora_{m}.weight"
        for n in range(runs.spec.model.n_layers)
        for t in LORA_TARGETS
        for m in "AB"
    }
    assert set(tensors) == expected_names
    q_a = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    q_b = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert torch.equal(q_a, ours["layers.0.self_attn.adapters.q_proj.lora_A.weight"])
    assert q_a.shape == (4, runs.spec.model.dim) and q_b.shape == (runs.spec.model.n_heads * runs.spec.model.head_dim, 4)
    assert q_b.abs().max() > 0  # trained away from its zero start

    main([str(runs.checkpoint.parent.parent), str(tmp_path / "cli")])  # a run folder: its newest checkpoint
    assert (tmp_path / "cli" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "cli" / "model.safetensors").exists()


def test_a_merged_export_is_the_base_plus_scaled_b_a_and_reloads_with_the_runs_logits(
    runs: LoraRuns, tmp_path: Path
) -> None:
    out = export(runs.checkpoint, tmp_path / "merged")
    _, model = load_model(runs.checkpoint)
    adapters = {k: v for k, v in model.state_dict().items() if is_adapter(k)}
    name = "model.layers.1.mlp.down_proj.weight"
    with safe_open(str(runs.folder / "model.safetensors"), framework="pt") as f:
        base = f.get_tensor(name)
    a = adapters["layers.1.mlp.adapters.down_proj.lora_A.weight"]
    b = adapters["layers.1.mlp.adapters.down_proj.lora_B.weight"]
    merged = load_file(str(out / "model.safetensors"))
    assert (merged[name] - (base + LORA.scale * b @ a)).abs().max().item() <= 1e-6
    with safe_open(str(runs.folder / "model.safetensors"), framework="pt") as f:
        assert set(merged) == set(f.keys())  # the base's architecture, names and biases included

    loaded = reference(out)
    ids = token_ids(runs.spec.model.vocab_size)
    with torch.no_grad():
        ours, theirs = model(ids), loaded(ids).logits
    assert (ours - theirs).abs().max().item() <= TOLERANCE

    main([str(runs.checkpoint), str(tmp_path / "cli"), "--merged"])
    assert (tmp_path / "cli" / "model.safetensors").is_file()
