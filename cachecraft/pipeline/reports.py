"""What a request leaves behind: the answer with its cache report, and the prefill's trace."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cachecraft.catalog.stats import saved_seconds

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ChunkReport:
    """What happened to one chunk of a request.

    A chunk whose variant was found but that the plan computed in full counts as a hit
    in the tier it was found in; its ``fraction`` is 1.0.
    """

    position: int
    chunk: str
    tokens: int
    tier: str  # gpu / cpu / disk, or "miss"
    variant: str | None  # the variant found; not loaded when the plan computed the chunk in full
    cci: float | None
    beta_prime: float | None
    cfo: float | None
    fraction: float
    stop_layer: int | None


@dataclass(frozen=True)
class Source:
    """A retrieved corpus chunk that went into the prompt (in retrieval's order: best first, or
    by file with ``retrieval_order`` "document"; the chunk reports follow the prompt, the same
    order unless ``Answer.order`` says otherwise)."""

    id: str
    title: str
    source: str
    score: float
    text: str


@dataclass(frozen=True)
class WarmReport:
    """What one warm pass over (a shard of) the corpus did."""

    made: int
    skipped: int
    total: int
    in_context: int = 0  # variants made after a neighbouring chunk (config warm_neighbours)


@dataclass
class PrefillTrace:
    """What a benchmark may inspect of one request, handed to the ``observer`` of
    :meth:`~cachecraft.pipeline.Pipeline.answer` before generation starts.

    ``logits``: the last position's ``[vocab]`` (float32, CPU); ``token_layers``: tokens
    run through a layer, summed over layers, look-ahead included; ``kv_bytes``: the
    request's KV in the compute dtype; ``keys``/``values``: the prefilled KV per layer
    (``[H_kv, N, D]``, RoPE applied), the tensors ``generate`` starts from (never changed
    in place; an observer that keeps them keeps them alive); ``token_ids``: the prompt
    ``[N]``. ``answer_ids``: the generated ids, filled in once generation is done."""

    method: str
    logits: torch.Tensor
    token_layers: int
    kv_bytes: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    token_ids: torch.Tensor
    answer_ids: torch.Tensor | None = None


@dataclass
class Answer:
    """The answer and the cache report of one request."""

    text: str
    method: str
    ttft_s: float
    prompt_tokens: int
    new_tokens: int
    recompute_fraction: float
    chunks: list[ChunkReport] = field(default_factory=list)
    request_id: int | None = None
    full_prefill_estimate_s: float | None = None
    sources: list[Source] = field(default_factory=list)
    retrieval_s: float | None = None
    # An answer that degenerated into repetition was answered again from a full prefill:
    # the text given up, and the first token's time of that first try (``ttft_s`` is then
    # the kept answer's, counted from the start of the request)
    abandoned_text: str | None = None
    first_try_ttft_s: float | None = None
    # With ``chunk_order = "cache"``: the chunks' given positions (0 = the first chunk given,
    # in a query the best retrieved) in the order the prompt held them; None: as given
    order: list[int] | None = None
    # The chunk order had been asked ``exact_after_asks`` times before (since it was last
    # kept exact, where it was) and its chunks were not all stored exactly: they were
    # computed in full (from the first such chunk on) and kept, so that later asks in this
    # order reuse them exactly. ``exact_wait``: the asks that keep waited for (twice the
    # last keep's where no ask reused that one; 0 where nothing was kept)
    kept_exact: bool = False
    exact_wait: int = 0
    # every chunk was reused from variants stored exactly: nothing recomputed, answered as full does
    reused_exact: bool = False
    # variants deleted at their chunk's cap to keep this request's exact ones: per variant its
    # ``chunk``, ``variant`` key, ``hits`` and whether it was ``made_exactly``
    gave_way: list[dict] = field(default_factory=list)

    def chunk_of_source(self) -> list[tuple[Source, ChunkReport]]:
        """Each source (best first) with the report of its chunk, wherever the prompt held it."""
        place = range(len(self.chunks)) if self.order is None else self.order
        at = {given: position for position, given in enumerate(place)}
        return [(source, self.chunks[at[i]]) for i, source in enumerate(self.sources)
                if at.get(i, len(self.chunks)) < len(self.chunks)]

    @property
    def escalated(self) -> bool:
        """Whether the answer came from a full prefill after the first one looped."""
        return self.abandoned_text is not None

    @property
    def hits_by_tier(self) -> dict[str, int]:
        """Chunks by the tier that served them (``miss``: none), tiers that served none left out."""
        counts: dict[str, int] = {}
        for chunk in self.chunks:
            counts[chunk.tier] = counts.get(chunk.tier, 0) + 1
        return counts

    @property
    def saved_s(self) -> float | None:
        """Prefill time saved against a full prefill (estimated from this machine's measured
        rate); negative when the request took longer, never positive when it recomputed
        everything (see :func:`cachecraft.catalog.stats.saved_seconds`)."""
        return saved_seconds(self.full_prefill_estimate_s, self.ttft_s, self.recompute_fraction)

    def to_dict(self) -> dict:
        """JSON-friendly report."""
        return {"text": self.text, "method": self.method, "ttft_s": self.ttft_s,
                "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
                "recompute_fraction": self.recompute_fraction, "request_id": self.request_id,
                "full_prefill_estimate_s": self.full_prefill_estimate_s, "saved_s": self.saved_s,
                "retrieval_s": self.retrieval_s, "escalated": self.escalated,
                "abandoned_text": self.abandoned_text, "first_try_ttft_s": self.first_try_ttft_s,
                "order": self.order, "kept_exact": self.kept_exact, "exact_wait": self.exact_wait,
                "reused_exact": self.reused_exact, "gave_way": self.gave_way,
                "chunks": [c.__dict__ for c in self.chunks],
                "sources": [s.__dict__ for s in self.sources]}
