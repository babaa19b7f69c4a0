"""The LlamaIndex query engine over a real VectorStoreIndex (FAISS + bundled MiniLM)."""

from __future__ import annotations

import asyncio
import hashlib
import threading

import pytest

faiss = pytest.importorskip("faiss")
pytest.importorskip("llama_index.core")
pytest.importorskip("llama_index.vector_stores.faiss")

from llama_index.core import StorageContext, VectorStoreIndex  # noqa: E402
from llama_index.core.base.response.schema import (AsyncStreamingResponse, Response,  # noqa: E402
                                                   StreamingResponse)
from llama_index.core.callbacks import CallbackManager, CBEventType, LlamaDebugHandler  # noqa: E402
from llama_index.core.instrumentation import get_dispatcher  # noqa: E402
from llama_index.core.instrumentation.event_handlers import BaseEventHandler  # noqa: E402
from llama_index.core.schema import (NodeRelationship, NodeWithScore, QueryBundle,  # noqa: E402
                                     RelatedNodeInfo, TextNode)
from llama_index.vector_stores.faiss import FaissVectorStore  # noqa: E402

from cachecraft.integrations.llama_index import (CacheCraftEmbedding, CacheCraftQueryEngine,  # noqa: E402
                                                 DocumentOrder, content_hash, in_document_order,
                                                 pipeline_lock)
from cachecraft.methods import UnknownMethod  # noqa: E402
from cachecraft.prompt import PromptBuilder  # noqa: E402

# Texts in the tiny tokenizer's words (w0 .. w316); titles too.
PASSAGES = [(f"w{i + 1}", " ".join(f"w{10 + 25 * i + j}" for j in range(18))) for i in range(6)]
QUESTION = "w60 w61 w62 w63"
NEW_TOKENS = 8
SETTINGS = {"kv_dtype": "float32", "policy_check_layer": 2}  # float32: exactness is the method's alone


@pytest.fixture(scope="module")
def embed_model():
    return CacheCraftEmbedding()


def make_index(embed_model, passages=PASSAGES, prefix="node") -> VectorStoreIndex:
    """A VectorStoreIndex over FAISS (inner product on unit vectors) with explicit node ids."""
    nodes = [TextNode(id_=f"{prefix}-{i}", text=text, metadata={"title": title})
             for i, (title, text) in enumerate(passages)]
    store = FaissVectorStore(faiss_index=faiss.IndexFlatIP(embed_model.embed_dim))
    return VectorStoreIndex(nodes, storage_context=StorageContext.from_defaults(vector_store=store),
                            embed_model=embed_model)


@pytest.fixture
def engine(embed_model, tiny_dir, cache_dir):
    with CacheCraftQueryEngine.from_index(make_index(embed_model), model=str(tiny_dir), similarity_top_k=2,
                                          cache_dir=cache_dir, config=SETTINGS,
                                          max_new_tokens=NEW_TOKENS) as built:
        yield built


def prompt_texts(response) -> list[str]:
    return [PromptBuilder.chunk_text(n.node.text, n.node.metadata["title"]) for n in response.source_nodes]


def test_embedding_is_minilm_with_unit_vectors(embed_model):
    assert embed_model.model_name == "minilm" and embed_model.embed_dim == 384
    query = embed_model.get_query_embedding("where is the paper tray")
    batch = embed_model.get_text_embedding_batch(["where is the paper tray", "w1 w2"])
    assert len(query) == 384 and sum(x * x for x in query) == pytest.approx(1.0, abs=1e-4)
    assert batch[0] == pytest.approx(query, abs=1e-5)


def test_first_answer_equals_full_prefill_on_the_retrieved_chunks(engine):
    response = engine.query(QUESTION)
    assert isinstance(response, Response)
    expected = engine.retriever.retrieve(QUESTION)
    assert [(n.node.node_id, n.score) for n in response.source_nodes] == [(n.node.node_id, n.score) for n in expected]
    assert len(response.source_nodes) == 2 and response.source_nodes[0].score >= response.source_nodes[1].score

    report = response.metadata["cachecraft"]
    texts = prompt_texts(response)
    # All misses: every chunk is computed in context, which must be exactly a full prefill.
    full = engine.pipeline.answer(texts, QUESTION, method="full", max_new_tokens=NEW_TOKENS, record=False)
    assert response.response and response.response == full.text
    assert report["recompute_fraction"] == 1.0 and report["method"].startswith("cachecraft")
    assert report["prompt_tokens"] == full.prompt_tokens and report["new_tokens"] == full.new_tokens
    assert [c["cache_key"] for c in report["chunks"]] == [c.chunk for c in full.chunks]
    assert [c["content_hash"] for c in report["chunks"]] == [hashlib.sha256(t.encode()).hexdigest() for t in texts]
    assert all(c["tier"] == "miss" and not c["hit"] and c["fraction"] == 1.0 for c in report["chunks"])
    assert {"ttft_s", "saved_s", "full_prefill_estimate_s", "request_id"} <= set(report)
    assert [s["node_id"] for s in report["sources"]] == [n.node.node_id for n in response.source_nodes]
    for node in response.source_nodes:  # LlamaIndex's own metadata shape is kept alongside
        assert response.metadata[node.node.node_id] == node.node.metadata


def test_repeat_and_same_text_under_other_node_ids_hit(engine, embed_model):
    first = engine.query(QUESTION)
    again = engine.query(QUESTION)
    report = again.metadata["cachecraft"]
    assert all(c["hit"] and c["tier"] != "miss" for c in report["chunks"])
    assert report["recompute_fraction"] == 0.0 and again.response == first.response

    other = CacheCraftQueryEngine(make_index(embed_model, prefix="copy").as_retriever(similarity_top_k=2),
                                  pipeline=engine.pipeline, max_new_tokens=NEW_TOKENS)
    copied = other.query(QUESTION)
    assert {n.node.node_id for n in copied.source_nodes}.isdisjoint(n.node.node_id for n in first.source_nodes)
    chunks = copied.metadata["cachecraft"]["chunks"]
    assert [c["content_hash"] for c in chunks] == [c["content_hash"] for c in report["chunks"]]
    assert all(c["hit"] for c in chunks) and copied.response == first.response


def test_a_text_retrieved_twice_is_sent_once(embed_model, engine):
    title, text = PASSAGES[2]
    index = make_index(embed_model, [(title, text), (title, text), PASSAGES[0]], prefix="dup")
    dup = CacheCraftQueryEngine(index.as_retriever(similarity_top_k=2), pipeline=engine.pipeline,
                                max_new_tokens=NEW_TOKENS)
    response = dup.query(text)
    report = response.metadata["cachecraft"]
    assert len(response.source_nodes) == 2 and len(report["chunks"]) == 1
    digest = content_hash(PromptBuilder.chunk_text(text, title))
    assert [s["content_hash"] for s in report["sources"]] == [digest, digest]


def test_streaming_pieces_join_to_the_answer(engine):
    streaming = CacheCraftQueryEngine(engine.retriever, pipeline=engine.pipeline, streaming=True,
                                      max_new_tokens=NEW_TOKENS)
    response = streaming.query(QUESTION)
    assert isinstance(response, StreamingResponse) and len(response.source_nodes) == 2
    pieces = list(response.response_gen)
    assert len(pieces) > 1  # the answer arrives in pieces, not in one go
    report = response.metadata["cachecraft"]  # filled in once the stream is consumed
    assert report is not None and all(not c["hit"] for c in report["chunks"])
    assert "".join(pieces) == engine.query(QUESTION).response


def test_streaming_raises_the_request_error_and_frees_the_pipeline(engine, monkeypatch):
    original = engine.pipeline.answer

    def fails_after_generating(*args, **kwargs):
        original(*args, **kwargs)
        raise RuntimeError("catalog write failed")

    monkeypatch.setattr(engine.pipeline, "answer", fails_after_generating)
    streaming = CacheCraftQueryEngine(engine.retriever, pipeline=engine.pipeline, streaming=True,
                                      max_new_tokens=NEW_TOKENS)
    response = streaming.query(QUESTION)
    with pytest.raises(RuntimeError, match="catalog write failed"):
        list(response.response_gen)
    monkeypatch.setattr(engine.pipeline, "answer", original)
    assert engine.query(QUESTION).response  # the lock was released


def test_aquery_gives_the_same_answer(engine):
    async def run():
        plain = await engine.aquery(QUESTION)
        streaming = CacheCraftQueryEngine(engine.retriever, pipeline=engine.pipeline, streaming=True,
                                          max_new_tokens=NEW_TOKENS)
        streamed = await streaming.aquery(QUESTION)
        assert isinstance(streamed, AsyncStreamingResponse)
        text = "".join([piece async for piece in streamed.async_response_gen()])
        return plain, streamed, text

    plain, streamed, text = asyncio.run(run())
    assert isinstance(plain, Response) and plain.response
    assert plain.response == engine.query(QUESTION).response == text
    assert streamed.metadata["cachecraft"]["chunks"] and all(c["hit"] for c in streamed.metadata["cachecraft"]["chunks"])


def test_one_request_at_a_time_per_pipeline(engine):
    other = CacheCraftQueryEngine(engine.retriever, pipeline=engine.pipeline, max_new_tokens=NEW_TOKENS)
    assert pipeline_lock(other.pipeline) is pipeline_lock(engine.pipeline)
    done = threading.Event()
    worker = threading.Thread(target=lambda: (other.query(QUESTION), done.set()))
    with pipeline_lock(engine.pipeline):
        worker.start()
        assert not done.wait(1.0)  # retrieval may run, the prefill waits for the lock
    worker.join(60)
    assert done.is_set()


class Recorder(BaseEventHandler):
    names: list = []

    @classmethod
    def class_name(cls) -> str:
        return "Recorder"

    def handle(self, event, **kwargs) -> None:
        self.names.append(event.class_name())


def test_events_reach_the_root_dispatcher_and_the_callback_manager(embed_model, tiny_dir, cache_dir):
    debug = LlamaDebugHandler()
    recorder = Recorder(names=[])
    root = get_dispatcher()
    root.add_event_handler(recorder)
    try:
        with CacheCraftQueryEngine.from_index(make_index(embed_model), model=str(tiny_dir), similarity_top_k=2,
                                              cache_dir=cache_dir, config=SETTINGS, max_new_tokens=NEW_TOKENS,
                                              callback_manager=CallbackManager([debug])) as engine:
            engine.query(QUESTION)
    finally:
        root.event_handlers.remove(recorder)
    wanted = ["QueryStartEvent", "RetrievalStartEvent", "RetrievalEndEvent", "SynthesizeStartEvent",
              "SynthesizeEndEvent", "QueryEndEvent"]
    seen = [name for name in recorder.names if name in wanted]
    assert seen == wanted
    for kind in (CBEventType.QUERY, CBEventType.RETRIEVE, CBEventType.SYNTHESIZE):
        assert len(debug.get_event_pairs(kind)) == 1, kind


def test_bad_arguments_are_refused(engine, tiny_dir):
    with pytest.raises(ValueError, match="not both"):
        CacheCraftQueryEngine(engine.retriever, pipeline=engine.pipeline, model=str(tiny_dir))
    with pytest.raises(UnknownMethod, match="unknown method"):
        CacheCraftQueryEngine(engine.retriever, pipeline=engine.pipeline, method="magic")
    with pytest.raises(TypeError, match="BaseRetriever"):
        CacheCraftQueryEngine(object(), pipeline=engine.pipeline)


def _node(name: str, document: str | None, start: int | None, score: float) -> NodeWithScore:
    node = TextNode(id_=name, text=name, start_char_idx=start)
    if document is not None:
        node.relationships[NodeRelationship.SOURCE] = RelatedNodeInfo(node_id=document)
    return NodeWithScore(node=node, score=score)


# best first: b's later part, a's later part, an unplaced node, a's start, b's start, a's node with no offset
RETRIEVED = [_node("b2", "b", 900, 0.9), _node("a2", "a", 500, 0.8), _node("x", None, None, 0.7),
             _node("a1", "a", 0, 0.6), _node("b1", "b", 100, 0.5), _node("a?", "a", None, 0.4)]
IN_DOCUMENT_ORDER = ["b1", "b2", "a1", "a2", "a?", "x"]  # worked out by hand


def test_document_order_groups_each_documents_nodes_in_its_order():
    assert [n.node.node_id for n in in_document_order(RETRIEVED)] == IN_DOCUMENT_ORDER
    got = DocumentOrder().postprocess_nodes(RETRIEVED, query_str="q")
    assert [n.node.node_id for n in got] == IN_DOCUMENT_ORDER
    assert [n.node.node_id for n in RETRIEVED][:2] == ["b2", "a2"]  # the input is left as it was


def test_the_engine_retrieves_in_the_configs_order(tiny_dir, cache_dir):
    from llama_index.core.retrievers import BaseRetriever

    class Fixed(BaseRetriever):
        def _retrieve(self, query_bundle):
            return list(RETRIEVED)

    for order, want in (("score", [n.node.node_id for n in RETRIEVED]), ("document", IN_DOCUMENT_ORDER)):
        with CacheCraftQueryEngine(Fixed(), model=str(tiny_dir), cache_dir=cache_dir,
                                   config={**SETTINGS, "retrieval_order": order}) as engine:
            assert [n.node.node_id for n in engine.retrieve(QueryBundle("q"))] == want
            assert [n.node.node_id for n in asyncio.run(engine.aretrieve(QueryBundle("q")))] == want


@pytest.mark.slow
def test_real_model_answers_and_second_query_hits(embed_model, tmp_path_factory):
    passages = [
        ("Paper tray", "The Kestrel K7 paper tray holds up to 200 labels. Open it by pressing the grey latch."),
        ("Power", "The K7 runs on a 24 V adapter. The power light turns green when the printer is ready."),
        ("Cleaning", "Clean the print head every month with an alcohol swab; let it dry before printing."),
        ("Wi-Fi", "Hold the Wi-Fi button for five seconds to pair the printer with a network."),
        ("Errors", "A blinking red light means the label roll is empty or jammed."),
        ("Warranty", "The printer has a two-year warranty covering parts and labour."),
    ]
    cache = tmp_path_factory.mktemp("real-cache")
    with CacheCraftQueryEngine.from_index(make_index(embed_model, passages), model="smollm2", similarity_top_k=2,
                                          cache_dir=cache, max_new_tokens=16) as engine:
        question = "What does a blinking red light mean?"
        first = engine.query(question)
        again = engine.query(question)
    assert first.response.strip() and again.response.strip()
    assert any(n.node.metadata["title"] == "Errors" for n in first.source_nodes)
    assert all(c["hit"] for c in again.metadata["cachecraft"]["chunks"])
    assert not any(c["hit"] for c in first.metadata["cachecraft"]["chunks"])


def test_the_cache_report_names_each_chunk_by_its_text_in_the_order_the_prompt_held_them():
    from cachecraft.integrations.llama_index import cache_report, content_hash
    from cachecraft.pipeline.reports import Answer, ChunkReport

    def report(position: int, tier: str) -> ChunkReport:
        return ChunkReport(position, f"key{position}", 5, tier, None, None, None, None, 1.0, None)

    # the prompt held the second text first (chunk_order "cache")
    answer = Answer("x", "cachecraft", 0.1, 20, 1, 0.5, [report(0, "cpu"), report(1, "miss")], order=[1, 0])
    out = cache_report(answer, ["first text", "second text"], [])
    assert [c["content_hash"] for c in out["chunks"]] == [content_hash("second text"), content_hash("first text")]
    assert [c["hit"] for c in out["chunks"]] == [True, False] and out["order"] == [1, 0]
    given = cache_report(Answer("x", "cachecraft", 0.1, 20, 1, 0.5, [report(0, "cpu"), report(1, "miss")]),
                         ["first text", "second text"], [])
    assert [c["content_hash"] for c in given["chunks"]] == [content_hash("first text"), content_hash("second text")]
