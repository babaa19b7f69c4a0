"""``cachecraft serve``, and the client side of ``query --server`` / ``stats --server``
(through :mod:`cachecraft.server.client`: the standard library, so no extra is needed)."""

from __future__ import annotations

import errno
import signal
import socket
import time
from typing import Any, Optional

import typer

from . import STARTED
from .common import UserError, console, err_console, friendly, load_config, working

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def serve_cmd(ctx: typer.Context,
              host: str = typer.Option("127.0.0.1", help="Address to listen on (loopback unless told otherwise)."),
              port: int = typer.Option(8000, min=1, max=65535, help="Port to listen on."),
              model: Optional[str] = typer.Option(None, help="Model (default: config model)."),
              log_level: str = typer.Option("info", help="uvicorn's log level: critical, error, warning, info, "
                                                         "debug.")) -> None:
    """Serve OpenAI-compatible completions from the ingested corpus, with the model, the
    embedder, the corpus and the store (memory tiers included) loaded once and kept:
    POST /v1/chat/completions and /v1/completions (streaming with "stream": true;
    "documents": [...], or chunks marked by chunk_separator in the prompt, answer over
    your own chunks; a chat's earlier messages are its conversation, written after the
    chunks), POST /v1/ingest {"paths": [...]}, POST /v1/forget, POST /v1/warm, GET /v1/stats,
    /v1/models, /healthz and /metrics (Prometheus). One request computes at a time,
    server_queue more wait, the next gets 429; CACHECRAFT_API_KEY, when set, is required
    as 'Authorization: Bearer <key>'. While no request waits, each chunk order answered
    from inexact caches is stored as a full prefill's KV (exact_when_idle), so a chat's
    next turn over the same passages reuses it exactly.

    Example: cachecraft serve --port 8000, then point an OpenAI client at
    http://127.0.0.1:8000/v1 (any api_key unless CACHECRAFT_API_KEY is set).
    """
    try:
        import uvicorn

        from cachecraft.server.app import create_app
        from cachecraft.server.service import Service
    except ImportError:
        raise UserError("cachecraft serve needs the server extra: pip install 'cachecraft[server]'") from None
    from uvicorn.config import LOG_LEVELS

    from .product import open_pipeline

    if log_level.lower() not in LOG_LEVELS:
        raise UserError(f"unknown --log-level {log_level!r}; one of {', '.join(LOG_LEVELS)}")
    config = load_config(ctx, model=model)
    # the address is taken before the model loads: a port in use is told at once, and
    # "serving" is printed only once the server can be reached there
    listening = _listening_socket(host, port)
    if host not in LOOPBACK and not config.api_key:
        err_console.print(f"[yellow]warning:[/yellow] listening on {host} without an API key: anyone who can "
                          "reach it may ask, ingest and warm; set CACHECRAFT_API_KEY", highlight=False)
    try:
        pipe = open_pipeline(config)
    except BaseException:
        listening.close()
        raise
    try:
        with working("measuring the prefill cost (once per model and machine) ..."):
            pipe.ensure_cost_model()
        if len(pipe.corpus):
            pipe.corpus.load_embedder()
        service = Service(config, pipe)
    except BaseException:
        pipe.close()
        raise
    # uvicorn shuts down gracefully on SIGTERM, then raises it again; with the default
    # handler that would end the process before the store is closed (memory tiers persisted)
    signal.signal(signal.SIGTERM, _exit_quietly)
    try:
        console.print(f"serving {pipe.lm.name} on http://{host}:{port} (OpenAI base URL http://{host}:{port}/v1), "
                      f"{len(pipe.corpus)} chunks ingested; ready in {time.perf_counter() - STARTED:.1f} s",
                      highlight=False)
        server = uvicorn.Server(uvicorn.Config(create_app(service), host=host, port=port, log_level=log_level.lower()))
        server.run(sockets=[listening])
    finally:
        listening.close()
        service.close()


def _listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port`` for the server, or a one-line error."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise UserError(f"cannot listen on {host}: {exc.strerror}; give an address of this machine with --host") \
            from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        hint = "; another server is there: stop it or pick another --port" if exc.errno == errno.EADDRINUSE else ""
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}{hint}") from None
    return sock


def _exit_quietly(signum, frame) -> None:
    raise SystemExit(0)


# -- the client side ---------------------------------------------------------------------

def _client(config):
    from cachecraft.server.client import ServerClient

    return ServerClient(config.server, config.api_key, timeout_s=config.server_timeout_s + 30)


def remote_query(config, question: str, *, method: str, top_k: Optional[int], max_new_tokens: Optional[int],
                 as_json: bool, retrieval_order: Optional[str] = None,
                 chunk_order: Optional[str] = None) -> dict[str, Any]:
    """Ask a running server; the answer streams to stdout unless ``as_json``. Returns the
    final payload: ``text``, ``usage`` and the cache report ``cachecraft``. The orders
    given go with the request (None: the server's own)."""
    from cachecraft.server.client import ServerError, chat_body, message_text

    body = chat_body(question, method=method, top_k=top_k, max_tokens=max_new_tokens,
                     retrieval_order=retrieval_order, chunk_order=chunk_order)
    client = _client(config)
    try:
        if as_json:
            data = client.post("/v1/chat/completions", body)
            return {"text": message_text(data), "usage": data["usage"], "cachecraft": data["cachecraft"]}
        parts, final = [], {}
        for payload in client.stream("/v1/chat/completions", body):
            piece = message_text(payload)
            if piece:
                parts.append(piece)
                print(piece, end="", flush=True)
            if "cachecraft" in payload:
                final = payload
        print()
    except ServerError as exc:
        raise UserError(f"{exc}; or unset server / CACHECRAFT_SERVER to work locally"
                        if "no cachecraft server" in str(exc) else str(exc)) from None
    return {"text": "".join(parts), "usage": final.get("usage"), "cachecraft": final.get("cachecraft")}


def remote_answer(result: dict):
    """The server's cache report as an :class:`Answer`, for the local report printer."""
    from cachecraft.pipeline import Answer
    from cachecraft.pipeline.reports import ChunkReport, Source

    report, usage = result["cachecraft"], result["usage"] or {}
    return Answer(result["text"], report["method"], report["ttft_s"], usage.get("prompt_tokens", 0),
                  usage.get("completion_tokens", 0), report["recompute_fraction"],
                  [ChunkReport(**c) for c in report["chunk_reports"]], report["request_id"],
                  report.get("full_prefill_estimate_s"), [Source(**s) for s in report["sources"]],
                  report.get("retrieval_s"), report.get("abandoned_text"), report.get("first_try_ttft_s"),
                  report.get("order"), kept_exact=bool(report.get("kept_exact")),
                  exact_wait=report.get("exact_wait", 0), reused_exact=bool(report.get("reused_exact")))


def remote_stats(config, top: int = 10) -> dict:
    """``GET /v1/stats`` of a running server, its ``top`` chunks listed."""
    from cachecraft.server.client import ServerError

    try:
        return _client(config).get(f"/v1/stats?top={top}")
    except ServerError as exc:
        raise UserError(str(exc)) from None


def register(app: typer.Typer) -> None:
    """Add ``serve`` to the app."""
    app.command("serve")(friendly(serve_cmd))
