"""The drafter equals z-lab's reference `dflash` package (DFlashDraftModel, dflash_generate) on the same checkpoint."""

from __future__ import annotations

import json
import time
from pathlib import Path

import dflash.model as zlab
import pytest
import torch
from dflash_trt.builder.graphs import torch_engine
from dflash_trt.builder.networks import DrafterNetwork, draft_logits, load_drafter, load_target
from dflash_trt.builder.tiny_checkpoints import write_tiny_drafter
from dflash_trt.runtime.loop import generate
from transformers import AutoModelForCausalLM

TOLERANCE = 1e-4  # fp32, max abs difference of draft logits


def to_legacy_schema(drafter_dir: Path) -> None:
    """Rewrite a drafter config in z-lab's legacy schema: DFlash fields top-level, no dflash_config."""
    config = json.loads((drafter_dir / "config.json").read_text())
    config.update(config.pop("dflash_config"))
    (drafter_dir / "config.json").write_text(json.dumps(config))


VARIANTS = {
    "new-schema": {},
    "legacy-schema": {},
    "sliding-window": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5, "use_sliding_window": True},
    "causal": {"is_causal": True},
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def drafter_pair(request: pytest.FixtureRequest, tiny_targets: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    path = write_tiny_drafter(tiny_targets["llama"], tmp_path_factory.mktemp(request.param) / "d", **VARIANTS[request.param])
    if request.param == "legacy-schema":
        to_legacy_schema(path)
    reference = zlab.DFlashDraftModel.from_pretrained(path, dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(tiny_targets["llama"], dtype=torch.float32).eval()
    return reference, load_drafter(path), target


def _ours_draft(drafter: DrafterNetwork, target, contexts: list[torch.Tensor], block: torch.Tensor) -> torch.Tensor:
    cache = drafter.allocate_cache(1, 128)
    start = 0
    for ctx in contexts:  # context arrives in chunks, as committed tokens do
        positions = torch.arange(start, start + ctx.shape[1])[None]
        k, v = drafter.context_kv(ctx, positions)
        cache.write(positions, k, v)
        start += ctx.shape[1]
    embeds = target.get_input_embeddings()(block)
    hidden = drafter(embeds, torch.arange(start, start + block.shape[1])[None], cache.k, cache.v, torch.tensor([start]))
    return draft_logits(hidden, target.lm_head.weight, drafter.config)


def _reference_draft(reference, target, contexts: list[torch.Tensor], block: torch.Tensor) -> torch.Tensor:
    cache = zlab._make_cache(reference.config)
    start = 0
    hidden = None
    for ctx in contexts:
        end = start + ctx.shape[1]
        positions = torch.arange(start, end + block.shape[1])[None]
        embeds = target.get_input_embeddings()(block)
        hidden = reference(
            target_hidden=ctx, noise_embedding=embeds, position_ids=positions, past_key_values=cache, use_cache=True
        )
        zlab._crop_to(cache, end)  # keep only context rows, as dflash_generate does
        start = end
    return reference.compute_logits(hidden, target.lm_head)


def test_draft_logits_match_reference(drafter_pair) -> None:
    reference, ours, target = drafter_pair
    torch.manual_seed(11)
    n_features = len(ours.config.target_layer_ids) * ours.config.hidden_size
    contexts = [torch.randn(1, 13, n_features), torch.randn(1, 4, n_features)]
    block = torch.tensor([[5] + [ours.config.mask_token_id] * 15])
    with torch.no_grad():
        expected = _reference_draft(reference, target, contexts, block)
        actual = _ours_draft(ours, target, contexts, block)
    assert actual.shape == expected.shape == (1, 16, 96)
    assert (actual - expected).abs().max() <= TOLERANCE


def test_variant_masks_change_the_draft(drafter_pair) -> None:
    """Guard against a variant silently running as the plain bidirectional drafter."""
    reference, ours, target = drafter_pair
    if all(c is False for c in ours.config.layer_causal):
        pytest.skip("bidirectional variant")
    torch.manual_seed(12)
    n_features = len(ours.config.target_layer_ids) * ours.config.hidden_size
    ctx, block = [torch.randn(1, 13, n_features)], torch.randint(0, 96, (1, 16))
    with torch.no_grad():
        masked = _ours_draft(ours, target, ctx, block)
        for layer in ours.layers:
            layer.self_attn.causal, layer.self_attn.window = False, None
        unmasked = _ours_draft(ours, target, ctx, block)
    assert (masked - unmasked).abs().max() > 100 * TOLERANCE


def test_greedy_loop_matches_reference_dflash_generate(
    tiny_targets: dict[str, Path], tiny_drafter: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same tokens and the same per-step acceptance lengths as z-lab's own loop."""
    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)  # its stats synchronise CUDA
    reference = zlab.DFlashDraftModel.from_pretrained(tiny_drafter, dtype=torch.float32).eval()
    hf_target = AutoModelForCausalLM.from_pretrained(tiny_targets["llama"], dtype=torch.float32).eval()
    drafter = load_drafter(tiny_drafter)
    engine = torch_engine(load_target(tiny_targets["llama"], drafter.config.target_layer_ids), drafter, max_seq_len=256)
    torch.manual_seed(5)
    for _ in range(3):
        prompt = torch.randint(1, 90, (1, 12))
        ref = zlab.dflash_generate(reference, hf_target, prompt, 48, None, temperature=0.0, return_stats=True)
        ours = generate(engine, prompt[0].tolist(), 48)
        assert ours.tokens == ref.output_ids[0, 12:].tolist()
        # z-lab counts the prefill token as its own step and shrinks the last block; compare the full steps
        assert ours.stats.acceptance_lengths[:-1] == ref.acceptance_lengths[: len(ours.stats.acceptance_lengths) - 1]
