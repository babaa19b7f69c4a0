"""The same questions asked again, as users ask them: the default method N times, `full` once.

Over an ingested and warmed cache directory, each question is answered by `full`, then by
the default method (`cachecraft`, through `Pipeline.query`, as `cachecraft query` answers
it, keeping the chunk-caches it makes). `full`'s answers are the yardstick, not a user's
ask: they are not recorded, so the default method's first ask is the first of its chunk
order, as for a user who never asks with `full` (``--record-full``: recorded, so that
`exact_after_asks` counts them, as in the runs before 2026-12-07). Once every question has
been asked, all of them are asked again with the default method, ``--asks`` times in all.
Per ask: how many first tries looped and were answered again from a full prefill, how many
were computed in full once to keep their chunk order exact (``exact_after_asks``), the
time to first token against full's (per question, then the median), the share recomputed
and how many answers are full's word for word. Writes a JSON result and a PNG of each
question's time to first token.

    CACHECRAFT_CACHE_DIR=DIR python benchmarks/repeat_questions.py QUESTIONS OUT.json

QUESTIONS: a text file of one question a line (``#`` lines skipped) or a MuSiQue-format
file. Run it with nothing else on the machine; the cache directory gains what the
requests keep, so copy it first to run again from the same start.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

from cachecraft.config import Config
from cachecraft.metrics import degenerate_repetition
from cachecraft.pipeline import Pipeline


def read_questions(path: Path, limit: int | None) -> list[str]:
    """The questions of a text file (one a line) or of a MuSiQue-format JSON file."""
    text = path.read_text()
    if path.suffix == ".json":
        questions = [item["question"] for item in json.loads(text)]
    else:
        questions = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    return questions[:limit]


def ask(pipe: Pipeline, question: str, method: str, top_k: int, record: bool = True) -> dict:
    """One request's row: its time to first token, recompute, answer and whether it looped;
    ``record``: kept in the catalog, where it counts as an ask of its chunk order."""
    answer = pipe.query(question, top_k=top_k, method=method, record=record)
    return {"ttft_s": answer.ttft_s, "recompute": answer.recompute_fraction, "answer": answer.text,
            "answered_again": answer.escalated, "kept_exact": answer.kept_exact, "first_try": answer.abandoned_text,
            "repeats": degenerate_repetition(answer.text),
            "tiers": [chunk.tier for chunk in answer.chunks]}


def summary(rows: list[dict], full: list[dict]) -> dict:
    """A pass's figures against full's rows (same questions, same order)."""
    ratios = [f["ttft_s"] / r["ttft_s"] for r, f in zip(rows, full)]
    return {"answered_again": sum(r["answered_again"] for r in rows),
            "kept_exact": sum(r.get("kept_exact", False) for r in rows),
            "ttft_median_s": statistics.median(r["ttft_s"] for r in rows),
            "ttft_mean_s": statistics.fmean(r["ttft_s"] for r in rows),
            "speedup_median": statistics.median(ratios),
            "speedup_of_means": statistics.fmean(f["ttft_s"] for f in full) / statistics.fmean(r["ttft_s"] for r in rows),
            "recompute_mean": statistics.fmean(r["recompute"] for r in rows),
            "same_as_full": sum(r["answer"] == f["answer"] for r, f in zip(rows, full)),
            "repeats_where_full_does_not": sum(r["repeats"] and not f["repeats"] for r, f in zip(rows, full))}


def plot(result: dict, path: Path) -> None:
    """Each question's time to first token: full's and each ask's."""
    from cachecraft.bench.common import pyplot

    plt = pyplot()
    full = [r["ttft_s"] for r in result["full"]]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    x = range(len(full))
    ax.plot(x, full, "s", color="#222222", label="full")
    for (name, data), marker, color in zip(result["passes"].items(), "o^v<>", ("#2ca02c", "#1f77b4", "#ff7f0e",
                                                                          "#9467bd", "#8c564b")):
        rows = data["rows"]
        ax.plot(x, [r["ttft_s"] for r in rows], marker, color=color, label=name, alpha=0.85)
        again = [i for i, r in enumerate(rows) if r["answered_again"]]
        ax.plot(again, [rows[i]["ttft_s"] for i in again], marker, mfc="none", mec="#d62728", ms=12)
        kept = [i for i, r in enumerate(rows) if r.get("kept_exact")]
        ax.plot(kept, [rows[i]["ttft_s"] for i in kept], marker, mfc="none", mec="#17becf", ms=12)
    ax.set_yscale("log")
    ax.set_xlabel("question")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"{result['corpus']}: {result['model']}, the default method (red ring: answered again; cyan: kept exact)")
    ax.legend()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("questions", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--limit", type=int, default=None, help="the first N questions")
    parser.add_argument("--top-k", type=int, default=None, help="chunks per question (default: the config's)")
    parser.add_argument("--corpus", default="", help="a name for the corpus, for the plot's title")
    parser.add_argument("--asks", type=int, default=3, help="times each question is asked with the default method")
    parser.add_argument("--record-full", action="store_true",
                        help="record full's answers too, so that each counts as its chunk order's first ask")
    args = parser.parse_args()
    questions = read_questions(args.questions, args.limit)
    config = Config.load()
    top_k = args.top_k or config.top_k
    with Pipeline(config) as pipe:
        pipe.ensure_cost_model()
        full, asks = [], [[] for _ in range(args.asks)]
        for i, question in enumerate(questions):
            full.append(ask(pipe, question, "full", top_k, record=args.record_full))
            asks[0].append(ask(pipe, question, "cachecraft", top_k))
            print(f"{i:2d} full {full[-1]['ttft_s']:.2f}s  ask 1 {asks[0][-1]['ttft_s']:.2f}s"
                  f"{' (again)' if asks[0][-1]['answered_again'] else ''}  {question}", flush=True)
        for n, rows in enumerate(asks[1:], start=2):
            for i, question in enumerate(questions):
                rows.append(ask(pipe, question, "cachecraft", top_k))
                print(f"{i:2d} ask {n} {rows[-1]['ttft_s']:.2f}s{' (again)' if rows[-1]['answered_again'] else ''}"
                      f"{' (kept exact)' if rows[-1]['kept_exact'] else ''}",
                      flush=True)
        model = pipe.lm.name
    commit = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"corpus": args.corpus or str(args.questions), "model": model, "top_k": top_k,
              "questions": questions, "commit": commit, "date": time.strftime("%Y-%m-%d"),
              "command": f"python benchmarks/repeat_questions.py {args.questions} {args.out}"
                         + (f" --limit {args.limit}" if args.limit else "")
                         + (f" --top-k {args.top_k}" if args.top_k else "")
                         + (f" --corpus '{args.corpus}'" if args.corpus else "") + f" --asks {args.asks}"
                         + (" --record-full" if args.record_full else ""),
              "full": full,
              "passes": {f"ask {n}": {"summary": summary(rows, full), "rows": rows}
                         for n, rows in enumerate(asks, start=1)}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    for name, data in result["passes"].items():
        print(name, json.dumps(data["summary"]))


if __name__ == "__main__":
    main()
