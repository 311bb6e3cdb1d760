"""Fine-tuning on chat JSONL: chats are rendered with the tokenizer's chat template, only the
assistant's turns count in the loss, and the export carries the template serving renders with."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from tools.check_parity import launch, parity_spec
from training.config import DataConfig, RunSpec
from training.data import CHAT_TEMPLATE, ChatTemplate, TokenWindows, prepare_data, save_tokenizer, train_tokenizer
from training.export import export
from training.model import IGNORE_INDEX
from training.run_dir import RunDir

CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."},
]
# A template other than Fathom's ChatML: what a tokenizer brought along.
OWN_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + ': ' + m['content'] + '<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant: ' }}{% endif %}"
)


def write_chats(path: Path, rows: int = 1) -> Path:
    path.write_text("".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(rows)))
    return path


def tokenizer_with(template: str | None, out_dir: Path) -> Path:
    text = ChatTemplate().render(CHAT) + "Paris Rome France Italy capital briefly answer"
    save_tokenizer(train_tokenizer(iter([text] * 20), 400), out_dir, model_max_length=64)
    config_file = out_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    if template is None:
        del config["chat_template"]
    else:
        config["chat_template"] = template
    config_file.write_text(json.dumps(config))
    return out_dir


def counted_text(tokenizer_dir: Path, tokens: np.ndarray, mask: np.ndarray) -> str:
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return tokenizer.decode(tokens[mask == 1].tolist(), skip_special_tokens=False)


def test_only_the_assistants_turns_count_in_the_loss(tmp_path: Path) -> None:
    dataset = write_chats(tmp_path / "chat.jsonl")
    prepared = prepare_data(DataConfig(dataset=str(dataset)), vocab_size=400, seq_len=8, work_dir=tmp_path / "work")
    windows = prepared.windows(8)
    assert windows.mask is not None
    tokens, mask = np.asarray(windows.tokens), np.asarray(windows.mask)
    # Each reply with the end of its turn, and the document's end after the last reply.
    assert counted_text(prepared.tokenizer_dir, tokens, mask) == "Paris.<|im_end|>\nRome.<|im_end|>\n<|endoftext|>"
    prompt = counted_text(prepared.tokenizer_dir, tokens, 1 - mask)
    assert prompt.startswith("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nCapital of France?")
    assert "Paris" not in prompt and "Rome" not in prompt
    # The targets of one window over the whole chat: masked exactly where the next token is.
    whole = TokenWindows(tokens, len(tokens) - 1, mask)
    _, targets = whole.batch(np.array([0]))
    assert (targets[0] == IGNORE_INDEX).tolist() == (mask[1:] == 0).tolist()


def test_chats_are_rendered_with_the_tokenizers_own_template(tmp_path: Path) -> None:
    dataset = write_chats(tmp_path / "chat.jsonl")
    given = tokenizer_with(OWN_TEMPLATE, tmp_path / "given")
    cfg = DataConfig(dataset=str(dataset), tokenizer=str(given))
    prepared = prepare_data(cfg, vocab_size=400, seq_len=8, work_dir=tmp_path / "work")
    tokenizer = Tokenizer.from_file(str(prepared.tokenizer_dir / "tokenizer.json"))
    tokens = np.asarray(prepared.tokens())
    rendered = "<|im_start|>system: Answer briefly.<|im_end|><|im_start|>user: Capital of France?<|im_end|>"
    assert tokenizer.decode(tokens.tolist(), skip_special_tokens=False).startswith(rendered)
    mask = np.asarray(prepared.windows(8).mask)
    # A reply's first word may carry the space the prompt ends with (" Rome"): it counts with it.
    counted = counted_text(prepared.tokenizer_dir, tokens, mask)
    assert counted.split() == ["Paris.<|im_end|>", "Rome.<|im_end|><|endoftext|>"]


def test_a_tokenizer_without_a_template_gets_the_one_chats_were_rendered_with(tmp_path: Path) -> None:
    dataset = write_chats(tmp_path / "chat.jsonl")
    given = tokenizer_with(None, tmp_path / "given")
    cfg = DataConfig(dataset=str(dataset), tokenizer=str(given))
    prepared = prepare_data(cfg, vocab_size=400, seq_len=8, work_dir=tmp_path / "work")
    config = json.loads((prepared.tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE


def test_the_export_of_a_chat_fine_tune_renders_chats_as_training_did(tmp_path: Path) -> None:
    dataset = write_chats(tmp_path / "chat.jsonl", rows=40)
    given = tokenizer_with(OWN_TEMPLATE, tmp_path / "given")
    spec = parity_spec(2).to_dict()
    spec["data"] = {"dataset": str(dataset), "tokenizer": str(given)}
    events = launch(RunSpec.from_dict(spec), tmp_path / "run", timeout=600)
    losses = [e["loss"] for e in events if e["kind"] == "metrics"]
    assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses)
    checkpoint = RunDir(tmp_path / "run").latest_checkpoint()
    assert checkpoint is not None
    out = export(checkpoint, tmp_path / "hf")
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == OWN_TEMPLATE
    # What vLLM's /v1/chat/completions renders (transformers' apply_chat_template on the same
    # config) is what training rendered, prompt included.
    served = AutoTokenizer.from_pretrained(out)
    assert served.apply_chat_template(CHAT, tokenize=False) == ChatTemplate(OWN_TEMPLATE).render(CHAT)
    prompt = served.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    assert ChatTemplate(OWN_TEMPLATE).render(CHAT[:3]).startswith(prompt)


def test_a_template_in_chat_template_jinja_or_a_named_list_is_the_tokenizers_own(tmp_path: Path) -> None:
    # transformers 4.43+ saves a tokenizer's template beside its config (Llama 3.x's and Qwen's
    # folders), or a config holds named templates: the "default" one is the chat template.
    dataset = write_chats(tmp_path / "chat.jsonl")
    rendered = "<|im_start|>system: Answer briefly.<|im_end|><|im_start|>user: Capital of France?<|im_end|>"
    beside = tokenizer_with(None, tmp_path / "beside")
    (beside / "chat_template.jinja").write_text(OWN_TEMPLATE)
    named = tokenizer_with(None, tmp_path / "named")
    config = json.loads((named / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": CHAT_TEMPLATE}, {"name": "default", "template": OWN_TEMPLATE}]
    (named / "tokenizer_config.json").write_text(json.dumps(config))
    for given in (beside, named):
        cfg = DataConfig(dataset=str(dataset), tokenizer=str(given))
        prepared = prepare_data(cfg, vocab_size=400, seq_len=8, work_dir=tmp_path / f"work-{given.name}")
        tokenizer = Tokenizer.from_file(str(prepared.tokenizer_dir / "tokenizer.json"))
        assert tokenizer.decode(np.asarray(prepared.tokens()).tolist(), skip_special_tokens=False).startswith(rendered)
        # Folded into the config the checkpoint and its export carry, which serving reads.
        assert json.loads((prepared.tokenizer_dir / "tokenizer_config.json").read_text())["chat_template"] == OWN_TEMPLATE
