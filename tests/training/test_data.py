"""Tokenizer, token cache and the sharded sampler (no processes)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from training.config import DataConfig
from training.data import END_OF_TEXT, IM_END, IM_START, ShardedSampler, TokenWindows, iter_documents, prepare_data


def test_the_sampler_is_the_same_sequence_for_the_same_seed() -> None:
    a = ShardedSampler(num_samples=50, global_batch=8, dp_rank=0, dp_size=1, seed=7)
    b = ShardedSampler(num_samples=50, global_batch=8, dp_rank=0, dp_size=1, seed=7)
    assert all((a.next_indices() == b.next_indices()).all() for _ in range(10))


def test_dp_ranks_split_each_global_batch_into_contiguous_disjoint_slices() -> None:
    whole = ShardedSampler(num_samples=50, global_batch=8, dp_rank=0, dp_size=1, seed=3)
    shards = [ShardedSampler(num_samples=50, global_batch=8, dp_rank=r, dp_size=4, seed=3) for r in range(4)]
    for _ in range(12):  # crosses epoch boundaries (50 samples, 8 per step)
        expected = whole.next_indices()
        assert np.concatenate([s.next_indices() for s in shards]).tolist() == expected.tolist()


def test_every_sample_is_drawn_once_per_epoch() -> None:
    sampler = ShardedSampler(num_samples=40, global_batch=8, dp_rank=0, dp_size=1, seed=0)
    drawn = np.concatenate([sampler.next_indices() for _ in range(5)])
    assert sorted(drawn.tolist()) == list(range(40))


def test_a_restored_sampler_continues_where_the_saved_one_was_even_on_another_dp_degree() -> None:
    first = ShardedSampler(num_samples=50, global_batch=8, dp_rank=0, dp_size=2, seed=5)
    for _ in range(7):
        first.next_indices()
    state = json.loads(json.dumps(first.state_dict()))  # it travels as JSON in the checkpoint
    uninterrupted = ShardedSampler(num_samples=50, global_batch=8, dp_rank=0, dp_size=1, seed=5)
    for _ in range(7):
        uninterrupted.next_indices()
    resumed = ShardedSampler(num_samples=50, global_batch=8, dp_rank=0, dp_size=1, seed=5)
    resumed.load_state_dict(state)
    assert resumed.next_indices().tolist() == uninterrupted.next_indices().tolist()


def test_a_sampler_refuses_a_state_from_another_dataset() -> None:
    sampler = ShardedSampler(num_samples=50, global_batch=8, dp_rank=0, dp_size=1, seed=5)
    with pytest.raises(ValueError, match="different dataset or seed"):
        sampler.load_state_dict({"consumed": 8, "seed": 5, "num_samples": 49})


def test_windows_give_inputs_and_next_token_targets() -> None:
    windows = TokenWindows(np.arange(100, dtype=np.uint16), seq_len=8)
    inputs, targets = windows.batch(np.array([0, 3]))
    assert inputs.shape == targets.shape == (2, 8)
    assert inputs[1].tolist() == list(range(24, 32))
    assert targets[1].tolist() == list(range(25, 33))


def test_jsonl_datasets_take_text_and_chat_messages(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    rows = [
        {"text": "plain words"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    docs = list(iter_documents(path))
    assert docs[0] == "plain words"
    assert docs[1] == f"{IM_START}user\nhi{IM_END}\n{IM_START}assistant\nhello{IM_END}\n"


def test_a_jsonl_row_without_text_or_messages_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ok"}\n{"body": "no"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: .*'text' or 'messages'"):
        list(iter_documents(path))


def test_prepared_tokens_decode_back_to_the_corpus(tmp_path: Path) -> None:
    dataset = tmp_path / "corpus.txt"
    dataset.write_text("The lighthouse keeper counted boats.\n\nTwo plus two is four.\n" * 50)
    prepared = prepare_data(DataConfig(dataset=str(dataset)), vocab_size=300, seq_len=16, work_dir=tmp_path / "work")
    tokenizer = Tokenizer.from_file(str(prepared.tokenizer_dir / "tokenizer.json"))
    assert tokenizer.get_vocab_size() <= 300
    tokens = prepared.tokens()
    assert tokens.dtype == np.uint16
    text = tokenizer.decode(tokens[:40].tolist(), skip_special_tokens=False)
    assert text.startswith("The lighthouse keeper counted boats." + END_OF_TEXT + "Two plus two is four.")


def test_the_token_cache_is_keyed_by_the_corpus_contents(tmp_path: Path) -> None:
    dataset = tmp_path / "corpus.txt"
    dataset.write_text("first version of the corpus\n" * 40)
    work = tmp_path / "work"
    first = prepare_data(DataConfig(dataset=str(dataset)), vocab_size=300, seq_len=16, work_dir=work)
    again = prepare_data(DataConfig(dataset=str(dataset)), vocab_size=300, seq_len=16, work_dir=work)
    assert again.tokens_path == first.tokens_path
    dataset.write_text("a changed corpus\n" * 40)
    changed = prepare_data(DataConfig(dataset=str(dataset)), vocab_size=300, seq_len=16, work_dir=work)
    assert changed.tokens_path != first.tokens_path


def test_a_given_tokenizer_is_used_instead_of_training_one(tiny_data: DataConfig, tmp_path: Path) -> None:
    prepared = prepare_data(tiny_data, vocab_size=512, seq_len=64, work_dir=tmp_path)
    given = Path(tiny_data.tokenizer).read_bytes()
    assert (prepared.tokenizer_dir / "tokenizer.json").read_bytes() == given
