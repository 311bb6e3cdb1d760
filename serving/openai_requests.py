"""Checks on an OpenAI request before it is proxied, so a bad one costs no replica time.

`check_request` validates the model name, the sampling parameters and the prompt length of a
`/v1/chat/completions` or `/v1/completions` body and raises `OpenAIError` (400 / 404) naming the
parameter. Prompt length is counted with the deployment's own tokenizer (`tokenizers`, the
Rust tokenizer: microseconds per prompt) and, for chat, its chat template, as vLLM does.

Everything else vLLM's OpenAI server takes passes through as sent (n, logprobs, stop, seed,
response_format, tools, vLLM's own sampling and structured-output fields, stream_options): vLLM
validates those and its 400s reach the client in OpenAI's shape. Refused here are the fields
that hand a caller the operator's controls (CLOSED_FIELDS) and message parts that would make
the replica fetch media from a URL of the caller's choosing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from serving.openai_errors import OpenAIError, invalid_request, model_not_found

Endpoint = Literal["chat", "completions"]
ENDPOINTS: dict[str, Endpoint] = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}

# OpenAI's own bound on n. Routing counts a request's n samples (of each prompt) as that many
# requests in flight (request_weight), so a large n weighs on its replica's share as it should.
MAX_N = 128
# The most prompts one /v1/completions request may batch (vLLM takes a list of prompts).
MAX_PROMPTS = 64

# Request fields of vLLM 0.32's chat and completions requests that a public endpoint must not
# pass on, with the reason each is refused. tests/serving/test_vllm_request_fields.py lists
# vLLM's fields from its own protocol classes and fails on any that is neither here nor in
# PASSED_FIELDS, so a vLLM upgrade brings each new field up for a decision.
CLOSED_FIELDS: dict[str, str] = {
    "chat_template": "the deployment renders chats with its checkpoint's own template",
    "request_id": "request ids are vLLM's own; one caller's id could collide with another's",
    "priority": "scheduling priority is the operator's to set, not a caller's",
    "kv_transfer_params": "it steers vLLM's disaggregated-serving KV transfers",
    "ec_transfer_params": "it steers vLLM's encoder-cache transfers",
    "vllm_xargs": "it feeds the replica's custom extensions, which only the operator configures",
    "prompt_embeds": "embeddings are deserialized tensors; the endpoint takes text and token ids",
    "media_io_kwargs": "Fathom's models take text only",
    "mm_processor_kwargs": "Fathom's models take text only",
}
# vLLM 0.32's fields that pass through as the caller sent them (besides model, messages, prompt).
PASSED_FIELDS = frozenset(
    """
    frequency_penalty logit_bias logprobs top_logprobs max_tokens max_completion_tokens n presence_penalty
    response_format seed stop stream stream_options temperature top_p tools tool_choice reasoning_effort
    thinking_token_budget include_reasoning parallel_tool_calls user use_beam_search top_k min_p
    repetition_penalty watermarking length_penalty stop_token_ids include_stop_str_in_output ignore_eos
    min_tokens skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens truncation_side
    prompt_logprobs logprob_token_ids allowed_token_ids bad_words echo add_generation_prompt
    continue_final_message add_special_tokens documents chat_template_kwargs structured_outputs session_id
    return_tokens_as_token_ids return_token_ids routed_experts_prompt_start return_token_offsets
    return_prompt_text mm_payload return_mm_kwargs cache_salt repetition_detection stream_interval suffix
    """.split()
)
# Message content parts of a text model. Others (image_url, audio_url, file, …) would have the
# replica fetch or decode media for a model that cannot read it.
TEXT_PARTS = frozenset({"text", "input_text", "refusal"})


class PromptCounter:
    """Counts prompt tokens the way vLLM will: the checkpoint's `tokenizer.json`, and for chat its
    chat template (`tokenizer_config.json`'s `chat_template`, the "default" of a list of named
    ones, else `chat_template.jinja`, as transformers reads them) rendered with
    `add_generation_prompt=True`."""

    def __init__(self, checkpoint_dir: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(checkpoint_dir)
        self._tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        config_file = path / "tokenizer_config.json"
        self._config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.exists() else {}
        self._folder = path

    @cached_property
    def _template(self) -> Any:
        source = self._config.get("chat_template")
        if isinstance(source, list):
            source = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}.get("default")
        if not source and (self._folder / "chat_template.jinja").is_file():
            source = (self._folder / "chat_template.jinja").read_text()
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
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid_request(
            f'stream_options must be an object such as {{"include_usage": true}}; got {options!r}', "stream_options"
        )
    return max_tokens


def _check_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid_request("messages must be a non-empty list of {role, content} objects", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid_request(f"messages[{i}] must be an object with a string role", f"messages[{i}]")
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in TEXT_PARTS:
                raise invalid_request(
                    f"messages[{i}].content[{j}] must be a text part ({', '.join(sorted(TEXT_PARTS))}): the model "
                    f"reads text only; got type {kind!r}",
                    f"messages[{i}].content[{j}].type",
                )
    return messages


def _prompts(body: dict[str, Any]) -> list[str | list[int]]:
    """A completions request's prompts: one string or token list, or a list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and _is_token_list(prompt)):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_list(p) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise invalid_request(f"prompt may batch at most {MAX_PROMPTS} prompts; got {len(prompt)}", "prompt")
        return prompt
    raise invalid_request(
        "prompt must be a string, a list of token ids, or a non-empty list of strings or of token-id lists", "prompt"
    )


def _is_token_list(value: Any) -> bool:
    return (
        isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _prompt_tokens(body: dict[str, Any], endpoint: Endpoint, counter: PromptCounter) -> tuple[int, str]:
    """The longest prompt's length in tokens, and the parameter that holds it."""
    if endpoint == "chat":
        return counter.count_chat(_check_messages(body)), "messages"
    return max(counter.count_text(p) if isinstance(p, str) else len(p) for p in _prompts(body)), "prompt"


def request_weight(path: str, body: dict[str, Any]) -> int:
    """The sequences a checked request asks the replica for: n samples of each prompt."""
    n = body.get("n") or 1
    prompts = len(_prompts(body)) if ENDPOINTS.get(path) == "completions" else 1
    return int(n) * prompts


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
    for field, reason in CLOSED_FIELDS.items():
        if field in body:
            raise invalid_request(f"{field} is not available through this endpoint: {reason}", field)
    max_tokens = _check_sampling(body, endpoint)
    if endpoint == "chat":
        _check_messages(body)
    else:
        _prompts(body)
    # A caller who asks vLLM to truncate the prompt gets vLLM's own length checks.
    if model.counter is not None and body.get("truncate_prompt_tokens") is None:
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
