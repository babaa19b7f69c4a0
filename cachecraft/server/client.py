"""A client of a running ``cachecraft serve`` (standard library only: no server extra
needed), for ``cachecraft query --server`` and the LlamaIndex LLM.

Errors are one line: :class:`ServerError` says which server and what it answered, or
that nothing answers there.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Iterator


class ServerError(Exception):
    """The server could not be reached, or refused or failed the request (one line)."""


class ServerClient:
    """Requests to the server at ``url`` (its root, e.g. ``http://127.0.0.1:8000``), with the
    API key when one is given; ``timeout_s`` bounds each request."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 630.0) -> None:
        self.url = url.rstrip("/")
        if self.url.endswith("/v1"):  # an OpenAI base URL names the same server
            self.url = self.url[:-3]
        self.api_key, self.timeout_s = api_key, timeout_s

    def open(self, path: str, body: dict | None = None):
        """The response of ``GET`` (no body) or ``POST`` of ``path``; a file-like object to close."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers=headers,
                                         method="GET" if body is None else "POST")
        try:
            return urllib.request.urlopen(request, timeout=self.timeout_s)
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = exc.reason
            raise ServerError(f"the server at {self.url} answered {exc.code}: {message}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ServerError(f"no cachecraft server at {self.url} ({reason}); start one with "
                              "`cachecraft serve`") from None

    def get(self, path: str) -> dict:
        """``GET path`` as JSON."""
        with self.open(path) as response:
            return json.loads(response.read())

    def post(self, path: str, body: dict) -> dict:
        """``POST path`` with a JSON body, the JSON answer."""
        with self.open(path, body) as response:
            return json.loads(response.read())

    def stream(self, path: str, body: dict) -> Iterator[dict]:
        """``POST path`` with ``"stream": true``: the payloads of its server-sent events, up to
        ``[DONE]``; an error event raises :class:`ServerError`."""
        with self.open(path, {**body, "stream": True}) as response:
            for raw in response:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                payload = json.loads(data)
                if "error" in payload:
                    raise ServerError(f"the server at {self.url} failed mid-answer: "
                                      f"{payload['error']['message']}")
                yield payload


def chat_body(question: str, **fields: Any) -> dict:
    """A chat-completion request asking ``question``, with cachecraft's fields (``documents``,
    ``method``, ``top_k``, ``question_template``, ``max_tokens``...) where not None."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": question}]}
    body.update({k: v for k, v in fields.items() if v is not None})
    return body


def message_text(payload: dict) -> str:
    """The answer text of a chat completion, or the piece a streamed chunk carries."""
    choice = payload["choices"][0]
    return (choice.get("message") or choice.get("delta") or {}).get("content") or ""
