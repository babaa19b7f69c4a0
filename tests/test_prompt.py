"""Prompt pieces."""

import pytest

from cachecraft.prompt import Conversation, PromptBuilder, PromptInputError, PromptTooLong
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


def test_a_conversation_is_written_after_the_chunks_taking_turns_before_the_question():
    said = Conversation(instructions=(" w20 w21 ", "  "),
                        turns=(("assistant", "w8"), ("user", "w3 w4"), ("assistant", " w5"), ("assistant", "w6"),
                               ("user", " ")))
    # the greeting before the first question dropped, one speaker's turns in a row joined
    assert said.exchanges("w9") == [("user", "w3 w4"), ("assistant", "w5\n\nw6"), ("user", "w9")]
    assert Conversation(turns=(("user", "w1"),)).exchanges("w2") == [("user", "w1\n\nw2")]
    builder = PromptBuilder(tiny_tokenizer(), "w1 w2")
    assert builder.suffix("w9", said) == "w20 w21\n\nQuestion: w3 w4\nAnswer: w5\n\nw6\n\nQuestion: w9\nAnswer:"
    assert builder.suffix("w9", Conversation()) == builder.suffix("w9") == "Question: w9\nAnswer:"
    plain = builder.build(["w5 w6\n\n", "w7\n\n"], "w9")
    chat = builder.build(["w5 w6\n\n", "w7\n\n"], "w9", conversation=said)
    # the system prefix and the chunks are the plain prompt's: their caches serve a chat
    assert chat.prefix == plain.prefix and chat.chunks == plain.chunks
    # by hand, a token per word: w20 w21, Question: w3 w4, Answer: w5, w6
    assert len(chat.question) == len(plain.question) + 8
    assert chat.question[-len(plain.question):] == plain.question  # the question and the tail stay last
    with pytest.raises(PromptTooLong, match="context window of 12; send fewer of the conversation's earlier turns"):
        builder.build(["w5"], "w6", max_tokens=12, conversation=said)
    with pytest.raises(PromptInputError, match="speaker must be user or assistant, got system"):
        Conversation(turns=(("system", "w1"),))


@pytest.mark.parametrize("system_role", [True, False])
def test_a_conversation_takes_the_chat_template_s_turns(system_role):
    tokenizer = tiny_tokenizer()
    refuse = "" if system_role else "{% if messages[0].role == 'system' %}{{ raise_exception('no system') }}{% endif %}"
    tokenizer.chat_template = (refuse + "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                               "{% if add_generation_prompt %}[assistant]{% endif %}")
    builder = PromptBuilder(tokenizer, "w1 w2")
    assert builder.head == ("[system]w1 w2[user]" if system_role else "[user]w1 w2\n\n")
    said = Conversation(instructions=("w20",), turns=(("user", "w3"), ("assistant", "w5")))
    # the turns the template writes, from just after the chunks (the first user turn's start) on
    assert builder.suffix("w9", said) == "w20\n\nQuestion: w3[assistant]w5[user]Question: w9[assistant]"
    assert builder.suffix("w9") == "Question: w9[assistant]"


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


def test_chunk_ids_are_remembered_bounded_and_shared_with_other_question_templates(monkeypatch):
    import cachecraft.prompt as prompt
    monkeypatch.setattr(prompt, "CHUNK_IDS_KEPT", 2)
    builder = PromptBuilder(tiny_tokenizer(), "w1")
    calls = []
    encode = builder.encode
    monkeypatch.setattr(builder, "encode", lambda text: calls.append(text) or encode(text))
    first = builder.build(["w2 w3\n\n", "w4\n\n"], "w5")
    again = builder.build(["w2 w3\n\n", "w4\n\n"], "w6")
    assert again.chunks == first.chunks == (encode("w2 w3\n\n"), encode("w4\n\n"))
    assert calls.count("w2 w3\n\n") == 1 and calls.count("w4\n\n") == 1
    builder.build(["w7\n\n"], "w5")  # a third chunk pushes out the least recently used
    builder.build(["w4\n\n"], "w5")
    builder.build(["w2 w3\n\n"], "w5")
    assert calls.count("w4\n\n") == 1 and calls.count("w2 w3\n\n") == 2
    other = builder.with_question_template("w8 {question}")
    monkeypatch.setattr(other, "encode", lambda text: calls.append(text) or encode(text))
    built = other.build(["w4\n\n"], "w5")
    assert built.chunks == (encode("w4\n\n"),) and built.question[0] == encode("w8")[0]
    assert calls.count("w4\n\n") == 1  # the variant shares what was remembered
