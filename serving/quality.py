"""What quantization cost: next-token agreement between two served models over a fixed prompt
set, and each one's perplexity on it.

Both models are asked, through their OpenAI-compatible `/v1/completions`, for vLLM's
`prompt_logprobs` (the log-probabilities of the best next tokens at every prompt position, and
of the prompt's own token there), so the figures are what the replicas themselves compute,
kernels included. Top-1 agreement is the share of positions where both put the same token
first; perplexity is exp of the mean negative log-probability of the prompts' own tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import httpx

from serving.quantize import calibration_documents

# The fixed prompt set a quantized export is measured on: this many pieces of the run's held-out
# data (its validation dataset, else its training one), each at most PROMPT_CHARS characters,
# drawn with PROMPT_SEED, which is not the calibration's seed (0), so that the two samples differ
# where the data allows. 32 pieces give hundreds of positions even of short documents: one
# position's flip moves the figure by well under 1%.
PROMPTS = 32
PROMPT_CHARS = 256
PROMPT_SEED = 1

# (token id, log-probability), best first, at one prompt position
Choices = list[tuple[int, float]]


def held_out_prompts(dataset: Path) -> list[str]:
    """The fixed prompt set of a run whose held-out data is the file `dataset`."""
    return calibration_documents(dataset, PROMPTS, PROMPT_SEED, piece_chars=PROMPT_CHARS)


@dataclass(frozen=True)
class Scores:
    """A served model's view of prompts, position by position (all after each prompt's first)."""

    choices: list[Choices]  # its best next tokens
    own: list[float]  # the log-probability it gave the prompt's actual token

    @property
    def perplexity(self) -> float:
        return math.exp(-sum(self.own) / len(self.own)) if self.own else math.nan


async def score_prompts(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    prompts: list[str],
    top: int = 2,
    max_prompt_tokens: int | None = None,
) -> Scores:
    """The `top` best next tokens, and the actual token's log-probability, at every position
    after the first of every prompt, in order. With `max_prompt_tokens`, vLLM keeps only that
    many of a longer prompt's last tokens."""
    choices: list[Choices] = []
    own: list[float] = []
    for prompt in prompts:
        body: dict[str, object] = {
            "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": top,
            "return_token_ids": True,
        }  # fmt: skip
        if max_prompt_tokens is not None:
            body["truncate_prompt_tokens"] = max_prompt_tokens
        response = await client.post(f"{base_url}/v1/completions", json=body)
        response.raise_for_status()
        choice = response.json()["choices"][0]
        for token_id, entry in zip(choice["prompt_token_ids"][1:], choice["prompt_logprobs"][1:], strict=True):
            # vLLM adds the prompt's own token when it is not among the best: keep the best `top`
            ranked = sorted((e["rank"], int(token), float(e["logprob"])) for token, e in entry.items())[:top]
            choices.append([(token, logprob) for _, token, logprob in ranked])
            own.append(float(entry[str(token_id)]["logprob"]))
    return Scores(choices=choices, own=own)


async def next_token_choices(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    prompts: list[str],
    top: int = 2,
    max_prompt_tokens: int | None = None,
) -> list[Choices]:
    """The `top` best next tokens at every position after the first of every prompt, in order."""
    return (await score_prompts(client, base_url, model, prompts, top, max_prompt_tokens)).choices


@dataclass(frozen=True)
class Agreement:
    positions: int
    agree: int
    # Where the two part: (the reference's choices there, the other model's first token)
    parted: list[tuple[Choices, int]]

    @property
    def top1(self) -> float:
        return self.agree / self.positions if self.positions else 0.0


def top1_agreement(reference: list[Choices], other: list[Choices]) -> Agreement:
    """Compare two models' choices over the same prompts (so the same positions)."""
    if len(reference) != len(other):
        raise ValueError(f"the two runs cover {len(reference)} and {len(other)} positions; use the same prompts")
    parted = [(ref, oth[0][0]) for ref, oth in zip(reference, other, strict=True) if ref[0][0] != oth[0][0]]
    return Agreement(positions=len(reference), agree=len(reference) - len(parted), parted=parted)
