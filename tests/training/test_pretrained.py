"""A run started from a Hugging Face Llama folder computes what `transformers` computes with it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tests.training.test_initial_weights import materialize_under
from tools.check_parity import launch, step_values
from training.config import DataConfig, ModelConfig, RunSpec, SpecError, tiny
from training.data import TOKENIZER_FILES, ShardedSampler, TokenWindows, iter_documents, prepare_data
from training.export import export, load_model
from training.initial_weights import PretrainedWeights, build_meta, materialize
from training.pretrained import INDEX_FILE, resolve
from training.run_dir import RunDir

TOLERANCE = 1e-4
TIMEOUT = 600  # seconds; a hung run fails its test instead of blocking the suite


def save_llama(folder: Path, tokenizer_dir: Path, tied: bool = False) -> Path:
    """A small random Llama saved by `transformers` in several safetensors files, with a tokenizer."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="300KB")  # sharded: an index and files
    assert (folder / "model.safetensors.index.json").exists()
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def llama_folder(tiny_data: DataConfig, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama(tmp_path_factory.mktemp("llama"), Path(tiny_data.tokenizer).parent)


def spec_from(folder: Path, dataset: str = "", **layout: int) -> RunSpec:
    spec = tiny(**layout)
    spec.data = DataConfig(dataset=dataset, pretrained=str(folder))
    return resolve(spec)


def reference(folder: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_the_model_and_tokenizer_come_from_the_folder(llama_folder: Path) -> None:
    spec = spec_from(llama_folder)
    assert (spec.model.n_layers, spec.model.dim, spec.model.ffn_dim) == (2, 128, 384)
    assert (spec.model.n_heads, spec.model.n_kv_heads, spec.model.vocab_size) == (4, 2, 512)
    assert spec.data.tokenizer == str(llama_folder / "tokenizer.json")
    assert resolve(spec) == spec


def test_a_folder_the_decoder_cannot_compute_is_refused_naming_the_field(llama_folder: Path, tmp_path: Path) -> None:
    shutil.copytree(llama_folder, tmp_path / "biased")
    config = (tmp_path / "biased" / "config.json").read_text()
    (tmp_path / "biased" / "config.json").write_text(
        config.replace('"attention_bias": false', '"attention_bias": true')
    )
    with pytest.raises(SpecError, match="attention_bias must be false") as info:
        spec_from(tmp_path / "biased")
    assert info.value.field == "data.pretrained"


def test_a_folder_whose_heads_tp_does_not_divide_is_refused(llama_folder: Path) -> None:
    with pytest.raises(SpecError) as info:
        spec_from(llama_folder, tp=8)
    assert info.value.field == "layout.tp"


def assert_same_logits(folder: Path) -> None:
    spec = spec_from(folder)
    model = build_meta(spec.model)
    materialize([model], torch.device("cpu"), PretrainedWeights(folder, spec.train.seed))
    ids = torch.randint(0, spec.model.vocab_size, (2, spec.model.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids), reference(folder)(ids).logits
    assert (ours - theirs).abs().max().item() <= TOLERANCE


def test_its_logits_are_those_of_transformers(llama_folder: Path) -> None:
    assert_same_logits(llama_folder)


def test_tied_embeddings_start_the_output_head_from_the_embedding(tiny_data: DataConfig, tmp_path: Path) -> None:
    folder = save_llama(tmp_path, Path(tiny_data.tokenizer).parent, tied=True)
    assert not any(name.startswith("lm_head") for name in json.loads((folder / INDEX_FILE).read_text())["weight_map"])
    assert_same_logits(folder)


def test_each_rank_of_a_dp2_tp2_zero3_layout_reads_its_shards_of_the_folder(llama_folder: Path, tmp_path: Path) -> None:
    reports = materialize_under(spec_from(llama_folder, dp=2, tp=2, zero=3), tmp_path)
    assert all(r["differ"] == [] for r in reports), [r["differ"] for r in reports]
    assert len({name for r in reports for name in r["held"]}) == 2 * 9 + 3


def test_a_dp2_tp2_run_starts_at_the_loss_transformers_computes_and_its_export_loads_back(
    llama_folder: Path, tiny_data: DataConfig, tmp_path: Path
) -> None:
    spec = spec_from(llama_folder, dataset=tiny_data.dataset, dp=2, tp=2)
    spec.train.steps = 1
    spec.train.warmup_steps = 1
    spec.train.checkpoint_interval = 1
    spec.model.seq_len = 32  # shorter than the folder's 64: continued pretraining at a shorter context
    first_loss = step_values(launch(spec, tmp_path / "run", TIMEOUT))[1]  # the forward before the first update

    data = prepare_data(spec.data, spec.model.vocab_size, spec.model.seq_len, tmp_path / "data")
    windows = TokenWindows(data.tokens(), spec.model.seq_len)
    # The step's global batch: what the two dp ranks draw together, in one piece.
    sampler = ShardedSampler(windows.num_samples, spec.train.global_batch, 0, 1, spec.train.seed)
    inputs, targets = windows.batch(sampler.next_indices())
    with torch.no_grad():
        logits = reference(llama_folder)(inputs).logits
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1)).item()
    assert abs(first_loss - expected) <= TOLERANCE, (first_loss, expected)

    # The trained model goes back out as a Llama folder that transformers loads with the
    # original's architecture and computes what Fathom computes.
    checkpoint = RunDir(tmp_path / "run").latest_checkpoint()
    assert checkpoint is not None
    exported = export(checkpoint, tmp_path / "exported")
    original = json.loads((llama_folder / "config.json").read_text())
    written = json.loads((exported / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "vocab_size"):
        assert written[key] == original[key], key
    # It trained at 32 tokens; it serves the 64 the original could.
    assert written["max_position_embeddings"] == original["max_position_embeddings"] == 64
    _, trained = load_model(checkpoint)
    with torch.no_grad():
        ours = trained(inputs)
        theirs = reference(exported)(inputs).logits
    assert (ours - theirs).abs().max().item() <= TOLERANCE
    assert (theirs - logits).abs().max().item() > TOLERANCE  # the step changed the weights


def test_a_spec_model_section_is_replaced_by_the_folders(llama_folder: Path) -> None:
    spec = tiny()
    spec.model = ModelConfig(n_layers=8, dim=256, n_heads=8, n_kv_heads=8, vocab_size=1024, seq_len=32)
    spec.data = DataConfig(pretrained=str(llama_folder))
    resolved = resolve(spec)
    assert (resolved.model.n_layers, resolved.model.dim, resolved.model.seq_len) == (2, 128, 32)


def llama_style_folder(folder: Path, dataset: Path) -> Path:
    """A small Llama whose tokenizer is as Llama 2 folders hold it: <s> and </s>, no
    <|endoftext|>, a tokenizer_config.json that names them, no special_tokens_map.json."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(iter_documents(dataset), trainer=trainer)
    folder.mkdir(parents=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    # Head size 32: one vLLM's CPU attention computes, so tests/serving serves its export too.
    return save_small_llama(folder, hidden_size=128)


def save_small_llama(folder: Path, hidden_size: int) -> Path:
    """A random 2-layer Llama (4 heads, 2 KV heads, 512 tokens, 64 positions) saved by transformers."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_a_tokenizer_without_fathoms_end_of_text_ends_documents_with_its_own_eos(tiny_data: DataConfig, tmp_path: Path) -> None:
    folder = llama_style_folder(tmp_path / "llama", Path(tiny_data.dataset))
    eos, bos = (Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id(t) for t in ("</s>", "<s>"))
    spec = spec_from(folder, dataset=tiny_data.dataset)
    spec.train.steps = 1
    spec.train.warmup_steps = 1
    spec.train.checkpoint_interval = 1
    launch(spec, tmp_path / "run", TIMEOUT)

    # Every document of the corpus ends with </s> in the token file the run trained on.
    (tokens_file,) = (tmp_path / "run" / "data").glob("tokens-*")
    tokens = np.fromfile(tokens_file, dtype=np.uint16)
    assert tokens[-1] == eos
    assert int((tokens == eos).sum()) == sum(1 for _ in iter_documents(Path(tiny_data.dataset)))

    # The export names the tokenizer's own tokens, and transformers reads them so.
    checkpoint = RunDir(tmp_path / "run").latest_checkpoint()
    assert checkpoint is not None
    exported = export(checkpoint, tmp_path / "exported")
    config = json.loads((exported / "config.json").read_text())
    generation = json.loads((exported / "generation_config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], generation["eos_token_id"]) == (bos, eos, [eos])
    assert AutoTokenizer.from_pretrained(exported).eos_token == "</s>"
