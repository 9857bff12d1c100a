"""Sampling and lossless acceptance, as tensor ops that engines can compile.

Randomness enters as explicit uniforms in [0, 1) drawn by the host from the request's seed, one per
sampled position, so the torch reference and compiled engines make the same choice from the same logits.

Acceptance: the draft is greedy (argmax of the draft logits). The target samples its own token y_i at every
block slot from its adjusted distribution; draft token d_{i+1} is accepted while d_{i+1} == y_i. Every emitted
token is then y_i, a sample from the target's distribution given the tokens actually emitted before it, so
output is distributed exactly as plain sampling from the target (and at T=0 equals greedy decoding).

A served request's sampling values and text inputs are checked here too (`RequestError` names the value and the fix).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


class RequestError(ValueError):
    """A generation request is invalid; the message names the value and the fix."""


def request_text(value: object, name: str) -> str:
    """A served request's text input (Triton BYTES: bytes; str where a client sent text) as str; bytes that are not
    UTF-8 are refused with where they break, not failed deep inside the model."""
    if not isinstance(value, bytes):
        return str(value)
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as bad:
        raise RequestError(
            f"{name} is not UTF-8 text (byte {value[bad.start]:#04x} at position {bad.start}): send it UTF-8 encoded"
        ) from None


def shown(value: object) -> str:
    """A request's value as its sender wrote it, for messages: a served float arrives as float32 (1.1 reads
    1.100000023841858 as a Python float), so a float that is exactly a float32 is shown by float32's shortest repr."""
    if isinstance(value, float) and float(np.float32(value)) == value:
        return str(np.float32(value))
    return repr(value)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = whole vocabulary
    top_p: float = 1.0
    seed: int | None = None

    def validate(self) -> None:
        if not 0 <= self.temperature < float("inf"):
            raise RequestError(f"temperature={shown(self.temperature)} is invalid: use 0 for greedy or a positive finite value")
        if self.top_k < 0:
            raise RequestError(f"top_k={self.top_k} is invalid: use 0 (no limit) or a positive count")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p={shown(self.top_p)} is outside (0, 1]: use 1.0 to disable nucleus sampling")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @staticmethod
    def from_request(temperature: float | None, top_k: int | None, top_p: float | None, seed: int | None) -> SamplingParams:
        """A served request's parameters under TensorRT-LLM's conventions (tensorrtllm_backend clients rely on them):
        neither top_k nor top_p set (or both 0) is greedy decoding whatever the temperature; top_p 0 means no
        nucleus; temperature defaults to 1.0 and 0 is greedy. Invalid values are refused by `validate`."""
        k, p = top_k or 0, top_p or 0.0
        params = SamplingParams(1.0 if temperature is None else temperature, k, 1.0 if p == 0 else p, seed)
        params.validate()
        return SamplingParams(seed=seed) if k == 0 and p == 0 or params.greedy else params

    def uniforms(self, count: int) -> np.ndarray:
        """[count] float32 in [0, 1): the uniform for generated token n is uniforms[n], whatever the steps look like,
        so a seeded request draws the same tokens alone or in any batch and with any verify length."""
        return np.random.default_rng(self.seed).random(count, dtype=np.float32)


@dataclass(frozen=True)
class SamplingTensors:
    """Per-sequence sampling parameters as graph inputs."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = no limit
    top_p: torch.Tensor  # [B] float32
    sampled_rows: torch.Tensor  # [Bs] int64: the rows with temperature > 0 (the only ones that pay for sampling)
    candidate_slots: torch.Tensor  # [K]: only its length matters, the width of the sorted candidate list

    @staticmethod
    def of(params: Sequence[SamplingParams], vocab_size: int) -> SamplingTensors:
        """K = V when a sampled row uses top-p (the nucleus needs the full sort), else its largest top-k, else 1."""
        sampled = [row for row, p in enumerate(params) if not p.greedy]
        widths = [vocab_size if params[r].top_p < 1 else min(params[r].top_k, vocab_size) for r in sampled]
        return SamplingTensors(
            torch.tensor([p.temperature for p in params], dtype=torch.float32),
            torch.tensor([p.top_k for p in params], dtype=torch.int64),
            torch.tensor([p.top_p for p in params], dtype=torch.float32),
            torch.tensor(sampled, dtype=torch.int64),
            torch.empty(max(1, *widths) if widths else 1, dtype=torch.int64),
        )

    def as_inputs(self) -> dict[str, torch.Tensor]:
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "sampled_rows": self.sampled_rows,
            "candidate_slots": self.candidate_slots,
        }


def sample_tokens(
    logits: torch.Tensor,
    uniforms: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    sampled_rows: torch.Tensor,
    candidate_slots: torch.Tensor,
) -> torch.Tensor:
    """logits: [B, S, V], uniforms: [B, S] in [0, 1), per-row parameters [B], sampled_rows [Bs] -> tokens [B, S].

    Every row takes the argmax; the rows listed in `sampled_rows` (those with temperature > 0) are then sampled
    and overwrite theirs. A greedy row never pays for another row's sampling, and an all-greedy batch passes
    an empty list: the sampling ops then run on zero rows.
    """
    tokens = logits.argmax(dim=-1)  # [B, S]
    sampled = _sample_rows(
        logits[sampled_rows], uniforms[sampled_rows], temperature[sampled_rows], top_k[sampled_rows], top_p[sampled_rows],
        candidate_slots,
    )  # fmt: skip
    return tokens.index_put((sampled_rows,), sampled)


def _sample_rows(
    logits: torch.Tensor,
    uniforms: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    candidate_slots: torch.Tensor,
) -> torch.Tensor:
    """Rows with temperature > 0. Rows without top-k/top-p sample the whole tempered distribution by inverse CDF
    in vocabulary order (no sort). Rows with top-k/top-p sample among the K best candidates,
    K = len(candidate_slots) (the host makes K = V when top-p is in use): top-k then top-p, as HF's warpers.
    """
    scores = logits.float() / temperature[:, None, None]  # [Bs, S, V]
    whole = _inverse_cdf(torch.softmax(scores, dim=-1), uniforms)  # [Bs, S]
    best, order = torch.topk(scores, candidate_slots.shape[0], dim=-1)  # [Bs, S, K], descending
    ranks = torch.arange(best.shape[-1], device=logits.device)
    in_top_k = (top_k[:, None, None] == 0) | (ranks < top_k[:, None, None])
    probs = torch.softmax(torch.where(in_top_k, best, torch.full_like(best, float("-inf"))), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    probs = torch.where(mass_before < top_p[:, None, None], probs, torch.zeros_like(probs))
    filtered = order.gather(-1, _inverse_cdf(probs, uniforms)[..., None])[..., 0]
    use_filter = ((top_k > 0) | (top_p < 1))[:, None]
    return torch.where(use_filter, filtered, whole)


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs: [B, S, N] (unnormalised is fine), uniforms: [B, S] -> index [B, S] drawn from probs."""
    cdf = probs.cumsum(dim=-1)
    threshold = uniforms[..., None].to(cdf.dtype) * cdf[..., -1:]
    return (cdf <= threshold).sum(dim=-1).clamp(max=probs.shape[-1] - 1)


def accepted_prefix_length(draft_tokens: torch.Tensor, target_tokens: torch.Tensor) -> torch.Tensor:
    """draft_tokens: [B, S-1] (slots 1..S-1), target_tokens: [B, S] -> accept_len [B] in [0, S-1].

    Draft slot i+1 is accepted while it equals the target's own choice at slot i.
    """
    mismatch = (draft_tokens != target_tokens[:, :-1]).float()  # [B, S-1]
    sentinel = torch.ones_like(target_tokens[:, :1], dtype=mismatch.dtype)  # every row mismatches at slot S-1 at the latest
    return torch.cat([mismatch, sentinel], dim=1).argmax(dim=1)  # the first mismatch = the accepted count
