"""Llama 3.x (rope scaling, tied embeddings), Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms, a
head size of its own) and Mistral, each a small random model transformers builds and saves: Fathom
computes what transformers computes, trains it under dp2×tp2 as one process does, and exports it
back to the same architecture."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config, Qwen3Config

from tests.training.test_checkpoint import resume_from
from tests.training.test_initial_weights import assert_materialized_is_eager, materialize_under
from tools.check_parity import launch, reference_spec, step_values
from training.config import DataConfig, ModelConfig, RunSpec, SpecError, tiny
from training.data import TOKENIZER_FILES, ShardedSampler, TokenWindows, prepare_data
from training.export import export, load_model
from training.initial_weights import PretrainedWeights, build_meta, materialize
from training.model import Transformer
from training.pretrained import resolve
from training.run_dir import RunDir

TOLERANCE = 1e-5  # fp32
TIMEOUT = 600  # seconds; a hung run fails its test instead of blocking the suite
SEQ_LEN = 32

# Small enough that a 4-rank run takes seconds; vocabulary of the shared test tokenizer.
COMMON: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
)  # fmt: skip
# original_max_position_embeddings 16: the scaling stretches most of the frequencies a 64-token
# context turns, and blends some, so the tables differ from plain rotary where it counts.
LLAMA3_SCALING = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}  # fmt: skip
CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama3_tied": lambda: LlamaConfig(
        **COMMON, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING, tie_word_embeddings=True
    ),
    "qwen2": lambda: Qwen2Config(**COMMON),
    # head_dim 32: 4 heads × 32 = 128, twice hidden_size.
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=48),
}


def save_model(name: str, folder: Path, tokenizer_dir: Path) -> Path:
    """A random model of `name`'s config saved by transformers, with the tests' tokenizer. Its
    biases and norm gains are random too (transformers starts them at 0 and 1), so a bias or gain
    read from the wrong place, or not applied, shows in the logits."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name]())
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param.ndim == 1:
                param.normal_(1.0 if param_name.endswith("norm.weight") else 0.0, 0.3)
    model.save_pretrained(folder)
    for file in TOKENIZER_FILES:
        if (tokenizer_dir / file).exists():
            shutil.copy(tokenizer_dir / file, folder / file)
    return folder


@pytest.fixture(scope="module")
def folders(tiny_data: DataConfig, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Each architecture's folder, saved the first time a test asks for it."""
    saved: dict[str, Path] = {}

    def folder(name: str) -> Path:
        if name not in saved:
            saved[name] = save_model(name, tmp_path_factory.mktemp(name), Path(tiny_data.tokenizer).parent)
        return saved[name]

    return folder


def spec_from(folder: Path, dataset: str = "", **layout: Any) -> RunSpec:
    spec = tiny(**layout)
    spec.model.seq_len = SEQ_LEN
    spec.data = DataConfig(dataset=dataset, pretrained=str(folder))
    return resolve(spec)


def reference(folder: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def token_ids(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fathoms_logits_are_those_of_transformers(name: str, folders: Callable[[str], Path]) -> None:
    spec = spec_from(folders(name))
    assert spec.model.architecture == json.loads((folders(name) / "config.json").read_text())["model_type"]
    model = build_meta(spec.model)
    materialize([model], torch.device("cpu"), PretrainedWeights(folders(name), spec.train.seed))
    assert sum(p.numel() for p in model.parameters()) == spec.model.num_params()
    ids = token_ids(spec.model.vocab_size)
    with torch.no_grad():
        ours, theirs = model(ids), reference(folders(name))(ids).logits
    assert (ours - theirs).abs().max().item() <= TOLERANCE


def test_each_architecture_maps_onto_the_decoders_fields(folders: Callable[[str], Path]) -> None:
    llama3 = spec_from(folders("llama3_tied")).model
    assert llama3.tie_embeddings and llama3.rope_scaling is not None
    assert llama3.rope_scaling.original_max_position_embeddings == 16
    qwen2, qwen3 = spec_from(folders("qwen2")).model, spec_from(folders("qwen3")).model
    assert (qwen2.qkv_bias, qwen2.qk_norm, qwen2.head_dim) == (True, False, 16)
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim) == (False, True, 32)
    assert spec_from(folders("mistral")).model.sliding_window == 48


def test_a_tied_head_is_the_embeddings_parameter(folders: Callable[[str], Path]) -> None:
    model = Transformer(spec_from(folders("llama3_tied")).model)
    assert model.lm_head is not None and model.embed_tokens is not None
    assert model.lm_head.weight is model.embed_tokens.weight
    assert "lm_head.weight" not in dict(model.named_parameters())


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3"])
def test_the_seeded_init_replays_the_eager_draws_biases_included(architecture: str) -> None:
    cfg = ModelConfig(
        n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=512, seq_len=SEQ_LEN,
        architecture=architecture, head_dim=32, tie_embeddings=True,
    )  # fmt: skip
    eager = assert_materialized_is_eager(cfg, seed=5)
    if architecture == "qwen2":
        assert not eager.layers["0"].self_attn.q_proj.bias.any()  # type: ignore[union-attr]


def test_every_rank_of_a_dp2_tp2_zero3_layout_starts_from_the_eager_weights_of_a_biased_tied_model(
    tmp_path: Path,
) -> None:
    spec = tiny(dp=2, tp=2, zero=3)
    spec.model = ModelConfig(**{**vars(spec.model), "architecture": "qwen2", "tie_embeddings": True})
    reports = materialize_under(spec, tmp_path)
    assert all(r["differ"] == [] for r in reports), [r["differ"] for r in reports]
    held = {name for r in reports for name in r["held"]}
    assert held == {name for name, _ in build_meta(spec.model).named_parameters()}
    assert "layers.0.self_attn.k_proj.bias" in held and "lm_head.weight" not in held


def first_loss_of_transformers(folder: Path, spec: RunSpec, work_dir: Path) -> float:
    """transformers' loss on the global batch of a run's first step."""
    data = prepare_data(spec.data, spec.model.vocab_size, spec.model.seq_len, work_dir)
    windows = TokenWindows(data.tokens(), spec.model.seq_len)
    sampler = ShardedSampler(windows.num_samples, spec.train.global_batch, 0, 1, spec.train.seed)
    inputs, targets = windows.batch(sampler.next_indices())
    with torch.no_grad():
        logits = reference(folder)(inputs).logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1)).item()


def assert_export_is_the_same_architecture(folder: Path, checkpoint: Path, out_dir: Path) -> None:
    exported = export(checkpoint, out_dir)
    original, written = (json.loads((f / "config.json").read_text()) for f in (folder, exported))
    assert (written["model_type"], written["architectures"]) == (original["model_type"], original["architectures"])
    for key in ("head_dim", "tie_word_embeddings", "num_key_value_heads", "rope_parameters", "sliding_window"):
        if key in original:  # Qwen2's config derives head_dim
            assert written[key] == original[key], key
    with safe_open(str(exported / "model.safetensors"), framework="pt") as f:
        with safe_open(str(folder / "model.safetensors"), framework="pt") as g:
            assert set(f.keys()) == set(g.keys())  # biases and q/k norms; no lm_head where tied
    loaded = reference(exported)
    assert loaded.config.model_type == original["model_type"]
    assert type(loaded).__name__ == original["architectures"][0]
    _, trained = load_model(checkpoint)
    ids = token_ids(trained.cfg.vocab_size)
    with torch.no_grad():
        ours, theirs = trained(ids), loaded(ids).logits
    assert (ours - theirs).abs().max().item() <= TOLERANCE


STEPS = 3


@pytest.mark.parametrize(
    ("name", "layout"),
    [
        ("qwen3", {"dp": 2, "tp": 2}),
        ("qwen2", {"dp": 2, "tp": 2}),
        ("llama3_tied", {"dp": 2, "tp": 2, "zero": 3}),
    ],
)
def test_a_dp2_tp2_run_trains_as_one_process_and_exports_the_same_architecture(
    name: str, layout: dict[str, int], folders: Callable[[str], Path], tiny_data: DataConfig, tmp_path: Path
) -> None:
    folder = folders(name)
    spec = spec_from(folder, dataset=tiny_data.dataset, **layout)
    spec.train.steps = STEPS
    spec.train.warmup_steps = 1
    spec.train.checkpoint_interval = 1
    parallel = launch(spec, tmp_path / "parallel", TIMEOUT)
    single = launch(reference_spec(spec), tmp_path / "single", TIMEOUT)
    losses, expected = step_values(parallel), step_values(single)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert abs(losses[1] - first_loss_of_transformers(folder, spec, tmp_path / "data")) <= TOLERANCE
    # Later losses and every step's gradient norm see the gradients: of the q/k gains summed over
    # tp, of the biases split with their columns, of both uses of a tied matrix.
    assert max(abs(losses[s] - expected[s]) for s in expected) <= TOLERANCE, (losses, expected)
    norms, expected_norms = step_values(parallel, "grad_norm"), step_values(single, "grad_norm")
    assert max(abs(norms[s] - expected_norms[s]) / expected_norms[s] for s in expected_norms) <= TOLERANCE

    checkpoint = RunDir(tmp_path / "parallel").latest_checkpoint()
    assert checkpoint is not None
    assert_export_is_the_same_architecture(folder, checkpoint, tmp_path / "exported")

    if spec.model.tie_embeddings:
        stored = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
        assert "model.embed_tokens.weight" in stored and "model.lm_head.weight" not in stored  # held once
        # The checkpoint resumes on one process (another layout) and continues the curve.
        resume_from(tmp_path / "parallel", STEPS - 1, tmp_path / "resumed")
        resumed = step_values(launch(reference_spec(spec), tmp_path / "resumed", TIMEOUT))
        assert sorted(resumed) == [STEPS]
        assert abs(resumed[STEPS] - losses[STEPS]) <= TOLERANCE


def test_a_mistral_run_exports_a_mistral_with_its_window(
    folders: Callable[[str], Path], tiny_data: DataConfig, tmp_path: Path
) -> None:
    folder = folders("mistral")
    spec = spec_from(folder, dataset=tiny_data.dataset)
    spec.train.steps = 1
    spec.train.warmup_steps = 1
    spec.train.checkpoint_interval = 1
    launch(spec, tmp_path / "run", TIMEOUT)
    checkpoint = RunDir(tmp_path / "run").latest_checkpoint()
    assert checkpoint is not None
    assert_export_is_the_same_architecture(folder, checkpoint, tmp_path / "exported")
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["sliding_window"] == 48


def edited(folder: Path, tmp_path: Path, **changes: Any) -> Path:
    """A copy of `folder`'s config and tokenizer with `changes` made to config.json."""
    copy = tmp_path / "edited"
    copy.mkdir()
    shutil.copy(folder / "tokenizer.json", copy / "tokenizer.json")
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize(
    ("name", "changes", "said"),
    [
        ("llama3_tied", {"model_type": "gemma"}, "model_type must be one of llama, qwen2, qwen3, mistral; got 'gemma'"),
        ("llama3_tied", {"hidden_act": "gelu"}, "hidden_act must be silu; got 'gelu'"),
        ("llama3_tied", {"attention_bias": True}, "attention_bias must be false"),
        ("llama3_tied", {"mlp_bias": True}, "mlp_bias must be false"),
        ("llama3_tied", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type must be default or llama3; got 'yarn'"),
        ("llama3_tied", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "lacks low_freq_factor"),
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window must be false"),
        ("qwen3", {"attention_bias": True}, "attention_bias must be false"),
        ("qwen3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor must be 1.0 (rotary over the whole head); got 0.5"),
    ],
)
def test_a_config_the_decoder_cannot_compute_is_refused_naming_the_field(
    name: str, changes: dict[str, Any], said: str, folders: Callable[[str], Path], tmp_path: Path
) -> None:
    with pytest.raises(SpecError) as info:
        spec_from(edited(folders(name), tmp_path, **changes))
    assert info.value.field == "data.pretrained"
    assert said in info.value.message


def test_a_mistral_window_shorter_than_the_training_context_is_refused_naming_both(
    folders: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = edited(folders("mistral"), tmp_path, sliding_window=16)
    with pytest.raises(SpecError) as info:
        spec_from(folder)
    assert info.value.field == "model.seq_len"
    assert "sliding_window=16" in info.value.message and f"seq_len={SEQ_LEN}" in info.value.message


def test_tied_embeddings_across_pipeline_stages_are_refused_naming_the_layout(folders: Callable[[str], Path]) -> None:
    with pytest.raises(SpecError) as info:
        spec_from(folders("llama3_tied"), pp=2, microbatches=2)
    assert info.value.field == "layout.pp"
    assert "tie_embeddings" in info.value.message
