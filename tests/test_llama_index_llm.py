"""CacheCraftLLM with real LlamaIndex objects: RetrieverQueryEngine.from_args, Settings-free
as_query_engine(llm=...), a chat engine; the retrieved nodes become the prompt's chunks
and a repeated question reuses their chunk-caches."""

from __future__ import annotations

import pytest

faiss = pytest.importorskip("faiss")
pytest.importorskip("llama_index.core")
pytest.importorskip("llama_index.vector_stores.faiss")

from llama_index.core.query_engine import RetrieverQueryEngine  # noqa: E402

from cachecraft.integrations.llama_index import CacheCraftLLM  # noqa: E402
from cachecraft.integrations.llama_index_llm import split_prompt  # noqa: E402
from tests.test_llama_index import QUESTION, SETTINGS, embed_model, make_index  # noqa: E402,F401  (fixture)


def test_split_prompt_finds_the_nodes_and_keeps_the_template_apart():
    prompt = "Context:\n---\nalpha beta\n\ngamma delta\n---\nQuery: why?\nAnswer: "
    chunks, question = split_prompt(prompt, ["gamma delta", "alpha beta", "not there"])
    assert chunks == ["Context:\n---\n", "alpha beta", "gamma delta"]
    assert question == "\n---\nQuery: why?\nAnswer: "
    assert split_prompt("history\nuser: plain prompt", ["x y"]) == (["history\n"], "user: plain prompt")
    assert split_prompt("one line prompt", []) == (["one line "], "prompt")
    # the longer text first; a shorter one is taken where it does not overlap it
    assert split_prompt("a b c a b c?", ["a b c", "b c"]) == (["a b c", " a ", "b c"], "?")


@pytest.fixture
def llm(tiny_dir, cache_dir):
    made = CacheCraftLLM(model=str(tiny_dir), cache_dir=cache_dir, config=SETTINGS, max_new_tokens=6)
    yield made
    made.close()


def test_a_retriever_query_engine_reuses_the_nodes_chunk_caches(embed_model, llm):  # noqa: F811
    index = make_index(embed_model)
    engine = RetrieverQueryEngine.from_args(index.as_retriever(similarity_top_k=2), llm=llm)
    first = engine.query(QUESTION)
    report = llm.last_answer
    assert str(first) == report.text and report.text
    assert len(report.chunks) == 3  # the template's head and the two retrieved nodes
    assert all(c.tier == "miss" for c in report.chunks)
    engine.query(QUESTION)
    again = llm.last_answer
    assert [c.tier for c in again.chunks] == ["cpu"] * 3  # every chunk served from the memory tier
    streaming = RetrieverQueryEngine.from_args(index.as_retriever(similarity_top_k=2), llm=llm, streaming=True)
    streamed = streaming.query(QUESTION)
    assert "".join(streamed.response_gen) == str(first)


def test_index_helpers_and_a_chat_engine_take_it(embed_model, llm):  # noqa: F811
    index = make_index(embed_model)
    answer = index.as_query_engine(llm=llm, similarity_top_k=2).query(QUESTION)
    assert str(answer) and len(llm.last_answer.chunks) == 3
    chat = index.as_chat_engine(chat_mode="context", llm=llm, similarity_top_k=2)
    reply = chat.chat(QUESTION)
    assert str(reply) == llm.last_answer.text
    assert len(llm.last_answer.chunks) == 3  # the context went into the system message: still found
    chat.chat(QUESTION)
    assert [c.tier for c in llm.last_answer.chunks][1:] == ["cpu", "cpu"]  # the nodes' chunk-caches reused


def test_the_engine_serves_one_prefill_modes_and_refuses_the_others_by_name(embed_model, tiny_dir, cache_dir):  # noqa: F811
    from llama_index.core.prompts import PromptTemplate

    from cachecraft.integrations.llama_index import CacheCraftQueryEngine

    index = make_index(embed_model)
    with pytest.raises(ValueError, match="response_mode 'tree_summarize' .*CacheCraftLLM"):
        CacheCraftQueryEngine.from_index(index, model=str(tiny_dir), cache_dir=cache_dir, config=SETTINGS,
                                         response_mode="tree_summarize")
    with pytest.raises(ValueError, match="text_qa_template: .* RetrieverQueryEngine.from_args"):
        CacheCraftQueryEngine.from_index(index, model=str(tiny_dir), cache_dir=cache_dir, config=SETTINGS,
                                         text_qa_template=PromptTemplate("{context_str} {query_str}"))
    with CacheCraftQueryEngine.from_index(index, model=str(tiny_dir), cache_dir=cache_dir, config=SETTINGS,
                                          response_mode="no_text", max_new_tokens=4) as engine:
        response = engine.query(QUESTION)
        assert response.response is None and len(response.source_nodes) == 2
        prompts = engine.get_prompts()
        assert set(prompts) == {"text_qa_template"}
        assert set(prompts["text_qa_template"].template_vars) == {"context_str", "query_str"}
        with pytest.raises(ValueError, match="text_qa_template: "):
            engine.update_prompts({"text_qa_template": PromptTemplate("{context_str} {query_str}")})
    with CacheCraftQueryEngine.from_index(index, model=str(tiny_dir), cache_dir=cache_dir, config=SETTINGS,
                                          response_mode="simple_summarize", max_new_tokens=4) as engine:
        assert str(engine.query(QUESTION))
