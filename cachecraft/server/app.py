"""The HTTP application of ``cachecraft serve``: OpenAI-compatible completions over the
one request path, plus ingest, forget, warm, stats, health and Prometheus metrics.

Errors are JSON in OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``),
one line each, never a stack trace: 400 for a request that cannot be answered as asked
(malformed JSON, an unknown field, a prompt longer than the context window), 401 for a
missing or wrong API key, 404 for another model's name, 429 when the queue is full, 503
past the timeout, for what needs a catalog server that is away (stats; answers go on
without it) and for a forget whose shared tier did not answer, 500 (logged with its
traceback on the server) for anything else.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import threading
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cachecraft.catalog import CatalogUnavailableError
from cachecraft.engine import GenerationOptions
from cachecraft.pipeline import Answer
from cachecraft.pipeline.documents import ForgetIncomplete
from cachecraft.prompt import Conversation, PromptInputError
from cachecraft.retrieval.documents import DocumentError
from cachecraft.retrieval.snapshot import CorpusError
from cachecraft.server.metrics import Metrics
from cachecraft.server.schemas import (ChatRequest, CompletionRequest, ForgetRequest, Generation, IngestRequest,
                                       Message, WarmRequest)
from cachecraft.server.service import BadRequest, Busy, Job, Service, TimedOut
from cachecraft.server.streaming import PieceStreamer, StopCutter

log = logging.getLogger(__name__)

MODEL_ALIASES = ("cachecraft", "default")
"""Model names every server answers to, besides its model's own name."""
UPKEEP_TIMEOUT_S = 24 * 3600.0
"""How long ingest, forget and warm may wait and run (at least server_timeout_s)."""


class ApiError(Exception):
    """An error response: HTTP status, OpenAI error type, one-line message, offending field."""

    def __init__(self, status: int, kind: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.param = status, kind, message, param

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "5"} if self.status in (429, 503) else None
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": None}}, status_code=self.status, headers=headers)


def create_app(service: Service) -> FastAPI:
    """The application serving ``service`` (its pipeline loaded, its queue empty)."""
    app = FastAPI(title="cachecraft", summary="OpenAI-compatible RAG answers with chunk-cache reuse",
                  docs_url=None, redoc_url=None)
    metrics = Metrics(service)
    app.state.service, app.state.metrics = service, metrics
    key = service.config.api_key

    @app.middleware("http")
    async def guard(request: Request, call_next):
        start = time.perf_counter()
        if key and request.url.path not in ("/healthz",) and not _authorised(request, key):
            response = ApiError(401, "authentication_error", "missing or wrong API key: send "
                                "'Authorization: Bearer <key>' (the server's CACHECRAFT_API_KEY)").response()
        else:
            try:
                response = await call_next(request)
            except Exception:  # a stack trace belongs in the log, not in a response
                log.exception("request %s %s failed", request.method, request.url.path)
                service.counters.failed += 1
                response = ApiError(500, "server_error", "internal error; the server's log has the "
                                    "details").response()
        metrics.observe_http(request.url.path, response.status_code, time.perf_counter() - start)
        return response

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, kind, str(exc.detail)).response()

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok", "model": service.model_name, "context_window": service.pipeline.lm.max_context,
                "queued": service.queued,
                "uptime_s": round(time.time() - service.counters.started_at, 1)}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "owned_by": "cachecraft",
                                            "created": int(service.counters.started_at)}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        question, conversation = _chat_question(body.messages)
        return await _complete(service, metrics, body, question, chat=True, request=request,
                               conversation=conversation)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        try:
            prompt = body.text
        except ValueError as exc:
            raise ApiError(400, "invalid_request_error", str(exc), "prompt") from None
        return await _complete(service, metrics, body, prompt, chat=False, request=request)

    # Ingest, forget and warm run to the end once started (they cannot be cut midway), so
    # they get a day, not server_timeout_s: a 503 "retry later" for work that then
    # finished would have clients do it twice.
    upkeep_s = max(service.config.server_timeout_s, UPKEEP_TIMEOUT_S)

    @app.post("/v1/ingest")
    async def ingest(body: IngestRequest) -> dict:
        outcome = await _queued(service, lambda: service.pipeline.ingest(body.paths), timeout_s=upkeep_s)
        return outcome.to_dict()

    @app.post("/v1/forget")
    async def forget(body: ForgetRequest) -> dict:
        outcome = await _queued(service, lambda: service.forget(body.paths, keep_caches=body.keep_caches),
                                timeout_s=upkeep_s)
        return outcome.to_dict()

    @app.post("/v1/warm")
    async def warm(body: WarmRequest | None = None) -> dict:
        shard = body.shard if body is not None and body.shard is not None else (0, 1)
        report = await _queued(service, lambda: service.pipeline.warm_corpus(shard=shard), timeout_s=upkeep_s)
        return {"made": report.made, "skipped": report.skipped, "total": report.total,
                "in_context": report.in_context}

    @app.get("/v1/stats")
    async def stats(top: int = Query(10, ge=1, le=1000)) -> dict:
        from cachecraft.catalog.stats import summary
        try:
            data = await asyncio.to_thread(lambda: summary(service.pipeline.catalog, top=top))
        except CatalogUnavailableError as exc:  # away (or hung): answers go on, the statistics wait for it
            raise ApiError(503, "server_error", str(exc)) from None
        config = service.config
        budgets = {"gpu": config.gpu_budget_bytes, "cpu": config.cpu_budget_bytes, "disk": config.disk_budget_bytes}
        for tier, usage in data["tiers"].items():
            usage["budget_bytes"] = budgets.get(tier)
        return data

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return PlainTextResponse(body, media_type=content_type)

    return app


def _authorised(request: Request, key: str) -> bool:
    given = request.headers.get("authorization", "")
    token = given[7:] if given.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
    return secrets.compare_digest(token.encode(), key.encode())


_TYPE_TAG = re.compile(r"(str|int|float|bool|none|(list|dict|tuple|function-[a-z]+)\[.*\])")


def _validation_error(exc: RequestValidationError) -> ApiError:
    """The first problem of a request body, as one line naming the field."""
    first = exc.errors()[0] if exc.errors() else {}
    # the location without pydantic's tags for the member of a union it tried (str, list[...])
    where = [str(p) for p in first.get("loc", ()) if p != "body" and not _TYPE_TAG.fullmatch(str(p))]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return ApiError(400, "invalid_request_error", "the request body is not valid JSON")
    if kind == "missing" and not where:
        return ApiError(400, "invalid_request_error", "the request has no body; send a JSON object")
    if kind == "extra_forbidden":
        return ApiError(400, "invalid_request_error", f"unknown field {'.'.join(where)!r}", ".".join(where))
    if kind == "missing":
        return ApiError(400, "invalid_request_error", f"missing field {'.'.join(where)!r}", ".".join(where))
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    return ApiError(400, "invalid_request_error", f"{'.'.join(where) or 'body'}: {message}", ".".join(where) or None)


async def _queued(service: Service, fn: Callable[[], Any], cancel: threading.Event | None = None,
                  timeout_s: float | None = None) -> Any:
    """``fn`` on the model's worker, its errors turned into API errors."""
    try:
        return await service.run(fn, cancel, timeout_s)
    except Busy as exc:
        raise ApiError(429, "rate_limit_error", str(exc)) from None
    except TimedOut as exc:
        raise ApiError(503, "server_error", str(exc)) from None
    except (CatalogUnavailableError, ForgetIncomplete) as exc:  # answers go on; what needs a server waits for it
        raise ApiError(503, "server_error", str(exc)) from None
    except (BadRequest, PromptInputError, CorpusError, DocumentError) as exc:
        raise ApiError(400, "invalid_request_error", _said_to_clients(str(exc))) from None


# the library's messages name the commands a user at the server's shell would run; a
# client of the API has the endpoints instead
_CLIENT_WORDS = (("run `cachecraft ingest PATH` first", "POST /v1/ingest first"),
                 ("(`cachecraft documents` lists what was)", "(`cachecraft documents` on the server lists what was)"))


def _said_to_clients(message: str) -> str:
    for cli_words, api_words in _CLIENT_WORDS:
        message = message.replace(cli_words, api_words)
    return message


def _chat_question(messages: list[Message]) -> tuple[str, Conversation | None]:
    """The question a chat asks (its last user message) and what else it says: the
    system and developer messages as instructions, the turns before the question."""
    last = max((i for i, m in enumerate(messages) if m.role == "user"), default=None)
    if last is None:
        raise ApiError(400, "invalid_request_error", "messages: no user message to answer", "messages")
    if any(m.role == "tool" for m in messages):
        raise ApiError(400, "invalid_request_error", "messages: tool messages are not supported (this server calls "
                       "no tools)", "messages")
    after = [m.role for m in messages[last + 1:] if m.role not in _INSTRUCTING and m.text.strip()]
    if after:
        raise ApiError(400, "invalid_request_error", f"messages: the last user message is followed by "
                       f"{'an' if after[0] == 'assistant' else 'a'} {after[0]} message; the question to answer "
                       "must come last (continuing a message is not supported)", "messages")
    instructions = tuple(m.text for m in messages if m.role in _INSTRUCTING and m.text.strip())
    turns = tuple((m.role, m.text) for m in messages[:last] if m.role not in _INSTRUCTING and m.text.strip())
    conversation = Conversation(instructions, turns) if instructions or turns else None
    return messages[last].text, conversation


_INSTRUCTING = ("system", "developer")  # roles whose messages instruct rather than converse


def _job_factory(service: Service, body: Generation, question: str, cancel: threading.Event,
                 conversation: Conversation | None = None) -> Callable[[], Job]:
    model = body.model
    if model is not None and model not in (service.model_name, *MODEL_ALIASES):
        raise ApiError(404, "not_found_error", f"model {model!r} is not served here; this server serves "
                       f"{service.model_name!r}", "model")
    options = GenerationOptions(temperature=body.temperature, top_p=body.top_p, stop=body.stops, seed=body.seed,
                                cancel=cancel)
    return lambda: service.job(question, documents=body.documents, method=body.method, top_k=body.top_k,
                               max_tokens=body.answer_tokens, generation=options,
                               question_template=body.question_template, fit_max_tokens=body.fit_max_tokens,
                               retrieval_order=body.retrieval_order, chunk_order=body.chunk_order,
                               conversation=conversation)


async def _complete(service: Service, metrics: Metrics, body: Generation, question: str, *, chat: bool,
                    request: Request, conversation: Conversation | None = None):
    cancel = threading.Event()
    make_job = _job_factory(service, body, question, cancel, conversation)
    ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    if not body.stream:
        holder: dict[str, Job] = {}

        def work() -> Answer:
            holder["job"] = job = make_job()
            return service.answer(job)

        answer = await _queued(service, work, cancel)
        metrics.observe_answer(answer)
        return _response(service, ident, chat, answer, holder["job"])
    return await _stream(service, metrics, ident, chat, make_job, cancel, request)


def _finish_reason(answer: Answer, job: Job) -> str:
    return "length" if answer.new_tokens >= job.max_new_tokens else "stop"


def _report(answer: Answer) -> dict:
    """The cache report carried beside OpenAI's fields (clients ignore unknown fields)."""
    return {"method": answer.method, "ttft_s": answer.ttft_s, "recompute_fraction": answer.recompute_fraction,
            "chunks": len(answer.chunks), "hits_by_tier": answer.hits_by_tier, "request_id": answer.request_id,
            "saved_s": answer.saved_s, "retrieval_s": answer.retrieval_s,
            "full_prefill_estimate_s": answer.full_prefill_estimate_s,
            "abandoned_text": answer.abandoned_text, "first_try_ttft_s": answer.first_try_ttft_s,
            "order": answer.order, "kept_exact": answer.kept_exact, "exact_wait": answer.exact_wait,
            "reused_exact": answer.reused_exact, "gave_way": answer.gave_way,
            "sources": [s.__dict__ for s in answer.sources],
            "chunk_reports": [c.__dict__ for c in answer.chunks]}


def _usage(answer: Answer) -> dict:
    return {"prompt_tokens": answer.prompt_tokens, "completion_tokens": answer.new_tokens,
            "total_tokens": answer.prompt_tokens + answer.new_tokens}


def _response(service: Service, ident: str, chat: bool, answer: Answer, job: Job) -> dict:
    finish = _finish_reason(answer, job)
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": answer.text}
    else:
        choice["text"] = answer.text
    return {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": service.model_name, "choices": [choice], "usage": _usage(answer), "cachecraft": _report(answer)}


async def _stream(service: Service, metrics: Metrics, ident: str, chat: bool, make_job: Callable[[], Job],
                  cancel: threading.Event, request: Request) -> StreamingResponse:
    """Server-sent events as OpenAI clients read them; errors found before the first token
    are ordinary error responses, later ones an ``error`` event before the end."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def push(item) -> None:
        loop.call_soon_threadsafe(events.put_nowait, item)

    def work() -> Answer:
        job = make_job()
        push(("job", job))
        return service.answer(job, PieceStreamer(service.pipeline.lm.tokenizer, lambda text: push(("text", text))))

    task = asyncio.ensure_future(_queued(service, work, cancel))
    first = asyncio.ensure_future(events.get())
    await asyncio.wait({task, first}, return_when=asyncio.FIRST_COMPLETED)
    if not first.done():
        first.cancel()
        task.result()  # raises the API error (or returns: an empty answer without a job event cannot happen)
    kind, job = first.result()
    cutter = StopCutter(job.generation.stop)
    created = int(time.time())

    def event(delta: dict | None, finish: str | None = None, **extra) -> str:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if chat:
            choice["delta"] = delta or {}
        else:
            choice["text"] = (delta or {}).get("content", "")
        payload = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion",
                   "created": created, "model": service.model_name, "choices": [choice], **extra}
        return f"data: {json.dumps(payload)}\n\n"

    async def body() -> AsyncIterator[str]:
        try:
            if chat:
                yield event({"role": "assistant", "content": ""})
            while True:
                getter = asyncio.ensure_future(events.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    while not events.empty():
                        _, text = events.get_nowait()
                        piece = cutter.feed(text)
                        if piece:
                            yield event({"content": piece})
                    break
                _, text = getter.result()
                piece = cutter.feed(text)
                if piece:
                    yield event({"content": piece})
                if cutter.stopped:
                    cancel.set()  # a stop string: the rest is not wanted
            try:
                answer = task.result()
            except ApiError as exc:
                yield f"data: {json.dumps({'error': {'message': exc.message, 'type': exc.kind}})}\n\n"
                return
            rest = cutter.finish()
            if rest:
                yield event({"content": rest})
            metrics.observe_answer(answer)
            finish = "stop" if cutter.stopped else _finish_reason(answer, job)
            yield event(None, finish, usage=_usage(answer), cachecraft=_report(answer))
            yield "data: [DONE]\n\n"
        finally:
            if not task.done():  # the client went away mid-stream: stop generating for it
                cancel.set()

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
