"""dflash-train: batched data generation equals one-prompt-at-a-time greedy decoding, batched taps equal
single-sequence taps, the CLI writes a z-lab drafter, resumes from its checkpoint as if never stopped and is
reproducible, and its prompts are the same in every process."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from dflash_trt.builder import train_cli
from dflash_trt.builder.networks import load_drafter, load_target
from dflash_trt.builder.train_cli import main as dflash_train
from dflash_trt.builder.training import generate_responses, make_examples


@pytest.fixture(scope="module")
def qwen3_target(tiny_targets: dict[str, Path]):  # noqa: ANN201
    return load_target(tiny_targets["qwen3"], (1, 3), torch.float32)


def test_batched_generation_equals_one_prompt_at_a_time(qwen3_target) -> None:  # noqa: ANN001
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 90, (length,), generator=generator).tolist() for length in (3, 11, 7, 11)]
    batched = generate_responses(qwen3_target, prompts, 20)
    for prompt, row in zip(prompts, batched, strict=True):
        alone = generate_responses(qwen3_target, [prompt], 20)[0]
        assert row.tolist() == alone.tolist()
        assert row[: len(prompt)].tolist() == prompt and len(row) == len(prompt) + 20


def test_batched_taps_equal_single_sequence_taps(qwen3_target) -> None:  # noqa: ANN001
    generator = torch.Generator().manual_seed(4)
    sequences = [torch.randint(1, 90, (length,), generator=generator) for length in (9, 30, 17)]
    batched = make_examples(qwen3_target, sequences, [2, 5, 3], batch_size=3)
    for example, tokens, prompt_length in zip(batched, sequences, [2, 5, 3], strict=True):
        alone = make_examples(qwen3_target, [tokens], [prompt_length], batch_size=1)[0]
        assert example.first_anchor == prompt_length and example.taps.shape == (len(tokens), 2 * 64)
        torch.testing.assert_close(example.taps, alone.taps, atol=1e-5, rtol=1e-5)


def _train(target: Path, output: Path, steps: int) -> None:
    command = ["--target", str(target), "--output", str(output), "--num-prompts", "6", "--max-new-tokens", "24",
               "--layers", "1", "--steps", str(steps), "--save-every", "4", "--sequences-per-step", "2",
               "--anchors", "4", "--generation-batch", "5", "--dtype", "float32", "--mask-token-id", "95"]  # fmt: skip
    assert dflash_train(command) == 0


def _stop_after(save_checkpoint: Callable[..., None]) -> Callable[..., None]:
    """save_checkpoint that saves, then interrupts the run as Ctrl-C would."""

    def save_then_stop(*args: object) -> None:
        save_checkpoint(*args)
        raise KeyboardInterrupt

    return save_then_stop


def test_cli_writes_a_resumable_reproducible_zlab_drafter(
    tiny_targets: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tiny_targets["qwen3"]
    # its word-level tokenizer fills the vocabulary: no mask token can be chosen, and the user is told so
    assert dflash_train(["--target", str(target), "--output", str(tmp_path / "x"), "--num-prompts", "2", "--steps", "1"]) == 2
    assert "pass mask_token_id explicitly" in capsys.readouterr().err
    _train(target, tmp_path / "a", 8)
    first_log = capsys.readouterr().err
    assert "the target answers 6 'code' prompts (24 tokens each)" in first_log
    assert "the target answers 6 'prose' prompts (24 tokens each)" in first_log
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", first_log)]
    assert len(losses) == 1 and losses[0] > 0  # step 8 of 8 reported with its loss

    drafter = load_drafter(tmp_path / "a")  # our loader reads it ...
    from dflash.model import DFlashDraftModel

    DFlashDraftModel.from_pretrained(tmp_path / "a")  # ... and so does z-lab's
    assert drafter.config.block_size == 16 and len(drafter.layers) == 1

    _train(target, tmp_path / "b", 8)  # same command, fresh directory: the same drafter, bit for bit
    capsys.readouterr()
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()

    interrupted = tmp_path / "c"  # stopped after its checkpoint at step 4, then the same command again
    monkeypatch.setattr(train_cli, "save_checkpoint", _stop_after(train_cli.save_checkpoint))
    with pytest.raises(KeyboardInterrupt):
        _train(target, interrupted, 8)
    monkeypatch.undo()
    _train(target, interrupted, 8)
    assert "resuming at step 4" in capsys.readouterr().err
    assert (interrupted / "model.safetensors").read_bytes() == (tmp_path / "a" / "model.safetensors").read_bytes()

    _train(target, tmp_path / "a", 12)  # more steps on the same output: data and checkpoint are reused
    log = capsys.readouterr().err
    assert "reusing 6 generated 'code' responses" in log and "resuming at step 8" in log
    assert "step 12/12" in log
    # a cached prompt set generated with other options is not silently reused
    assert dflash_train(["--target", str(target), "--output", str(tmp_path / "a"), "--num-prompts", "6",
                         "--max-new-tokens", "32", "--mask-token-id", "95", "--steps", "1"]) == 2  # fmt: skip
    assert "holds 6 responses of 24 new tokens, but this run asks for 6 of 32" in capsys.readouterr().err
    cached = torch.load(tmp_path / "a" / "data-code.pt")  # ... nor one made from other prompts (older code, say)
    cached["prompts"][2] += " (an older wording)"
    torch.save(cached, tmp_path / "a" / "data-code.pt")
    assert dflash_train(["--target", str(target), "--output", str(tmp_path / "a"), "--num-prompts", "6",
                         "--max-new-tokens", "24", "--mask-token-id", "95", "--steps", "1"]) == 2  # fmt: skip
    assert "answers other 'code' prompts than this dflash-train makes (1 of 6 differ; the first is #2" in capsys.readouterr().err


def test_code_prompts_are_the_same_in_every_process() -> None:
    """The training data are the target's answers to these prompts, so they must not carry anything that changes
    between runs, such as the memory address in a default value's repr (`<function copy2 at 0x7f...>`)."""
    program = "import json; from dflash_trt.builder.train_data import code_prompts; print(json.dumps(code_prompts()))"
    runs = [subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True).stdout for _ in range(2)]
    assert runs[0] == runs[1]
    prompts = json.loads(runs[0])
    assert len(prompts) > 600 and not [p for p in prompts if re.search(r" at 0x[0-9a-f]+>", p)]
    assert any("copy_function=copy2" in p for p in prompts)
