"""Incremental detokenization: streamed pieces never split a character and add up to the whole decode."""

from __future__ import annotations

from dflash_trt.runtime.detokenize import TextStream
from dflash_trt.runtime.loop import StopCriteria
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

TEXT = "naïve café — 中文字符 and emoji 🚀🎉 plus plain ASCII words, repeated: naïve café 中文 🚀"


def _byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with few merges, so multi-byte characters are split over several tokens."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=core)


def test_pieces_are_whole_characters_and_add_up_to_the_decode() -> None:
    tokenizer = _byte_level_tokenizer()
    ids = tokenizer(TEXT)["input_ids"]
    assert any("\ufffd" in tokenizer.decode([token]) for token in ids), "the fixture splits some character across tokens"
    for chunk in (1, 2, 3):  # tokens arrive one at a time or several per step
        stream = TextStream(tokenizer)
        pieces = [stream.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
        assert all("\ufffd" not in piece for piece in pieces)
        assert "".join(pieces) == tokenizer.decode(ids) == TEXT


def test_stop_strings_are_found_in_a_tail_window_where_a_whole_text_search_finds_them() -> None:
    """StopCriteria decodes only a tail window per token; it must stop exactly where searching the whole text
    would, also for stop strings whose characters span several byte-level tokens."""
    tokenizer = _byte_level_tokenizer()
    ids = tokenizer(TEXT)["input_ids"]
    for stop in ("café", "中文字", "🚀🎉", "ASCII words", "é 中", "not in the text"):
        whole = next((i + 1 for i in range(len(ids)) if stop in tokenizer.decode(ids[: i + 1])), None)
        assert StopCriteria(stop_strings=(stop,), decode=tokenizer.decode).first_stop(ids, 0) == whole, stop
