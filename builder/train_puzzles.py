"""The "code-puzzles" prompt set: small self-written programming puzzles in the shape of a function stub whose
docstring states the task and shows `>>>` examples (the shape of HumanEval's problems, none of its problems: no
function name is one of HumanEval's entry points, and a test checks that).

Each puzzle is one rule from a small grammar (a predicate x an operation over a list of integers, a class of
characters x an operation over a string, a kind of word x an operation over a sentence, and short lists of digit,
pairwise and sequence rules); its examples are computed by running the rule's reference implementation, so every
example in a prompt is right. `train_data.puzzle_prompts` turns every puzzle into two prompts: the stub as a code
task (the benchmark's wording) and a one-line instruction.
"""

from __future__ import annotations

import inspect
import itertools
import math
import operator
import os
import re
import string
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
IntTest = Callable[[int], bool]
StrTest = Callable[[str], bool]


@dataclass(frozen=True)
class Puzzle:
    name: str
    signature: str  # "(numbers: List[int]) -> int"
    task: str  # one sentence, the docstring's first line(s)
    solve: Callable[..., object]
    examples: tuple[tuple[object, ...], ...]  # argument tuples shown as `>>>` lines with solve's results
    helper: str = ""  # a finished function the stub follows (its source), as some HumanEval prompts have

    def stub(self) -> str:
        """`def name(signature):` with the task wrapped at 76 columns and the examples, after typing imports and the
        helper."""
        names = [n for n in ("Dict", "List", "Optional", "Tuple") if f"{n}[" in self.signature + self.helper]
        header = f"from typing import {', '.join(names)}\n\n\n" if names else ""
        header += f"{self.helper.strip()}\n\n\n" if self.helper else ""
        task = textwrap.fill(self.task, 76, initial_indent="    ", subsequent_indent="    ").lstrip()
        lines = [f"def {self.name}{self.signature}:", f'    """ {task}']
        for arguments in self.examples:
            lines += [f"    >>> {self.name}({', '.join(map(repr, arguments))})", f"    {self.solve(*arguments)!r}"]
        return header + "\n".join([*lines, '    """']) + "\n"

    def instruction(self) -> str:
        """The same puzzle as a one-line request without examples (and the helper after it, if it has one)."""
        parameters = self.signature.split(" -> ")[0]
        request = f"Write a Python function `{self.name}{parameters}`. {self.task}"
        return f"{request} The helper:\n```python\n{self.helper.strip()}\n```" if self.helper else request


def _with_test(rule: Callable[[Any, Any], object], test: Callable[[Any], bool]) -> Callable[[Any], object]:
    """rule(value, test) as a function of the value alone."""
    return lambda value: rule(value, test)


Rule = tuple[str, str, str, Callable[[Any, Any], object]]  # (name, return type, task, rule(value, test))


def _kinds_by_rules(
    kinds: list[tuple[dict[str, str], Callable[[Any], bool]]],
    rules: tuple[Rule, ...],
    parameter: str,
    shown: Callable[[str], tuple[object, ...]],
    preamble: str = "",
) -> list[Puzzle]:
    """Every rule over every kind (kind-major): name and task filled from the kind's words, one `>>>` example per
    value that `shown` gives for the rule's return type, the task after `preamble`."""
    puzzles = []
    for words, test in kinds:
        for name, returns, task, rule in rules:
            examples = tuple((value,) for value in shown(returns))
            signature = f"({parameter}) -> {returns}"
            puzzles.append(
                Puzzle(name.format(**words), signature, preamble + task.format(**words), _with_test(rule, test), examples)
            )
    return puzzles


def _one_rule_each(
    rules: tuple[tuple[str, str, str, Callable[..., object]], ...],
    parameters: str,
    examples: tuple[tuple[object, ...], ...],
    preamble: str = "",
    helper: str = "",
) -> list[Puzzle]:
    """A puzzle per rule: `def name(parameters) -> returns`, the task after `preamble`, the same examples for all,
    the stub after `helper`."""
    return [
        Puzzle(name, f"({parameters}) -> {returns}", preamble + task, solve, examples, helper)
        for name, returns, task, solve in rules
    ]


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1))


# (name part, plural noun, "is ..." phrase, test)
NUMBER_KINDS: tuple[tuple[str, str, str, IntTest], ...] = (
    ("even", "even numbers", "even", lambda x: x % 2 == 0),
    ("odd", "odd numbers", "odd", lambda x: x % 2 == 1),
    ("positive", "positive numbers", "positive", lambda x: x > 0),
    ("negative", "negative numbers", "negative", lambda x: x < 0),
    ("big", "numbers greater than ten", "greater than ten", lambda x: x > 10),
    ("triple", "multiples of three", "divisible by three", lambda x: x % 3 == 0),
    ("one_digit", "single-digit numbers", "between -9 and 9", lambda x: -9 <= x <= 9),
    ("square", "perfect squares", "a perfect square", lambda x: x >= 0 and math.isqrt(x) ** 2 == x),
    ("prime", "prime numbers", "a prime number", _is_prime),
)
NUMBER_LISTS: tuple[list[int], ...] = ([3, 8, -2, 15, 9, 4, 12], [7, 1, 25, -6, 11], [])


# (name, return type, task; {part}, {plural}, {phrase} filled from NUMBER_KINDS, rule(numbers, test))
NUMBER_RULES: tuple[tuple[str, str, str, Callable[[list[int], IntTest], object]], ...] = (
    ("sum_of_{part}", "int", "Return the sum of the {plural} in the list.", lambda n, t: sum(x for x in n if t(x))),
    ("product_of_{part}", "int", "Return the product of the {plural} in the list (1 if there are none).",
     lambda n, t: math.prod(x for x in n if t(x))),
    ("how_many_{part}", "int", "Return how many numbers in the list are {phrase}.", lambda n, t: sum(map(t, n))),
    ("keep_{part}", "List[int]", "Return the {plural} of the list, in their original order.",
     lambda n, t: [x for x in n if t(x)]),
    ("drop_{part}", "List[int]", "Return the list without its {plural}, keeping the order of the others.",
     lambda n, t: [x for x in n if not t(x)]),
    ("largest_{part}", "Optional[int]", "Return the largest of the {plural} in the list, or None if there is none.",
     lambda n, t: max((x for x in n if t(x)), default=None)),
    ("smallest_{part}", "Optional[int]", "Return the smallest of the {plural} in the list, or None if there is none.",
     lambda n, t: min((x for x in n if t(x)), default=None)),
    ("first_{part}_index", "int", "Return the index of the first number in the list that is {phrase}, "
     "or -1 if there is none.", lambda n, t: next((i for i, x in enumerate(n) if t(x)), -1)),
    ("all_{part}", "bool", "Return True if every number in the list is {phrase}, and False otherwise.",
     lambda n, t: all(map(t, n))),
    ("any_{part}", "bool", "Return True if at least one number in the list is {phrase}, and False otherwise.",
     lambda n, t: any(map(t, n))),
    ("squares_of_{part}", "List[int]", "Return the squares of the {plural} in the list, in their original order.",
     lambda n, t: [x * x for x in n if t(x)]),
)  # fmt: skip


def _number_puzzles(rules: tuple[Rule, ...] = NUMBER_RULES) -> list[Puzzle]:
    kinds = [({"part": part, "plural": plural, "phrase": phrase}, test) for part, plural, phrase, test in NUMBER_KINDS]
    return _kinds_by_rules(kinds, rules, "numbers: List[int]", _number_lists_shown)


def _number_lists_shown(returns: str) -> tuple[list[int], ...]:
    """The empty list only where the answer is a list."""
    return NUMBER_LISTS if "List" in returns else NUMBER_LISTS[:2]


# (name part, noun for one, plural noun, test)
CHARACTER_CLASSES: tuple[tuple[str, str, str, StrTest], ...] = (
    ("vowel", "a vowel", "vowels", lambda c: c in "aeiouAEIOU"),
    ("consonant", "a consonant", "consonants", lambda c: c.isalpha() and c not in "aeiouAEIOU"),
    ("digit", "a digit", "digits", str.isdigit),
    ("capital", "an uppercase letter", "uppercase letters", str.isupper),
    ("small_letter", "a lowercase letter", "lowercase letters", str.islower),
    ("blank", "a space", "spaces", lambda c: c == " "),
    ("punctuation", "a punctuation mark", "punctuation marks", lambda c: c in string.punctuation),
)
TEXTS = ("Hello World, 42 apples!", "Python 3.11 is FAST", "abc")


# (name, return type, task; {part}, {one}, {plural} filled from CHARACTER_CLASSES, rule(text, test))
TEXT_RULES: tuple[tuple[str, str, str, Callable[[str, StrTest], object]], ...] = (
    ("number_of_{part}s", "int", "Return how many characters of the text are {plural}.", lambda s, t: sum(map(t, s))),
    ("strip_{part}s", "str", "Return the text with its {plural} taken out.", lambda s, t: "".join(c for c in s if not t(c))),
    ("only_{part}s", "str", "Return only the {plural} of the text, in the order they appear.",
     lambda s, t: "".join(c for c in s if t(c))),
    ("hide_{part}s", "str", "Return the text with each character that is {one} replaced by '*'.",
     lambda s, t: "".join("*" if t(c) else c for c in s)),
    ("{part}_positions", "List[int]", "Return the indices of the characters of the text that are {plural}.",
     lambda s, t: [i for i, c in enumerate(s) if t(c)]),
    ("first_{part}", "int", "Return the index of the first character of the text that is {one}, "
     "or -1 if there is none.", lambda s, t: next((i for i, c in enumerate(s) if t(c)), -1)),
    ("has_{part}", "bool", "Return True if the text contains {one}, and False otherwise.", lambda s, t: any(map(t, s))),
    ("every_char_{part}", "bool", "Return True if the text is not empty and every character of it is {one}.",
     lambda s, t: bool(s) and all(map(t, s))),
)  # fmt: skip


def _text_puzzles(rules: tuple[Rule, ...] = TEXT_RULES) -> list[Puzzle]:
    kinds = [({"part": part, "one": one, "plural": plural}, test) for part, one, plural, test in CHARACTER_CLASSES]
    return _kinds_by_rules(kinds, rules, "text: str", lambda returns: TEXTS)


# (name part, description, test)
WORD_KINDS: tuple[tuple[str, str, StrTest], ...] = (
    ("long_words", "words longer than four letters", lambda w: len(w) > 4),
    ("short_words", "words of at most three letters", lambda w: len(w) <= 3),
    ("capitalized_words", "words that start with an uppercase letter", lambda w: w[:1].isupper()),
    ("vowel_words", "words that start with a vowel", lambda w: w[:1] != "" and w[:1].lower() in "aeiou"),
    ("mirror_words", "words that read the same backwards (ignoring case)", lambda w: w.lower() == w.lower()[::-1]),
)
SENTENCES = ("Anna saw an Owl eating bread at noon", "the quick brown Fox jumps over it", "")


SENTENCE_IS = "The sentence is made of words separated by single spaces. "
# (name, return type, task after SENTENCE_IS; {part}, {description} filled from WORD_KINDS, rule(sentence, test))
WORD_RULES: tuple[tuple[str, str, str, Callable[[str, StrTest], object]], ...] = (
    ("count_{part}", "int", "Return how many of them are {description}.", lambda s, t: sum(map(t, s.split()))),
    ("list_{part}", "List[str]", "Return the {description}, in the order they appear.",
     lambda s, t: [w for w in s.split() if t(w)]),
    ("without_{part}", "str", "Return the sentence without its {description}.",
     lambda s, t: " ".join(w for w in s.split() if not t(w))),
    ("shout_{part}", "str", "Return the sentence with its {description} in uppercase.",
     lambda s, t: " ".join(w.upper() if t(w) else w for w in s.split())),
    ("reverse_{part}", "str", "Return the sentence with the letters of its {description} reversed.",
     lambda s, t: " ".join(w[::-1] if t(w) else w for w in s.split())),
    ("longest_of_{part}", "str", "Return the longest of its {description} (the first one if there is a tie), or an "
     "empty string if there is none.", lambda s, t: max((w for w in s.split() if t(w)), key=len, default="")),
)  # fmt: skip


def _word_puzzles(rules: tuple[Rule, ...] = WORD_RULES) -> list[Puzzle]:
    kinds = [({"part": part, "description": description}, test) for part, description, test in WORD_KINDS]
    return _kinds_by_rules(kinds, rules, "sentence: str", lambda returns: SENTENCES, SENTENCE_IS)


def _collatz_steps(n: int) -> int:
    steps = 0
    while n != 1:
        n, steps = (n // 2 if n % 2 == 0 else 3 * n + 1), steps + 1
    return steps


def _digits(n: int) -> list[int]:
    return [int(d) for d in str(n)]


DIGIT_RULES: tuple[tuple[str, str, str, Callable[[int], object]], ...] = (
    ("sum_of_digits", "int", "Return the sum of the decimal digits of n.", lambda n: sum(_digits(n))),
    ("product_of_digits", "int", "Return the product of the decimal digits of n.", lambda n: math.prod(_digits(n))),
    ("even_digit_count", "int", "Return how many decimal digits of n are even.", lambda n: sum(d % 2 == 0 for d in _digits(n))),
    ("odd_digit_count", "int", "Return how many decimal digits of n are odd.", lambda n: sum(d % 2 for d in _digits(n))),
    ("largest_digit", "int", "Return the largest decimal digit of n.", lambda n: max(_digits(n))),
    ("smallest_digit", "int", "Return the smallest decimal digit of n.", lambda n: min(_digits(n))),
    ("reversed_number", "int", "Return the number whose decimal digits are those of n in reverse order.",
     lambda n: int(str(n)[::-1])),
    ("reads_same_backwards", "bool", "Return True if the decimal digits of n read the same backwards.",
     lambda n: str(n) == str(n)[::-1]),
    ("digit_count", "int", "Return how many decimal digits n has.", lambda n: len(str(n))),
    ("digits_ascending", "bool", "Return True if each decimal digit of n is at least the one before it.",
     lambda n: _digits(n) == sorted(_digits(n))),
    ("digit_root", "int", "Add up the decimal digits of n, then the digits of the result, and so on until one digit "
     "is left; return that digit.", lambda n: 0 if n == 0 else 1 + (n - 1) % 9),
)  # fmt: skip
PAIR_RULES: tuple[tuple[str, str, str, Callable[[list[int], list[int]], object]], ...] = (
    ("pairwise_sums", "List[int]", "Return the sums of the items at the same positions of the two lists (as long "
     "as the shorter list).", lambda a, b: [x + y for x, y in zip(a, b, strict=False)]),
    ("pairwise_products", "List[int]", "Return the products of the items at the same positions of the two lists "
     "(as long as the shorter list).", lambda a, b: [x * y for x, y in zip(a, b, strict=False)]),
    ("pairwise_larger", "List[int]", "Return the larger of the two items at each position of the two lists (as "
     "long as the shorter list).", lambda a, b: [max(x, y) for x, y in zip(a, b, strict=False)]),
    ("pairwise_gaps", "List[int]", "Return the absolute differences of the items at the same positions of the two "
     "lists (as long as the shorter list).", lambda a, b: [abs(x - y) for x, y in zip(a, b, strict=False)]),
    ("shared_items", "List[int]", "Return the numbers that appear in both lists, sorted, each once.",
     lambda a, b: sorted(set(a) & set(b))),
    ("items_only_in_first", "List[int]", "Return the numbers of the first list that the second list does not "
     "contain, in their original order.", lambda a, b: [x for x in a if x not in b]),
    ("merge_in_order", "List[int]", "Both lists are sorted. Return one sorted list with the items of both.",
     lambda a, b: sorted(a + b)),
    ("dot_product", "int", "Return the sum of the products of the items at the same positions of the two lists.",
     lambda a, b: sum(x * y for x, y in zip(a, b, strict=False))),
)  # fmt: skip
SEQUENCE_RULES: tuple[tuple[str, str, str, Callable[[int], object]], ...] = (
    ("first_squares", "List[int]", "Return the squares of 1, 2, ..., n.", lambda n: [i * i for i in range(1, n + 1)]),
    ("first_odd_numbers", "List[int]", "Return the first n odd positive numbers.", lambda n: [2 * i + 1 for i in range(n)]),
    ("triangular_numbers", "List[int]", "Return the first n triangular numbers (1, 3, 6, ...).",
     lambda n: [i * (i + 1) // 2 for i in range(1, n + 1)]),
    ("countdown", "List[int]", "Return the numbers from n down to 0.", lambda n: list(range(n, -1, -1))),
    ("powers_of_two_below", "List[int]", "Return the powers of two (1, 2, 4, ...) that are smaller than n.",
     lambda n: [1 << i for i in range(n.bit_length()) if 1 << i < n]),
    ("divisors_of", "List[int]", "Return the positive divisors of n in increasing order.",
     lambda n: [d for d in range(1, n + 1) if n % d == 0]),
    ("primes_up_to", "List[int]", "Return the prime numbers that are at most n.",
     lambda n: [p for p in range(n + 1) if _is_prime(p)]),
    ("collatz_steps", "int", "Return how many steps the Collatz rule (halve an even number, triple an odd one and "
     "add one) takes to bring n down to 1.", _collatz_steps),
    ("alternating_sum", "int", "Return 1 - 2 + 3 - 4 + ... with n terms.",
     lambda n: sum(i if i % 2 else -i for i in range(1, n + 1))),
    ("repeat_digits", "str", "Return the text made of each digit from 1 to n repeated as many times as its value "
     "(n is at most 9).", lambda n: "".join(str(i) * i for i in range(1, n + 1))),
)  # fmt: skip


def _single_rule_puzzles() -> list[Puzzle]:
    digit_examples, sequence_examples = ((1234,), (907,), (5,)), ((6,), (1,))
    pair_examples = (([1, 4, 6, 9], [2, 4, 5]), ([3, 3], [3]))
    return (
        _one_rule_each(DIGIT_RULES, "n: int", digit_examples)
        + _one_rule_each(PAIR_RULES, "first: List[int], second: List[int]", pair_examples)
        + _one_rule_each(SEQUENCE_RULES, "n: int", sequence_examples)
    )


def all_puzzles() -> list[Puzzle]:
    return _number_puzzles() + _text_puzzles() + _word_puzzles() + _single_rule_puzzles()


# The "code-puzzles-2" set: other shapes of the same kind of puzzle (lists of strings, a list with a limit, lists of
# floats, dictionaries, sorting by a key, more rules over numbers and characters), none of them in all_puzzles.

# (name part, plural noun, "is ..." phrase, test) over strings
STRING_KINDS: tuple[tuple[str, str, str, StrTest], ...] = (
    ("empty", "empty strings", "empty", lambda w: w == ""),
    ("long", "strings longer than three characters", "longer than three characters", lambda w: len(w) > 3),
    ("numeric", "strings made only of digits", "made only of digits", str.isdigit),
    ("shouted", "strings written in uppercase", "written in uppercase", str.isupper),
    ("a_initial", "strings that start with 'a'", "a string that starts with 'a'", lambda w: w.startswith("a")),
    ("spaced", "strings that contain a space", "a string that contains a space", lambda w: " " in w),
)
STRING_LISTS: tuple[list[str], ...] = (["apple", "", "42", "ZIP", "a b", "kiwi", "007"], ["avocado", "Fig", "", "TEA"], [])


# (name, return type, task; {part}, {plural}, {phrase} filled from STRING_KINDS, rule(strings, test))
STRING_RULES: tuple[tuple[str, str, str, Callable[[list[str], StrTest], object]], ...] = (
    ("count_{part}_strings", "int", "Return how many strings of the list are {phrase}.", lambda w, t: sum(map(t, w))),
    ("keep_{part}_strings", "List[str]", "Return the {plural} of the list, in their original order.",
     lambda w, t: [x for x in w if t(x)]),
    ("drop_{part}_strings", "List[str]", "Return the list without its {plural}, keeping the order of the others.",
     lambda w, t: [x for x in w if not t(x)]),
    ("join_{part}_strings", "str", "Return the {plural} of the list joined by commas, in their original order.",
     lambda w, t: ",".join(x for x in w if t(x))),
    ("first_{part}_string", "Optional[str]", "Return the first string of the list that is {phrase}, or None if "
     "there is none.", lambda w, t: next((x for x in w if t(x)), None)),
    ("length_of_{part}_strings", "int", "Return the total number of characters in the {plural} of the list.",
     lambda w, t: sum(len(x) for x in w if t(x))),
    ("mark_{part}_strings", "List[bool]", "Return, for each string of the list, True if it is {phrase} and False "
     "otherwise.", lambda w, t: [t(x) for x in w]),
)  # fmt: skip


def _string_list_puzzles(rules: tuple[Rule, ...] = STRING_RULES) -> list[Puzzle]:
    kinds = [({"part": part, "plural": plural, "phrase": phrase}, test) for part, plural, phrase, test in STRING_KINDS]
    return _kinds_by_rules(kinds, rules, "strings: List[str]", lambda returns: STRING_LISTS)


# More rules over NUMBER_KINDS (name, return type, task, rule(numbers, test))
MORE_NUMBER_RULES: tuple[tuple[str, str, str, Callable[[list[int], IntTest], object]], ...] = (
    ("double_the_{part}", "List[int]", "Return the list with each of its {plural} doubled and the other numbers "
     "unchanged.", lambda n, t: [2 * x if t(x) else x for x in n]),
    ("zero_out_{part}", "List[int]", "Return the list with each of its {plural} replaced by 0.",
     lambda n, t: [0 if t(x) else x for x in n]),
    ("last_{part}_index", "int", "Return the index of the last number in the list that is {phrase}, or -1 if "
     "there is none.", lambda n, t: max((i for i, x in enumerate(n) if t(x)), default=-1)),
    ("sorted_{part}", "List[int]", "Return the {plural} of the list sorted from smallest to largest.",
     lambda n, t: sorted(x for x in n if t(x))),
    ("average_of_{part}", "Optional[float]", "Return the average of the {plural} in the list, or None if there is "
     "none.", lambda n, t: (lambda kept: sum(kept) / len(kept) if kept else None)([x for x in n if t(x)])),
    ("split_by_{part}", "Tuple[List[int], List[int]]", "Return two lists: the {plural} of the list and the other "
     "numbers, each in their original order.", lambda n, t: ([x for x in n if t(x)], [x for x in n if not t(x)])),
)  # fmt: skip


def _longest_run(items: Iterable[T], test: Callable[[T], bool]) -> int:
    """The length of the longest stretch of consecutive items that pass `test`."""
    best = run = 0
    for item in items:
        run = run + 1 if test(item) else 0
        best = max(best, run)
    return best


# More rules over CHARACTER_CLASSES (name, return type, task, rule(text, test))
MORE_TEXT_RULES: tuple[tuple[str, str, str, Callable[[str, StrTest], object]], ...] = (
    ("last_{part}", "int", "Return the index of the last character of the text that is {one}, or -1 if there is "
     "none.", lambda s, t: max((i for i, c in enumerate(s) if t(c)), default=-1)),
    ("double_{part}s", "str", "Return the text with each character that is {one} written twice.",
     lambda s, t: "".join(c * 2 if t(c) else c for c in s)),
    ("longest_{part}_run", "int", "Return the length of the longest stretch of consecutive characters of the text "
     "that are {plural}.", _longest_run),
)  # fmt: skip


LIMIT_RULES: tuple[tuple[str, str, str, Callable[[list[int], int], object]], ...] = (
    ("count_above_limit", "int", "Return how many numbers in the list are greater than limit.",
     lambda n, k: sum(x > k for x in n)),
    ("keep_below_limit", "List[int]", "Return the numbers of the list that are smaller than limit, in their "
     "original order.", lambda n, k: [x for x in n if x < k]),
    ("clip_to_limit", "List[int]", "Return the list with every number greater than limit replaced by limit.",
     lambda n, k: [min(x, k) for x in n]),
    ("sum_above_limit", "int", "Return the sum of the numbers in the list that are greater than limit.",
     lambda n, k: sum(x for x in n if x > k)),
    ("first_index_over_limit", "int", "Return the index of the first number in the list that is greater than "
     "limit, or -1 if there is none.", lambda n, k: next((i for i, x in enumerate(n) if x > k), -1)),
    ("two_sum_to_limit", "bool", "Return True if two numbers at different positions of the list add up to limit, "
     "and False otherwise.", lambda n, k: any(n[i] + n[j] == k for i in range(len(n)) for j in range(i + 1, len(n)))),
    ("shift_by_limit", "List[int]", "Return the list with limit added to every number.", lambda n, k: [x + k for x in n]),
    ("multiples_of_limit", "List[int]", "Return the numbers of the list that are multiples of limit (limit is "
     "positive), in their original order.", lambda n, k: [x for x in n if x % k == 0]),
    ("closest_to_limit", "Optional[int]", "Return the number of the list closest to limit (the first one if there "
     "is a tie), or None if the list is empty.", lambda n, k: min(n, key=lambda x: abs(x - k), default=None)),
    ("chunks_of_limit", "List[List[int]]", "Split the list into pieces of limit numbers each (the last piece may "
     "be shorter) and return the pieces in order.", lambda n, k: [n[i : i + k] for i in range(0, len(n), k)]),
)  # fmt: skip
FLOAT_RULES: tuple[tuple[str, str, str, Callable[[list[float]], object]], ...] = (
    ("average_value", "float", "Return the average of the values (the list is not empty).", lambda v: sum(v) / len(v)),
    ("value_spread", "float", "Return the largest value minus the smallest one (the list is not empty).",
     lambda v: max(v) - min(v)),
    ("rounded_values", "List[float]", "Return the values rounded to one decimal place.",
     lambda v: [round(x, 1) for x in v]),
    ("running_totals", "List[float]", "Return the running totals of the values: the sum of the first one, the "
     "first two, and so on.", lambda v: [sum(v[: i + 1]) for i in range(len(v))]),
    ("neighbour_steps", "List[float]", "Return the difference between each value and the one before it.",
     lambda v: [b - a for a, b in zip(v, v[1:], strict=False)]),
    ("above_average_count", "int", "Return how many values are greater than the average of the values (the list is "
     "not empty).", lambda v: sum(x > sum(v) / len(v) for x in v)),
    ("whole_parts", "List[int]", "Return the whole part of each value (the value rounded towards zero).",
     lambda v: [int(x) for x in v]),
    ("halved_values", "List[float]", "Return each value divided by two.", lambda v: [x / 2 for x in v]),
)  # fmt: skip
DICT_RULES: tuple[tuple[str, str, str, Callable[[str], object]], ...] = (
    ("letter_tally", "Dict[str, int]", "Return a dictionary mapping each letter of the text to how many times it "
     "occurs (case-sensitive; other characters are ignored).",
     lambda s: {c: s.count(c) for c in dict.fromkeys(s) if c.isalpha()}),
    ("word_lengths", "Dict[str, int]", "The text is made of words separated by single spaces. Return a dictionary "
     "mapping each word to its length.", lambda s: {w: len(w) for w in s.split()}),
    ("words_by_initial", "Dict[str, List[str]]", "The text is made of words separated by single spaces. Return a "
     "dictionary mapping each first letter to the words that start with it, in order.",
     lambda s: {c: [w for w in s.split() if w[0] == c] for c in dict.fromkeys(w[0] for w in s.split())}),
    ("word_positions", "Dict[str, int]", "The text is made of words separated by single spaces. Return a "
     "dictionary mapping each word to the index of its first occurrence among the words.",
     lambda s: {w: s.split().index(w) for w in s.split()}),
    ("most_common_letter", "str", "Return the letter that occurs most often in the text (the one that occurs first "
     "if there is a tie), or an empty string if the text has no letter.",
     lambda s: max((c for c in dict.fromkeys(s) if c.isalpha()), key=s.count, default="")),
)  # fmt: skip
SORT_RULES: tuple[tuple[str, str, str, Callable[[list[Any]], object]], ...] = (
    ("order_by_length", "List[str]", "Return the words sorted from shortest to longest (words of the same length "
     "keep their order).", lambda w: sorted(w, key=len)),
    ("order_by_last_letter", "List[str]", "Return the words sorted by their last letter (the words are not empty; "
     "ties keep their order).", lambda w: sorted(w, key=lambda x: x[-1])),
    ("order_by_digit_sum", "List[int]", "Return the numbers sorted by the sum of the decimal digits of their "
     "absolute value, ties keeping their order.", lambda n: sorted(n, key=lambda x: sum(_digits(abs(x))))),
    ("order_by_distance_from_zero", "List[int]", "Return the numbers sorted by their absolute value, ties keeping "
     "their order.", lambda n: sorted(n, key=abs)),
    ("order_descending", "List[int]", "Return the numbers sorted from largest to smallest.",
     lambda n: sorted(n, reverse=True)),
    ("order_ignoring_case", "List[str]", "Return the words in alphabetical order, ignoring upper and lower case.",
     lambda w: sorted(w, key=str.lower)),
)  # fmt: skip


def _more_single_rule_puzzles() -> list[Puzzle]:
    limit_examples = (([4, 11, -3, 8, 15], 8), ([2, 6, 9], 3))
    float_examples = (([1.5, 2.25, 4.0, 0.75],), ([-2.5, 3.5],))
    dict_examples = (("banana bread",), ("to be or not",))
    sort_examples = {"str": ((["pear", "Fig", "banana", "kiwi"],), (["b", "Ab", "a"],)),
                     "int": (([31, 4, -12, 102, 7],), ([5, 50, 14],))}  # fmt: skip
    puzzles = _one_rule_each(LIMIT_RULES, "numbers: List[int], limit: int", limit_examples)
    puzzles += _one_rule_each(FLOAT_RULES, "values: List[float]", float_examples)
    puzzles += _one_rule_each(DICT_RULES, "text: str", dict_examples)
    for name, returns, task, solve in SORT_RULES:
        kind = returns[5:-1]  # "str" | "int"
        parameter = "words: List[str]" if kind == "str" else "numbers: List[int]"
        puzzles.append(Puzzle(name, f"({parameter}) -> {returns}", task, solve, sort_examples[kind]))
    return puzzles


def more_puzzles() -> list[Puzzle]:
    """The "code-puzzles-2" set: other shapes than all_puzzles', in grammar order."""
    return (
        _string_list_puzzles() + _number_puzzles(MORE_NUMBER_RULES) + _text_puzzles(MORE_TEXT_RULES) + _more_single_rule_puzzles()
    )


# The "code-puzzles-3" set: more shapes again (two texts, two numbers, a number as text, a grid of numbers, whole-text
# rewrites) and more rules over the kinds of numbers, strings and characters, none of them in the two sets above.

# More rules over STRING_KINDS (name, return type, task, rule(strings, test))
THIRD_STRING_RULES: tuple[tuple[str, str, str, Callable[[list[str], StrTest], object]], ...] = (
    ("last_{part}_string", "Optional[str]", "Return the last string of the list that is {phrase}, or None if there "
     "is none.", lambda w, t: next((x for x in reversed(w) if t(x)), None)),
    ("upper_{part}_strings", "List[str]", "Return the list with each string that is {phrase} in uppercase.",
     lambda w, t: [x.upper() if t(x) else x for x in w]),
    ("{part}_string_indices", "List[int]", "Return the index of each string of the list that is {phrase}.",
     lambda w, t: [i for i, x in enumerate(w) if t(x)]),
    ("every_string_{part}", "bool", "Return True if every string of the list is {phrase} (True for an empty list), "
     "and False otherwise.", lambda w, t: all(map(t, w))),
)  # fmt: skip
# More rules over NUMBER_KINDS (name, return type, task, rule(numbers, test))
THIRD_NUMBER_RULES: tuple[tuple[str, str, str, Callable[[list[int], IntTest], object]], ...] = (
    ("indices_of_{part}", "List[int]", "Return the indices of the numbers in the list that are {phrase}.",
     lambda n, t: [i for i, x in enumerate(n) if t(x)]),
    ("negate_{part}", "List[int]", "Return the list with the sign of each of its {plural} flipped.",
     lambda n, t: [-x if t(x) else x for x in n]),
    ("{part}_to_front", "List[int]", "Return the list with its {plural} moved to the front, both groups keeping "
     "their original order.", lambda n, t: [x for x in n if t(x)] + [x for x in n if not t(x)]),
    ("longest_{part}_streak", "int", "Return the length of the longest stretch of consecutive numbers in the list "
     "that are all {phrase}.", _longest_run),
)  # fmt: skip


def _split_where(text: str, test: StrTest) -> list[str]:
    """The pieces of `text` between the characters that pass `test`."""
    pieces = [""]
    for character in text:
        if test(character):
            pieces.append("")
        else:
            pieces[-1] += character
    return pieces


# More rules over CHARACTER_CLASSES (name, return type, task, rule(text, test))
THIRD_TEXT_RULES: tuple[tuple[str, str, str, Callable[[str, StrTest], object]], ...] = (
    ("upper_{part}s", "str", "Return the text with each character that is {one} in uppercase.",
     lambda s, t: "".join(c.upper() if t(c) else c for c in s)),
    ("{part}_share", "float", "Return the fraction of the characters of the text that are {plural} (0.0 for an "
     "empty text).", lambda s, t: sum(map(t, s)) / len(s) if s else 0.0),
    ("split_at_{part}s", "List[str]", "Split the text at each character that is {one} (which is left out) and "
     "return the pieces in order, empty ones included.", _split_where),
)  # fmt: skip


TWO_TEXT_RULES: tuple[tuple[str, str, str, Callable[[str, str], object]], ...] = (
    ("letters_in_both", "str", "Return the characters that occur in both texts, each once, in the order of their "
     "first occurrence in the first text.", lambda a, b: "".join(c for c in dict.fromkeys(a) if c in b)),
    ("are_anagrams", "bool", "Return True if the second text is made of exactly the characters of the first one, "
     "each as many times, and False otherwise.", lambda a, b: sorted(a) == sorted(b)),
    ("is_rotation_of", "bool", "Return True if the second text is the first one with some of its characters moved "
     "from its front to its end, and False otherwise.", lambda a, b: len(a) == len(b) and b in a + a),
    ("shared_prefix", "str", "Return the longest text that both texts start with.",
     lambda a, b: os.path.commonprefix([a, b])),
    ("differing_positions", "int", "Return at how many positions, up to the end of the shorter text, the two texts "
     "have different characters.", lambda a, b: sum(x != y for x, y in zip(a, b, strict=False))),
    ("interleave_texts", "str", "Return the characters of the two texts taken in turn, one from each, starting with "
     "the first text; what is left of the longer text comes at the end.",
     lambda a, b: "".join(x + y for x, y in zip(a, b, strict=False)) + a[len(b) :] + b[len(a) :]),
    ("drop_letters_of", "str", "Return the first text without the characters that occur in the second one.",
     lambda a, b: "".join(c for c in a if c not in b)),
    ("ends_with_other", "bool", "Return True if the first text ends with the second one, ignoring upper and lower "
     "case, and False otherwise.", lambda a, b: a.lower().endswith(b.lower())),
    ("longer_text", "str", "Return the longer of the two texts (the first one if they are equally long).",
     lambda a, b: b if len(b) > len(a) else a),
)  # fmt: skip
TWO_NUMBER_RULES: tuple[tuple[str, str, str, Callable[[int, int], object]], ...] = (
    ("common_divisor_count", "int", "Return how many positive numbers divide both a and b.",
     lambda a, b: sum(a % d == 0 and b % d == 0 for d in range(1, min(a, b) + 1))),
    ("least_common_multiple", "int", "Return the smallest positive number that both a and b divide.", math.lcm),
    ("sum_from_a_to_b", "int", "Return the sum of the whole numbers from a to b, both included (0 if a is greater "
     "than b).", lambda a, b: sum(range(a, b + 1))),
    ("multiples_up_to", "int", "Return how many of the numbers 1, 2, ..., a are multiples of b.", lambda a, b: a // b),
    ("divide_rounding_up", "int", "Return a divided by b, rounded up to a whole number.", lambda a, b: -(-a // b)),
    ("same_last_digit", "bool", "Return True if a and b end in the same decimal digit, and False otherwise.",
     lambda a, b: a % 10 == b % 10),
    ("larger_digit_sum", "int", "Return whichever of a and b has the larger sum of decimal digits (a if the sums "
     "are equal).", lambda a, b: b if sum(_digits(b)) > sum(_digits(a)) else a),
    ("closer_to_ten", "int", "Return whichever of a and b is closer to 10 (a if there is a tie).",
     lambda a, b: b if abs(b - 10) < abs(a - 10) else a),
    ("distance_apart", "int", "Return how far apart a and b are on the number line.", lambda a, b: abs(a - b)),
)  # fmt: skip
DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
NUMBER_TEXT_RULES: tuple[tuple[str, str, str, Callable[[int], object]], ...] = (
    ("spelled_digits", "str", "Return the decimal digits of n spelled out in English, separated by spaces.",
     lambda n: " ".join(DIGIT_NAMES[d] for d in _digits(n))),
    ("with_thousands_commas", "str", "Return n written with a comma between each group of three digits, counted "
     "from the right.", lambda n: f"{n:,}"),
    ("zero_padded", "str", "Return n written with leading zeros to at least six digits.", lambda n: f"{n:06d}"),
    ("ordinal_form", "str", "Return n followed by its English ordinal suffix (1st, 2nd, 3rd, 4th, 11th, 12th, 13th, "
     "21st, ...).", lambda n: f"{n}{'th' if n % 100 in (11, 12, 13) else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"),
    ("hexadecimal_form", "str", "Return n written in base sixteen with lowercase letters and no prefix.",
     lambda n: f"{n:x}"),
    ("clock_time", "str", "n is a number of minutes after midnight, less than 1440. Return that time as HH:MM.",
     lambda n: f"{n // 60:02d}:{n % 60:02d}"),
)  # fmt: skip
GRID_IS = "The grid is a list of rows of the same length. "
GRID_RULES: tuple[tuple[str, str, str, Callable[[list[list[int]]], object]], ...] = (
    ("row_totals", "List[int]", "Return the sum of each row.", lambda g: [sum(r) for r in g]),
    ("column_totals", "List[int]", "Return the sum of each column.", lambda g: [sum(c) for c in zip(*g, strict=True)]),
    ("flipped_grid", "List[List[int]]", "Return the grid with its rows and columns swapped.",
     lambda g: [list(c) for c in zip(*g, strict=True)]),
    ("main_diagonal", "List[int]", "It is square. Return the numbers on its diagonal from the top left to the bottom "
     "right.", lambda g: [g[i][i] for i in range(len(g))]),
    ("flatten_grid", "List[int]", "Return all its numbers in one list, row after row.", lambda g: [x for r in g for x in r]),
    ("grid_maximum", "int", "Return the largest number in the grid (it is not empty).", lambda g: max(max(r) for r in g)),
    ("row_of_largest_total", "int", "Return the index of the row with the largest sum (the first one if there is a "
     "tie).", lambda g: max(range(len(g)), key=lambda i: sum(g[i]))),
    ("zeros_in_grid", "int", "Return how many of its numbers are 0.", lambda g: sum(r.count(0) for r in g)),
    ("mirror_rows", "List[List[int]]", "Return the grid with each row reversed.", lambda g: [r[::-1] for r in g]),
)  # fmt: skip


def _alternate_case(text: str) -> str:
    characters, letters = [], 0
    for character in text:
        if character.isalpha():
            characters.append(character.lower() if letters % 2 else character.upper())
            letters += 1
        else:
            characters.append(character)
    return "".join(characters)


WHOLE_TEXT_RULES: tuple[tuple[str, str, str, Callable[[str], object]], ...] = (
    ("swap_ends", "str", "Return the text with its first and last characters swapped (unchanged if it is shorter "
     "than two characters).", lambda s: s[-1] + s[1:-1] + s[0] if len(s) > 1 else s),
    ("run_length_code", "str", "Return the text with each run of one repeated character written as the character "
     "followed by the length of the run.", lambda s: "".join(f"{c}{len(list(run))}" for c, run in itertools.groupby(s))),
    ("capitalize_each_word", "str", "The words of the text are separated by spaces. Return them separated by single "
     "spaces, each with its first letter in uppercase and the others in lowercase.",
     lambda s: " ".join(w.capitalize() for w in s.split())),
    ("initials_of", "str", "The words of the text are separated by spaces. Return the first letters of the words in "
     "uppercase, joined together.", lambda s: "".join(w[0].upper() for w in s.split())),
    ("squeeze_spaces", "str", "Return the text with every stretch of several spaces replaced by one space.",
     lambda s: re.sub(" {2,}", " ", s)),
    ("is_pangram", "bool", "Return True if every letter of the English alphabet occurs in the text (in upper or "
     "lower case), and False otherwise.", lambda s: set(string.ascii_lowercase) <= set(s.lower())),
    ("middle_of", "str", "Return the middle character of the text, or its two middle characters if its length is "
     "even (an empty text for an empty text).", lambda s: s[(len(s) - 1) // 2 : len(s) // 2 + 1]),
    ("alternate_case", "str", "Return the text with its letters in uppercase and lowercase by turns, starting with "
     "uppercase; other characters are kept and do not count as a turn.", _alternate_case),
)  # fmt: skip


def _third_single_rule_puzzles() -> list[Puzzle]:
    text_pairs = (("listen", "silent"), ("abcde", "cdeab"), ("Help", "Hello"), ("Banana", "NA"))
    number_pairs, numbers = ((12, 18), (7, 3), (25, 5)), ((1234,), (7,), (42,))
    grids = (([[1, 2, 3], [4, 0, 6], [7, 8, 0]],), ([[5, -1], [0, 2]],))
    texts = (("Hello  world,  again",), ("the quick brown fox jumps over the lazy dog",), ("aaabccd",))
    return (
        _one_rule_each(TWO_TEXT_RULES, "first: str, second: str", text_pairs)
        + _one_rule_each(TWO_NUMBER_RULES, "a: int, b: int", number_pairs)
        + _one_rule_each(NUMBER_TEXT_RULES, "n: int", numbers)
        + _one_rule_each(GRID_RULES, "grid: List[List[int]]", grids, GRID_IS)
        + _one_rule_each(WHOLE_TEXT_RULES, "text: str", texts)
    )


def third_puzzles() -> list[Puzzle]:
    """The "code-puzzles-3" set, in grammar order."""
    return (
        _string_list_puzzles(THIRD_STRING_RULES) + _number_puzzles(THIRD_NUMBER_RULES) + _text_puzzles(THIRD_TEXT_RULES)
        + _third_single_rule_puzzles()
    )  # fmt: skip


# The "code-puzzles-4" set: more shapes again (a text and a piece of text, a list of strings and a piece, running
# values over a list, strings of bits, numbers written in a text, a pair of results, a finished helper the stub
# follows) and more rules over the kinds of numbers, characters, words and strings, none of them in the sets above.
# Rules that mirror or closely neighbour a HumanEval problem are left out (e.g. no running minimum beside its rolling
# maximum, no filter by a piece beside its substring and prefix filters): HumanEval is what the sets are measured on.

# More rules over NUMBER_KINDS (name, return type, task, rule(numbers, test))
FOURTH_NUMBER_RULES: tuple[tuple[str, str, str, Callable[[list[int], IntTest], object]], ...] = (
    ("last_{part}", "Optional[int]", "Return the last of the {plural} in the list, or None if there is none.",
     lambda n, t: next((x for x in reversed(n) if t(x)), None)),
    ("neighbouring_{part}_pairs", "int", "Return how many pairs of neighbouring numbers in the list are both "
     "{phrase}.", lambda n, t: sum(t(a) and t(b) for a, b in zip(n, n[1:], strict=False))),
    ("{part}_as_indices", "List[int]", "Return the list with each of its {plural} replaced by its own index.",
     lambda n, t: [i if t(x) else x for i, x in enumerate(n)]),
    ("count_up_to_first_{part}", "int", "Return how many numbers come before the first number in the list that is "
     "{phrase} (the length of the list if there is none).",
     lambda n, t: next((i for i, x in enumerate(n) if t(x)), len(n))),
)  # fmt: skip
# More rules over CHARACTER_CLASSES (name, return type, task, rule(text, test))
FOURTH_TEXT_RULES: tuple[tuple[str, str, str, Callable[[str, StrTest], object]], ...] = (
    ("{part}s_to_end", "str", "Return the text with its {plural} moved to its end, both groups of characters "
     "keeping their order.", lambda s, t: "".join(c for c in s if not t(c)) + "".join(c for c in s if t(c))),
    ("count_{part}_runs", "int", "Return how many stretches of consecutive characters of the text are {plural} "
     "(a stretch is as long as possible).", lambda s, t: sum(1 for key, _ in itertools.groupby(s, key=t) if key)),
    ("{part}s_between_brackets", "str", "Return the text with each character that is {one} written between square "
     "brackets.", lambda s, t: "".join(f"[{c}]" if t(c) else c for c in s)),
)  # fmt: skip
# More rules over WORD_KINDS (name, return type, task after SENTENCE_IS, rule(sentence, test))
FOURTH_WORD_RULES: tuple[tuple[str, str, str, Callable[[str, StrTest], object]], ...] = (
    ("index_of_first_{part}", "int", "Return the index among the words of the first of its {description}, or -1 if "
     "there is none.", lambda s, t: next((i for i, w in enumerate(s.split()) if t(w)), -1)),
    ("lengths_of_{part}", "List[int]", "Return the length of each of its {description}, in order.",
     lambda s, t: [len(w) for w in s.split() if t(w)]),
    ("bracket_{part}", "str", "Return the sentence with each of its {description} written between parentheses.",
     lambda s, t: " ".join(f"({w})" if t(w) else w for w in s.split())),
)  # fmt: skip
# More rules over STRING_KINDS (name, return type, task, rule(strings, test))
FOURTH_STRING_RULES: tuple[tuple[str, str, str, Callable[[list[str], StrTest], object]], ...] = (
    ("{part}_strings_to_end", "List[str]", "Return the list with its {plural} moved to its end, both groups keeping "
     "their original order.", lambda w, t: [x for x in w if not t(x)] + [x for x in w if t(x)]),
)  # fmt: skip


TEXT_PIECE_RULES: tuple[tuple[str, str, str, Callable[[str, str], object]], ...] = (
    ("cut_out_piece", "str", "Return the text with every occurrence of piece removed, looking from left to right.",
     lambda s, p: s.replace(p, "")),
    ("before_piece", "str", "Return the part of the text before the first occurrence of piece, or the whole text if "
     "piece does not occur in it.", lambda s, p: s.split(p, 1)[0]),
    ("after_last_piece", "str", "Return the part of the text after the last occurrence of piece, or an empty text if "
     "piece does not occur in it.", lambda s, p: s.rsplit(p, 1)[1] if p in s else ""),
    ("split_on_piece", "List[str]", "Return the parts of the text between the occurrences of piece (piece is not "
     "empty), empty ones included.", lambda s, p: s.split(p)),
    ("piece_ignoring_case", "bool", "Return True if piece occurs in the text when upper and lower case are not told "
     "apart, and False otherwise.", lambda s, p: p.lower() in s.lower()),
    ("surround_piece", "str", "Return the text with every occurrence of piece surrounded by asterisks.",
     lambda s, p: s.replace(p, f"*{p}*")),
    ("first_piece_to_upper", "str", "Return the text with the first occurrence of piece in uppercase.",
     lambda s, p: s.replace(p, p.upper(), 1)),
)  # fmt: skip
STRINGS_PIECE_RULES: tuple[tuple[str, str, str, Callable[[list[str], str], object]], ...] = (
    ("count_piece_in_strings", "int", "Return how many times piece occurs in the strings of the list altogether "
     "(occurrences within a string do not overlap).", lambda w, p: sum(x.count(p) for x in w)),
    ("prefix_each_with", "List[str]", "Return the strings of the list, each with piece put in front of it.",
     lambda w, p: [p + x for x in w]),
    ("join_with_piece", "str", "Return the strings of the list joined together with piece between each two of "
     "them.", lambda w, p: p.join(w)),
    ("index_of_string", "int", "Return the index of the first string of the list equal to piece, or -1 if there "
     "is none.", lambda w, p: w.index(p) if p in w else -1),
)  # fmt: skip


RUNNING_RULES: tuple[tuple[str, str, str, Callable[[list[int]], object]], ...] = (
    ("running_sums", "List[int]", "Return the running sums of the list: the sum of its first number, of its first "
     "two numbers, and so on.", lambda n: list(itertools.accumulate(n))),
    ("running_products", "List[int]", "Return the running products of the list: the product of its first number, "
     "of its first two numbers, and so on.", lambda n: list(itertools.accumulate(n, operator.mul))),
    ("neighbour_differences", "List[int]", "Return each number of the list minus the number before it.",
     lambda n: [b - a for a, b in zip(n, n[1:], strict=False)]),
    ("sums_from_the_end", "List[int]", "Return, for each position of the list, the sum of the numbers from that "
     "position to the end.", lambda n: [sum(n[i:]) for i in range(len(n))]),
)  # fmt: skip
BIT_RULES: tuple[tuple[str, str, str, Callable[[str], object]], ...] = (
    ("bits_value", "int", "bits is a string of the characters '0' and '1'. Return the number it writes in base two.",
     lambda b: int(b, 2)),
    ("count_set_bits", "int", "bits is a string of the characters '0' and '1'. Return how many of them are '1'.",
     lambda b: b.count("1")),
    ("longest_run_of_ones", "int", "bits is a string of the characters '0' and '1'. Return the length of its longest "
     "stretch of consecutive '1's.", lambda b: max(map(len, b.split("0")))),
    ("bits_alternate", "bool", "bits is a string of the characters '0' and '1'. Return True if no two neighbouring "
     "characters of it are the same, and False otherwise.", lambda b: all(x != y for x, y in zip(b, b[1:], strict=False))),
    ("padded_to_byte", "str", "bits is a string of at most eight characters '0' and '1'. Return it with '0's added "
     "in front until it is eight characters long.", lambda b: b.zfill(8)),
)  # fmt: skip
NUMBERS_IN_TEXT_IS = "The text holds whole numbers separated by commas, with no spaces. "
NUMBERS_IN_TEXT_RULES: tuple[tuple[str, str, str, Callable[[str], object]], ...] = (
    ("total_of_listed", "int", "Return their sum.", lambda s: sum(int(x) for x in s.split(","))),
    ("largest_listed", "int", "Return the largest of them.", lambda s: max(int(x) for x in s.split(","))),
    ("listed_as_numbers", "List[int]", "Return them as a list of numbers, in order.",
     lambda s: [int(x) for x in s.split(",")]),
    ("repeated_listed", "List[int]", "Return, sorted, each number that occurs more than once among them.",
     lambda s: sorted({int(x) for x in s.split(",") if s.split(",").count(x) > 1})),
    ("listed_without_negatives", "str", "Return the text without its negative numbers, in the same format.",
     lambda s: ",".join(x for x in s.split(",") if not x.startswith("-"))),
)  # fmt: skip
PAIR_RESULT_RULES: tuple[tuple[str, str, str, Callable[[list[int]], object]], ...] = (
    ("smallest_and_largest", "Tuple[int, int]", "Return the smallest and the largest number of the list, as a pair "
     "(the list is not empty).", lambda n: (min(n), max(n))),
    ("first_and_last", "Tuple[int, int]", "Return the first and the last number of the list, as a pair (the list is "
     "not empty).", lambda n: (n[0], n[-1])),
    ("positions_of_extremes", "Tuple[int, int]", "Return the index of the smallest and the index of the largest "
     "number of the list, as a pair (the first ones if there are ties; the list is not empty).",
     lambda n: (n.index(min(n)), n.index(max(n)))),
    ("sum_of_halves", "Tuple[int, int]", "Return the sum of the first half of the list and the sum of the second "
     "half, as a pair (the middle number of a list of odd length goes to the second half).",
     lambda n: (sum(n[: len(n) // 2]), sum(n[len(n) // 2 :]))),
    ("positives_and_negatives", "Tuple[int, int]", "Return how many numbers of the list are positive and how many "
     "are negative, as a pair.", lambda n: (sum(x > 0 for x in n), sum(x < 0 for x in n))),
)  # fmt: skip


def digit_total(n: int) -> int:
    """Return the sum of the decimal digits of the absolute value of n."""
    return sum(int(d) for d in str(abs(n)))


def is_vowel(character: str) -> bool:
    """Return True if the character is a vowel (in upper or lower case)."""
    return character.lower() in "aeiou"


def _vowel_ratio(letters: list[str]) -> float:
    return sum(map(is_vowel, letters)) / len(letters) if letters else 0.0


# the helpers' source as the stubs show it: the functions the rules below call
DIGIT_TOTAL_HELPER, IS_VOWEL_HELPER = inspect.getsource(digit_total), inspect.getsource(is_vowel)
# Rules whose stub follows a finished helper, which the task names (name, return type, task, rule)
DIGIT_TOTAL_RULES: tuple[tuple[str, str, str, Callable[[list[int]], object]], ...] = (
    ("largest_digit_total", "int", "Return the number of the list whose digit_total is the largest (the first one "
     "if there is a tie; the list is not empty).", lambda n: max(n, key=digit_total)),
    ("even_digit_totals", "List[int]", "Return the numbers of the list whose digit_total is even, in their original "
     "order.", lambda n: [x for x in n if digit_total(x) % 2 == 0]),
)  # fmt: skip
IS_VOWEL_RULES: tuple[tuple[str, str, str, Callable[[str], object]], ...] = (
    ("neighbouring_vowels", "int", "Return how many pairs of neighbouring characters of the text are both vowels "
     "(use is_vowel).", lambda s: sum(is_vowel(a) and is_vowel(b) for a, b in zip(s, s[1:], strict=False))),
    ("vowel_ratio", "float", "Return the fraction of the letters of the text that are vowels (use is_vowel; 0.0 if "
     "the text has no letter).", lambda s: _vowel_ratio([c for c in s if c.isalpha()])),
    ("starts_and_ends_with_vowel", "bool", "Return True if the text is not empty and both its first and its last "
     "characters are vowels (use is_vowel), and False otherwise.",
     lambda s: bool(s) and is_vowel(s[0]) and is_vowel(s[-1])),
)  # fmt: skip


def _fourth_single_rule_puzzles() -> list[Puzzle]:
    text_pieces = (("banana bandana", "ana"), ("a-b--c", "-"), ("Hello", "xyz"))
    string_pieces = ((["photo.png", "notes.txt", "logo.png", ""], ".png"), (["to", "do"], "o"))
    running_lists: tuple[tuple[list[int]], ...] = (([3, -1, 4, -1, 5],), ([2, 2, 1],), ([],))
    bits = (("101100",), ("0111",), ("1",))
    numbers_texts = (("12,-3,7,12,0",), ("5,-5,5",))
    pair_lists = (([4, -2, 9, 0, -7],), ([6, 1, 6],))
    return (
        _one_rule_each(TEXT_PIECE_RULES, "text: str, piece: str", text_pieces)
        + _one_rule_each(STRINGS_PIECE_RULES, "strings: List[str], piece: str", string_pieces)
        + _one_rule_each(RUNNING_RULES, "numbers: List[int]", running_lists)
        + _one_rule_each(BIT_RULES, "bits: str", bits)
        + _one_rule_each(NUMBERS_IN_TEXT_RULES, "text: str", numbers_texts, NUMBERS_IN_TEXT_IS)
        + _one_rule_each(PAIR_RESULT_RULES, "numbers: List[int]", pair_lists)
        + _one_rule_each(DIGIT_TOTAL_RULES, "numbers: List[int]", (([15, 8, -99, 40],), ([123, 321, 5],)),
                         helper=DIGIT_TOTAL_HELPER)
        + _one_rule_each(IS_VOWEL_RULES, "text: str", (("Education",), ("rhythm",), ("Area",)), helper=IS_VOWEL_HELPER)
    )  # fmt: skip


def fourth_puzzles() -> list[Puzzle]:
    """The "code-puzzles-4" set, in grammar order."""
    return (
        _number_puzzles(FOURTH_NUMBER_RULES) + _text_puzzles(FOURTH_TEXT_RULES) + _word_puzzles(FOURTH_WORD_RULES)
        + _string_list_puzzles(FOURTH_STRING_RULES) + _fourth_single_rule_puzzles()
    )  # fmt: skip


# The "code-puzzles-5" set: more shapes again (a list of name-and-score pairs, a list and a step k, times of day, a
# text and a width, a text and a character, two lists of strings, more rules over one whole number) and more rules
# over the kinds of numbers, characters, words and strings, none of them in the sets above. Left out as HumanEval
# neighbours, as in code-puzzles-4: counting a character or piece (how_many_times), shortest words (longest),
# strings in both lists (common), swapping case (flip_case), rotations (circular_shift), the k largest (maximum),
# powers (is_simple_power), sums up to n (sum_to_n), and floats against a threshold (has_close_elements).

# More rules over NUMBER_KINDS (name, return type, task, rule(numbers, test))
FIFTH_NUMBER_RULES: tuple[tuple[str, str, str, Callable[[list[int], IntTest], object]], ...] = (
    ("{part}_in_reverse", "List[int]", "Return the {plural} of the list in reverse order.",
     lambda n, t: [x for x in reversed(n) if t(x)]),
    ("{part}_minus_others", "int", "Return the sum of the {plural} in the list minus the sum of the other numbers.",
     lambda n, t: sum(x if t(x) else -x for x in n)),
    ("repeat_{part}", "List[int]", "Return the list with each of its {plural} written twice in a row.",
     lambda n, t: [y for x in n for y in ([x, x] if t(x) else [x])]),
)  # fmt: skip
# More rules over CHARACTER_CLASSES (name, return type, task, rule(text, test))
FIFTH_TEXT_RULES: tuple[tuple[str, str, str, Callable[[str, StrTest], object]], ...] = (
    ("text_after_first_{part}", "str", "Return the part of the text after its first character that is {one}, or an "
     "empty text if it has none.", lambda s, t: next((s[i + 1 :] for i, c in enumerate(s) if t(c)), "")),
    ("upper_after_{part}s", "str", "Return the text with each character that comes right after {one} in uppercase.",
     lambda s, t: "".join(c.upper() if i and t(s[i - 1]) else c for i, c in enumerate(s))),
)  # fmt: skip
# More rules over WORD_KINDS (name, return type, task after SENTENCE_IS, rule(sentence, test))
FIFTH_WORD_RULES: tuple[tuple[str, str, str, Callable[[str, StrTest], object]], ...] = (
    ("{part}_to_front", "str", "Return the sentence with its {description} moved to the front, both groups of "
     "words keeping their order.",
     lambda s, t: " ".join([w for w in s.split() if t(w)] + [w for w in s.split() if not t(w)])),
    ("initials_of_{part}", "str", "Return the first letters of its {description}, joined together in order.",
     lambda s, t: "".join(w[0] for w in s.split() if t(w))),
    ("letters_in_{part}", "int", "Return how many letters its {description} have altogether.",
     lambda s, t: sum(len(w) for w in s.split() if t(w))),
)  # fmt: skip
# More rules over STRING_KINDS (name, return type, task, rule(strings, test))
FIFTH_STRING_RULES: tuple[tuple[str, str, str, Callable[[list[str], StrTest], object]], ...] = (
    ("reverse_{part}_strings", "List[str]", "Return the list with the characters of each of its {plural} in "
     "reverse order.", lambda w, t: [x[::-1] if t(x) else x for x in w]),
    ("lengths_of_each_{part}_string", "List[int]", "Return the length of each of the {plural} of the list, in "
     "order.", lambda w, t: [len(x) for x in w if t(x)]),
)  # fmt: skip


def _best_name(pairs: list[tuple[str, int]]) -> str:
    return max(pairs, key=lambda pair: pair[1])[0]


def _totals_by_name(pairs: list[tuple[str, int]]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for name, score in pairs:
        totals[name] = totals.get(name, 0) + score
    return totals


SCORES_ARE = "Each pair of the list holds a name and a score. "
SCORE_RULES: tuple[tuple[str, str, str, Callable[[list[tuple[str, int]]], object]], ...] = (
    ("total_score", "int", "Return the sum of all the scores.", lambda p: sum(score for _, score in p)),
    ("best_scorer", "str", "Return the name with the highest score (the first one if there is a tie; the list is "
     "not empty).", _best_name),
    ("names_scoring_over_ten", "List[str]", "Return the names whose score is greater than ten, in their original "
     "order.", lambda p: [name for name, score in p if score > 10]),
    ("score_per_name", "Dict[str, int]", "A name can occur more than once. Return a dictionary mapping each name to "
     "the sum of its scores.", _totals_by_name),
    ("by_score_descending", "List[Tuple[str, int]]", "Return the pairs sorted from the highest score to the lowest "
     "(pairs with the same score keep their order).", lambda p: sorted(p, key=lambda pair: -pair[1])),
    ("scores_first", "List[Tuple[int, str]]", "Return the pairs with the score before the name.",
     lambda p: [(score, name) for name, score in p]),
)  # fmt: skip
STEP_IS = "k is a positive whole number. "
STEP_RULES: tuple[tuple[str, str, str, Callable[[list[int], int], object]], ...] = (
    ("every_kth_number", "List[int]", "Return the numbers of the list at the indices 0, k, 2k, and so on.",
     lambda n, k: n[::k]),
    ("window_sums", "List[int]", "Return the sum of every k consecutive numbers of the list, from the first window "
     "to the last (none if the list is shorter than k).", lambda n, k: [sum(n[i : i + k]) for i in range(len(n) - k + 1)]),
    ("repeat_each_k_times", "List[int]", "Return the list with each of its numbers written k times in a row.",
     lambda n, k: [x for x in n for _ in range(k)]),
    ("drop_every_kth", "List[int]", "Return the list without its k-th, 2k-th, 3k-th, ... numbers (counting from "
     "one).", lambda n, k: [x for i, x in enumerate(n, 1) if i % k]),
)  # fmt: skip


def _minutes(time: str) -> int:
    hours, minutes = time.split(":")
    return 60 * int(hours) + int(minutes)


def _twelve_hour(time: str) -> str:
    hours, minutes = divmod(_minutes(time), 60)
    return f"{(hours - 1) % 12 + 1}:{minutes:02d} {'AM' if hours < 12 else 'PM'}"


TIME_IS = "time is a time of day written as 'HH:MM' on a 24-hour clock. "
TIME_RULES: tuple[tuple[str, str, str, Callable[[str], object]], ...] = (
    ("minutes_since_midnight", "int", "Return how many minutes have passed since midnight.", _minutes),
    ("minutes_until_midnight", "int", "Return how many minutes are left until the next midnight.",
     lambda s: 24 * 60 - _minutes(s)),
    ("twelve_hour_clock", "str", "Return the same time on a 12-hour clock, as 'H:MM AM' or 'H:MM PM' (midnight is "
     "'12:00 AM', noon '12:00 PM').", _twelve_hour),
    ("is_before_noon", "bool", "Return True if the time is earlier than 12:00, and False otherwise.",
     lambda s: _minutes(s) < 12 * 60),
    ("nearest_hour", "str", "Return the time rounded to the nearest whole hour, as 'HH:00' (half past rounds up; "
     "'23:30' becomes '00:00').", lambda s: f"{(_minutes(s) + 30) // 60 % 24:02d}:00"),
)  # fmt: skip


def _centred(text: str, width: int, fill: str) -> str:
    """text between runs of `fill` making it `width` long, the longer run on the right."""
    room = max(width - len(text), 0)
    return fill * (room // 2) + text + fill * (room - room // 2)


WIDTH_RULES: tuple[tuple[str, str, str, Callable[[str, int], object]], ...] = (
    ("pad_to_width", "str", "Return the text with spaces added at its end until it is width characters long (the "
     "text unchanged if it is already that long).", lambda s, w: s.ljust(w)),
    ("centre_in_stars", "str", "Return the text in the middle of a line of width characters filled with '*' (when "
     "the stars cannot be split evenly, the extra one goes to the right; the text unchanged if it is too long).",
     lambda s, w: _centred(s, w, "*")),
    ("shorten_to_width", "str", "Return the text unchanged if it has at most width characters; otherwise its first "
     "width - 3 characters followed by '...' (width is at least 3).", lambda s, w: s if len(s) <= w else s[: w - 3] + "..."),
    ("lines_of_width", "List[str]", "Cut the text into lines of width characters each (the last one may be "
     "shorter) and return them in order.", lambda s, w: [s[i : i + w] for i in range(0, len(s), w)]),
    ("fits_in_width", "bool", "Return True if the text has at most width characters, and False otherwise.",
     lambda s, w: len(s) <= w),
)  # fmt: skip
CHARACTER_IS = "character is a single character. "
CHARACTER_RULES: tuple[tuple[str, str, str, Callable[[str, str], object]], ...] = (
    ("positions_of_character", "List[int]", "Return the indices at which character occurs in the text.",
     lambda s, c: [i for i, x in enumerate(s) if x == c]),
    ("last_index_of_character", "int", "Return the index of the last occurrence of character in the text, or -1 "
     "if it does not occur.", lambda s, c: s.rfind(c)),
    ("characters_after_each", "str", "Return the characters that come right after each occurrence of character in "
     "the text, joined in order.", lambda s, c: "".join(s[i + 1] for i in range(len(s) - 1) if s[i] == c)),
    ("span_of_character", "int", "Return the distance between the first and the last occurrence of character in "
     "the text, or -1 if it does not occur.", lambda s, c: s.rfind(c) - s.find(c) if c in s else -1),
    ("dash_for_character", "str", "Return the text with every occurrence of character replaced by '-'.",
     lambda s, c: s.replace(c, "-")),
)  # fmt: skip
TWO_LISTS_RULES: tuple[tuple[str, str, str, Callable[[list[str], list[str]], object]], ...] = (
    ("strings_only_in_second", "List[str]", "Return the strings of the second list that the first list does not "
     "contain, in their original order.", lambda a, b: [x for x in b if x not in a]),
    ("paired_with_dashes", "List[str]", "Return the strings at the same positions of the two lists joined by '-' "
     "(as many as the shorter list has).", lambda a, b: [f"{x}-{y}" for x, y in zip(a, b, strict=False)]),
    ("same_lengths_throughout", "bool", "Return True if the two lists are equally long and the strings at each "
     "position have the same length, and False otherwise.",
     lambda a, b: len(a) == len(b) and all(len(x) == len(y) for x, y in zip(a, b, strict=False))),
    ("longer_of_each_pair", "List[str]", "Return, for each position of the two lists (as many as the shorter list "
     "has), the longer of the two strings there (the first list's if they are equally long).",
     lambda a, b: [x if len(x) >= len(y) else y for x, y in zip(a, b, strict=False)]),
)  # fmt: skip


def _thirds_down_to_one(n: int) -> list[int]:
    thirds = []
    while n > 0:
        thirds.append(n)
        n //= 3
    return thirds


def _halve_until_odd(n: int) -> int:
    while n % 2 == 0:
        n //= 2
    return n


WHOLE_NUMBER_RULES: tuple[tuple[str, str, str, Callable[[int], object]], ...] = (
    ("trailing_zeros", "int", "Return how many zeros the decimal digits of n end with (n is positive).",
     lambda n: len(str(n)) - len(str(n).rstrip("0"))),
    ("next_multiple_of_seven", "int", "Return the smallest multiple of seven that is at least n.",
     lambda n: -(-n // 7) * 7),
    ("digit_spread", "int", "Return the largest decimal digit of n minus its smallest one.",
     lambda n: max(_digits(n)) - min(_digits(n))),
    ("halve_until_odd", "int", "Divide n (a positive number) by two for as long as it is even, and return what is "
     "left.", _halve_until_odd),
    ("thirds_down_to_one", "List[int]", "Return n, then n divided by three (rounded down), and so on, for as long "
     "as the numbers are positive.", _thirds_down_to_one),
)  # fmt: skip


def _fifth_single_rule_puzzles() -> list[Puzzle]:
    score_lists = (([("ann", 12), ("bob", 7), ("cy", 12), ("bob", 5)],), ([("dee", -3)],))
    step_lists = (([5, 1, 8, 3, 9, 2], 2), ([7, 4, 6], 3))
    times = (("09:45",), ("23:30",), ("12:00",))
    widths = (("hello", 8), ("stretched out", 6))
    characters = (("Mississippi", "s"), ("banana", "a"), ("xyz", "q"))
    string_pairs: tuple[tuple[list[str], list[str]], ...] = (
        (["red", "blue", "green"], ["blue", "black", "red", "tan"]),
        (["a"], []),
    )
    return (
        _one_rule_each(SCORE_RULES, "pairs: List[Tuple[str, int]]", score_lists, SCORES_ARE)
        + _one_rule_each(STEP_RULES, "numbers: List[int], k: int", step_lists, STEP_IS)
        + _one_rule_each(TIME_RULES, "time: str", times, TIME_IS)
        + _one_rule_each(WIDTH_RULES, "text: str, width: int", widths)
        + _one_rule_each(CHARACTER_RULES, "text: str, character: str", characters, CHARACTER_IS)
        + _one_rule_each(TWO_LISTS_RULES, "first: List[str], second: List[str]", string_pairs)
        + _one_rule_each(WHOLE_NUMBER_RULES, "n: int", ((48,), (7,), (1000,)))
    )  # fmt: skip


def fifth_puzzles() -> list[Puzzle]:
    """The "code-puzzles-5" set, in grammar order."""
    return (
        _number_puzzles(FIFTH_NUMBER_RULES) + _text_puzzles(FIFTH_TEXT_RULES) + _word_puzzles(FIFTH_WORD_RULES)
        + _string_list_puzzles(FIFTH_STRING_RULES) + _fifth_single_rule_puzzles()
    )  # fmt: skip


# The "code-puzzles-6" set: more shapes again (a dictionary of counts, points in the plane, more grid rules, checks of
# a text's form, durations, sums of money, pieces picked out of a text, a list of words) and more rules over the kinds
# of numbers, characters and words, none of them in the sets above. Left out as HumanEval neighbours, besides those
# named for the sets before: checks of file names and dates (file_name_check, valid_date), the word with the most
# distinct letters (find_max), the case of a dictionary's keys (check_dict_case), the longest string (longest).

# More rules over NUMBER_KINDS (name, return type, task, rule(numbers, test))
SIXTH_NUMBER_RULES: tuple[tuple[str, str, str, Callable[[list[int], IntTest], object]], ...] = (
    ("after_first_{part}", "List[int]", "Return the numbers of the list that come after its first number that is "
     "{phrase} (none if no number is).", lambda n, t: next((n[i + 1 :] for i, x in enumerate(n) if t(x)), [])),
    ("span_of_{part}", "int", "Return the index of the last number of the list that is {phrase} minus the index of "
     "the first one, or -1 if there is none.",
     lambda n, t: (lambda at: at[-1] - at[0] if at else -1)([i for i, x in enumerate(n) if t(x)])),
    ("halve_{part}", "List[int]", "Return the list with each of its {plural} halved, rounding down, and the other "
     "numbers unchanged.", lambda n, t: [x // 2 if t(x) else x for x in n]),
)  # fmt: skip
# More rules over CHARACTER_CLASSES (name, return type, task, rule(text, test))
SIXTH_TEXT_RULES: tuple[tuple[str, str, str, Callable[[str, StrTest], object]], ...] = (
    ("{part}s_in_first_half", "int", "Return how many of the first len(text) // 2 characters of the text are "
     "{plural}.", lambda s, t: sum(map(t, s[: len(s) // 2]))),
    ("text_before_first_{part}", "str", "Return the part of the text before its first character that is {one} (the "
     "whole text if it has none).", lambda s, t: next((s[:i] for i, c in enumerate(s) if t(c)), s)),
    ("{part}s_with_indices", "str", "Return each character of the text that is {one} followed by '@' and its "
     "index, joined by commas.", lambda s, t: ",".join(f"{c}@{i}" for i, c in enumerate(s) if t(c))),
)  # fmt: skip
# More rules over WORD_KINDS (name, return type, task after SENTENCE_IS, rule(sentence, test))
SIXTH_WORD_RULES: tuple[tuple[str, str, str, Callable[[str, StrTest], object]], ...] = (
    ("last_of_{part}", "str", "Return the last of its {description}, or an empty string if there is none.",
     lambda s, t: next((w for w in reversed(s.split()) if t(w)), "")),
    ("{part}_to_back", "str", "Return the sentence with its {description} moved to the end, both groups of words "
     "keeping their order.",
     lambda s, t: " ".join([w for w in s.split() if not t(w)] + [w for w in s.split() if t(w)])),
)  # fmt: skip


STOCK_IS = "The dictionary maps item names to how many of each are in stock. "
STOCK_RULES: tuple[tuple[str, str, str, Callable[[dict[str, int]], object]], ...] = (
    ("items_out_of_stock", "List[str]", "Return the names of the items with none in stock, in the dictionary's "
     "order.", lambda d: [k for k, v in d.items() if v == 0]),
    ("total_in_stock", "int", "Return how many items are in stock altogether.", lambda d: sum(d.values())),
    ("most_stocked_item", "str", "Return the name of the item with the most in stock (the first one if there is a "
     "tie; the dictionary is not empty).", lambda d: max(d, key=lambda k: d[k])),
    ("items_by_count", "List[str]", "Return the item names sorted from the most in stock to the least (items with "
     "the same count keep the dictionary's order).", lambda d: sorted(d, key=lambda k: -d[k])),
    ("restock_to_ten", "Dict[str, int]", "Return a new dictionary in which every count below ten is raised to ten.",
     lambda d: {k: max(v, 10) for k, v in d.items()}),
)  # fmt: skip
POINTS_ARE = "Each point is a pair (x, y) of whole numbers. "
POINT_RULES: tuple[tuple[str, str, str, Callable[[list[tuple[int, int]]], object]], ...] = (
    ("farthest_from_origin", "Tuple[int, int]", "Return the point with the largest |x| + |y| (the first one if "
     "there is a tie; the list is not empty).", lambda p: max(p, key=lambda q: abs(q[0]) + abs(q[1]))),
    ("points_on_an_axis", "int", "Return how many of the points have x equal to 0 or y equal to 0.",
     lambda p: sum(x == 0 or y == 0 for x, y in p)),
    ("bounding_box", "Tuple[int, int, int, int]", "Return the smallest x, the smallest y, the largest x and the "
     "largest y of the points (the list is not empty).",
     lambda p: (min(x for x, _ in p), min(y for _, y in p), max(x for x, _ in p), max(y for _, y in p))),
    ("points_above_diagonal", "List[Tuple[int, int]]", "Return the points whose y is greater than their x, in "
     "their original order.", lambda p: [(x, y) for x, y in p if y > x]),
    ("walk_length", "int", "Return the total |dx| + |dy| of the steps from each point to the next one.",
     lambda p: sum(abs(b[0] - a[0]) + abs(b[1] - a[1]) for a, b in zip(p, p[1:], strict=False))),
)  # fmt: skip
SIXTH_GRID_RULES: tuple[tuple[str, str, str, Callable[[list[list[int]]], object]], ...] = (
    ("anti_diagonal", "List[int]", "It is square. Return the numbers on its diagonal from the top right to the "
     "bottom left.", lambda g: [g[i][len(g) - 1 - i] for i in range(len(g))]),
    ("column_maxima", "List[int]", "Return the largest number of each column.",
     lambda g: [max(c) for c in zip(*g, strict=True)]),
    ("sorted_rows", "List[List[int]]", "Return the grid with the numbers of each row sorted from smallest to "
     "largest.", lambda g: [sorted(r) for r in g]),
    ("positives_in_grid", "int", "Return how many of its numbers are positive.", lambda g: sum(x > 0 for r in g for x in r)),
    ("edge_total", "int", "Return the sum of the numbers in its first and last rows and first and last columns, "
     "each number counted once.",
     lambda g: sum(x for i, r in enumerate(g) for j, x in enumerate(r) if i in (0, len(g) - 1) or j in (0, len(r) - 1))),
)  # fmt: skip


def _looks_like_email(text: str) -> bool:
    user, at, domain = text.partition("@")
    return bool(user) and at == "@" and "@" not in domain and "." in domain[1:-1]


FORM_RULES: tuple[tuple[str, str, str, Callable[[str], object]], ...] = (
    ("is_hex_colour", "bool", "Return True if the text is '#' followed by exactly six characters, each a digit or a "
     "letter from a to f in either case, and False otherwise.",
     lambda s: len(s) == 7 and s[0] == "#" and all(c in string.hexdigits for c in s[1:])),
    ("looks_like_email", "bool", "Return True if the text has exactly one '@', at least one character before it, and "
     "a '.' after it that is neither right after the '@' nor the last character; False otherwise.", _looks_like_email),
    ("is_snake_case", "bool", "Return True if the text is not empty, is made only of lowercase letters, digits and "
     "'_', and does not start with a digit or '_'; False otherwise.",
     lambda s: bool(re.fullmatch(r"[a-z][a-z0-9_]*", s))),
    ("is_signed_number", "bool", "Return True if the text is an optional '+' or '-' followed by one or more digits "
     "and nothing else, and False otherwise.", lambda s: bool(re.fullmatch(r"[+-]?[0-9]+", s))),
)  # fmt: skip
DURATION_RULES: tuple[tuple[str, str, str, Callable[[int], object]], ...] = (
    ("duration_clock", "str", "seconds is a duration. Return it as 'H:MM:SS' (hours, then minutes and seconds with "
     "two digits each).", lambda n: f"{n // 3600}:{n // 60 % 60:02d}:{n % 60:02d}"),
    ("duration_parts", "Tuple[int, int, int]", "seconds is a duration. Return its whole hours, the minutes left "
     "over, and the seconds left over, as a triple.", lambda n: (n // 3600, n // 60 % 60, n % 60)),
    ("largest_time_unit", "str", "seconds is a duration. Return 'hours' if it lasts an hour or more, 'minutes' if it "
     "lasts a minute or more, and 'seconds' otherwise.", lambda n: "hours" if n >= 3600 else "minutes" if n >= 60 else "seconds"),
    ("duration_in_minutes", "float", "seconds is a duration. Return it in minutes, rounded to two decimal places.",
     lambda n: round(n / 60, 2)),
)  # fmt: skip
MONEY_RULES: tuple[tuple[str, str, str, Callable[[int], object]], ...] = (
    ("as_dollars", "str", "cents is a sum of money in cents. Return it as dollars: '$', the whole dollars with a "
     "comma between each group of three digits, '.', and two digits of cents.", lambda c: f"${c // 100:,}.{c % 100:02d}"),
    ("is_whole_dollars", "bool", "cents is a sum of money in cents. Return True if it is a whole number of dollars, "
     "and False otherwise.", lambda c: c % 100 == 0),
    ("quarters_and_rest", "Tuple[int, int]", "cents is a sum of money in cents. Return how many quarters (25 cents) "
     "fit in it and how many cents are left over, as a pair.", lambda c: divmod(c, 25)),
)  # fmt: skip
PICK_RULES: tuple[tuple[str, str, str, Callable[[str], object]], ...] = (
    ("hashtags_in", "List[str]", "Return the words of the text that start with '#', without the '#', in order "
     "(words are separated by spaces).", lambda s: [w[1:] for w in s.split() if w.startswith("#")]),
    ("sentences_of", "List[str]", "Split the text after each '.', '!' or '?' and return the sentences with the spaces "
     "around them removed, leaving out empty ones.", lambda s: [p.strip() for p in re.split(r"(?<=[.!?])", s) if p.strip()]),
    ("numbers_written_in", "List[int]", "Return the whole numbers written in the text as runs of digits, in order.",
     lambda s: [int(x) for x in re.findall(r"[0-9]+", s)]),
    ("quoted_parts", "List[str]", "Return the parts of the text written between pairs of double quotes, in order.",
     lambda s: re.findall(r'"([^"]*)"', s)),
)  # fmt: skip


WORD_LIST_RULES: tuple[tuple[str, str, str, Callable[[list[str]], object]], ...] = (
    ("common_start", "str", "Return the longest beginning that all the words share (an empty string if there is "
     "none or the list is empty).", os.path.commonprefix),
    ("word_with_most_vowels", "str", "Return the word with the most vowels, a, e, i, o or u in either case (the first "
     "one if there is a tie; the list is not empty).", lambda w: max(w, key=lambda x: sum(map(is_vowel, x)))),
    ("words_as_sentence", "str", "Return the words joined by single spaces, with the first letter of the first word "
     "in uppercase and a '.' at the end.", lambda w: (lambda s: s[:1].upper() + s[1:] + ".")(" ".join(w))),
    ("words_by_length", "Dict[int, List[str]]", "Return a dictionary mapping each word length to the words of that "
     "length, in their original order.", lambda w: {n: [x for x in w if len(x) == n] for n in dict.fromkeys(map(len, w))}),
    ("first_letter_to_end", "List[str]", "Return each word with its first letter moved to its end.",
     lambda w: [x[1:] + x[:1] for x in w]),
)  # fmt: skip


def _sixth_single_rule_puzzles() -> list[Puzzle]:
    stock = (({"apples": 4, "pears": 0, "plums": 12, "figs": 0},), ({"tea": 30},))
    points = (([(3, -1), (0, 4), (-2, -2), (5, 0)],), ([(1, 1)],))
    grids = (([[4, 9, 2], [3, 5, 7], [8, 1, 6]],), ([[0, -3], [2, 2]],))
    forms = (("#1a2B3c",), ("user@mail.com",), ("snake_case_2",), ("-42",))
    texts = (('Meet at 10. Bring #snacks and "good vibes"! #fun',), ('"a" and "b" cost 42?',))
    word_lists = ((["flower", "flow", "flight"],), (["sky", "idea", "Ocean"],))
    return (
        _one_rule_each(STOCK_RULES, "stock: Dict[str, int]", stock, STOCK_IS)
        + _one_rule_each(POINT_RULES, "points: List[Tuple[int, int]]", points, POINTS_ARE)
        + _one_rule_each(SIXTH_GRID_RULES, "grid: List[List[int]]", grids, GRID_IS)
        + _one_rule_each(FORM_RULES, "text: str", forms)
        + _one_rule_each(DURATION_RULES, "seconds: int", ((3725,), (59,), (86400,)))
        + _one_rule_each(MONEY_RULES, "cents: int", ((123405,), (99,), (700,)))
        + _one_rule_each(PICK_RULES, "text: str", texts)
        + _one_rule_each(WORD_LIST_RULES, "words: List[str]", word_lists)
    )  # fmt: skip


def sixth_puzzles() -> list[Puzzle]:
    """The "code-puzzles-6" set, in grammar order."""
    return (
        _number_puzzles(SIXTH_NUMBER_RULES) + _text_puzzles(SIXTH_TEXT_RULES) + _word_puzzles(SIXTH_WORD_RULES)
        + _sixth_single_rule_puzzles()
    )  # fmt: skip
