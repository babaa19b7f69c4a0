"""``cachecraft serve`` as a real process on a loopback port, driven by the official
``openai`` client and by ``cachecraft query/stats --server``: answers equal the
pipeline's, a client that disconnects mid-stream does not stop the server, and a
``kill -9`` during a warm leaves the cache consistent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="fastapi not installed (pip install cachecraft[server])")
openai = pytest.importorskip("openai", reason="openai not installed (pip install cachecraft[dev])")

from cachecraft.bench.serving import Server  # noqa: E402
from cachecraft.config import Config  # noqa: E402
from cachecraft.pipeline import Pipeline  # noqa: E402
from cachecraft.prompt import Conversation  # noqa: E402
from cachecraft.store import TieredStore, verify  # noqa: E402
from tests.servers import free_port  # noqa: E402
from tests.test_pipeline import CHUNKS, QUESTION  # noqa: E402

class ServerProcess(Server):
    """``cachecraft serve`` on the tiny model in a subprocess (the benchmark's server), with
    the CLI at hand for commands that ask it."""

    def __init__(self, cache_dir: Path, model: Path, **env: str) -> None:
        self.env = {**os.environ, "CACHECRAFT_CACHE_DIR": str(cache_dir), "CACHECRAFT_MODEL": str(model),
                    "CACHECRAFT_KV_DTYPE": "float32", "CACHECRAFT_MAX_NEW_TOKENS": "6", "OMP_NUM_THREADS": "1",
                    **env}
        super().__init__(cache_dir, self.env)

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cachecraft.cli.app", *args], env={**self.env,
                              "CACHECRAFT_SERVER": self.url}, capture_output=True, text=True, timeout=120)


@pytest.fixture
def server(tiny_dir, tmp_path):
    proc = ServerProcess(tmp_path / "cache", tiny_dir)
    yield proc
    proc.stop()


def reference_text(tiny_dir, tmp_path, conversation: Conversation | None = None) -> str:
    from cachecraft.model.loader import load_model
    config = Config.load(overrides={"cache_dir": tmp_path / "reference", "model": str(tiny_dir), "max_new_tokens": 6,
                                    "kv_dtype": "float32"}, environ={})
    with Pipeline(config, lm=load_model(config.model, config), store=TieredStore(config, tiers=("cpu",))) as pipe:
        return pipe.answer(CHUNKS, QUESTION, method="full", conversation=conversation).text


def test_the_openai_client_gets_the_pipelines_answer_streamed_or_not(server, tiny_dir, tmp_path):
    want = reference_text(tiny_dir, tmp_path)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    extra = {"documents": CHUNKS, "method": "full"}
    whole = client.chat.completions.create(model="cachecraft", messages=[{"role": "user", "content": QUESTION}],
                                           max_tokens=6, extra_body=extra)
    assert whole.choices[0].message.content == want
    assert whole.model_extra["cachecraft"]["hits_by_tier"] == {"miss": len(CHUNKS)}
    stream = client.chat.completions.create(model="cachecraft", messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=6, stream=True, extra_body=extra)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    text = client.completions.create(model="cachecraft", prompt="<|chunk|>".join([*CHUNKS, QUESTION]), max_tokens=6)
    assert text.choices[0].text == want
    again = client.completions.create(model="cachecraft", prompt="<|chunk|>".join([*CHUNKS, QUESTION]), max_tokens=6)
    assert set(again.model_extra["cachecraft"]["hits_by_tier"]) == {"cpu"}  # the server's memory tier
    with pytest.raises(openai.BadRequestError, match="unknown field"):
        client.chat.completions.create(model="cachecraft", messages=[{"role": "user", "content": "q"}],
                                       extra_body={"documents": ["a"], "temprature": 1})
    # a follow-up: the conversation so far in messages, as any chat client sends it
    follow_up = client.chat.completions.create(model="cachecraft", max_tokens=6, extra_body=extra, messages=[
        {"role": "system", "content": "w40"}, {"role": "user", "content": "w41"},
        {"role": "assistant", "content": want}, {"role": "user", "content": QUESTION}])
    said = Conversation(("w40",), (("user", "w41"), ("assistant", want)))
    assert follow_up.choices[0].message.content == reference_text(tiny_dir, tmp_path, said)


def test_a_client_gone_mid_stream_leaves_the_server_serving(server):
    import http.client
    body = json.dumps({"messages": [{"role": "user", "content": QUESTION}], "documents": CHUNKS, "stream": True,
                       "max_tokens": 6})
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    response.fp.readline()  # the first event, then hang up
    conn.sock.close()
    conn.close()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    answer = client.chat.completions.create(model="cachecraft", messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=6, extra_body={"documents": CHUNKS})
    assert answer.choices[0].message.content
    assert json.loads(urllib.request.urlopen(server.url + "/healthz", timeout=5).read())["queued"] == 0


def test_query_and_stats_ask_the_running_server(server, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i, chunk in enumerate(CHUNKS):
        (docs / f"d{i}.txt").write_text(chunk)
    request = urllib.request.Request(server.url + "/v1/ingest", data=json.dumps({"paths": [str(docs)]}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    assert json.loads(urllib.request.urlopen(request, timeout=60).read())["skipped"] == []
    done = server.cli("query", CHUNKS[2], "--json", "--top-k", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(done.stdout)
    assert data["server"] == server.url and len(data["cachecraft"]["sources"]) == 2
    assert data["cachecraft"]["order"] is None  # the server's own chunk order: as given
    chained = server.cli("query", CHUNKS[2], "--json", "--top-k", "2", "--chunk-order", "cache")
    assert chained.returncode == 0 and sorted(json.loads(chained.stdout)["cachecraft"]["order"]) == [0, 1]
    shown = server.cli("query", CHUNKS[2], "--top-k", "2")
    assert shown.returncode == 0 and "TTFT" in shown.stdout and f"answered by the server at {server.url}" in shown.stdout
    stats = server.cli("stats", "--json")
    assert stats.returncode == 0 and json.loads(stats.stdout)["counts"]["requests"] == 3
    assert len(json.loads(stats.stdout)["top_chunks"]) == 2  # the two retrieved
    assert len(json.loads(server.cli("stats", "--json", "--top", "1").stdout)["top_chunks"]) == 1
    other = server.cli("query", CHUNKS[2], "--model", "smollm2")
    assert other.returncode == 1 and "--model does not apply with a server" in other.stderr


def test_query_with_no_server_there_is_one_line(tmp_path):
    env = {**os.environ, "CACHECRAFT_CACHE_DIR": str(tmp_path), "CACHECRAFT_SERVER": f"http://127.0.0.1:{free_port()}"}
    done = subprocess.run([sys.executable, "-m", "cachecraft.cli.app", "query", "anything"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "no cachecraft server at" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_port_in_use_or_a_bad_log_level_is_one_line_before_anything_loads(server, tiny_dir, tmp_path):
    port = server.url.rsplit(":", 1)[1]
    second = server.cli("serve", "--port", port)
    assert second.returncode == 1 and "serving" not in second.stdout
    assert second.stderr.strip() == (f"error: cannot listen on 127.0.0.1:{port}: Address already in use; another "
                                     "server is there: stop it or pick another --port")
    bad = server.cli("serve", "--port", str(free_port()), "--log-level", "loud")
    assert bad.returncode == 1 and "serving" not in bad.stdout and "Traceback" not in bad.stderr
    assert "unknown --log-level 'loud'; one of critical, error, warning, info, debug, trace" in bad.stderr
    assert server.cli("stats", "--json").returncode == 0  # the first server still answers


def test_kill_9_during_a_warm_leaves_the_cache_consistent(tiny_dir, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(120):
        (docs / f"d{i}.txt").write_text(" ".join(f"w{(i * 7 + j) % 300}" for j in range(40)))
    server = ServerProcess(tmp_path / "cache", tiny_dir)
    try:
        ingest = urllib.request.Request(server.url + "/v1/ingest", data=json.dumps({"paths": [str(docs)]}).encode(),
                                        headers={"Content-Type": "application/json"}, method="POST")
        assert json.loads(urllib.request.urlopen(ingest, timeout=120).read())["skipped"] == []
        warm = subprocess.Popen(["curl", "-s", "-X", "POST", server.url + "/v1/warm", "-H",
                                 "Content-Type: application/json", "-d", "{}"], stdout=subprocess.DEVNULL)
        time.sleep(1.0)
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(30)
        warm.wait(30)
    finally:
        server.stop()
    report = verify(tmp_path / "cache")
    # nothing damaged or lost: the dead process's memory-tier rows are all that is left (the next open drops them)
    assert {p.kind for p in report.problems} <= {"dead-owner"}, report.problems
    again = ServerProcess(tmp_path / "cache", tiny_dir)  # opening reconciles; a new warm finishes the job
    try:
        warmed = urllib.request.Request(again.url + "/v1/warm", data=b"{}", headers={"Content-Type":
                                        "application/json"}, method="POST")
        result = json.loads(urllib.request.urlopen(warmed, timeout=300).read())
        assert result["made"] + result["skipped"] == result["total"]
    finally:
        again.stop()
    assert verify(tmp_path / "cache").ok


def test_bench_serve_runs_clients_against_fresh_servers(tiny_dir, tmp_path):
    from cachecraft.bench.serving import percentile, run_serving
    from cachecraft.bench.workload import build_trace
    from tests.test_workload import ITEMS, fake_embed

    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5 and percentile([], 50) is None
    trace, _ = build_trace(ITEMS, 6, 3, embed=fake_embed, seed=1)
    models = tmp_path / "models"
    models.mkdir()
    env = {"CACHECRAFT_MODEL": str(tiny_dir), "CACHECRAFT_KV_DTYPE": "float32", "OMP_NUM_THREADS": "1"}
    runs = run_serving(trace, clients=[1, 2], methods=["cachecraft", "full"], max_tokens=3, workdir=tmp_path / "w",
                       models_dir=models, env=env)
    assert [(r["method"], r["clients"], r["started"]) for r in runs] == [
        ("cachecraft", 1, 0), ("cachecraft", 2, 3), ("full", 1, 1), ("full", 2, 2)]  # made side by side
    for run in runs:
        assert run["requests"] == 6 and run["errors"] == [] and run["throughput_rps"] > 0
        assert run["client_ttft_s"]["p50"] <= run["client_ttft_s"]["p99"]
    assert runs[0]["hit_rate"] > 0 and runs[2]["hit_rate"] == 0  # full never looks up chunk-caches
    from cachecraft.bench.readme import serve_table
    table = serve_table({"runs": runs, "command": "cachecraft bench serve", "model": "tiny", "unique_requests": 3,
                         "top_k": 3, "date": "2026-11-24", "machine": {"cpu": "cpu", "cores": 2}})
    assert table.count("| cachecraft | ") == 2 and table.count("| full | ") == 2


def test_a_llama_index_app_with_its_own_retriever_reuses_the_servers_chunk_caches(tiny_dir, tmp_path):
    """CacheCraftLLM(server=...) in a RetrieverQueryEngine over the app's own FAISS index: the
    retrieved nodes go to the server as documents, the answer is what the same LLM gives
    on a local pipeline, and the server's memory tier serves them the second time."""
    pytest.importorskip("faiss")
    pytest.importorskip("llama_index.vector_stores.faiss")
    from llama_index.core.query_engine import RetrieverQueryEngine

    from cachecraft.integrations.llama_index import CacheCraftLLM
    from cachecraft.integrations.llama_index_llm import LLM_SYSTEM_PROMPT
    from tests.test_llama_index import QUESTION as LI_QUESTION
    from tests.test_llama_index import SETTINGS, CacheCraftEmbedding, make_index

    index = make_index(CacheCraftEmbedding())
    local = CacheCraftLLM(model=str(tiny_dir), cache_dir=tmp_path / "local", config=SETTINGS, max_new_tokens=6)
    want = str(RetrieverQueryEngine.from_args(index.as_retriever(similarity_top_k=2), llm=local).query(LI_QUESTION))
    local.close()

    proc = ServerProcess(tmp_path / "cache", tiny_dir, CACHECRAFT_SYSTEM_PROMPT=LLM_SYSTEM_PROMPT,
                         CACHECRAFT_POLICY_CHECK_LAYER="2")
    try:
        llm = CacheCraftLLM(server=proc.url + "/v1", max_new_tokens=6)
        assert llm.metadata.model_name == str(tiny_dir) and llm.metadata.context_window > 0
        engine = RetrieverQueryEngine.from_args(index.as_retriever(similarity_top_k=2), llm=llm)
        first = engine.query(LI_QUESTION)
        assert str(first) == want
        assert llm.last_report["chunks"] == 3 and llm.last_report["hits_by_tier"].get("cpu", 0) == 0
        again = engine.query(LI_QUESTION)
        assert llm.last_report["hits_by_tier"].get("cpu") == 3  # the head and both nodes, from the server's memory
        assert str(again)
        streaming = RetrieverQueryEngine.from_args(index.as_retriever(similarity_top_k=2), llm=llm, streaming=True)
        assert "".join(streaming.query(LI_QUESTION).response_gen) == str(again)
        with pytest.raises(ValueError, match="either server"):
            CacheCraftLLM(server=proc.url, model=str(tiny_dir))
    finally:
        proc.stop()
    with pytest.raises(Exception, match="no cachecraft server at"):
        CacheCraftLLM(server=proc.url).complete("some context\nwhy?")
