"""dflash-build --draft-vocab: the drafter proposes only token ids below N (its LM-head use cut to N rows, float or
quantized), output stays exactly plain decoding's, and bad values fail at build time; a drafter trained with a draft
vocabulary (dflash_config.draft_vocab_size) is built with it unless told less."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from dflash_trt.builder.cli import main as dflash_build
from dflash_trt.runtime.engine import GraphEngine
from dflash_trt.runtime.loop import generate, generate_plain
from dflash_trt.runtime.repository import load_engine
from dflash_trt.runtime.scheduler import FixedVerify

from tests.test_quantize import _build

KEEP = 48  # of the tiny target's 96 ids


def _drafted(engine: GraphEngine, prompts: list[list[int]]) -> tuple[torch.Tensor, list[list[int]], list[list[int]]]:
    """Every token the drafter proposed while DFlash generated each prompt (whole blocks verified), with its outputs
    and plain decoding's."""
    drafted, run = [], engine.runner.run

    def spying(graph: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = run(graph, inputs)
        if graph in ("prefill", "step"):
            drafted.append(out["next_block"][:, 1:].flatten())  # [B, 1 + K]: the first token, then the drafts
        return out

    engine.runner.run = spying  # type: ignore[method-assign]
    outputs = [generate(engine, prompt, 40, policy=FixedVerify(engine.block_size - 1)).tokens for prompt in prompts]
    engine.runner.run = run  # type: ignore[method-assign]
    return torch.cat(drafted), outputs, [generate_plain(engine, prompt, 40).tokens for prompt in prompts]


def _trained_for(drafter: Path, keep: int, directory: Path) -> Path:
    """A copy of `drafter` whose config says it was trained to draft only ids below `keep` (dflash-train --draft-vocab)."""
    shutil.copytree(drafter, directory)
    config = json.loads((directory / "config.json").read_text())
    config["dflash_config"]["draft_vocab_size"] = keep
    (directory / "config.json").write_text(json.dumps(config))
    return directory


PROMPTS = [torch.randint(1, 96, (10 + i,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(3)]


@pytest.mark.parametrize(("drafter_mode", "cut_by"), [("none", "flag"), ("int4", "drafter config")])
def test_the_drafter_proposes_only_the_kept_ids_and_output_is_unchanged(
    drafter_mode: str, cut_by: str, tiny_targets: dict[str, Path], trained_drafter: Path, tiny_repo: Path, tmp_path: Path
) -> None:
    """The same pair built whole (tiny_repo) drafts ids above KEEP on these prompts; cut, none of its drafts is, on
    the float drafter side and on the 4-bit one (whose LM-head copy is then quantized from the cut head), whether
    --draft-vocab asks for the cut or the drafter's config carries it."""
    whole, _ = load_engine(tiny_repo, max_batch=1)
    drafted, _, _ = _drafted(whole, PROMPTS)
    assert (drafted >= KEEP).any(), "the whole drafter never drafted an id above the cut: the test would prove nothing"
    options = ("--max-seq-len", "256", "--quantize-drafter", drafter_mode)
    if cut_by == "flag":
        drafter, options = trained_drafter, (*options, "--draft-vocab", str(KEEP))
    else:
        drafter = _trained_for(trained_drafter, KEEP, tmp_path / "drafter")
    repo = _build(tiny_targets["qwen3"], drafter, tmp_path / "repo", *options)
    cut, manifest = load_engine(repo, max_batch=1)
    assert manifest["drafter"]["vocab"] == KEEP
    drafted, outputs, plain = _drafted(cut, PROMPTS)
    assert drafted.max() < KEEP
    assert outputs == plain


def test_bad_draft_vocabularies_fail_at_build_time(
    tiny_targets: dict[str, Path], trained_drafter: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--model", str(tiny_targets["qwen3"]), "--drafter", str(trained_drafter), "--output", str(tmp_path / "r")]
    assert dflash_build([*base, "--draft-vocab", "97"]) == 2
    assert "--draft-vocab 97 must be in [1, 96] (the target's vocabulary), or 0 for all of it" in capsys.readouterr().err
    assert dflash_build([*base, "--draft-vocab", "48", "--backend", "torch-cuda"]) == 2
    assert "--draft-vocab cuts the drafter's LM head in ONNX engines" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    plan = ["--model", str(tiny_targets["qwen3"]), "--drafter", str(trained_drafter), "--plan"]
    assert dflash_build([*plan, "--draft-vocab", "97"]) == 2  # no plan for a build that would be refused
    assert "--draft-vocab 97 must be in [1, 96]" in capsys.readouterr().err
    trained_cut = _trained_for(trained_drafter, KEEP, tmp_path / "cut")
    assert dflash_build([*base[:2], "--drafter", str(trained_cut), *base[4:], "--draft-vocab", "64"]) == 2
    assert (
        f"--draft-vocab 64: the drafter was trained to draft only ids below {KEEP} (its dflash_config.draft_vocab_size)"
        in capsys.readouterr().err
    )
    plan = [*plan[:2], "--drafter", str(trained_cut), "--plan", "--backend", "torch-cuda"]
    assert dflash_build(plan) == 0  # built uncut where the head cannot be cut, with a warning
    assert f"warning: the drafter was trained to draft only ids below {KEEP}" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
