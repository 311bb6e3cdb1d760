"""What quantization cost: next-token agreement between two served models over a fixed prompt set.

Both models are asked, through their OpenAI-compatible `/v1/completions`, for vLLM's
`prompt_logprobs` (the log-probabilities of the best next tokens at every prompt position), so
the figure is what the replicas themselves compute, kernels included. Top-1 agreement is the
share of positions where both put the same token first.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

# (token id, log-probability), best first, at one prompt position
Choices = list[tuple[int, float]]


async def next_token_choices(
    client: httpx.AsyncClient, base_url: str, model: str, prompts: list[str], top: int = 2
) -> list[Choices]:
    """The `top` best next tokens at every position after the first of every prompt, in order."""
    positions: list[Choices] = []
    for prompt in prompts:
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": top}
        response = await client.post(f"{base_url}/v1/completions", json=body)
        response.raise_for_status()
        for entry in response.json()["choices"][0]["prompt_logprobs"][1:]:
            # vLLM adds the prompt's own token when it is not among the best: keep the best `top`
            ranked = sorted((e["rank"], int(token), float(e["logprob"])) for token, e in entry.items())[:top]
            positions.append([(token, logprob) for _, token, logprob in ranked])
    return positions


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
