"""Hand a prefilled KV to ``transformers``' ``generate``.

The cache given to ``generate`` holds every prompt token but the last; ``generate``
then runs the last prompt token itself over that cache, which reproduces the
prefill's last-position logits, and continues with any decoding settings
(greedy, sampling, stop strings, streamers).
"""

from __future__ import annotations

import functools
import inspect
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
from tokenizers import decoders
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList
from transformers.cache_utils import DynamicLayer

from cachecraft.engine.blend import BlendResult


@functools.cache
def _forward_takes(model_class: type, name: str) -> bool:
    """Whether ``model_class.forward`` has a parameter ``name`` (read once per class)."""
    return name in inspect.signature(model_class.forward).parameters


def cache_argument(model) -> str:
    """The keyword ``model``'s forward (and so ``generate``) takes a KV cache under:
    ``cache`` in the transformers releases that renamed it (where ``past_key_values`` is
    deprecated, to be removed in 5.40), ``past_key_values`` in those before."""
    return "cache" if _forward_takes(type(model), "cache") else "past_key_values"


@dataclass(frozen=True)
class GenerationOptions:
    """How generation continues from a prefill. The default is greedy decoding (what every
    benchmark and the equality checks use); ``temperature`` above 0 samples, within the
    ``top_p`` nucleus, reproducibly when ``seed`` is given. ``stop``: strings that end the
    answer (the answer text is cut before the first one). ``cancel``: once set, generation
    ends at the next token (a client that went away, a timeout)."""

    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    cancel: threading.Event | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be within (0, 1], got {self.top_p}")

    @property
    def sampling(self) -> bool:
        """Whether tokens are sampled rather than chosen greedily."""
        return self.temperature > 0.0

    def cut(self, text: str) -> str:
        """``text`` up to (not including) the first stop string."""
        ends = [i for i in (text.find(s) for s in self.stop if s) if i >= 0]
        return text[:min(ends)] if ends else text


class _Cancelled(StoppingCriteria):
    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class _WhenText(StoppingCriteria):
    """Ends generation once the decoded answer so far satisfies ``ends`` (decoded text, so
    a stop string works whatever the tokenizer splits it into)."""

    def __init__(self, tokenizer, ends: Callable[[str], bool], prompt_len: int) -> None:
        self.ends, self.prompt_len = ends, prompt_len
        self.text = AnswerText(tokenizer)

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        text = self.text(input_ids[0, self.prompt_len:])
        return torch.full((input_ids.shape[0],), bool(self.ends(text)), dtype=torch.bool, device=input_ids.device)


class AnswerText:
    """The decoded text of an answer as it grows, one call per new token: equal to decoding
    it whole each time, without the cost growing with the answer. With a byte-level
    tokenizer (GPT-2's kind: Qwen, SmolLM2, Llama 3), whose pieces decode to their bytes,
    the text up to a settled point (a line break, or any whitespace where the tokenizer
    does not clean up spaces around punctuation, at least :attr:`SETTLE_EVERY` tokens on)
    is kept and only the tokens after it are decoded; each settled point is checked
    against a whole decode first, and a mismatch turns this off. Other tokenizers (which
    may drop a piece's leading space) are decoded whole on every call."""

    SETTLE_EVERY = 32

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.settled, self.settled_text = 0, ""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.joins = isinstance(getattr(backend, "decoder", None), decoders.ByteLevel)
        self.breaks = "\n" if getattr(tokenizer, "clean_up_tokenization_spaces", True) else None

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def __call__(self, answer_ids: torch.Tensor) -> str:
        if not self.joins or answer_ids.shape[0] < self.settled:
            return self._decode(answer_ids)
        tail = self._decode(answer_ids[self.settled:])
        text = self.settled_text + tail
        ends = tail.endswith(self.breaks) if self.breaks else tail[-1:].isspace()
        if ends and answer_ids.shape[0] - self.settled >= self.SETTLE_EVERY:
            whole = self._decode(answer_ids)
            if whole != text:  # not seen with byte-level pieces; whole decodes from here on
                self.joins = False
                return whole
            self.settled, self.settled_text = answer_ids.shape[0], whole
        return text


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` that appends new tokens' K/V into room it keeps spare, instead of
    concatenating: a plain layer copies its whole KV at every decoded token, which on a
    long prompt is a large share of a small model's time a token (276 MB a token for
    SmolLM2 at 6k tokens in float32, about a third of its time on a CPU). The layer's
    ``keys``/``values`` are views of the first tokens of the room, so attention reads the
    same numbers as before.

    ``room``: tokens to hold without growing (the prompt plus the answer); past it the
    room grows by half. Where something else replaced ``keys`` (cropping keeps them in the
    room; reordering the batch does not), the next update moves them into new room."""

    def __init__(self, room: int = 0) -> None:
        super().__init__()
        self.room = max(0, int(room))
        self._rooms: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            if _initializer_takes_values(type(self)):
                self.lazy_initialization(key_states, value_states)
            else:  # releases whose form takes the keys alone
                self.lazy_initialization(key_states)
        used = self.keys.shape[-2] if self.keys.numel() else 0
        total = used + key_states.shape[-2]
        rooms = self._rooms
        fits = (rooms is not None and total <= rooms[0].shape[-2]
                and rooms[0].shape[:-2] == key_states.shape[:-2]
                and (not used or _views_start(self.keys, rooms[0]) and _views_start(self.values, rooms[1])))
        if not fits:
            size = max(total, self.room) if rooms is None else max(total, total + total // 2)
            rooms = tuple(x.new_empty(*x.shape[:-2], size, x.shape[-1]) for x in (key_states, value_states))
            if used:
                rooms[0][..., :used, :] = self.keys
                rooms[1][..., :used, :] = self.values
            self._rooms = rooms
        rooms[0][..., used:total, :] = key_states
        rooms[1][..., used:total, :] = value_states
        self.keys, self.values = rooms[0][..., :total, :], rooms[1][..., :total, :]
        return self.keys, self.values

    def reset(self) -> None:
        self._rooms = None
        super().reset()


@functools.cache
def _initializer_takes_values(layer_class: type) -> bool:
    """Whether ``layer_class.lazy_initialization`` takes the values as well as the keys
    (read once per class)."""
    return len(inspect.signature(layer_class.lazy_initialization).parameters) > 2


def _views_start(view: torch.Tensor, room: torch.Tensor) -> bool:
    """Whether ``view`` is the first tokens of ``room`` (as this layer left it)."""
    return (view.dim() == room.dim() and view.data_ptr() == room.data_ptr()
            and view.shape[:-2] == room.shape[:-2] and view.shape[-1] == room.shape[-1]
            and view.stride() == room.stride())


def to_transformers_cache(result: BlendResult, model_config, drop_last: int = 1,
                          room: int = 0) -> DynamicCache:
    """A ``DynamicCache`` with the prompt's KV (RoPE applied), minus the last ``drop_last``
    tokens. The result's per-layer tensors are released as they are handed over, so
    the request's KV exists once. Its full-attention layers are :class:`GrowingLayer` with
    room for ``room`` more tokens (the answer), so decoding does not copy the cache; no
    more room than the model's positions allow is set aside up front, however long an
    answer was asked for."""
    cache = DynamicCache(config=model_config)
    keep = result.num_tokens - drop_last
    positions = getattr(model_config, "max_position_embeddings", None)
    size = keep + room if not positions else min(keep + room, max(positions, keep))
    cache.layers = [GrowingLayer(size) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    for layer in range(len(result.keys)):
        k, v = result.keys[layer], result.values[layer]
        cache.update(k[None, :, :keep], v[None, :, :keep], layer)
        result.keys[layer] = result.values[layer] = None  # type: ignore[assignment]
    return cache


@torch.inference_mode()
def generate_from(model, tokenizer, result: BlendResult, *, max_new_tokens: int = 32,
                  do_sample: bool = False, streamer=None, stop_strings: list[str] | None = None,
                  options: GenerationOptions | None = None, until: Callable[[str], bool] | None = None,
                  **generate_kwargs: Any) -> torch.Tensor:
    """Continue generation from a prefill; returns only the new token ids ``[n_new]``.
    ``options`` (sampling, stop strings, cancellation) take the place of ``do_sample`` and
    ``stop_strings``; ``until``: generation also ends once the answer's text so far makes
    it true (the pipeline stops an answer that loops there)."""
    ids = result.token_ids[None]
    cache = to_transformers_cache(result, model.config, room=max_new_tokens + 1)
    kwargs = dict(generate_kwargs)
    criteria: list[StoppingCriteria] = []
    text_ends: list[Callable[[str], bool]] = []
    if options is not None:
        do_sample = options.sampling
        if do_sample:
            kwargs.update(temperature=options.temperature, top_p=options.top_p, top_k=None)
            if options.seed is not None:
                torch.manual_seed(options.seed)
        if options.cancel is not None:
            criteria.append(_Cancelled(options.cancel))
        if options.stop:
            stops = options.stop
            text_ends.append(lambda text: any(s in text for s in stops))
    if until is not None:
        text_ends.append(until)
    if text_ends:  # one decode a token serves every check of the text
        criteria.append(_WhenText(tokenizer, lambda text: any(ends(text) for ends in text_ends), ids.shape[1]))
    if criteria:
        kwargs["stopping_criteria"] = StoppingCriteriaList(criteria)
    if stop_strings:
        kwargs.update(stop_strings=stop_strings, tokenizer=tokenizer)
    if not do_sample:
        kwargs.setdefault("temperature", None)
        kwargs.setdefault("top_p", None)
        kwargs.setdefault("top_k", None)
    kwargs[cache_argument(model)] = cache
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                         max_new_tokens=max_new_tokens, do_sample=do_sample, streamer=streamer,
                         pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id, **kwargs)
    return out[0, ids.shape[1]:]


@torch.inference_mode()
def teacher_forced_logits(model, keys: list[torch.Tensor], values: list[torch.Tensor], token_ids: torch.Tensor,
                          forced_ids: torch.Tensor) -> torch.Tensor:
    """Next-token logits ``[n, vocab]`` (float32) at each position of ``forced_ids`` after a
    prefill (``keys``/``values`` per layer ``[H_kv, N, D]`` with RoPE applied, ``token_ids``
    the prompt ``[N]``): row 0 predicts ``forced_ids[0]`` from the prompt, row i predicts
    ``forced_ids[i]`` after ``forced_ids[:i]``. As in :func:`generate_from`, the last prompt
    token runs again over the cache of the others; the given tensors are not changed."""
    n = token_ids.numel()
    cache = DynamicCache(config=model.config)
    for layer, (k, v) in enumerate(zip(keys, values)):
        cache.update(k[None, :, :n - 1], v[None, :, :n - 1], layer)
    inputs = torch.cat([token_ids[-1:], forced_ids[:-1].to(token_ids.device)])[None]  # [1, n_forced]
    mask = torch.ones(1, n - 1 + inputs.shape[1], dtype=torch.long, device=token_ids.device)
    out = model(input_ids=inputs, attention_mask=mask, use_cache=True, **{cache_argument(model): cache})
    return out.logits[0].float()
