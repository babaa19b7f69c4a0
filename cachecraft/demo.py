"""The demo behind ``make demo``: full prefill and CacheBlend side by side."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from cachecraft.bench.quality import run_method, warm_chunks
from cachecraft.config import Config
from cachecraft.dataset import load_items
from cachecraft.engine import create_chunk_cache
from cachecraft.methods import MethodSpec
from cachecraft.metrics import first_line
from cachecraft.model.loader import DTYPES, LoadedModel
from cachecraft.prompt import PromptBuilder, builder_for


def run_demo(lm: LoadedModel, config: Config, questions: Path, limit: int, console: Console) -> None:
    """Answer ``limit`` questions from ``questions`` with ``full`` and ``cacheblend``."""
    items = load_items(questions, limit)
    builder = builder_for(lm.tokenizer, config)
    kv_dtype = DTYPES[config.kv_dtype]
    specs = [MethodSpec("full"), MethodSpec("cacheblend", config.cacheblend_ratio, config.check_layer)]
    prefix_kv = None
    for item in items:
        chunks = [PromptBuilder.chunk_text(text, title) for title, text in item.passages]
        pieces = builder.build(chunks, item.question, max_tokens=lm.max_context)
        if prefix_kv is None:
            prefix_kv = create_chunk_cache(lm.adapter, [], pieces.prefix, fingerprint=lm.fingerprint,
                                           collect_stats=False).to(kv_dtype)
        with console.status(f"warming {len(chunks)} chunk-caches ..."):
            chunk_kvs = warm_chunks(lm, pieces, prefix_kv, kv_dtype)
        with console.status(f"answering: {item.question}"):
            full, blend = [run_method(lm, spec, pieces, prefix_kv, chunk_kvs, config.max_new_tokens)
                           for spec in specs]
        table = Table(title=f"{item.question}  ({pieces.num_tokens} prompt tokens, {len(chunks)} chunks)",
                      title_justify="left")
        table.add_column("method")
        table.add_column("TTFT (s)", justify="right")
        table.add_column("recompute", justify="right")
        table.add_column("answer", overflow="fold")
        for spec, run in zip(specs, (full, blend)):
            table.add_row(spec.label, f"{run.ttft_s:.2f}", f"{run.recompute_fraction:.0%}", first_line(run.answer))
        console.print(table)
        console.print(f"cacheblend reached the first token [bold]{full.ttft_s / blend.ttft_s:.1f}x[/bold] "
                      f"sooner than full prefill.\n")
