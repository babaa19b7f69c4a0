"""Prompt pieces."""

import pytest

from cachecraft.prompt import PromptBuilder, PromptTooLong
from tests.conftest import tiny_tokenizer


def test_pieces_concatenate_in_order_and_chunks_are_independent():
    builder = PromptBuilder(tiny_tokenizer(), "w1 w2")
    a = builder.build(["w5 w6\n\n", "w7\n\n"], "w9 w10")
    b = builder.build(["w7\n\n", "w5 w6\n\n"], "w11")
    assert a.chunks[0] == b.chunks[1] and a.chunks[1] == b.chunks[0]
    assert a.prefix == b.prefix
    assert a.token_ids == [*a.prefix, *a.chunks[0], *a.chunks[1], *a.question]
    assert a.num_tokens == len(a.token_ids)


def test_empty_question_chunk_and_too_long_prompt():
    builder = PromptBuilder(tiny_tokenizer(), "w1")
    with pytest.raises(ValueError, match="question is empty"):
        builder.build(["w5"], "  ")
    with pytest.raises(ValueError, match="no chunks given"):
        builder.build([], "w5")
    with pytest.raises(ValueError, match="chunk is empty"):
        builder.build(["   "], "w5")
    with pytest.raises(PromptTooLong, match="context window of 5"):
        builder.build(["w5 " * 10], "w6", max_tokens=5)


def test_chunk_text_formats_title():
    assert PromptBuilder.chunk_text(" body ", "Title") == "Title\nbody\n\n"
    assert PromptBuilder.chunk_text("body") == "body\n\n"


def test_question_template_is_applied_and_validated():
    from cachecraft.config import Config, ConfigError
    builder = PromptBuilder(tiny_tokenizer(), "w1", "w7 {question} w8")
    pieces = builder.build(["w5\n\n"], "w9")
    assert builder.tokenizer.decode(pieces.question).split()[:3] == ["w7", "w9", "w8"]
    with pytest.raises(ConfigError, match="placeholder"):
        Config.from_mapping({"question_template": "no placeholder"})
