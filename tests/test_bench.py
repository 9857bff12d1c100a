"""dflash-bench on a built repository: plain and DFlash on one engine against the z-lab reference and
transformers on the same pair and prompts; its statistics add up; bad options get clear errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from dflash_trt.runtime.bench import main as dflash_bench


def _prompts_file(path: Path) -> Path:
    lines = [json.dumps({"prompt": " ".join(f"w{(7 * i + j) % 90 + 1}" for j in range(6))}) for i in range(3)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bench_agrees_with_zlab_and_transformers(tiny_repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    command = ["--repo", str(tiny_repo), "--dataset", str(_prompts_file(tmp_path / "prompts.jsonl")), "--num-prompts", "3",
               "--max-tokens", "40", "--repeats", "2", "--against", "zlab", "--against", "transformers",
               "--verify", "full", "--json", str(out), "--plot", str(plot)]  # fmt: skip
    assert dflash_bench(command) == 0
    results = json.loads(out.read_text())
    assert results["prompts"] == 3 and results["dataset"].endswith("prompts.jsonl")
    # each baseline ran in its own process with the engine's threads (the engine's process gives torch one)
    assert results["engine_threads"] == len(os.sched_getaffinity(0))
    assert results["transformers_threads"] == results["zlab_threads"] == results["engine_threads"]
    assert results["t0_identical"] is True  # DFlash == plain decoding on the engine
    assert results["transformers_identical"] is True and results["zlab_identical"] is True
    histogram, per_position = results["tokens_per_step_histogram"], results["accepted_per_position"]
    assert len(histogram) == 16 and len(per_position) == 15
    steps = sum(histogram)
    emitted = sum(n * count for n, count in enumerate(histogram, 1))
    assert emitted == 3 * 40 - 3  # every token after each prompt's first comes from a step
    assert results["tau_mean"] > 1.5  # the trained tiny drafter gets runs accepted
    assert results["draft_acceptance_rate"] == pytest.approx(sum(p * steps for p in per_position) / (15 * steps))
    assert abs(results["zlab_tau_mean"] - results["tau_mean"]) < 0.05  # the same drafter accepts the same runs
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "dflash_speedup" in capsys.readouterr().out


def test_bench_verifies_as_served_by_default(tiny_repo: Path, tmp_path: Path) -> None:
    """The default DFlash side runs the served policy (verify length chosen by cost and acceptance): still exact;
    its loop step times are per step of each generation."""
    out = tmp_path / "bench.json"
    command = ["--repo", str(tiny_repo), "--dataset", str(_prompts_file(tmp_path / "prompts.jsonl")), "--num-prompts", "3",
               "--max-tokens", "40", "--repeats", "2", "--json", str(out)]  # fmt: skip
    assert dflash_bench(command) == 0
    results = json.loads(out.read_text())
    assert results["verify"] == "adaptive" and results["t0_identical"] is True
    steps = sum(results["tokens_per_step_histogram"])
    assert sum(n * c for n, c in enumerate(results["tokens_per_step_histogram"], 1)) == 3 * 40 - 3
    assert steps < 3 * 39, "the trained tiny drafter's runs are accepted under the served policy too"
    ratio = results["dflash_step_ms_median"] / results["plain_step_ms_median"]
    assert results["dflash_step_over_plain_step"] == pytest.approx(ratio)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--block-size", "8"], "this engine was built with block size 16; rebuild with dflash-build --block-size 8"),
        (["--dataset", "no-such-file.jsonl"], "is neither builtin, humaneval, mt-bench nor an existing JSON-lines file"),
        (["--temperature", "-1"], "temperature=-1.0 is invalid"),
    ],
)
def test_bench_rejects_bad_options(options: list[str], message: str, tiny_repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        dflash_bench(["--repo", str(tiny_repo), *options])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_rejects_a_prompts_file_without_prompt_fields(
    tiny_repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "hello"}\n')
    with pytest.raises(SystemExit):
        dflash_bench(["--repo", str(tiny_repo), "--dataset", str(bad)])
    assert 'bad.jsonl:1 has no string "prompt" field' in capsys.readouterr().err
