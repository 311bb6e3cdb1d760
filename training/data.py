"""Text → tokenizer → one memory-mapped token file → batches sharded over data-parallel ranks.

`prepare_data` runs on every rank before the process group exists; a file lock makes the first
rank on a node do the work (train the tokenizer if none was given, tokenize the corpus once) while
the others wait and then reuse it. The token file is named by a hash of the corpus and tokenizer
bytes, so a changed dataset or tokenizer is never read through a stale cache.

The sampler draws fixed windows of `seq_len + 1` tokens in a seeded order per epoch. Its whole
position is one number (global samples consumed), identical on every rank, so it resumes exactly
and onto another data-parallel degree: global batch k is always the same sequences, and dp rank r
takes the r-th contiguous slice of it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from training.config import DataConfig
from training.demo import corpus as demo_corpus
from training.storage import fetch_dataset, local_root

END_OF_TEXT = "<|endoftext|>"  # separates documents; also eos and padding
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # ends a chat turn; generation stops on it too
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)

# ChatML, which both transformers' and vLLM's chat templating render with plain Jinja.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_ENCODE_BATCH = 2048  # documents per encode_batch call: large enough to keep tokenizers' threads busy


# --- Documents ------------------------------------------------------------------------------


def render_chat(messages: list[dict[str, str]]) -> str:
    """The text CHAT_TEMPLATE renders for `messages`, for training on chat-shaped data."""
    return "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)


def iter_documents(path: Path) -> Iterator[str]:
    """Documents of a .txt file (blank-line separated) or a .jsonl file ("text" or "messages")."""
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if "text" in row:
                    yield str(row["text"])
                elif "messages" in row:
                    yield render_chat(row["messages"])
                else:
                    raise ValueError(f"{path}:{number}: a row needs a 'text' or 'messages' field; got {sorted(row)}")
    elif path.suffix == ".txt":
        text = path.read_text(encoding="utf-8")
        yield from (doc for doc in text.split("\n\n") if doc.strip())
    else:
        raise ValueError(f"{path}: the dataset must be a .txt or .jsonl file")


# --- Tokenizer ------------------------------------------------------------------------------


def train_tokenizer(documents: Iterator[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 style): every byte is a token, so any text encodes without <unk>."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Writes the files `transformers.AutoTokenizer` and vLLM load: tokenizer.json plus its config."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    special = {"bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT, "pad_token": END_OF_TEXT, "unk_token": None}
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "additional_special_tokens": [IM_START, IM_END],
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special_map: dict[str, Any] = {k: v for k, v in special.items() if v is not None}
    special_map["additional_special_tokens"] = [IM_START, IM_END]
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def copy_tokenizer(src_dir: Path, dst_dir: Path) -> None:
    dst_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(src_dir / name, dst_dir / name)


def special_token_ids(tokenizer_dir: Path) -> dict[str, int]:
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    ids: dict[str, int] = {}
    for token in SPECIAL_TOKENS:
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{tokenizer_dir}/tokenizer.json lacks the special token {token}")
        ids[token] = token_id
    return ids


# --- Preparation ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PreparedData:
    tokenizer_dir: Path  # holds TOKENIZER_FILES
    tokens_path: Path  # flat token ids, documents separated by END_OF_TEXT
    dtype: str  # "uint16" or "uint32"

    def tokens(self) -> np.memmap:
        return np.memmap(self.tokens_path, dtype=self.dtype, mode="r")


def _sha256(*paths: Path) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def dataset_cache_root(work_dir: Path) -> Path:
    """Where this host keeps datasets downloaded from object storage: its own data folder (the
    host worker passes FATHOM_DATA_DIR on to agents and ranks), else the run's data folder."""
    data_dir = os.environ.get("FATHOM_DATA_DIR")
    return Path(data_dir) / "cache" if data_dir else work_dir / "cache"


def _local_dataset(dataset: str, work_dir: Path) -> Path:
    """A dataset on object storage is read from this host's checked copy; a file, where it is."""
    if local_root(dataset) is None:
        return fetch_dataset(dataset, dataset_cache_root(work_dir))
    return Path(dataset)


def prepare_data(cfg: DataConfig, vocab_size: int, seq_len: int, work_dir: Path) -> PreparedData:
    """Makes sure `work_dir` holds the tokenizer and the token file; safe to call from every rank."""
    work_dir.mkdir(parents=True, exist_ok=True)
    with (work_dir / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        dataset = _local_dataset(cfg.dataset, work_dir) if cfg.dataset else demo_corpus.write(work_dir / "demo.txt")
        tokenizer_dir = work_dir / "tokenizer"
        if cfg.tokenizer:
            given = Path(cfg.tokenizer)
            given_dir = given.parent if given.is_file() else given
            if not (tokenizer_dir / "tokenizer.json").exists() or _sha256(given_dir / "tokenizer.json") != _sha256(
                tokenizer_dir / "tokenizer.json"
            ):
                if (given_dir / "tokenizer_config.json").exists():
                    copy_tokenizer(given_dir, tokenizer_dir)
                else:  # a bare tokenizer.json: add the config files Fathom's exports need
                    save_tokenizer(Tokenizer.from_file(str(given_dir / "tokenizer.json")), tokenizer_dir, seq_len)
        elif not (tokenizer_dir / "tokenizer_config.json").exists():
            save_tokenizer(train_tokenizer(iter_documents(dataset), vocab_size), tokenizer_dir, seq_len)
        tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        if tokenizer.get_vocab_size() > vocab_size:
            raise ValueError(
                f"the tokenizer has {tokenizer.get_vocab_size()} tokens but model.vocab_size is {vocab_size}"
            )
        dtype = "uint16" if vocab_size <= np.iinfo(np.uint16).max + 1 else "uint32"
        key = _sha256(dataset, tokenizer_dir / "tokenizer.json")[:16]
        tokens_path = work_dir / f"tokens-{key}.{dtype}"
        if not tokens_path.exists():
            _tokenize(dataset, tokenizer, tokens_path, dtype)
    return PreparedData(tokenizer_dir=tokenizer_dir, tokens_path=tokens_path, dtype=dtype)


def _tokenize(dataset: Path, tokenizer: Tokenizer, out: Path, dtype: str) -> None:
    eot = tokenizer.token_to_id(END_OF_TEXT)
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("wb") as f:
        batch: list[str] = []
        for doc in [*iter_documents(dataset), None]:
            if doc is not None:
                batch.append(doc)
            if batch and (doc is None or len(batch) == _ENCODE_BATCH):
                for encoding in tokenizer.encode_batch(batch, add_special_tokens=False):
                    np.asarray([*encoding.ids, eot], dtype=dtype).tofile(f)
                batch = []
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(out)  # readers never see a half-written token file


# --- Sampling -------------------------------------------------------------------------------


class TokenWindows:
    """Sample i is tokens[i·seq_len : i·seq_len + seq_len + 1]: inputs and next-token targets."""

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_samples = (len(tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(f"the corpus has {len(tokens)} tokens, fewer than one sequence of {seq_len + 1}")

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (len(indices), seq_len) int64."""
        rows = np.stack([self.tokens[i * self.seq_len : i * self.seq_len + self.seq_len + 1] for i in indices])
        rows_t = torch.from_numpy(rows.astype(np.int64))
        return rows_t[:, :-1], rows_t[:, 1:]


class ShardedSampler:
    """Seeded, epoch-shuffled sample order; each step's global batch is split over dp ranks."""

    def __init__(self, num_samples: int, global_batch: int, dp_rank: int, dp_size: int, seed: int) -> None:
        if global_batch % dp_size:
            raise ValueError(f"global_batch={global_batch} is not divisible by dp={dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside 0..{dp_size - 1}")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.consumed = 0  # global samples handed out so far, summed over dp ranks
        self._epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    def _order_of(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._order = np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(self.num_samples)
            self._epoch = epoch
        return self._order

    def next_indices(self) -> np.ndarray:
        """This rank's sample indices for the next step (global_batch / dp of them)."""
        local = self.global_batch // self.dp_size
        start = self.consumed + self.dp_rank * local
        positions = range(start, start + local)
        indices = np.array([self._order_of(g // self.num_samples)[g % self.num_samples] for g in positions])
        self.consumed += self.global_batch
        return indices

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if (state["seed"], state["num_samples"]) != (self.seed, self.num_samples):
            raise ValueError(
                f"the checkpoint's sampler drew from {state['num_samples']} samples with seed {state['seed']}; "
                f"this run has {self.num_samples} samples with seed {self.seed} (a different dataset or seed)"
            )
        self.consumed = int(state["consumed"])
