"""``cachecraft serve`` in-process on the tiny model: OpenAI-shaped answers equal to the
pipeline's, streaming, the documents and separator forms reusing chunk-caches, errors as
one-line JSON, the queue's limits, the API key and the metrics."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="fastapi not installed (pip install cachecraft[server])")

from fastapi.testclient import TestClient  # noqa: E402

from cachecraft.catalog import CatalogUnavailableError  # noqa: E402
from cachecraft.config import Config  # noqa: E402
from cachecraft.engine import GenerationOptions  # noqa: E402
from cachecraft.pipeline import Pipeline  # noqa: E402
from cachecraft.pipeline.documents import ForgetIncomplete  # noqa: E402
from cachecraft.prompt import Conversation  # noqa: E402
from cachecraft.retrieval.snapshot import CorpusError  # noqa: E402
from cachecraft.server.app import create_app  # noqa: E402
from cachecraft.server.service import Busy, Service, TimedOut, search_text  # noqa: E402
from cachecraft.server.streaming import StopCutter  # noqa: E402
from cachecraft.store import TieredStore  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402
from tests.test_pipeline import CHUNKS, QUESTION  # noqa: E402

SEP = "<|chunk|>"


def make_service(cache_dir, **overrides) -> Service:
    config = Config.load(overrides={"cache_dir": cache_dir, "max_new_tokens": 6, "kv_dtype": "float32",
                                    **overrides}, environ={})
    pipe = Pipeline(config, lm=tiny_model("llama"), store=TieredStore(config, tiers=("cpu", "disk")))
    return Service(config, pipe)


@pytest.fixture
def service(tmp_path):
    svc = make_service(tmp_path / "server")
    yield svc
    svc.close()


@pytest.fixture
def client(service):
    with TestClient(create_app(service)) as c:
        yield c


@pytest.fixture
def reference(tmp_path):
    """A pipeline of its own (its own store) to compare answers with."""
    config = Config.load(overrides={"cache_dir": tmp_path / "reference", "max_new_tokens": 6,
                                    "kv_dtype": "float32"}, environ={})
    pipe = Pipeline(config, lm=tiny_model("llama"), store=TieredStore(config, tiers=("cpu",)))
    yield pipe
    pipe.close()


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"model": "cachecraft", **body})


def streamed(client, path: str, body: dict) -> tuple[str, list[dict]]:
    """The text of a streamed answer and its event payloads."""
    payloads = []
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    payloads = [json.loads(line[6:]) for line in lines[:-1]]
    pieces = [(p["choices"][0].get("delta") or {}).get("content") or p["choices"][0].get("text") or ""
              for p in payloads]
    return "".join(pieces), payloads


def test_chat_with_documents_answers_as_the_pipeline_does_and_reuses_on_repeat(client, reference):
    want = reference.answer(CHUNKS, QUESTION, method="full")
    got = chat(client, messages=[{"role": "user", "content": QUESTION}], documents=CHUNKS, method="full")
    assert got.status_code == 200, got.text
    data = got.json()
    assert data["object"] == "chat.completion" and data["choices"][0]["message"]["role"] == "assistant"
    assert data["choices"][0]["message"]["content"] == want.text
    assert data["usage"] == {"prompt_tokens": want.prompt_tokens, "completion_tokens": want.new_tokens,
                             "total_tokens": want.prompt_tokens + want.new_tokens}
    assert data["choices"][0]["finish_reason"] == "length"  # 6 tokens asked, 6 made
    first = chat(client, messages=[{"role": "user", "content": QUESTION}], documents=CHUNKS).json()
    again = chat(client, messages=[{"role": "user", "content": QUESTION}], documents=CHUNKS).json()
    assert first["cachecraft"]["hits_by_tier"] == {"miss": len(CHUNKS)}
    assert again["cachecraft"]["hits_by_tier"] == {"cpu": len(CHUNKS)}
    assert again["cachecraft"]["method"].startswith("cachecraft")


def test_a_chat_s_instructions_and_earlier_turns_are_in_its_prompt_and_its_chunks_reuse_caches(client, reference):
    messages = [{"role": "system", "content": "w40 w41"}, {"role": "user", "content": "w42"},
                {"role": "assistant", "content": "w43 w44"}, {"role": "developer", "content": "w45"},
                {"role": "user", "content": QUESTION}]
    said = Conversation(("w40 w41", "w45"), (("user", "w42"), ("assistant", "w43 w44")))
    plain = reference.answer(CHUNKS, QUESTION, method="full", record=False)
    want = reference.answer(CHUNKS, QUESTION, method="full", record=False, conversation=said)
    got = chat(client, messages=messages, documents=CHUNKS, method="full").json()
    assert got["choices"][0]["message"]["content"] == want.text
    # by hand, a token per word (the tiny model has no chat template): w40 w41, w45, the earlier
    # question as the template asks it (its 13-word instruction, Question: w42), Answer: w43 w44
    assert got["usage"]["prompt_tokens"] == want.prompt_tokens == plain.prompt_tokens + 2 + 1 + 13 + 2 + 3
    streamed_text, _ = streamed(client, "/v1/chat/completions",
                                {"messages": messages, "documents": CHUNKS, "method": "full"})
    assert streamed_text == want.text
    # chunk-caches made for a plain question serve the chat, whose own words are computed
    chat(client, messages=[{"role": "user", "content": QUESTION}], documents=CHUNKS)
    again = chat(client, messages=messages, documents=CHUNKS).json()
    assert again["cachecraft"]["hits_by_tier"] == {"cpu": len(CHUNKS)}
    assert again["usage"]["prompt_tokens"] == want.prompt_tokens


@pytest.mark.parametrize("when_idle", [True, False])
def test_idle_time_stores_an_answered_order_exactly_for_the_next_turn(tmp_path, reference, when_idle):
    svc = make_service(tmp_path / "server", exact_when_idle=when_idle)
    try:
        svc.pipeline.warm(CHUNKS)  # caches made after the warm context: reused inexactly
        with TestClient(create_app(svc)) as client:
            first = chat(client, messages=[{"role": "user", "content": QUESTION}], documents=CHUNKS).json()
            assert not first["cachecraft"]["reused_exact"] and not first["cachecraft"]["kept_exact"]
            svc.settle()  # the user reads the answer: the worker has time
            turns = [{"role": "user", "content": QUESTION},
                     {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "w60 w61"}]
            second = chat(client, messages=turns, documents=CHUNKS).json()
            metrics = client.get("/metrics").text
        said = Conversation((), (("user", QUESTION), ("assistant", first["choices"][0]["message"]["content"])))
        want = reference.answer(CHUNKS, "w60 w61", method="full", record=False, conversation=said)
        assert second["choices"][0]["message"]["content"] == want.text
        if when_idle:  # stored exactly while idle: every chunk reused as full's, nothing recomputed
            assert second["cachecraft"]["reused_exact"] and second["cachecraft"]["recompute_fraction"] == 0.0
            assert not second["cachecraft"]["kept_exact"] and svc.counters.made_exact == 1
            assert "cachecraft_orders_made_exact_total 1.0" in metrics
            assert svc.pipeline.make_exact(CHUNKS) == 0  # nothing left to store
        else:  # the second ask of the order pays the keep's full prefill at its first token
            assert second["cachecraft"]["kept_exact"] and second["cachecraft"]["recompute_fraction"] == 1.0
            assert svc.counters.made_exact == 0 and "cachecraft_orders_made_exact_total 0.0" in metrics
    finally:
        svc.close()


def test_idle_work_gives_way_to_a_waiting_request(tmp_path):
    svc = make_service(tmp_path / "server", exact_after_asks=0)  # the same order asked again: no keep
    try:
        svc.pipeline.warm(CHUNKS)
        made = []
        svc.pipeline.make_exact = lambda texts, sources=None, should_stop=None: made.append(texts) or len(texts)
        job = svc.job(QUESTION, documents=CHUNKS, method=None, top_k=None, max_tokens=None,
                      generation=GenerationOptions())
        with svc._pending_lock:
            svc._pending += 1  # a request waits: the idle work must not start
        svc.answer(job)
        svc.settle()
        assert made == [] and len(svc._to_make_exact) == 1
        with svc._pending_lock:
            svc._pending -= 1
        svc._worker.submit(svc._make_exact_while_idle).result()
        given = tuple(c.strip() for c in CHUNKS)  # as the server takes documents
        assert made == [given] and len(svc._to_make_exact) == 0
        other = svc.job(QUESTION, documents=CHUNKS, method="reuse", top_k=None, max_tokens=None,
                        generation=GenerationOptions())
        svc.answer(other)  # a baseline's answer is left as it is: only the policy's orders
        svc.settle()
        assert made == [given] and len(svc._to_make_exact) == 0
        with svc._pending_lock:
            svc._pending += 1
        svc.answer(job)
        svc.settle()
        assert len(svc._to_make_exact) == 1
        with pytest.raises(CorpusError):  # forgetting drops what was remembered, whatever it finds
            svc.forget(["no-such-file.txt"])
        assert len(svc._to_make_exact) == 0
        with svc._pending_lock:
            svc._pending -= 1
        svc._worker.submit(svc._make_exact_while_idle).result()
        assert made == [given] and svc.counters.made_exact == 1

        def cut_short(texts, sources=None, should_stop=None):  # a request comes after one chunk
            assert not should_stop()
            with svc._pending_lock:
                svc._pending += 1
            assert should_stop()
            made.append(texts)
            return 1
        svc.pipeline.make_exact = cut_short
        svc.answer(job)
        svc.settle()
        assert made == [given, given] and svc.counters.made_exact == 1  # not done: not counted
        assert list(svc._to_make_exact) == [(given, None)]  # goes on at the next idle time
    finally:
        svc.close()


def test_a_follow_up_is_searched_for_with_the_user_s_turn_before_it():
    assert search_text("w9", None) == "w9"
    assert search_text("w9", Conversation(("w1",), ())) == "w9"  # instructions are not searched for
    turns = (("user", "w1 w2"), ("assistant", "w3"), ("user", " w4 "), ("assistant", "w5"))
    assert search_text("w9", Conversation((), turns)) == "w4\nw9"


def test_streaming_equals_the_whole_answer(client, reference):
    want = reference.answer(CHUNKS, QUESTION, method="full")
    text, payloads = streamed(client, "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": QUESTION}], "documents": CHUNKS,
                               "method": "full"})
    assert text == want.text
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = payloads[-1]
    assert last["choices"][0]["finish_reason"] == "length" and last["usage"]["completion_tokens"] == 6
    assert last["cachecraft"]["hits_by_tier"] == {"miss": len(CHUNKS)}
    text, _ = streamed(client, "/v1/completions", {"prompt": SEP.join([*CHUNKS, QUESTION]), "method": "full"})
    assert text == want.text


def test_the_separator_form_hits_the_caches_on_a_repeat(client):
    prompt = SEP.join([*CHUNKS, QUESTION])
    first = client.post("/v1/completions", json={"prompt": prompt}).json()
    again = client.post("/v1/completions", json={"prompt": prompt}).json()
    assert first["object"] == "text_completion" and first["choices"][0]["text"] == again["choices"][0]["text"]
    assert first["cachecraft"]["hits_by_tier"] == {"miss": len(CHUNKS)}
    assert again["cachecraft"]["hits_by_tier"] == {"cpu": len(CHUNKS)}


def test_stop_strings_end_the_answer_before_them(client, reference):
    full = reference.answer(CHUNKS, QUESTION, method="full").text
    stop = full.split()[2]  # a word in the middle of the greedy answer
    body = {"messages": [{"role": "user", "content": QUESTION}], "documents": CHUNKS, "method": "full",
            "stop": [stop]}
    whole = chat(client, **body).json()
    assert whole["choices"][0]["message"]["content"] == full[:full.index(stop)]
    text, payloads = streamed(client, "/v1/chat/completions", body)
    assert text == full[:full.index(stop)] and payloads[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("body, status, words", [
    ("{not json", 400, "not valid JSON"),
    ({"messages": [{"role": "user", "content": "q"}], "documents": ["a"], "temprature": 0}, 400, "unknown field 'temprature'"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "assistant", "content": "q"}], "documents": ["a"]}, 400, "no user message"),
    ({"messages": [{"role": "user", "content": "q"}], "documents": ["a"], "model": "gpt-9"}, 404, "not served here"),
    ({"messages": [{"role": "user", "content": "q"}], "documents": ["a"], "n": 2}, 400, "n"),
    ({"messages": [{"role": "user", "content": "q"}], "documents": ["a"], "method": "nope"}, 400, "method"),
    ({"messages": [{"role": "user", "content": "q"}], "documents": []}, 400, "documents is empty"),
    ({"messages": [{"role": "user", "content": "q"}]}, 400, "corpus is empty"),
    ({"messages": [{"role": "user", "content": "w1 " * 3000}], "documents": ["a"]}, 400, "context window"),
    ({"messages": [{"role": "user", "content": "q"}], "documents": ["a"], "max_tokens": 10**6}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "q"}], "retrieval_order": "date"}, 400, "score, document"),
    ({"messages": [{"role": "user", "content": "q"}], "documents": ["a"], "chunk_order": "x"}, 400, "given, cache"),
    ({"messages": [{"role": "user", "content": "q"}], "documents": ["a"], "stream": "yes"}, 400, "stream: Input should be a valid boolean"),
    ({"messages": [{"role": "user", "content": "q"}], "documents": ["a"], "stream": 1}, 400, "stream"),
    ({"messages": [{"role": "user", "content": "q"}], "documents": ["a"], "max_tokens": "5"}, 400, "max_tokens: Input should be a valid integer"),
    ({"messages": [{"role": "user", "content": "q"}], "documents": ["a"], "method": ""}, 400, "method: unknown method ''"),
    ({"messages": [{"role": "user", "content": 5}], "documents": ["a"]}, 400, "messages.0.content: "),
    ({"messages": [{"role": "user", "content": [{"text": "q"}]}], "documents": ["a"]}, 400,
     "each content part needs a 'type' ('text')"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
      "documents": ["a"]}, 400, "only text content parts"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}], "documents": ["a"]}, 400,
     "needs its text as a string"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}], "documents": ["a"]}, 400,
     "needs its text as a string"),
    ("", 400, "the request has no body; send a JSON object"),
    ({"messages": [{"role": "user", "content": "  "}], "documents": ["a"]}, 400, "the question is empty"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "documents": ["a"]},
     400, "messages: the last user message is followed by an assistant message; the question to answer must "
          "come last"),
    ({"messages": [{"role": "system", "content": "s"}], "documents": ["a"]}, 400, "no user message to answer"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "t"}, {"role": "user", "content": "q"}],
      "documents": ["a"]}, 400, "messages: tool messages are not supported"),
    ({"messages": [{"role": "user", "content": "w1 " * 1000}, {"role": "user", "content": "q"}],
      "documents": ["a"]}, 400, "send fewer of the conversation's earlier turns"),
])
def test_bad_requests_are_one_line_json_errors(client, body, status, words):
    if isinstance(body, str):
        response = client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    else:
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"] and "\n" not in error["message"] and "Traceback" not in response.text


def test_the_api_key_is_required_when_set(tmp_path):
    service = make_service(tmp_path / "k", api_key="s3cret")
    try:
        with TestClient(create_app(service)) as c:
            body = {"messages": [{"role": "user", "content": QUESTION}], "documents": CHUNKS}
            assert c.get("/healthz").status_code == 200  # health checks need no key
            assert c.post("/v1/chat/completions", json=body).status_code == 401
            wrong = c.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401 and "API key" in wrong.json()["error"]["message"]
            ok = c.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer s3cret"})
            assert ok.status_code == 200
    finally:
        service.close()


def test_the_queue_refuses_past_its_length_and_times_out(tmp_path):
    service = make_service(tmp_path / "q", server_queue=1, server_timeout_s=0.5)
    release = threading.Event()

    async def scenario():
        first = asyncio.ensure_future(service.run(lambda: release.wait(5)))  # computing
        second = asyncio.ensure_future(service.run(lambda: "second"))  # waiting
        await asyncio.sleep(0.05)
        with pytest.raises(Busy, match="server_queue = 1"):
            await service.run(lambda: "third")
        release.set()
        assert await first is True and await second == "second"
        hold = threading.Event()
        busy = asyncio.ensure_future(service.run(lambda: hold.wait(5)))
        await asyncio.sleep(0.05)
        cancel, ran = threading.Event(), []
        with pytest.raises(TimedOut, match="server_timeout_s"):
            await service.run(lambda: ran.append(1), cancel, timeout_s=0.1)
        assert cancel.is_set()  # had it been generating, it would stop at its next token
        hold.set()
        await busy
        await asyncio.sleep(0.05)
        assert ran == []  # timed out while queued: never run

    try:
        asyncio.run(scenario())
        assert service.counters.refused_busy == 1 and service.counters.timed_out == 1 and service.queued == 0
    finally:
        service.close()


def test_upkeep_is_not_cut_by_the_answer_timeout(tmp_path, monkeypatch):
    """Ingest, forget and warm run to their end once started: answering 503 "retry later"
    for one that then finished would have the client do it twice."""
    service = make_service(tmp_path / "u", server_timeout_s=0.2)

    class Done:
        def to_dict(self):
            return {"done": True}

    def slowly(*args, **kwargs):
        time.sleep(0.6)
        return Done()

    monkeypatch.setattr(service.pipeline, "ingest", slowly)
    monkeypatch.setattr(service.pipeline, "forget_documents", slowly)
    try:
        with TestClient(create_app(service)) as c:
            assert c.post("/v1/ingest", json={"paths": ["a.txt"]}).json() == {"done": True}
            assert c.post("/v1/forget", json={"paths": ["a.txt"]}).json() == {"done": True}
            assert service.counters.timed_out == 0
    finally:
        service.close()


def test_ingest_query_stats_health_and_metrics(client, service, tmp_path, monkeypatch):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i, chunk in enumerate(CHUNKS):
        (docs / f"d{i}.txt").write_text(chunk)
    empty = client.post("/v1/warm", json={})
    assert empty.status_code == 400 and empty.json()["error"]["message"].endswith("is empty: POST /v1/ingest first")
    ingested = client.post("/v1/ingest", json={"paths": [str(docs)]})
    assert ingested.status_code == 200 and ingested.json()["skipped"] == []
    for shard in ([1, 0], [5, 2], [-1, 2], ["0", "1"]):
        refused = client.post("/v1/warm", json={"shard": shard})
        assert refused.status_code == 400 and refused.json()["error"]["message"].startswith("shard"), refused.text
    assert client.post("/v1/warm", json={}).json()["total"] >= len(CHUNKS)
    corpus, searches = service.pipeline.corpus, []
    search = corpus.search
    monkeypatch.setattr(corpus, "search", lambda *args: searches.append(args) or search(*args))
    answer = chat(client, messages=[{"role": "user", "content": CHUNKS[1]}], top_k=2).json()
    assert len(searches) == 1  # one search: the answer is made over the chunks its room was measured on
    assert len(answer["cachecraft"]["sources"]) == 2
    assert answer["cachecraft"]["retrieval_s"] > 0
    assert set(answer["cachecraft"]["hits_by_tier"]) <= {"cpu", "disk"}  # warmed
    follow_up = chat(client, messages=[{"role": "user", "content": CHUNKS[1]}, {"role": "assistant", "content": "w1"},
                                       {"role": "user", "content": "w299"}], top_k=2)
    assert follow_up.status_code == 200 and searches[-1][0] == CHUNKS[1].strip() + "\nw299"
    # found by the turn before, not by w299 alone
    assert follow_up.json()["cachecraft"]["sources"][0]["id"] == answer["cachecraft"]["sources"][0]["id"]
    assert client.get("/healthz").json()["status"] == "ok"
    assert client.get("/v1/models").json()["data"][0]["object"] == "model"
    stats = client.get("/v1/stats").json()
    assert stats["counts"]["requests"] == 2 and "budget_bytes" in stats["tiers"]["cpu"]
    metrics = client.get("/metrics").text
    assert 'cachecraft_chunk_lookups_total{tier="' in metrics
    assert 'cachecraft_http_requests_total{path="/v1/chat/completions",status="200"} 2.0' in metrics
    assert "cachecraft_tier_bytes{tier=\"cpu\"}" in metrics and "cachecraft_ttft_seconds_bucket" in metrics
    forgot = client.post("/v1/forget", json={"paths": ["d0.txt"]})
    assert forgot.status_code == 200, forgot.text
    assert forgot.json()["files"] == [str((docs / "d0.txt").resolve())] and forgot.json()["evicted"] >= 1
    assert str((docs / "d0.txt").resolve()) not in corpus.documents()
    missing = client.post("/v1/forget", json={"paths": ["d0.txt"]})  # gone already
    assert missing.status_code == 400 and missing.json()["error"]["message"].endswith(
        "nothing was ingested from d0.txt (`cachecraft documents` on the server lists what was)")

    def redis_away(paths, keep_caches=False):
        raise ForgetIncomplete("forgot 1 file(s), but the shared tier at redis://h:1/0 did not answer")

    monkeypatch.setattr(service.pipeline, "forget_documents", redis_away)
    away = client.post("/v1/forget", json={"paths": ["d1.txt"]})
    assert away.status_code == 503 and "did not answer" in away.json()["error"]["message"]

    def catalog_away(catalog, top=10):
        raise CatalogUnavailableError("cannot reach the catalog at catalog_url postgresql+psycopg://db/c")

    monkeypatch.setattr("cachecraft.catalog.stats.summary", catalog_away)
    no_stats = client.get("/v1/stats")
    assert no_stats.status_code == 503 and "cannot reach the catalog" in no_stats.json()["error"]["message"]
    assert client.get("/healthz").json()["status"] == "ok"  # the server itself is fine


def test_a_request_may_ask_for_its_own_retrieval_and_chunk_order(tmp_path):
    from tests.test_pipeline import _write_docs

    service = make_service(tmp_path / "server", chunk_tokens=24, top_k=4)
    try:
        with TestClient(create_app(service)) as client:
            assert client.post("/v1/ingest", json={"paths": [str(_write_docs(tmp_path / "docs"))]}).status_code == 200
            position = {c.id: (c.source, c.position) for c in service.pipeline.corpus.chunks()}
            asked = {"messages": [{"role": "user", "content": "w80 w81 w82 w12 w13"}], "method": "full"}
            placed = {}
            for order in ("score", "document", None):
                extra = {} if order is None else {"retrieval_order": order}
                report = chat(client, **asked, **extra).json()["cachecraft"]
                placed[order] = [position[s["id"]] for s in report["sources"]]
                assert report["order"] is None
            assert placed[None] == placed["score"] != placed["document"]  # the server's own: score
            files = [source for source, _ in placed["document"]]
            assert placed["document"] == sorted(placed["document"], key=lambda p: (files.index(p[0]), p[1]))
            chained = chat(client, **asked, chunk_order="cache").json()["cachecraft"]
            assert sorted(chained["order"]) == list(range(4))  # chained: the prompt's order is reported
    finally:
        service.close()


def test_stop_cutter_holds_back_a_possible_stop_string():
    cutter = StopCutter(("END",))
    assert cutter.feed("ab") == ""  # the last len("END") - 1 characters are held back
    assert cutter.feed("cE") == "ab"
    assert cutter.feed("N") == "c"  # "EN" may begin "END"
    assert cutter.feed("D and more") == "" and cutter.stopped
    assert cutter.finish() == "" and cutter.feed("x") == ""
    plain = StopCutter(())
    assert plain.feed("abc") == "abc" and plain.finish() == ""
