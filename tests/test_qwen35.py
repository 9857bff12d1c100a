"""Qwen3.5 hybrid targets (Gated DeltaNet + gated attention): checkpoints in the published layout, the layers
against transformers, exact rollback of the recurrent state, and greedy DFlash equal to transformers' greedy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest
import torch
from dflash_trt.builder.checkpoints import CheckpointError, parse_target_config, read_config_json, require_buildable
from dflash_trt.builder.gated_deltanet import GDNTape, commit_state, commit_window
from dflash_trt.builder.graphs import DFlashGraphs, engine_spec
from dflash_trt.builder.models import SHIPPED_CONFIGS
from dflash_trt.builder.networks import KVCache, load_pair, load_target
from dflash_trt.builder.tiny_checkpoints import peak_weights, write_tiny_drafter, write_tiny_tokenizer
from dflash_trt.plugins.gated_delta_rule import gated_delta_rule
from dflash_trt.plugins.onnx_domain import DOMAIN
from dflash_trt.runtime.engine import GraphEngine, PrefillRow, TorchRunner
from dflash_trt.runtime.graph_io import GRAPH_NAMES
from dflash_trt.runtime.loop import generate
from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.runtime.scheduler import AdaptiveVerify
from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

from tests.conftest import all_nodes

VOCAB = 96
TEXT_CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    full_attention_interval=2,  # linear, full, linear, full
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": [3, 3, 2],
        "mrope_interleaved": True,
    },
    max_position_embeddings=512,
    tie_word_embeddings=False,
    eos_token_id=None,
    pad_token_id=0,
)
TINY_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=1, out_hidden_size=64, num_position_embeddings=16)
PROMPTS = 20
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random qwen3_5 checkpoint saved as published: the vision-language wrapper, text weights under
    model.language_model.*, a vision tower that is not built."""
    torch.manual_seed(0)
    config = Qwen3_5Config(text_config=TEXT_CONFIG, vision_config=TINY_VISION, tie_word_embeddings=False)
    model = Qwen3_5ForConditionalGeneration(config)
    peak_weights(model, 0.08)
    directory = tmp_path_factory.mktemp("qwen35") / "target"
    model.save_pretrained(directory)
    write_tiny_tokenizer(directory, VOCAB)
    return directory


@pytest.fixture(scope="module")
def reference(qwen35_dir: Path) -> Qwen3_5ForCausalLM:
    model = Qwen3_5ForCausalLM.from_pretrained(qwen35_dir, dtype=torch.float32)
    return model.eval()


def test_published_layout_parses_with_its_config_traps(qwen35_dir: Path) -> None:
    raw = read_config_json(qwen35_dir)
    assert raw["model_type"] == "qwen3_5" and "text_config" in raw
    config = parse_target_config(raw)
    assert config.layer_types == ("linear_attention", "full_attention", "linear_attention", "full_attention")
    assert config.attention_layers == (1, 3) and config.linear_layers == (0, 2)
    assert config.partial_rotary_factor == 0.25 and config.rope_parameters["rope_theta"] == 1e7
    assert config.linear is not None and config.linear.conv_dim == 2 * 2 * 32 + 4 * 32
    assert config.gated_attention and config.zero_centered_norms and config.qk_norm


def test_related_types_are_refused_naming_what_is_missing() -> None:
    with pytest.raises(CheckpointError, match="qwen3_next.*not supported yet.*fused in_proj_qkvz"):
        parse_target_config({**TEXT_CONFIG, "model_type": "qwen3_next"})
    moe = {**TEXT_CONFIG, "model_type": "qwen3_5_moe_text", "num_experts": 8, "num_experts_per_tok": 2}
    config = parse_target_config({**moe, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16})
    assert config.moe is not None and config.moe.num_experts == 8  # read for plans and --backend trtllm ...
    with pytest.raises(CheckpointError, match="qwen3_5_moe.*not supported yet.*mixture-of-experts MLP.*--backend trtllm"):
        require_buildable(config)  # ... but not built into this toolkit's engines


def _logits_three_ways(network, reference, prompt: torch.Tensor, block: torch.Tensor) -> None:  # noqa: ANN001
    """Prefill, one-token decode and a 16-token verify on top of the cached state, against transformers."""
    length = prompt.shape[1]
    with torch.no_grad():
        expected = reference(torch.cat([prompt, block], dim=1)).logits  # no cache: the full sequence at once
        cache = KVCache.allocate(len(network.config.attention_layers), 1, 64, 2, 64, torch.float32)
        positions = torch.arange(length)[None, :]
        out = network(prompt, positions, cache.past(0))
        torch.testing.assert_close(out.logits, expected[:, :length], atol=1e-4, rtol=0)
        cache.write(positions, out.k, out.v)
        one = network(block[:, :1], torch.tensor([[length]]), cache.past(length), recurrent=out.recurrent)
        torch.testing.assert_close(one.logits, expected[:, length : length + 1], atol=1e-4, rtol=0)
        verify = network(block, length + torch.arange(16)[None, :], cache.past(length), recurrent=out.recurrent)
        torch.testing.assert_close(verify.logits, expected[:, length:], atol=1e-4, rtol=0)


def test_target_logits_equal_transformers(qwen35_dir: Path, reference: Qwen3_5ForCausalLM) -> None:
    network = load_target(qwen35_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    for length in (1, 5, 23):
        prompt = torch.randint(1, VOCAB, (1, length), generator=generator)
        block = torch.randint(1, VOCAB, (1, 16), generator=generator)
        _logits_three_ways(network, reference, prompt, block)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_commit_equals_the_truncated_recurrence(dtype: torch.dtype) -> None:
    """For n = 1..16 committed tokens: the state re-run with later gates masked is bit-identical (torch.equal) to
    running only the first n tokens; the conv window is the K-1 inputs before token n."""
    generator = torch.Generator().manual_seed(5)
    batch, length, heads, dk, dv, kernel, channels = 2, 16, 4, 8, 6, 4, 10

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype).float()

    k = torch.nn.functional.normalize(rand(batch, length, heads, dk), dim=-1)
    v, q = rand(batch, length, heads, dv), rand(batch, length, heads, dk)
    g = -torch.rand(batch, length, heads, generator=generator)
    beta = torch.rand(batch, length, heads, generator=generator)
    state = rand(batch, heads, dk, dv)
    window = rand(batch, kernel - 1 + length, channels)
    tape = GDNTape(k, v, g, beta, window)
    for n in range(1, length + 1):
        committed = torch.full((batch,), n)
        _, truncated = gated_delta_rule(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], state)
        assert torch.equal(commit_state(state, tape, committed), truncated), n
        assert torch.equal(commit_window(window, committed, kernel), window[:, n : n + kernel - 1]), n
    mixed = torch.tensor([3, 16])  # rows commit different lengths in one batch
    _, row0 = gated_delta_rule(q[:1, :3], k[:1, :3], v[:1, :3], g[:1, :3], beta[:1, :3], state[:1])
    assert torch.equal(commit_state(state, tape, mixed)[:1], row0)


def _prompts(count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [
        torch.randint(1, VOCAB, (int(torch.randint(3, 30, (1,), generator=generator)),), generator=generator).tolist()
        for _ in range(count)
    ]


@pytest.fixture(scope="module")
def greedy(reference: Qwen3_5ForCausalLM) -> dict[tuple[int, ...], list[int]]:
    """transformers generate(do_sample=False), NEW_TOKENS tokens for each prompt."""
    answers = {}
    for prompt in _prompts(PROMPTS):
        ids = torch.tensor([prompt])
        output = reference.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        answers[tuple(prompt)] = output[0, len(prompt) :].tolist()
    return answers


@pytest.fixture(scope="module")
def random_drafter(qwen35_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_drafter(qwen35_dir, tmp_path_factory.mktemp("qwen35-drafter") / "random")


def test_greedy_dflash_with_a_random_drafter_equals_transformers(
    qwen35_dir: Path, random_drafter: Path, greedy: dict[tuple[int, ...], list[int]]
) -> None:
    from dflash_trt.builder.graphs import torch_engine

    engine = torch_engine(*load_pair(qwen35_dir, random_drafter), max_seq_len=128)
    for prompt, expected in greedy.items():
        assert generate(engine, list(prompt), NEW_TOKENS).tokens == expected, prompt


def test_plain_stretches_keep_the_drafter_context_on_a_hybrid_target(qwen35_dir: Path, random_drafter: Path) -> None:
    """The Gated DeltaNet state has taken in the tokens that a catch-up would recompute: the engine refuses it, and
    the served policy keeps running `verify` (which keeps the drafter's context) where it does not draft."""
    from dflash_trt.builder.graphs import torch_engine

    engine = torch_engine(*load_pair(qwen35_dir, random_drafter), max_seq_len=64, max_batch=2)
    assert not AdaptiveVerify.calibrated(engine).can_catch_up
    slot = engine.pool.acquire()
    with pytest.raises(ValueError, match="recurrent states have taken in the tokens"):
        engine.catch_up([PrefillRow(slot, [1, 2], 0.5, SamplingParams(), 4)])


class OracleGraphs(DFlashGraphs):
    """A test drafter that knows the greedy answer and drafts it right for a chosen number of slots, then wrong:
    its rejection length cycles through 0 .. block-2, so every acceptance length is exercised."""

    reference: list[int] = []  # prompt + greedy answer of the sequence being generated (batch of one)
    schedule = 0
    stride, offset = 1, 0  # block n drafts (n * stride + offset) % block_size tokens right

    def draft_block(
        self, first_token: torch.Tensor, start: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, drafts: int
    ) -> torch.Tensor:
        position = int(start[0])
        right = (self.schedule * self.stride + self.offset) % self.block_size  # accepted drafts (capped by what is left)
        OracleGraphs.schedule += 1
        truth = self.reference[position + 1 : position + 1 + drafts]
        truth += [1] * (drafts - len(truth))
        guesses = [t if j < right else (t % (VOCAB - 1)) + 1 for j, t in enumerate(truth)]  # a wrong token differs
        return torch.tensor([[int(first_token[0]), *guesses]])


def _oracle_engine(qwen35_dir: Path, drafter_dir: Path, rollback: bool) -> GraphEngine:
    target, drafter = load_pair(qwen35_dir, drafter_dir)
    spec = engine_spec(target, drafter, drafter.config.block_size, 128, 1)
    graphs = OracleGraphs(target, drafter, drafter.config.block_size, spec.positions)
    graphs.rollback = rollback
    return GraphEngine(TorchRunner(graphs, spec), spec)


def test_every_rejection_length_rolls_back_exactly_and_keeping_the_whole_block_fails(
    qwen35_dir: Path, random_drafter: Path, greedy: dict[tuple[int, ...], list[int]]
) -> None:
    engine = _oracle_engine(qwen35_dir, random_drafter, rollback=True)
    emitted: set[int] = set()
    for prompt, expected in greedy.items():
        OracleGraphs.reference = [*prompt, *expected]
        result = generate(engine, list(prompt), NEW_TOKENS)
        assert result.tokens == expected, prompt
        emitted.update(result.stats.acceptance_lengths)
    assert emitted >= set(range(1, 17)), f"acceptance lengths seen: {sorted(emitted)}"
    without = _oracle_engine(qwen35_dir, random_drafter, rollback=False)
    wrong = 0
    for prompt, expected in greedy.items():
        OracleGraphs.reference = [*prompt, *expected]
        wrong += generate(without, list(prompt), NEW_TOKENS).tokens != expected
    assert wrong >= PROMPTS // 2, "keeping the state of rejected drafts must change the output"


def test_engine_state_description_has_the_recurrent_states(qwen35_dir: Path, random_drafter: Path) -> None:
    target, drafter = load_pair(qwen35_dir, random_drafter)
    spec = engine_spec(target, drafter, 16, 128, 4)
    states = {s.name: s for s in spec.states}
    assert states["target_k"].layers == 2  # attention layers only
    assert states["target_ssm"].kind == "recurrent" and states["target_ssm"].shape == (4, 32, 32)
    assert states["target_ssm"].dtype == "float32"
    assert states["target_conv"].shape == (3, 2 * 2 * 32 + 4 * 32)
    assert json.loads(json.dumps(spec.to_json()))["states"][-1]["name"] == "target_conv"


FIXTURES = SHIPPED_CONFIGS / "qwen3.5-27b"


def test_plan_of_the_27b_pair_from_its_configs(capsys: pytest.CaptureFixture[str]) -> None:
    """Qwen3.5-27B + its z-lab drafter: 48 GDN layers x (48*128*128 fp32 state + 3*10240 bf16 window), 16
    attention layers x 2 x 4 heads x 256 bf16 per token, 5 drafter layers x 2 x 8 x 128 bf16 per token."""
    from dflash_trt.builder.checkpoints import parse_drafter_config
    from dflash_trt.builder.cli import main as dflash_build
    from dflash_trt.builder.plan import memory_plan, target_parameters

    target = parse_target_config(read_config_json(FIXTURES / "target"))
    drafter = parse_drafter_config(read_config_json(FIXTURES / "drafter"))
    plan = memory_plan(target, drafter, "bfloat16", 32768, 16)
    assert plan.recurrent_bytes_per_sequence == 48 * (48 * 128 * 128 * 4 + 3 * 10240 * 2)  # 146.8 MiB
    assert plan.kv_bytes_per_token == 16 * 2 * 4 * 256 * 2 and plan.draft_bytes_per_token == 5 * 2 * 8 * 128 * 2
    assert 26e9 < target_parameters(target) < 28e9  # "27B": the language model without vision tower and MTP head
    assert plan.sequences_that_fit(141 * 10**9) == (141 * 10**9 - plan.weight_bytes) // plan.bytes_per_sequence
    command = ["--model", str(FIXTURES / "target"), "--drafter", str(FIXTURES / "drafter"), "--plan", "--gpu-memory", "141GB"]
    assert dflash_build([*command, "--max-seq-len", "32768"]) == 0
    printed = capsys.readouterr().out
    assert "recurrent state per sequence            146.8 MiB" in printed and "in 131.3 GiB  28 " in printed


def test_alias_offline_without_checkpoints_is_refused_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    began = time.perf_counter()
    output = tmp_path / "repo"
    command = [sys.executable, "-m", "dflash_trt.builder.cli", "--model", "qwen3.5-27b", "--output", str(output)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert done.returncode == 2, done.stderr
    assert "Qwen/Qwen3.5-27B and z-lab/Qwen3.5-27B-DFlash" in done.stderr
    assert "--model TARGET_DIR --drafter DRAFTER_DIR" in done.stderr
    assert not output.exists() and time.perf_counter() - began < 60


@pytest.fixture(scope="module")
def qwen35_repo(qwen35_dir: Path, random_drafter: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """dflash-build (ONNX Runtime) of the tiny qwen3_5 pair, raw prompts (the tiny tokenizer has no chat template)."""
    from dflash_trt.builder.cli import main as dflash_build

    output = tmp_path_factory.mktemp("qwen35-repo") / "repo"
    command = ["--model", str(qwen35_dir), "--drafter", str(random_drafter), "--output", str(output)]
    assert dflash_build([*command, "--max-seq-len", "128", "--max-batch-size", "4"]) == 0
    return output


def test_hybrid_graphs_are_ready_for_tensorrt(qwen35_repo: Path, tmp_path: Path) -> None:
    """What a TensorRT build of a hybrid pair needs and can be checked without TensorRT: with the dflash function
    bodies stripped (GatedDeltaRule's Scan and CausalConv1d's Conv with them), every operator is one TensorRT's
    ONNX parser has, the dflash nodes are the four plugins, and the optimization profile bounds every input, the
    recurrent state pools at layers x slots."""
    from dflash_trt.builder.tensorrt_engine import input_dims, plugin_ready_onnx
    from dflash_trt.runtime.repository import load_engine

    from tests.test_build import TENSORRT_OPS

    spec = load_engine(qwen35_repo)[0].spec
    engine_dir = qwen35_repo / "dflash" / "1" / "engine"
    for name in GRAPH_NAMES:
        stripped = tmp_path / f"{name}.plugins.onnx"
        plugin_ready_onnx(engine_dir / f"{name}.onnx", stripped)
        model = onnx.load(str(stripped), load_external_data=False)
        nodes = all_nodes(model.graph)
        standard = {n.op_type for n in nodes if n.domain in ("", "ai.onnx")}
        assert standard <= TENSORRT_OPS, f"{name}: operators TensorRT's parser lacks: {standard - TENSORRT_OPS}"
        custom = {n.op_type for n in nodes if n.domain == DOMAIN}
        assert (
            {"GatedDeltaRule", "CausalConv1d"} <= custom <= {"HiddenStateTap", "BlockDenoise", "GatedDeltaRule", "CausalConv1d"}
        )
        assert not [f.name for f in model.functions if f.domain == DOMAIN], "the plugins' bodies are stripped"
        dims = input_dims(name, spec)
        assert [i.name for i in model.graph.input] == list(dims)
        for state in spec.states:
            if state.name in dims and state.kind == "recurrent":
                assert dims[state.name][0] == (state.layers * spec.max_batch_size,) * 3, state.name
                assert [d[0] for d in dims[state.name][1:]] == list(state.shape)


@pytest.mark.slow
def test_onnxruntime_engine_and_dflash_serve_equal_transformers(
    qwen35_repo: Path, greedy: dict[tuple[int, ...], list[int]], tmp_path: Path
) -> None:
    """The exported graphs (dflash::GatedDeltaRule as an ONNX Scan, the rollback inside the step graph) in ONNX
    Runtime, in process and behind a real tritonserver: greedy output equals transformers' generate()."""
    from dflash_trt.client.triton_client import Request, stream_tokens
    from dflash_trt.runtime.repository import load_engine

    from tests.conftest import running_server

    engine, manifest = load_engine(qwen35_repo)
    assert [s["name"] for s in manifest["engine"]["states"]][-2:] == ["target_ssm", "target_conv"]
    assert manifest["target"]["not_built"] == ["visual.*"]  # the tiny checkpoint has a vision tower, no MTP head
    for prompt, expected in greedy.items():
        assert generate(engine, list(prompt), NEW_TOKENS).tokens == expected, prompt
    with running_server(qwen35_repo, tmp_path) as ports:
        for prompt, expected in list(greedy.items())[:5]:
            served = [t for r in stream_tokens(f"localhost:{ports.grpc}", list(prompt), Request(NEW_TOKENS)) for t in r["tokens"]]
            assert served == expected, prompt


def test_a_conversation_turn_continues_the_slots_recurrent_states(qwen35_repo: Path) -> None:
    """A hybrid target's recurrent states hold a slot's whole sequence: the next turn of a conversation (previous
    prompt + answer + new text) continues them and prefills only the new text, with the output of prefilling the
    whole conversation (ONNX Runtime); a head shared with another prompt alone is not reused (the states hold
    more than it), and a prefill from a position the states do not end at is refused."""
    from dflash_trt.runtime.repository import load_engine

    engine, _ = load_engine(qwen35_repo)
    prompt = _prompts(PROMPTS)[0]
    answer = generate(engine, prompt, 24).tokens
    follow_up = prompt + answer + [7, 8, 9]
    turn = generate(engine, follow_up, 24)
    assert len(prompt) + len(answer) - 1 <= turn.stats.reused_prompt_tokens <= len(prompt) + len(answer)
    head_only = prompt + [11, 12]
    other = generate(engine, head_only, 24)
    assert other.stats.reused_prompt_tokens == 0
    engine.reuse_prefixes = False
    assert generate(engine, follow_up, 24).tokens == turn.tokens
    assert generate(engine, head_only, 24).tokens == other.tokens
    slot = engine.pool.acquire()
    try:
        engine.prefill([PrefillRow(slot, head_only, 0.0, SamplingParams())])
        with pytest.raises(ValueError, match=rf"start=2: slot {slot}'s recurrent states have taken in {len(head_only)} "):
            engine.prefill([PrefillRow(slot, head_only[2:], 0.0, SamplingParams(), start=2)])
    finally:
        engine.pool.release(slot)


def test_a_drafter_for_another_hidden_size_is_refused(qwen35_dir: Path, tmp_path: Path) -> None:
    from dflash_trt.builder.checkpoints import check_pair, parse_drafter_config

    raw = json.loads((FIXTURES / "drafter" / "config.json").read_text())
    with pytest.raises(CheckpointError, match="drafter hidden_size 5120 != target hidden_size 64"):
        check_pair(parse_target_config(read_config_json(qwen35_dir)), parse_drafter_config(raw))


def test_training_generation_on_a_hybrid_target_equals_transformers(
    qwen35_dir: Path, greedy: dict[tuple[int, ...], list[int]]
) -> None:
    """dflash-train's batched response generation carries the Gated DeltaNet state token to token."""
    from dflash_trt.builder.training import generate_responses

    prompts = [list(p) for p in list(greedy)[:6]]
    responses = generate_responses(load_target(qwen35_dir, dtype=torch.float32), prompts, 16, temperature=0.0)
    for prompt, response in zip(prompts, responses, strict=True):
        assert response[len(prompt) :].tolist() == greedy[tuple(prompt)][:16]


def _teacher_forced_logits(engine: GraphEngine, prompt: list[int], expected: list[int]) -> dict[int, torch.Tensor]:
    """The target's logits at every position of prompt + expected, each recorded from a verify block whose inputs
    up to that slot are the text's own tokens (so it is the target's prediction given the text)."""
    graphs = engine.runner.graphs  # type: ignore[attr-defined]
    text = [*prompt, *expected]
    recorded: dict[int, torch.Tensor] = {}
    forward = graphs.target.forward

    def recording(input_ids, positions, past, logits_to_keep=0, recurrent=None):  # noqa: ANN001, ANN202
        out = forward(input_ids, positions, past, logits_to_keep, recurrent)
        if not logits_to_keep:  # verify blocks (prefill keeps only its last logits)
            inside = [int(p) for p in positions[0] if p < len(text)]
            for slot in range(len(inside)):
                if all(int(input_ids[0, i]) == text[inside[i]] for i in range(slot + 1)):
                    recorded[int(positions[0, slot])] = out.logits[0, slot].clone()
        return out

    graphs.target.forward = recording
    OracleGraphs.reference = text
    assert generate(engine, prompt, NEW_TOKENS).tokens == expected or not graphs.rollback
    return recorded


def test_teacher_forced_logits_do_not_depend_on_the_rejection_pattern(
    qwen35_dir: Path, random_drafter: Path, greedy: dict[tuple[int, ...], list[int]]
) -> None:
    """z-lab/dflash #172's check: along one fixed text, the target's logits do not depend on which drafts were
    rejected before, up to rounding; keeping the state of the whole block (no rollback) moves them far more.

    Not bit-equal: a position's logits come from blocks of different widths under the two patterns, and CPU GEMMs
    round a row differently with the number of rows (batch-shape non-invariance, also of transformers itself), so
    the Gated DeltaNet inputs of a token differ in the last bits; the recurrence and the rollback themselves are
    bit-exact (test_masked_commit_equals_the_truncated_recurrence)."""
    prompt, expected = next(iter(greedy.items()))
    patterns = []
    for stride, offset in ((1, 0), (7, 3)):
        OracleGraphs.stride, OracleGraphs.offset, OracleGraphs.schedule = stride, offset, 0
        patterns.append(_teacher_forced_logits(_oracle_engine(qwen35_dir, random_drafter, True), list(prompt), expected))
    OracleGraphs.stride, OracleGraphs.offset, OracleGraphs.schedule = 7, 3, 0
    contaminated = _teacher_forced_logits(_oracle_engine(qwen35_dir, random_drafter, False), list(prompt), expected)
    OracleGraphs.stride, OracleGraphs.offset = 1, 0
    shared = sorted(set(patterns[0]) & set(patterns[1]))
    assert len(shared) >= NEW_TOKENS - 1
    rounding = max(float((patterns[0][p] - patterns[1][p]).abs().max()) for p in shared)
    assert rounding < 1e-5, rounding
    worst = max(float((contaminated[p] - patterns[0][p]).abs().max()) for p in set(contaminated) & set(patterns[0]))
    assert worst > 1000 * max(rounding, 1e-7), (worst, rounding)


def test_max_seq_len_defaults_to_what_the_target_supports(qwen35_dir: Path, random_drafter: Path, capsys) -> None:  # noqa: ANN001
    from dflash_trt.builder.cli import main as dflash_build

    assert dflash_build(["--model", str(qwen35_dir), "--drafter", str(random_drafter), "--plan"]) == 0
    assert "--max-seq-len 496" in capsys.readouterr().err  # 512 positions, less one block of 16
