"""What watching an answer as it grows costs per token, as answers get long.

While an answer is generated, the handoff decodes the answer so far after every token
and hands the text to the checks that may stop it (stop strings, the repetition watch of
``repetition_fallback``). Read whole on every token, both cost in proportion to the
answer's length, so a long answer pays in proportion to its length squared. This times,
per token, over the first N tokens of a long text (this project's README with each line
kept once, so real prose, tables and code that no check stops) in the bundled SmolLM2's
tokenizer:

- ``decode``: the whole answer decoded on every token, against
  :class:`cachecraft.engine.handoff.AnswerText` (decodes from its last settled point);
- ``watch``: the whole text parsed on every token (the part of what the watch did before
  it kept what it had read that grew with the answer: a lower bound on its old cost),
  against :class:`cachecraft.metrics.RepetitionWatch`, fed the decoded texts.

Every call's results are checked equal first (the same texts; the watch saying the same
as the whole-text check would). Writes OUT (JSON) and prints it.

    python benchmarks/answer_checks.py benchmarks/results/answer_checks.json --tokens 500 2000 8000
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from cachecraft.bench.common import machine, running_code
from cachecraft.engine.handoff import AnswerText
from cachecraft.metrics import RepetitionWatch, _parts
from cachecraft.model.bundled import ModelLoadError
from cachecraft.model.loader import load_model


def per_token_ms(step, count: int) -> float:
    """Milliseconds per call of ``step(i)`` for i = 1..count."""
    start = time.perf_counter()
    for i in range(1, count + 1):
        step(i)
    return (time.perf_counter() - start) / count * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, nargs="+", default=[500, 2000, 8000])
    parser.add_argument("--text", type=Path, default=Path("README.md"))
    args = parser.parse_args()
    if not args.text.is_file():
        raise SystemExit(f"no such text file: {args.text}")
    if min(args.tokens) < 1:
        raise SystemExit(f"--tokens must be at least 1, got {min(args.tokens)}")
    try:
        tokenizer = load_model(args.model).tokenizer
    except ModelLoadError as exc:
        raise SystemExit(str(exc)) from None
    lines = args.text.read_text().splitlines()
    ids = torch.tensor(tokenizer.encode("\n".join(dict.fromkeys(lines))))  # each line once, in order
    rows = []
    for count in args.tokens:
        if count > ids.numel():
            raise SystemExit(f"{args.text} has only {ids.numel()} tokens")
        whole = [tokenizer.decode(ids[:i], skip_special_tokens=True) for i in range(1, count + 1)]
        growing = AnswerText(tokenizer)
        assert [growing(ids[:i]) for i in range(1, count + 1)] == whole and growing.joins
        row = {"tokens": count,
               "decode_whole_ms": per_token_ms(lambda i: tokenizer.decode(ids[:i], skip_special_tokens=True), count)}
        growing = AnswerText(tokenizer)
        row["decode_settled_ms"] = per_token_ms(lambda i: growing(ids[:i]), count)
        row["watch_whole_ms"] = per_token_ms(lambda i: _parts(whole[i - 1], done=False), count)
        watch = RepetitionWatch()
        fired = []
        row["watch_kept_ms"] = per_token_ms(lambda i: fired.append(watch(whole[i - 1])), count)
        row["watch_fired_at"] = fired.index(True) + 1 if any(fired) else None
        rows.append(row)
        print(json.dumps(row))
    result = {"benchmark": "answer_checks", "model": args.model, "text": str(args.text), "rows": rows,
              "machine": machine(), "code": running_code(),
              "command": "python benchmarks/answer_checks.py " + " ".join(
                  [str(args.out), "--tokens", *map(str, args.tokens)])}
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
