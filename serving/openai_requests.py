"""Checks on an OpenAI request before it is proxied, so a bad one costs no replica time.

`check_request` validates the model name, the sampling parameters and the prompt length of a
`/v1/chat/completions` or `/v1/completions` body and raises `OpenAIError` (400 / 404) naming the
parameter. Prompt length is counted with the deployment's own tokenizer (`tokenizers`, the
Rust tokenizer: microseconds per prompt) and, for chat, its chat template, as vLLM does.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from serving.errors import OpenAIError, invalid_request, model_not_found

Endpoint = Literal["chat", "completions"]
ENDPOINTS: dict[str, Endpoint] = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}

# Least-outstanding routing counts a request as one unit of load; n samples are n units that
# would land on one replica together, so Fathom serves one sample per request.
MAX_N = 1


class PromptCounter:
    """Counts prompt tokens the way vLLM will: the checkpoint's `tokenizer.json`, and for chat the
    `chat_template` of `tokenizer_config.json` rendered with `add_generation_prompt=True`."""

    def __init__(self, checkpoint_dir: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(checkpoint_dir)
        self._tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        config_file = path / "tokenizer_config.json"
        self._config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.exists() else {}

    @cached_property
    def _template(self) -> Any:
        source = self._config.get("chat_template")
        if not source:
            return None
        # jinja2's sandbox, as transformers renders chat templates: a template is data from the
        # checkpoint and must not reach Python internals.
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise_template_error
        return env.from_string(source)

    def _special(self, name: str) -> str:
        token = self._config.get(name)
        return token.get("content", "") if isinstance(token, dict) else (token or "")

    def count_text(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=True).ids)

    def count_chat(self, messages: list[dict[str, Any]]) -> int:
        if self._template is None:
            text = "\n".join(_message_text(m) for m in messages)
        else:
            text = self._template.render(
                messages=[{**m, "content": _message_text(m)} for m in messages],
                add_generation_prompt=True,
                bos_token=self._special("bos_token"),
                eos_token=self._special("eos_token"),
            )
        # The rendered template carries its own special tokens; vLLM adds none for chat.
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)


def _raise_template_error(message: str) -> None:
    # Templates call raise_exception() to reject a conversation (e.g. roles out of order).
    raise invalid_request(f"the conversation does not fit the model's chat template: {message}", "messages")


def _message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


@dataclass(frozen=True, kw_only=True)
class ServedModel:
    """What the checks need to know about a deployment."""

    name: str
    max_model_len: int
    counter: PromptCounter | None = None  # None skips the prompt-length check


def _number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid_request(f"{name} must be a number; got {value!r}", name)
    return float(value)


def _check_sampling(body: dict[str, Any], endpoint: Endpoint) -> int | None:
    """Validate sampling parameters; return max_tokens when given."""
    temperature = _number(body, "temperature")
    if temperature is not None and not 0 <= temperature <= 2:
        raise invalid_request(f"temperature must be between 0 and 2; got {temperature:g}", "temperature")
    top_p = _number(body, "top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise invalid_request(f"top_p must be greater than 0 and at most 1; got {top_p:g}", "top_p")
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(body, name)
        if value is not None and not -2 <= value <= 2:
            raise invalid_request(f"{name} must be between -2 and 2; got {value:g}", name)
    max_tokens: int | None = None
    names = ("max_completion_tokens", "max_tokens") if endpoint == "chat" else ("max_tokens",)
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise invalid_request(f"{name} must be an integer of at least 1; got {value!r}", name)
        max_tokens = value
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N):
        raise invalid_request(f"n must be an integer from 1 to {MAX_N}; got {n!r}", "n")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid_request(f"stream must be true or false; got {stream!r}", "stream")
    return max_tokens


def _prompt_tokens(body: dict[str, Any], endpoint: Endpoint, counter: PromptCounter) -> tuple[int, str]:
    if endpoint == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise invalid_request("messages must be a non-empty list of {role, content} objects", "messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise invalid_request(f"messages[{i}] must be an object with a string role", f"messages[{i}]")
        return counter.count_chat(messages), "messages"
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return counter.count_text(prompt), "prompt"
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return len(prompt), "prompt"
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return counter.count_text(prompt[0]), "prompt"
    raise invalid_request("prompt must be a string, a list of token ids, or a list holding one string", "prompt")


def unknown_endpoint(path: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"Unknown endpoint {path}; Fathom serves /v1/models, {', '.join(ENDPOINTS)}.",
        "invalid_request_error",
        None,
        "unknown_url",
    )


def check_request(path: str, body: Any, models: dict[str, ServedModel]) -> ServedModel:
    """Validate an OpenAI request body for `path`; return the model it addresses.

    Raises `OpenAIError`: 404 for an unknown path or model, 400 for anything else wrong."""
    endpoint = ENDPOINTS.get(path)
    if endpoint is None:
        raise unknown_endpoint(path)
    if not isinstance(body, dict):
        raise invalid_request("the request body must be a JSON object")
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise invalid_request("model is required: the name of a deployment", "model")
    model = models.get(name)
    if model is None:
        raise model_not_found(name, sorted(models))
    max_tokens = _check_sampling(body, endpoint)
    if model.counter is not None:
        tokens, param = _prompt_tokens(body, endpoint, model.counter)
        if tokens >= model.max_model_len:
            raise invalid_request(
                f"This model's maximum context length is {model.max_model_len} tokens; the prompt "
                f"({param}) is {tokens} tokens long, which leaves no room for a completion.",
                param,
                "context_length_exceeded",
            )
        if max_tokens is not None and tokens + max_tokens > model.max_model_len:
            raise invalid_request(
                f"This model's maximum context length is {model.max_model_len} tokens; you asked "
                f"for {tokens + max_tokens} ({tokens} in the {param}, {max_tokens} to generate).",
                "max_tokens",
                "context_length_exceeded",
            )
    return model
