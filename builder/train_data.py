"""Training prompt sets, disjoint from HumanEval and MT-Bench.

- "code": each public, documented function of a set of standard modules becomes "write this function" from its
  signature and the first paragraph of its docstring, plus a fixed list of generic programming instructions.
- "code-methods": the same for the methods that the public classes of those modules define ("write the method
  `limit_denominator` of a class `Fraction`"): more code tasks of the same kind, none of them in "code".
- "code-puzzles": small self-written programming puzzles in HumanEval's shape (a stub whose docstring states the
  task and shows `>>>` examples), each also as a one-line instruction: see train_puzzles.
- "code-puzzles-2": more puzzles of that kind in other shapes (lists of strings, a list with a limit, lists of
  floats, dictionaries, sorting by a key, more rules over numbers and characters), none of them in "code-puzzles".
- "code-puzzles-3": more again (two texts, two numbers, a number as text, a grid of numbers, whole-text rewrites,
  more rules over the kinds of numbers, strings and characters), none of them in the two sets before.
- "code-puzzles-4": more again (a text and a piece of text, a list of strings and a piece, running values, strings
  of bits, numbers written in a text, a pair of results, a stub after a finished helper, more rules over the kinds
  of numbers, characters, words and strings), none of them in the three sets before.
- "code-puzzles-5": more again (name-and-score pairs, a list and a step k, times of day, a text and a width, a text
  and a character, two lists of strings, more rules over one whole number and over the kinds of numbers, characters,
  words and strings), none of them in the four sets before.
- "code-puzzles-6": more again (a dictionary of counts, points in the plane, more grid rules, checks of a text's
  form, durations, sums of money, pieces picked out of a text, a list of words, more rules over the kinds of numbers,
  characters and words), none of them in the five sets before.
- "prose": everyday writing and explaining tasks (templates x topics), so the drafter also learns to follow the
  target through prose, lists and its own repetitions, not only code.

Corpora are real text the target reads (teacher-forced) instead of answering: a forward over a window is far
cheaper than generating as many tokens, and training follows the target's greedy predictions in it.
- "stdlib-source": the source of the running Python's top-level standard-library modules (code, docstrings and
  comments), in file-name order.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.builder.train_puzzles import (
    Puzzle,
    all_puzzles,
    fifth_puzzles,
    fourth_puzzles,
    more_puzzles,
    sixth_puzzles,
    third_puzzles,
)
from transformers import PreTrainedTokenizerBase

STDLIB_MODULES = (
    "bisect", "calendar", "colorsys", "difflib", "fnmatch", "fractions", "functools", "glob", "hashlib", "heapq",
    "html", "itertools", "json", "keyword", "math", "operator", "os.path", "pathlib", "pprint", "random", "re",
    "shlex", "shutil", "statistics", "string", "textwrap", "urllib.parse", "uuid", "zlib", "base64", "binascii",
    "collections", "copy", "csv", "datetime", "decimal", "ipaddress", "locale", "posixpath", "secrets", "struct",
)  # fmt: skip
GENERIC_INSTRUCTIONS = (
    "Explain what a Python generator is, with a short example.",
    "Write a Python function that counts the words in a text file.",
    "What is the difference between a process and a thread?",
    "Write a Python function that flattens a nested list.",
    "Give a short example of reading a CSV file with the csv module.",
    "Write a Python function that removes duplicate items from a list while keeping their order.",
    "Explain list comprehensions in Python with two examples.",
    "Write a Python function that converts a Roman numeral to an integer.",
    "Write a Python function that checks whether two strings are anagrams.",
    "Explain the difference between == and is in Python.",
    "Write a Python function that returns the most common character in a string.",
    "Write a Python class that represents a 2D vector with addition and length.",
    "Write a Python function that computes the running average of a list of numbers.",
    "Describe how a hash table works in a few sentences.",
    "Write a Python function that splits a list into chunks of size n.",
    "Write a Python function that validates an email address with a regular expression.",
)  # fmt: skip


PROSE_TEMPLATES = (
    "Write a short story about {topic}.",
    "Explain {topic} to a ten-year-old.",
    "Write a blog post about {topic}.",
    "Give five practical tips about {topic}.",
    "Write a poem about {topic}.",
    "What are the advantages and disadvantages of {topic}?",
    "Write a persuasive paragraph about {topic}.",
    "Summarize the history of {topic} in a few paragraphs.",
    "Write an email to a friend about {topic}.",
    "Write a list of interesting facts about {topic}.",
)  # fmt: skip
PROSE_TOPICS = (
    "the water cycle", "learning a new language", "public libraries", "electric cars", "baking bread", "volcanoes",
    "working from home", "honeybees", "the first moon landing", "chess", "recycling", "sleep", "coffee",
    "the printing press", "rainforests", "saving money", "video games", "the human heart", "photosynthesis", "trains",
    "jazz music", "the Roman Empire", "social media", "space exploration", "a healthy breakfast", "city parks",
    "the internet", "friendship", "mountains", "ocean tides", "solar power", "dinosaurs", "gardening",
    "running a marathon", "robots", "museums", "the four seasons", "bicycles", "board games", "owls",
)  # fmt: skip


CODE_TASK = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{stub}\n```"


@dataclass(frozen=True)
class Documented:
    """A public routine's signature (stable text), one-line summary and docstring (first two paragraphs)."""

    signature: str
    summary: str
    docstring: str

    def stub(self, name: str, indent: str = "") -> str:
        """`def name(signature):` with the docstring, indented by `indent` (a method's stub sits in its class)."""
        docstring = self.docstring.replace("\n", "\n    " + indent)
        return f'{indent}def {name}{self.signature}:\n{indent}    """{docstring}\n{indent}    """\n'


def documented(name: str, routine: object) -> Documented | None:
    """What the prompts need of a routine, or None where it is private, undocumented, briefly documented (a summary
    under 20 characters) or has no signature."""
    doc = inspect.getdoc(routine)
    if not doc or name.startswith("_"):
        return None
    try:
        signature = stable_signature(routine)
    except (TypeError, ValueError):
        return None
    paragraphs = doc.split("\n\n")
    summary = paragraphs[0].replace("\n", " ").strip()
    if len(summary) < 20:
        return None
    return Documented(signature, summary, "\n\n".join(paragraphs[:2]).replace('"""', "'''"))


def _function_prompts(name: str, function: object) -> list[str]:
    """Two prompts per documented public function: a one-line instruction, and a stub with its docstring as a
    code task (the z-lab benchmark's user-turn wording around standard-library content)."""
    doc = documented(name, function)
    if doc is None:
        return []
    return [f"Write a Python function `{name}{doc.signature}`: {doc.summary}", CODE_TASK.format(stub=doc.stub(name))]


def _method_prompts(class_name: str, name: str, method: object) -> list[str]:
    """Two prompts per documented public method, as `_function_prompts` words them, the stub inside its class."""
    doc = documented(name, method)
    if doc is None:
        return []
    stub = f"class {class_name}:\n" + doc.stub(name, indent="    ")
    instruction = f"Write the method `{name}{doc.signature}` of a Python class `{class_name}`: {doc.summary}"
    return [instruction, CODE_TASK.format(stub=stub)]


_OBJECT_REPR = re.compile(r"<(?:function|built-in method|built-in function|bound method) ([\w.]+)[^<>]* at 0x[0-9a-fA-F]+>")
_ANY_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+>")


def stable_signature(function: object) -> str:
    """The signature as text, with default values that are functions named instead of shown with their memory
    address (`copy_function=<function copy2 at 0x7f...>` -> `copy_function=copy2`): addresses change from process to
    process, and the prompts, hence the training data, must not."""
    signature = str(inspect.signature(function))  # type: ignore[arg-type]
    return _ANY_ADDRESS.sub(">", _OBJECT_REPR.sub(r"\1", signature))


def code_prompts() -> list[str]:
    """Deterministic list of prompts (module order, then name order), generic instructions first."""
    prompts = list(GENERIC_INSTRUCTIONS)
    for module_name in STDLIB_MODULES:
        module = importlib.import_module(module_name)
        for name, member in sorted(vars(module).items()):
            if inspect.isfunction(member) or inspect.isbuiltin(member):
                prompts.extend(p for p in _function_prompts(name, member) if p not in prompts)
    return prompts


def code_method_prompts() -> list[str]:
    """Deterministic list of prompts for the methods that the public classes of STDLIB_MODULES define themselves
    (module order, then class and method name order): more code tasks of the same kind, none the "code" set has."""
    prompts: list[str] = []
    for module_name in STDLIB_MODULES:
        module = importlib.import_module(module_name)
        for class_name, cls in sorted(vars(module).items()):
            if not inspect.isclass(cls) or class_name.startswith("_") or cls.__module__ != module.__name__:
                continue
            for name, member in sorted(vars(cls).items()):
                if inspect.isroutine(member):
                    prompts.extend(p for p in _method_prompts(class_name, name, member) if p not in prompts)
    return prompts


def puzzle_prompts(puzzles: list[Puzzle] | None = None) -> list[str]:
    """Deterministic list: every puzzle's stub as a code task, then every puzzle as an instruction (grammar order);
    the "code-puzzles" set's puzzles by default."""
    puzzles = all_puzzles() if puzzles is None else puzzles
    return [CODE_TASK.format(stub=puzzle.stub().strip()) for puzzle in puzzles] + [puzzle.instruction() for puzzle in puzzles]


def more_puzzle_prompts() -> list[str]:
    """The "code-puzzles-2" set's prompts, as puzzle_prompts makes them."""
    return puzzle_prompts(more_puzzles())


def third_puzzle_prompts() -> list[str]:
    """The "code-puzzles-3" set's prompts, as puzzle_prompts makes them."""
    return puzzle_prompts(third_puzzles())


def fourth_puzzle_prompts() -> list[str]:
    """The "code-puzzles-4" set's prompts, as puzzle_prompts makes them."""
    return puzzle_prompts(fourth_puzzles())


def fifth_puzzle_prompts() -> list[str]:
    """The "code-puzzles-5" set's prompts, as puzzle_prompts makes them."""
    return puzzle_prompts(fifth_puzzles())


def sixth_puzzle_prompts() -> list[str]:
    """The "code-puzzles-6" set's prompts, as puzzle_prompts makes them."""
    return puzzle_prompts(sixth_puzzles())


def prose_prompts() -> list[str]:
    """Every template with every topic, topic-major (deterministic)."""
    return [template.format(topic=topic) for topic in PROSE_TOPICS for template in PROSE_TEMPLATES]


PROMPT_SETS: dict[str, Callable[[], list[str]]] = {
    "code": code_prompts, "code-methods": code_method_prompts, "code-puzzles": puzzle_prompts,
    "code-puzzles-2": more_puzzle_prompts, "code-puzzles-3": third_puzzle_prompts, "code-puzzles-4": fourth_puzzle_prompts,
    "code-puzzles-5": fifth_puzzle_prompts, "code-puzzles-6": sixth_puzzle_prompts, "prose": prose_prompts,
}  # fmt: skip


def stdlib_source_texts() -> list[str]:
    """The source of every top-level module of this Python's standard library, sorted by file name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [path.read_text(encoding="utf-8", errors="replace") for path in sorted(root.glob("*.py"))]


CORPORA: dict[str, Callable[[], list[str]]] = {"stdlib-source": stdlib_source_texts}


def corpus_windows(tokenizer: PreTrainedTokenizerBase, texts: list[str], window: int, budget: int) -> list[list[int]]:
    """Whole windows of `window` tokens (no special tokens) cut from each text, taken round-robin over the texts
    (every text's first window, then every text's second, ...) until `budget` tokens are taken: a budget smaller
    than the corpus still draws from all of it. Deterministic for the same texts and tokenizer."""
    per_text = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        per_text.append([ids[start : start + window] for start in range(0, len(ids) - window + 1, window)])
    windows: list[list[int]] = []
    for index in range(max((len(w) for w in per_text), default=0)):
        for text_windows in per_text:
            if index < len(text_windows) and (len(windows) + 1) * window <= budget:
                windows.append(text_windows[index])
    return windows
