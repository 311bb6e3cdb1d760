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
from training.model import IGNORE_INDEX
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
# Where transformers (4.43 and later) saves a tokenizer's chat template, outside its config:
# Llama 3.x's and Qwen's current folders carry it so.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
_ENCODE_BATCH = 2048  # documents per encode_batch call: large enough to keep tokenizers' threads busy


# --- Documents ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Document:
    """A document's text and, for a chat, the character spans the loss counts (the assistant's
    turns); None: every token counts."""

    text: str
    trained_spans: tuple[tuple[int, int], ...] | None = None


class ChatTemplate:
    """A tokenizer's Jinja chat template, rendered as transformers and vLLM render it (jinja2's
    sandbox: a template is data that came with a tokenizer), so the text a model is fine-tuned
    on is the text /v1/chat/completions later builds from the same messages."""

    def __init__(self, source: str = CHAT_TEMPLATE) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        self.source = source
        self._template = env.from_string(source)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token="",
            eos_token=END_OF_TEXT,
        )

    def document(self, messages: list[dict[str, str]]) -> Document:
        """The rendered chat with the spans of its assistant turns.

        A turn's span is what rendering it adds after the prompt that asks for it
        (`add_generation_prompt`): the reply and whatever the template closes it with
        (<|im_end|> in ChatML), so the model learns to end its turn. That holds for any template
        whose rendering of a conversation extends the rendering of its prefix, as chat templates
        do for generation to work at all.
        """
        text = self.render(messages)
        spans: list[tuple[int, int]] = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[: i + 1])
            if not (upto.startswith(prompt) and text.startswith(upto)):
                raise ValueError(
                    "the chat template does not render a conversation as its prefix followed by the "
                    "reply; assistant turns cannot be told apart from the prompt"
                )
            spans.append((len(prompt), len(upto)))
        return Document(text, tuple(spans))


def iter_rows(path: Path, template: ChatTemplate | None = None) -> Iterator[Document]:
    """Documents of a .txt file (blank-line separated) or a .jsonl file ("text" or "messages");
    chats are rendered with `template` (default: Fathom's ChatML) and carry their assistant spans."""
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if "text" in row:
                    yield Document(str(row["text"]))
                elif "messages" in row:
                    messages = row["messages"]
                    if not isinstance(messages, list) or not all(
                        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                        for m in messages
                    ):
                        raise ValueError(f"{path}:{number}: 'messages' must be a list of {{role, content}} strings")
                    if template is None:
                        template = ChatTemplate()
                    try:
                        yield template.document(messages)
                    except ValueError as exc:
                        raise ValueError(f"{path}:{number}: {exc}") from None
                else:
                    raise ValueError(f"{path}:{number}: a row needs a 'text' or 'messages' field; got {sorted(row)}")
    elif path.suffix == ".txt":
        text = path.read_text(encoding="utf-8")
        yield from (Document(doc) for doc in text.split("\n\n") if doc.strip())
    else:
        raise ValueError(f"{path}: the dataset must be a .txt or .jsonl file")


def iter_documents(path: Path) -> Iterator[str]:
    """The texts of `iter_rows`, for training a tokenizer."""
    return (doc.text for doc in iter_rows(path))


def trained_token_mask(doc: Document, offsets: list[tuple[int, int]]) -> np.ndarray:
    """1 for each token (by its character `offsets`) that ends inside one of the document's
    trained spans, 0 elsewhere; all ones for a document without spans. Ends, not lies: byte-level
    BPE joins a word to the space before it, which may be the prompt's last character
    ("assistant: " then " Rome")."""
    mask = np.ones(len(offsets), dtype=np.uint8)
    if doc.trained_spans is None:
        return mask
    mask[:] = 0
    for i, (_, end) in enumerate(offsets):
        if any(lo < end <= hi for lo, hi in doc.trained_spans):
            mask[i] = 1
    return mask


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
    """Copies a tokenizer folder's files; a Hugging Face folder may lack special_tokens_map.json."""
    dst_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if name == "tokenizer.json" or (src_dir / name).exists():
            shutil.copyfile(src_dir / name, dst_dir / name)


@dataclass(frozen=True)
class EndTokens:
    """How a tokenizer begins and ends a document, and what generation stops on."""

    bos: int
    eos: int  # also what the token files put between documents
    stops: tuple[int, ...]  # eos, and <|im_end|> (a chat turn's end) where the tokenizer has it


def _named_token(config: dict[str, Any], key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):  # transformers' AddedToken, as older tokenizer configs store it
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def end_tokens(tokenizer_dir: Path) -> EndTokens:
    """Fathom's own tokenizers end documents with <|endoftext|>; a pretrained model's, with the
    eos token its tokenizer_config.json names (Llama's `</s>`, `<|end_of_text|>`)."""
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    im_end = tokenizer.token_to_id(IM_END)
    end_of_text = tokenizer.token_to_id(END_OF_TEXT)
    if end_of_text is not None:
        bos = eos = end_of_text
    else:
        config_file = tokenizer_dir / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.exists() else {}
        eos_name = _named_token(config, "eos_token")
        found = tokenizer.token_to_id(eos_name) if eos_name else None
        if found is None:
            raise ValueError(
                f"{tokenizer_dir}/tokenizer.json has no {END_OF_TEXT} and its tokenizer_config.json names no eos_token "
                "that it holds: documents need an end-of-text token"
            )
        eos = found
        bos_name = _named_token(config, "bos_token")
        bos = (tokenizer.token_to_id(bos_name) if bos_name else None) or eos
    stops = (eos,) if im_end is None or im_end == eos else (eos, im_end)
    return EndTokens(bos=bos, eos=eos, stops=stops)


# --- Preparation ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PreparedData:
    tokenizer_dir: Path  # holds TOKENIZER_FILES
    tokens_path: Path  # flat token ids, documents separated by END_OF_TEXT
    dtype: str  # "uint16" or "uint32"
    validation_tokens_path: Path | None = None  # data.validation_dataset's token file, if one was given

    def tokens(self) -> np.memmap:
        return np.memmap(self.tokens_path, dtype=self.dtype, mode="r")

    def windows(self, seq_len: int, validation: bool = False) -> TokenWindows:
        """Windows over the dataset's token file (or the validation dataset's), with its loss mask."""
        path = self.validation_tokens_path if validation else self.tokens_path
        assert path is not None, "no validation dataset was prepared"
        mask = mask_path_of(path)
        return TokenWindows(
            np.memmap(path, dtype=self.dtype, mode="r"),
            seq_len,
            mask=np.memmap(mask, dtype=np.uint8, mode="r") if mask.exists() else None,
        )


def _sha256(*paths: Path) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def _local_dataset(dataset: str, work_dir: Path, download_cache: Path | None) -> Path:
    """A dataset on object storage is read from this host's checked copy; a file, where it is."""
    if local_root(dataset) is None:
        return fetch_dataset(dataset, download_cache or work_dir / "cache")
    return Path(dataset)


def prepare_data(
    cfg: DataConfig, vocab_size: int, seq_len: int, work_dir: Path, download_cache: Path | None = None
) -> PreparedData:
    """Makes sure `work_dir` holds the tokenizer and the token file; safe to call from every rank.
    Datasets on object storage are downloaded into `download_cache` (the agent names its
    machine's, `RankEnvironment.download_cache`), else into `work_dir`'s cache."""
    work_dir.mkdir(parents=True, exist_ok=True)
    with (work_dir / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        dataset = _local_dataset(cfg.dataset, work_dir, download_cache) if cfg.dataset else demo_corpus.write(work_dir / "demo.txt")
        tokenizer_dir = work_dir / "tokenizer"
        if cfg.tokenizer:
            given = Path(cfg.tokenizer)
            given_dir = given.parent if given.is_file() else given
            if not (tokenizer_dir / "tokenizer.json").exists() or _sha256(given_dir / "tokenizer.json") != _sha256(
                tokenizer_dir / "tokenizer.json"
            ):
                if (given_dir / "tokenizer_config.json").exists():
                    copy_tokenizer(given_dir, tokenizer_dir)
                    _keep_chat_template(tokenizer_dir, given_dir)
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
        template = chat_template_of(tokenizer_dir)
        tokens_path = _tokenized(dataset, tokenizer, tokenizer_dir, template, work_dir, dtype)
        validation_path = None
        if cfg.validation_dataset:
            validation_path = _tokenized(
                _local_dataset(cfg.validation_dataset, work_dir, download_cache), tokenizer, tokenizer_dir, template, work_dir, dtype
            )
    return PreparedData(
        tokenizer_dir=tokenizer_dir, tokens_path=tokens_path, dtype=dtype, validation_tokens_path=validation_path
    )


def chat_template_of(tokenizer_dir: Path) -> ChatTemplate:
    """The template chats are rendered with: the tokenizer's own (`_keep_chat_template` made sure
    there is one), which the export copies, so serving renders chats as training did."""
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    return ChatTemplate(own_chat_template(config, tokenizer_dir) or CHAT_TEMPLATE)


def own_chat_template(config: dict[str, Any], folder: Path) -> str | None:
    """A tokenizer folder's own chat template: its config's `chat_template` (of a list of named
    templates, the one named "default", as transformers picks), else its chat_template.jinja."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str) and template:
        return template
    file = folder / CHAT_TEMPLATE_FILE
    return file.read_text(encoding="utf-8") if file.is_file() else None


def _keep_chat_template(tokenizer_dir: Path, source_dir: Path) -> None:
    """Puts into a copied tokenizer's config the template chats train in: the source folder's
    own (from its config or its chat_template.jinja), else Fathom's. The export copies this file,
    so serving renders chats in it too."""
    path = tokenizer_dir / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    template = own_chat_template(config, source_dir) or CHAT_TEMPLATE
    if config.get("chat_template") != template:
        config["chat_template"] = template
        path.write_text(json.dumps(config, indent=2) + "\n")


def _tokenized(
    dataset: Path, tokenizer: Tokenizer, tokenizer_dir: Path, template: ChatTemplate, work_dir: Path, dtype: str
) -> Path:
    """The token file of `dataset` under `work_dir`, tokenized now unless it already is."""
    key = hashlib.sha256(
        (_sha256(dataset, tokenizer_dir / "tokenizer.json") + template.source).encode()
    ).hexdigest()[:16]
    tokens_path = work_dir / f"tokens-{key}.{dtype}"
    if not tokens_path.exists():
        _tokenize(dataset, tokenizer, end_tokens(tokenizer_dir).eos, template, tokens_path, dtype)
    return tokens_path


def mask_path_of(tokens_path: Path) -> Path:
    """Where the loss mask of a token file is, when its corpus has chats (one byte per token)."""
    return tokens_path.with_suffix(".mask")


def _tokenize(dataset: Path, tokenizer: Tokenizer, eot: int, template: ChatTemplate, out: Path, dtype: str) -> None:
    """Writes the token file (documents separated by `eot`) and, when some tokens do not count in
    the loss (chat prompts), the mask beside it; the mask is renamed into place first, so a token
    file never lacks its mask."""
    tmp = out.with_name(out.name + ".tmp")
    mask_out = mask_path_of(out)
    mask_tmp = mask_out.with_name(mask_out.name + ".tmp")
    masked = False
    with tmp.open("wb") as f, mask_tmp.open("wb") as m:
        batch: list[Document] = []
        for doc in [*iter_rows(dataset, template), None]:
            if doc is not None:
                batch.append(doc)
            if batch and (doc is None or len(batch) == _ENCODE_BATCH):
                encodings = tokenizer.encode_batch([d.text for d in batch], add_special_tokens=False)
                for document, encoding in zip(batch, encodings, strict=True):
                    np.asarray([*encoding.ids, eot], dtype=dtype).tofile(f)
                    mask = trained_token_mask(document, encoding.offsets)
                    # The separator counts when the document's last token does: a chat's last
                    # reply is followed by it, a prompt left without a reply is not.
                    np.append(mask, mask[-1] if len(mask) else 0).astype(np.uint8).tofile(m)
                    masked = masked or document.trained_spans is not None
                batch = []
        for handle in (f, m):
            handle.flush()
            os.fsync(handle.fileno())
    if masked:
        mask_tmp.replace(mask_out)
    else:
        mask_tmp.unlink()
    tmp.replace(out)  # readers never see a half-written token file


# --- Sampling -------------------------------------------------------------------------------


class TokenWindows:
    """Sample i is tokens[i·seq_len : i·seq_len + seq_len + 1]: inputs and next-token targets.

    With a `mask` (one byte per token), a target whose token is masked out is IGNORE_INDEX: the
    loss skips it (a chat's prompt tokens)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, mask: np.ndarray | None = None) -> None:
        self.tokens = tokens
        self.mask = mask
        self.seq_len = seq_len
        self.num_samples = (len(tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(f"the corpus has {len(tokens)} tokens, fewer than one sequence of {seq_len + 1}")

    def split(self, fraction: float) -> tuple[TokenWindows, TokenWindows]:
        """(training, held-out) windows: the last `fraction` of the samples (at least one) held out."""
        held = max(1, int(self.num_samples * fraction))
        if held >= self.num_samples:
            raise ValueError(
                f"holding out {fraction} of {self.num_samples} sequences leaves none to train on; "
                "lower data.validation_fraction or give a larger dataset"
            )
        cut = (self.num_samples - held) * self.seq_len
        # The training part ends on the held-out part's first token (the last target it reads).
        train = TokenWindows(self.tokens[: cut + 1], self.seq_len, None if self.mask is None else self.mask[: cut + 1])
        rest = TokenWindows(self.tokens[cut:], self.seq_len, None if self.mask is None else self.mask[cut:])
        return train, rest

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (len(indices), seq_len) int64."""
        span = self.seq_len + 1
        rows = np.stack([self.tokens[i * self.seq_len : i * self.seq_len + span] for i in indices])
        rows_t = torch.from_numpy(rows.astype(np.int64))
        inputs, targets = rows_t[:, :-1], rows_t[:, 1:]
        if self.mask is not None:
            mask = np.stack([self.mask[i * self.seq_len + 1 : i * self.seq_len + span] for i in indices])
            targets = targets.masked_fill(torch.from_numpy(mask == 0), IGNORE_INDEX)
        return inputs, targets


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

    def skip(self, batches: int) -> None:
        """Passes over the next `batches` global batches unseen (a guard's rollback); the position,
        and so a resume, counts them."""
        self.consumed += batches * self.global_batch

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if (state["seed"], state["num_samples"]) != (self.seed, self.num_samples):
            raise ValueError(
                f"the checkpoint's sampler drew from {state['num_samples']} samples with seed {state['seed']}; "
                f"this run has {self.num_samples} samples with seed {self.seed} (a different dataset or seed)"
            )
        self.consumed = int(state["consumed"])
