"""A chat's next turns over the same passages, with the server's idle time used or not.

Over an ingested and warmed cache directory, each question opens a chat: its top-k chunks
are retrieved once and sent as the chat's documents at every turn (as a client that pins
a conversation's passages does), then follow-up questions come as the next turns. The
server's service answers every turn (the one request path, in process, without HTTP),
once with ``exact_when_idle`` on and once off, each on its own copy of the directory, side
by side per turn; `full`, on a third copy, answers the same turns as the yardstick. Every
setting's turn sees the same conversation: the earlier questions and full's answers to
them. Between turns the service gets its idle time (:meth:`Service.settle`; the seconds
its idle work took are recorded: the time a user must read or type for it). Per turn:
time to first token, share recomputed, whether the chunks were reused exactly or kept
exact at this ask (``exact_after_asks``), and whether the answer is full's word for word.
Writes a JSON result and a PNG.

    CACHECRAFT_CACHE_DIR=DIR python benchmarks/chat_turns.py QUESTIONS OUT.json
    python benchmarks/chat_turns.py DATASET.json OUT.json --model qwen2.5-coder-0.5b --limit 6

QUESTIONS: a text file of one question a line (``#`` lines skipped), over DIR's ingested
and warmed corpus; or a MuSiQue-format file, each item a chat over its own passages (all of
them, in the file's order), warmed here as `warm` makes caches. Run it with nothing else on
the machine; DIR itself is not changed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from cachecraft.config import Config
from cachecraft.dataset import load_items
from cachecraft.engine import GenerationOptions
from cachecraft.evaluation import item_chunks
from cachecraft.model.loader import load_model
from cachecraft.pipeline import Pipeline
from cachecraft.prompt import Conversation
from cachecraft.server.service import Job, Service

FOLLOW_UPS = ("Can you say that in fewer words?", "Why is that?")
SETTINGS = {"idle time used": True, "idle time unused": False}


def turn_row(answer, idle_s: float | None) -> dict:
    """One turn's figures."""
    return {"ttft_s": answer.ttft_s, "recompute": answer.recompute_fraction, "answer": answer.text,
            "reused_exact": answer.reused_exact, "kept_exact": answer.kept_exact,
            "answered_again": answer.escalated, "idle_s": idle_s}


def summary(rows: list[dict], full: list[dict]) -> dict:
    """One setting's figures at one turn, against full's rows of the same turn."""
    ratios = [f["ttft_s"] / r["ttft_s"] for r, f in zip(rows, full)]
    idle = [r["idle_s"] for r in rows if r["idle_s"] is not None]
    return {"ttft_median_s": statistics.median(r["ttft_s"] for r in rows),
            "ttft_mean_s": statistics.fmean(r["ttft_s"] for r in rows),
            "speedup_median": statistics.median(ratios),
            "recompute_mean": statistics.fmean(r["recompute"] for r in rows),
            "reused_exact": sum(r["reused_exact"] for r in rows),
            "kept_exact": sum(r["kept_exact"] for r in rows),
            "answered_again": sum(r["answered_again"] for r in rows),
            "same_as_full": sum(r["answer"] == f["answer"] for r, f in zip(rows, full)),
            "idle_median_s": statistics.median(idle) if idle else 0.0,
            "idle_max_s": max(idle) if idle else 0.0}


def plot(result: dict, path: Path) -> None:
    """Median time to first token per turn: full's and each setting's."""
    from cachecraft.bench.common import pyplot

    plt = pyplot()
    turns = range(1, len(result["full"]) + 1)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(turns, [statistics.median(r["ttft_s"] for r in rows) for rows in result["full"]], "s-",
            color="#222222", label="full")
    for (name, data), color in zip(result["settings"].items(), ("#2ca02c", "#ff7f0e")):
        ax.plot(turns, [s["ttft_median_s"] for s in data["summary"]], "o-", color=color, label=f"cachecraft, {name}")
    ax.set_yscale("log")
    ax.set_xticks(list(turns))
    ax.set_xlabel("turn of the chat")
    ax.set_ylabel("median time to first token (s)")
    ax.set_title(f"{result['corpus']}: {result['model']}, {len(result['questions'])} chats")
    ax.legend()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("questions", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--limit", type=int, default=None, help="the first N questions")
    parser.add_argument("--corpus", default="", help="a name for the corpus, for the plot's title")
    parser.add_argument("--model", default=None, help="the model (default: the config's)")
    parser.add_argument("--turns", type=int, default=1 + len(FOLLOW_UPS),
                        help=f"turns per chat, the question and up to {len(FOLLOW_UPS)} follow-ups")
    args = parser.parse_args()
    base = Config.load(overrides={"model": args.model} if args.model else None)
    lm = load_model(None, base)
    if args.questions.suffix == ".json":  # each item a chat over its own passages, warmed here
        items = load_items(args.questions, args.limit)
        questions = [item.question for item in items]
        pinned = [item_chunks(item) for item in items]  # as bench quality writes them
        with Pipeline(base, lm=lm) as warming:
            for chunks in pinned:
                warming.warm(chunks)
    else:
        questions = [line.strip() for line in args.questions.read_text().splitlines()
                     if line.strip() and not line.startswith("#")][:args.limit]
        pinned = None
    with tempfile.TemporaryDirectory() as scratch:
        services, full_pipe = {}, None
        try:
            for name, on in (*SETTINGS.items(), ("full", False)):
                folder = Path(scratch) / name.replace(" ", "-")
                shutil.copytree(base.cache_dir, folder, ignore=shutil.ignore_patterns("models"))
                (folder / "models").symlink_to(base.models_dir)  # converted once, read only
                config = dataclasses.replace(base, cache_dir=folder, exact_when_idle=on)
                pipe = Pipeline(config, lm=lm)
                pipe.ensure_cost_model()
                if name == "full":
                    full_pipe = pipe
                else:
                    services[name] = Service(config, pipe)
            turns = max(1, min(args.turns, 1 + len(FOLLOW_UPS)))
            full = [[] for _ in range(turns)]
            rows = {name: [[] for _ in range(turns)] for name in services}
            for i, question in enumerate(questions):
                # pinned for the whole chat
                chunks = pinned[i] if pinned is not None else full_pipe.retrieve(question).chunks
                said: list[tuple[str, str]] = []
                for turn, asked in enumerate((question, *FOLLOW_UPS)[:turns]):
                    conversation = Conversation((), tuple(said)) if said else None
                    for name, service in services.items():
                        # the chunks as retrieval gives them to the prompt (the server's
                        # `documents` are sent stripped), so the warmed caches are found
                        job = Job(asked, list(chunks), "cachecraft", None, base.max_new_tokens,
                                  GenerationOptions(), conversation=conversation)
                        answer = service.answer(job)
                        start = time.perf_counter()
                        service.settle()  # the user reads and types: the worker has its idle time
                        rows[name][turn].append(turn_row(answer, time.perf_counter() - start))
                    reference = full_pipe.answer(chunks, asked, method="full", record=False, conversation=conversation)
                    full[turn].append(turn_row(reference, None))
                    said += [("user", asked), ("assistant", reference.text)]
                    print(f"{i:2d} turn {turn + 1} full {reference.ttft_s:.2f}s "
                          + " ".join(f"{name}: {rows[name][turn][-1]['ttft_s']:.2f}s" for name in services),
                          flush=True)
        finally:
            for service in services.values():
                service.close()
            if full_pipe is not None:
                full_pipe.close()
    commit = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"corpus": args.corpus or str(args.questions), "model": lm.name, "top_k": base.top_k,
              "questions": questions, "follow_ups": list(FOLLOW_UPS), "commit": commit,
              "date": time.strftime("%Y-%m-%d"),
              "command": f"python benchmarks/chat_turns.py {args.questions} {args.out}"
                         + (f" --model {args.model}" if args.model else "")
                         + (f" --limit {args.limit}" if args.limit else "")
                         + (f" --turns {args.turns}" if args.turns != 1 + len(FOLLOW_UPS) else "")
                         + (f" --corpus '{args.corpus}'" if args.corpus else ""),
              "full": full,
              "settings": {name: {"summary": [summary(r, f) for r, f in zip(per_turn, full)], "rows": per_turn}
                           for name, per_turn in rows.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    for name, data in result["settings"].items():
        for turn, figures in enumerate(data["summary"], start=1):
            print(name, "turn", turn, json.dumps(figures))


if __name__ == "__main__":
    main()
