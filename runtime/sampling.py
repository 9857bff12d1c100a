"""Sampling and lossless acceptance, as tensor ops that engines can compile.

Randomness enters as explicit uniforms in [0, 1) drawn by the host from the request's seed, one per
sampled position, so the torch reference and compiled engines make the same choice from the same logits.

Acceptance: the draft is greedy (argmax of the draft logits). The target samples its own token y_i at every
block slot from its adjusted distribution; draft token d_{i+1} is accepted while d_{i+1} == y_i. Every emitted
token is then y_i, a sample from the target's distribution given the tokens actually emitted before it, so
output is distributed exactly as plain sampling from the target (and at T=0 equals greedy decoding).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class RequestError(ValueError):
    """A generation request is invalid; the message names the value and the fix."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = whole vocabulary
    top_p: float = 1.0
    seed: int | None = None

    def validate(self) -> None:
        if not self.temperature >= 0:
            raise RequestError(f"temperature={self.temperature} is invalid: use 0 for greedy or a positive value")
        if self.top_k < 0:
            raise RequestError(f"top_k={self.top_k} is invalid: use 0 (no limit) or a positive count")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p={self.top_p} is outside (0, 1]: use 1.0 to disable nucleus sampling")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def uniform_source(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


def sample_tokens(logits: torch.Tensor, uniforms: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [B, S, V], uniforms: [B, S] in [0, 1) -> tokens [B, S] (argmax when greedy)."""
    if params.greedy:
        return logits.argmax(dim=-1)
    scores, order = torch.sort(logits.float() / params.temperature, dim=-1, descending=True)  # [B, S, V]
    if 0 < params.top_k < scores.shape[-1]:
        scores[..., params.top_k :] = float("-inf")
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        mass_before = probs.cumsum(dim=-1) - probs
        probs = torch.where(mass_before < params.top_p, probs, torch.zeros_like(probs))
    cdf = probs.cumsum(dim=-1)  # unnormalised: compare with u * total mass
    threshold = uniforms[..., None].float() * cdf[..., -1:]
    rank = (cdf <= threshold).sum(dim=-1).clamp(max=scores.shape[-1] - 1)  # [B, S]
    return order.gather(-1, rank[..., None])[..., 0]


def accepted_prefix_length(draft_tokens: torch.Tensor, target_tokens: torch.Tensor) -> torch.Tensor:
    """draft_tokens: [B, S-1] (slots 1..S-1), target_tokens: [B, S] -> accept_len [B] in [0, S-1].

    Draft slot i+1 is accepted while it equals the target's own choice at slot i.
    """
    matches = (draft_tokens == target_tokens[:, :-1]).to(torch.int64)
    return matches.cumprod(dim=-1).sum(dim=-1)
