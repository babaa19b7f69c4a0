"""``cachecraft bench scaling``: time to first token and peak memory as the work grows.

Two sweeps over the same questions: context length (chunks of about ``chunk_tokens``
tokens, so a longer context has more chunks) and number of chunks at a fixed context
length. A context is cut from a MuSiQue-format file: the question's own passages,
then the next items' passages, as one token stream split into equal windows.

``full`` is one plain prefill of the whole prompt. Every other (point, question,
method) runs in a fresh pipeline over a scratch store, set up as in real use: the
chunk-caches were made ahead of time (``Pipeline.warm``, after the system prefix
and the configured warm context) for the methods that reuse them; ``prefix`` has
seen one earlier request sharing the system prompt and the first ``prefix_shared``
chunks. With ``cold``, cachecraft also answers each request with nothing cached
(label ``... cold``): the chunk-caches and their statistics are made inside the
request, which is what a user's first question over new documents costs. With
``revisit``, cachecraft also answers after an earlier question retrieved the same
chunks in another order (label ``... revisit``): that untimed request made each
chunk's cache in its own context and kept it as a variant, as Cache-Craft does, so
the timed request reuses caches made beside the same passages; ``prefix``, when
asked for, gets the same history, which its cache cannot match past the system
prompt. With ``whole_read``, every method that reuses chunk-caches also answers with
them read whole before the prefill (``stream_kv`` off; label ``... whole-read``), beside
the default of streaming them in layer by layer. TTFT is
``Pipeline.answer``'s (store loading included); quality is agreement with ``full``'s
answer (and first-token KL against it) on the same request.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import logging
import math
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from cachecraft.bench.common import PeakRSS
from cachecraft.config import Config
from cachecraft.dataset import QAItem
from cachecraft.evaluation import answer_traced
from cachecraft.methods import CacheCraft, Full, Method, Prefix
from cachecraft.metrics import exact_match, first_line, kl_divergence, token_f1
from cachecraft.model.loader import LoadedModel
from cachecraft.prompt import PromptBuilder, builder_for

log = logging.getLogger(__name__)

DEFAULT_CONTEXTS = (1000, 2000, 4000, 7900)  # SmolLM2's window is 8192: room for the answer
DEFAULT_CHUNK_COUNTS = (2, 5, 10, 20)
GOAL_SPEEDUP = 10.0
GOAL_AGREEMENT = 0.95
COLD = " cold"  # label suffix of a request answered with nothing cached
REVISIT = " revisit"  # label suffix of a request whose chunks an earlier request saw, shuffled
WHOLE = " whole-read"  # label suffix of a request whose chunk-caches were read whole before the prefill
FREE = "free: used as stored"  # a loading bandwidth in a result: the tier's caches are never copied
SHUFFLE_SEED = 0  # the earlier request's order in revisit rows
SETTING_SUFFIX = {"warm": "", "cold": COLD, "revisit": REVISIT, "whole": WHOLE}
EARLIER_QUESTION = "What is this text about?"


@dataclass(frozen=True)
class Point:
    """One point of a sweep: a prompt of about ``target_tokens`` tokens in ``n_chunks`` chunks."""

    sweep: str  # "context" or "chunks"
    target_tokens: int
    n_chunks: int


def plan_points(contexts: Sequence[int], chunk_counts: Sequence[int], *, fixed_context: int,
                chunk_tokens: int) -> list[Point]:
    """The context sweep (about ``chunk_tokens`` per chunk) then the chunk-count sweep."""
    points = [Point("context", t, max(1, round(t / chunk_tokens))) for t in contexts]
    return points + [Point("chunks", fixed_context, n) for n in chunk_counts]


def passage_stream(builder: PromptBuilder, items: Sequence[QAItem], start: int, need: int) -> list[int]:
    """Token ids of the passages of ``items[start]``, then of the items after it (wrapping
    around), until there are ``need`` tokens."""
    ids: list[int] = []
    for step in range(len(items)):
        for title, text in items[(start + step) % len(items)].passages:
            ids.extend(builder.encode(PromptBuilder.chunk_text(text, title)))
        if len(ids) >= need:
            return ids
    raise ValueError(f"the dataset's passages hold {len(ids)} tokens, fewer than the {need} a point needs")


def cut_chunks(builder: PromptBuilder, stream: Sequence[int], question: str, point: Point) -> list[str]:
    """Chunk texts that make a prompt of about ``point.target_tokens`` tokens with ``question``."""
    probe = builder.build(["x"], question)
    budget = point.target_tokens - (probe.num_tokens - len(probe.chunks[0]))
    if budget < point.n_chunks:
        raise ValueError(f"{point.target_tokens} tokens leave no room for {point.n_chunks} chunks "
                         "after the system prompt and the question")
    bounds = [round(i * budget / point.n_chunks) for i in range(point.n_chunks + 1)]
    return [builder.tokenizer.decode(list(stream[a:b])) for a, b in zip(bounds, bounds[1:])]


def run_scaling(lm: LoadedModel, config: Config, items: Sequence[QAItem], specs: Sequence[Method], *,
                contexts: Sequence[int] = DEFAULT_CONTEXTS, chunk_counts: Sequence[int] = DEFAULT_CHUNK_COUNTS,
                fixed_context: int = 4000, chunk_tokens: int = 512, repeats: int = 2, prefix_shared: int = 1,
                max_new_tokens: int = 32, tier: str = "cpu", cold: bool = False, revisit: bool = False,
                whole_read: bool = False, share_warm: bool = False,
                on_step: Callable[[str, int, int], None] | None = None) -> dict:
    """Run both sweeps; returns ``{"scaling": [...], "requests": [...], "summary": {...}, "setup": {...}}``.
    ``on_step(description, done, total)`` is called after each timed request. With
    ``share_warm``, the methods of one request that use warm chunk-caches read them from
    one store warmed once (each still in a fresh pipeline): the same caches, made once
    rather than once per method."""
    points = plan_points(contexts, chunk_counts, fixed_context=fixed_context, chunk_tokens=chunk_tokens)
    if not points:
        raise ValueError("nothing to run: give at least one context length or chunk count")
    longest = max(p.target_tokens for p in points)
    if longest + max_new_tokens > lm.max_context:
        raise ValueError(f"a {longest}-token prompt plus {max_new_tokens} answer tokens does not fit the "
                         f"model's context window of {lm.max_context}")
    if repeats < 1 or not items:
        raise ValueError("need at least one item and one repeat")
    order = [(Full(), "warm")] + [(s, "warm") for s in specs if not isinstance(s, Full)]
    craft = next((s for s in specs if isinstance(s, CacheCraft)), CacheCraft(config.policy_alpha))
    if cold:
        order.append((craft, "cold"))
    if revisit:  # prefix caching on the same history, where any is asked for
        order += [(craft, "revisit")] + [(s, "revisit") for s in specs if isinstance(s, Prefix)]
    if whole_read:
        order += [(s, "whole") for s in specs if s.uses_cache]
    builder = builder_for(lm.tokenizer, config)
    starts = [(r * len(items)) // repeats for r in range(repeats)]  # questions far apart in the file
    streams = [passage_stream(builder, items, s, longest) for s in starts]
    runner = _Runner(lm, config, prefix_shared=prefix_shared, max_new_tokens=max_new_tokens, tier=tier,
                     share_warm=share_warm)
    runner.warm_up(order, [builder.tokenizer.decode(streams[0][i:i + 32]) for i in (0, 32)])
    total = len(points) * repeats * len(order)
    rows: list[dict] = []
    gc.collect()
    gc.freeze()  # what exists now lives on; each request's collection need not walk it
    try:
        for point in points:
            for row in _run_point(runner, order, builder, items, starts, streams, point):
                rows.append(row)
                if on_step:
                    on_step(f"{point.sweep} {point.target_tokens} tokens x{point.n_chunks} chunks: {row['method']}",
                            len(rows), total)
    finally:
        gc.unfreeze()
        runner.release_shared()
    table = aggregate(rows)
    setup = {"full": "one plain prefill of the whole prompt in the same engine, nothing saved",
             "chunk_caches": "made ahead of time by Pipeline.warm, after the system prefix and the warm "
                             f"context ({runner.config.warm_context!r}, up to {runner.config.warm_context_tokens} "
                             f"tokens), stored in the {tier} tier and loaded inside the timed request",
             "prefix": f"one earlier request ({EARLIER_QUESTION!r}) shared the system prompt and the first "
                       f"{prefix_shared} chunk(s); its blocks were in the prefix cache",
             "cold": f"'{COLD.strip()}' rows: cachecraft with nothing cached; the request makes the "
                     "chunk-caches and their statistics" if cold else None,
             "revisit": f"'{REVISIT.strip()}' rows: after one earlier request ({EARLIER_QUESTION!r}, same "
                        "method, nothing cached ahead) over the same chunks in a shuffled order "
                        f"(seed {SHUFFLE_SEED}); cachecraft kept each chunk's cache made in that context as a "
                        "variant, prefix caching its blocks" if revisit else None,
             "whole_read": f"'{WHOLE.strip()}' rows: the same chunk-caches read whole, in the compute dtype, "
                           "before the prefill (stream_kv off); the other rows stream them in layer by layer "
                           "during it" if whole_read else None,
             "loading_bandwidths": {setting: {t: FREE if math.isinf(b) else b for t, b in model.bandwidths.items()}
                                    for setting, model in runner.learned.items()} or None,
             "prefill_s_per_token": {"measured at start": runner.measured_prefill_s_per_token,
                                     "after the sweep": runner.cost_model.prefill_s_per_token},
             "blend_s_per_token": {setting: model.blend_s_per_token
                                   for setting, model in runner.learned.items()} or None,
             "fresh_pipeline_per_request": True,
             "shared_warm_store": ("the methods of one request that use warm chunk-caches read them from one "
                                   "store warmed once; setup_s is that warm's, on the first of them"
                                   if share_warm else None),
             "chunk_tokens": chunk_tokens, "fixed_context": fixed_context,
             "repeats": repeats, "prefix_shared": prefix_shared, "tier": tier, "max_new_tokens": max_new_tokens,
             "context_tokens": "whole prompt: system prefix, chunks and question",
             "peak_rss_mb": "process RSS sampled through the request (prefill and answer), after freed heap "
                            "was handed back to the OS; model weights included"}
    return {"scaling": table, "requests": rows, "summary": summarize(table), "setup": setup}


def _run_point(runner: "_Runner", order: Sequence[tuple[Method, str]], builder: PromptBuilder,
               items: Sequence[QAItem], starts: Sequence[int], streams: Sequence[list[int]], point: Point):
    """Rows of every method on every question of one point (``full`` first on each)."""
    for repeat, (start, stream) in enumerate(zip(starts, streams)):
        question = items[start].question
        chunks = cut_chunks(builder, stream, question, point)
        reference = None
        for spec, setting in order:
            row, run = runner.run(spec, chunks, question, reference, setting=setting)
            reference = reference or run
            log.info("%s %d tokens, %d chunks, %s: ttft %.2fs", point.sweep, row["context_tokens"],
                     point.n_chunks, row["method"], row["ttft_s"])
            yield {"sweep": point.sweep, "target_tokens": point.target_tokens, "n_chunks": point.n_chunks,
                   "repeat": repeat, "item": start, **row}


class _Runner:
    """Runs one method on one request through a fresh pipeline over a scratch store
    (``full`` too: its pipeline has nothing cached and keeps nothing)."""

    def __init__(self, lm: LoadedModel, config: Config, *, prefix_shared: int, max_new_tokens: int, tier: str,
                 share_warm: bool = False):
        import torch

        from cachecraft.pipeline.cost import measure_cost_model
        from cachecraft.policy.loading import CostModel

        self.lm, self.tier, self.prefix_shared = lm, tier, prefix_shared
        self.config = config.replace(max_new_tokens=max_new_tokens)
        # A server measures its cost model once at start-up; so do we, outside the timed requests.
        self.cost_model = measure_cost_model(lm, kv_dtype=getattr(torch, config.kv_dtype))
        self.measured_prefill_s_per_token = self.cost_model.prefill_s_per_token
        self.learned: dict[str, CostModel] = {}  # per setting, as the last request left it (bandwidths timed)
        self.share_warm = share_warm
        self._shared: tuple[tuple[str, ...], Path, object] | None = None  # (chunks, directory, warmed store)

    def warm_up(self, order: Sequence[tuple[Method, str]], chunks: list[str]) -> None:
        """One untimed small request per method, so lazy initialisation is not timed."""
        for spec, setting in order:
            self.run(spec, chunks, EARLIER_QUESTION, None, setting=setting)

    def run(self, spec: Method, chunks: list[str], question: str, reference,
            setting: str = "warm") -> tuple[dict, object]:
        """Time ``spec`` on one request (``setting``: warm, cold, revisit or whole, see the module doc); its row
        (quality against ``reference``) and its answer."""
        (answer, trace), mem, setup_s, peak_gpu_mb = self._through_pipeline(spec, chunks, question, setting)
        ref, ref_trace = reference or (answer, trace)
        row = {"method": spec.label + SETTING_SUFFIX[setting], "context_tokens": answer.prompt_tokens,
               "ttft_s": answer.ttft_s,
               "speedup_vs_full": ref.ttft_s / answer.ttft_s, "recompute_fraction": answer.recompute_fraction,
               "token_layers": trace.token_layers,
               "agreement_f1": token_f1(first_line(answer.text), first_line(ref.text)),
               "exact_match": float(exact_match(answer.text, ref.text)),
               "kl": kl_divergence(ref_trace.logits, trace.logits),
               "peak_rss_mb": mem.peak_mb, "rss_growth_mb": mem.growth_mb, "peak_gpu_mb": peak_gpu_mb,
               "setup_s": setup_s,
               "cached_chunks": sum(c.tier != "miss" for c in answer.chunks),
               "prefix_overlap": _mean_overlap(answer.chunks), "answer": answer.text}
        return row, (answer, trace)

    def _through_pipeline(self, spec: Method, chunks: list[str], question: str, setting: str = "warm"):
        """A fresh pipeline over a scratch store, set up as ``setting`` says (chunk-caches
        made ahead, nothing, or an earlier request over the chunks shuffled), then the
        timed request."""
        from cachecraft.pipeline import Pipeline
        from cachecraft.store import TieredStore

        if self.share_warm and spec.uses_cache and setting == "warm":
            return self._on_shared_store(spec, chunks, question)
        self.release_shared()  # its caches would sit in memory beside this request's
        scratch = Path(tempfile.mkdtemp(prefix=f"scaling-{spec.name}-", dir=self.config.cache_dir))
        config = self.config.replace(cache_dir=scratch, **({"stream_kv": False} if setting == "whole" else {}))
        try:
            with TieredStore(config, tiers=(self.tier,)) as store:
                pipeline = Pipeline(config, lm=self.lm, store=store)
                self._start_from_learned(pipeline, setting)
                start = time.perf_counter()
                if setting == "revisit":
                    pipeline.answer(shuffled(chunks), EARLIER_QUESTION, method=spec, max_new_tokens=1, record=False)
                elif spec.uses_cache and setting in ("warm", "whole"):
                    pipeline.warm(chunks)
                elif isinstance(spec, Prefix):
                    earlier = chunks[:self.prefix_shared] or ["An earlier, unrelated passage.\n\n"]
                    pipeline.answer(earlier, EARLIER_QUESTION, method="prefix", max_new_tokens=1, record=False)
                setup_s = time.perf_counter() - start
                answer, mem, peak_gpu_mb = self._timed(pipeline, spec, chunks, question, setting)
                store.close(persist=False)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return answer, mem, setup_s, peak_gpu_mb

    def _start_from_learned(self, pipeline, setting: str) -> None:
        """One prefill cost for every setting (measured, then moved by each full prefill), so a
        setting's rows differ from another's only in how the caches are read; bandwidths as
        this setting has timed them so far."""
        learned = self.learned.get(setting)
        pipeline.cost_model = dataclasses.replace(
            self.cost_model, bandwidths=learned.bandwidths if learned else pipeline.starting_bandwidths(),
            timed=learned.timed if learned else frozenset(),
            blend_s_per_token_layer=learned.blend_s_per_token_layer if learned else None)

    def _timed(self, pipeline, spec: Method, chunks: list[str], question: str, setting: str):
        """The timed request: its answer and trace, peak RSS and peak GPU memory (MB, on CUDA)."""
        import torch

        _release_freed_memory()
        on_gpu = self.lm.device.type == "cuda"
        if on_gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with PeakRSS() as mem:
            answer = answer_traced(pipeline, chunks, question, spec, record=False)
        peak_gpu_mb = torch.cuda.max_memory_allocated() / 2**20 if on_gpu else None
        self.learned[setting] = pipeline.cost_model  # later requests start from what this one timed
        self.cost_model = dataclasses.replace(
            self.cost_model, prefill_s_per_token_layer=pipeline.cost_model.prefill_s_per_token_layer)
        return answer, mem, peak_gpu_mb

    def _on_shared_store(self, spec: Method, chunks: list[str], question: str):
        """Like :meth:`_through_pipeline` for a warm request, over the one store warmed for
        these chunks (warmed now, when the chunks are new; setup_s is then that warm's)."""
        from cachecraft.pipeline import Pipeline
        from cachecraft.store import TieredStore

        setup_s = 0.0
        if self._shared is None or self._shared[0] != tuple(chunks):
            self.release_shared()
            scratch = Path(tempfile.mkdtemp(prefix="scaling-shared-", dir=self.config.cache_dir))
            config = self.config.replace(cache_dir=scratch)
            store = TieredStore(config, tiers=(self.tier,))
            self._shared = (tuple(chunks), scratch, store)
            warmer = Pipeline(config, lm=self.lm, store=store)
            self._start_from_learned(warmer, "warm")
            start = time.perf_counter()
            warmer.warm(chunks)
            setup_s = time.perf_counter() - start
        _, scratch, store = self._shared
        pipeline = Pipeline(self.config.replace(cache_dir=scratch), lm=self.lm, store=store)
        self._start_from_learned(pipeline, "warm")
        answer, mem, peak_gpu_mb = self._timed(pipeline, spec, chunks, question, "warm")
        return answer, mem, setup_s, peak_gpu_mb

    def release_shared(self) -> None:
        """Close and delete the shared warm store, if any."""
        if self._shared is not None:
            _, scratch, store = self._shared
            self._shared = None
            store.close(persist=False)
            shutil.rmtree(scratch, ignore_errors=True)


def _mean_overlap(chunks) -> float | None:
    """Mean beta' (the policy's order-weighted prefix overlap) of the chunks it planned; None without a plan."""
    overlaps = [c.beta_prime for c in chunks if c.beta_prime is not None]
    return statistics.fmean(overlaps) if overlaps else None


def shuffled(chunks: Sequence[str]) -> list[str]:
    """``chunks`` in a fixed pseudo-random order that moves the first one (so that a
    prefix cache shares at most the system prompt with the original order)."""
    order = list(range(len(chunks)))
    random.Random(SHUFFLE_SEED).shuffle(order)
    if len(order) > 1 and order[0] == 0:
        order = order[1:] + order[:1]
    return [chunks[i] for i in order]


def _release_freed_memory() -> None:
    """Collect garbage and hand freed heap back to the OS (glibc), so that a request's
    peak RSS is not the high-water mark an earlier, larger request left behind."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: peaks may include earlier requests' freed memory
        pass


def aggregate(rows: Sequence[dict]) -> list[dict]:
    """One row per (sweep, point, method): means over the repeats; speedup from mean TTFTs."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["sweep"], r["target_tokens"], r["n_chunks"], r["method"]), []).append(r)
    mean = lambda rs, key: statistics.fmean(r[key] for r in rs)  # noqa: E731
    out = []
    for (sweep, target, n_chunks, method), mine in groups.items():
        full = groups.get((sweep, target, n_chunks, "full"), mine)
        out.append({"sweep": sweep, "method": method, "target_tokens": target,
                    "context_tokens": round(mean(mine, "context_tokens")), "n_chunks": n_chunks,
                    "repeats": len(mine), "ttft_s": mean(mine, "ttft_s"),
                    "ttft_s_min": min(r["ttft_s"] for r in mine), "ttft_s_max": max(r["ttft_s"] for r in mine),
                    "speedup_vs_full": mean(full, "ttft_s") / mean(mine, "ttft_s"),
                    # prefill work (token-layers) saved: the speedup a machine free of other load would approach
                    "work_ratio_vs_full": mean(full, "token_layers") / max(1.0, mean(mine, "token_layers")),
                    "agreement_f1": mean(mine, "agreement_f1"), "exact_match": mean(mine, "exact_match"),
                    "kl": mean(mine, "kl"), "recompute_fraction": mean(mine, "recompute_fraction"),
                    "token_layers": mean(mine, "token_layers"), "peak_rss_mb": max(r["peak_rss_mb"] for r in mine),
                    "rss_growth_mb": max(r["rss_growth_mb"] for r in mine), "setup_s": mean(mine, "setup_s"),
                    "peak_gpu_mb": max((r["peak_gpu_mb"] for r in mine if r.get("peak_gpu_mb") is not None),
                                       default=None),
                    "prefix_overlap": (mean(mine, "prefix_overlap")
                                       if all(r.get("prefix_overlap") is not None for r in mine) else None)})
    return out


def summarize(table: Sequence[dict]) -> dict:
    """The figures at the longest context: every method's speedup and agreement, and
    whether ``cachecraft`` meets the goal (>= 10x at agreement >= 0.95)."""
    context = [r for r in table if r["sweep"] == "context"]
    if not context:
        return {}
    top = max(r["target_tokens"] for r in context)
    at = {r["method"]: r for r in context if r["target_tokens"] == top}
    crafts = [label for label in at if label.split("@")[0] == "cachecraft"]
    craft = next((label for label in crafts if not label.endswith((COLD, REVISIT, WHOLE))), None)
    revisit = next((label for label in crafts if label.endswith(REVISIT)), None)
    meets = lambda r: r["speedup_vs_full"] >= GOAL_SPEEDUP and r["agreement_f1"] >= GOAL_AGREEMENT  # noqa: E731
    summary = {"max_context_tokens": next(iter(at.values()))["context_tokens"],
               "at_max_context": {label: {k: r[k] for k in ("ttft_s", "speedup_vs_full", "agreement_f1", "kl",
                                                             "recompute_fraction", "peak_rss_mb")}
                                  for label, r in at.items()},
               "method": craft, "speedup_at_max_context": None, "agreement_at_max_context": None,
               "goal": {"speedup": GOAL_SPEEDUP, "agreement_f1": GOAL_AGREEMENT, "met": None}}
    if craft is not None:
        summary.update(speedup_at_max_context=at[craft]["speedup_vs_full"],
                       agreement_at_max_context=at[craft]["agreement_f1"])
        summary["goal"]["met"] = meets(at[craft])
    if revisit is not None:
        summary["goal_revisit"] = {"method": revisit, "speedup": at[revisit]["speedup_vs_full"],
                                   "agreement_f1": at[revisit]["agreement_f1"], "met": meets(at[revisit])}
    return summary
