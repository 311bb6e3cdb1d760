"""A tiny Hugging Face Llama checkpoint for tests and benchmarks of the serving path.

It lets the serving tests run without training a model first (the control plane's end-to-end
test serves a real `training.export` output): a `LlamaConfig` model
saved with `save_pretrained(safe_serialization=True)`, a byte-level BPE tokenizer trained with
`tokenizers` on generated text, and a chat template in `tokenizer_config.json`. The model is
trained for a few hundred steps on the same text so that its next-token distributions are
peaked: with random weights the top two logits sit ~1e-6 apart and greedy decoding in two
float32 engines would part ways on rounding alone, which tests nothing useful.

A development helper (tools/, not the product's serving package): torch and transformers are
imported inside `build_tiny_llama`.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]

_SUBJECTS = ["the cat", "a dog", "the bird", "my friend", "the teacher", "a child", "the robot"]
_VERBS = ["sees", "likes", "follows", "draws", "finds", "carries", "counts"]
_OBJECTS = ["the ball", "a red box", "the moon", "three apples", "a small boat", "the river"]
_PLACES = ["in the park", "at home", "near the sea", "on the hill", "under the tree"]


@dataclass(frozen=True, kw_only=True)
class TinyLlamaSpec:
    """Shape of the tiny model. head_dim = hidden_size / num_attention_heads must be one of the
    head sizes vLLM's CPU attention supports (32, 64, 80, ...)."""

    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 384
    vocab_size: int = 1024
    max_position_embeddings: int = 1024
    train_steps: int = 300
    seed: int = 0


def generated_text(n_sentences: int, seed: int) -> list[str]:
    """Sentences from a small grammar plus counting lines: enough structure to learn quickly."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_sentences):
        if i % 4 == 3:
            start = rng.randint(1, 40)
            lines.append(" ".join(str(start + k) for k in range(8)))
        else:
            lines.append(f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_PLACES)}.")
    return lines


def build_tiny_llama(out_dir: Path, spec: TinyLlamaSpec = TinyLlamaSpec()) -> Path:
    """Write the checkpoint to `out_dir` (atomically: a crash leaves no half checkpoint) and return
    it. An existing checkpoint built from the same spec is reused; processes that ask for it at
    once (the test suite's workers) build it once, the others wait for it."""
    out_dir = Path(out_dir)
    stamp = out_dir / "fathom-tiny-llama.json"
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with (out_dir.parent / f".{out_dir.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists() and json.loads(stamp.read_text()) == asdict(spec):
            return out_dir
        work = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
        work.chmod(0o755)  # mkdtemp makes it private; a replica may run as another user
        try:
            _write_checkpoint(work, spec)
            (work / stamp.name).write_text(json.dumps(asdict(spec)))
            if out_dir.exists():
                shutil.rmtree(out_dir)
            os.rename(work, out_dir)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return out_dir


def _write_checkpoint(out: Path, spec: TinyLlamaSpec) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = generated_text(4000, spec.seed)

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(text, trainer=trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "model_max_length": spec.max_position_embeddings,
                "add_bos_token": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"})
    )

    config = transformers.LlamaConfig(
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        intermediate_size=spec.intermediate_size,
        vocab_size=tokenizer.get_vocab_size(),
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tokenizer.token_to_id("<s>"),
        eos_token_id=tokenizer.token_to_id("</s>"),
        pad_token_id=tokenizer.token_to_id("<pad>"),
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = transformers.LlamaForCausalLM(config)
    _train(model, tokenizer, text, spec, torch)
    model.save_pretrained(out, safe_serialization=True)


def _train(model, tokenizer, text: list[str], spec: TinyLlamaSpec, torch) -> None:  # type: ignore[no-untyped-def]
    """A few hundred AdamW steps on 64-token windows of the generated text."""
    eos = tokenizer.token_to_id("</s>")
    ids: list[int] = []
    for line in text:
        ids.extend(tokenizer.encode(line).ids + [eos])
    data = torch.tensor(ids)
    seq, batch = 64, 16
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(spec.seed)
    model.train()
    for _ in range(spec.train_steps):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=generator)
        x = torch.stack([data[s : s + seq] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()

