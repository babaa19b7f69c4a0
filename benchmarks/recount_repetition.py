"""Count again, with today's repetition check, the kept answers of stored quality results.

Each result of `bench quality` keeps every answer it scored (``items[].answer``) and
whether it repeated (``items[].repetition``) by the check of its day. This reads the
answers again through :func:`cachecraft.metrics.degenerate_repetition` and lists, per
file and method, the answers the check now calls repeating that the result did not, and
how many of those repeat where full's answer to the same item does not. Nothing is run
again: an answer the check would now stop early is counted as it was kept.

    python benchmarks/recount_repetition.py OUT benchmarks/results/*.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cachecraft.metrics import degenerate_repetition


def recount(result: dict) -> dict[str, dict[str, int]]:
    """Per method: answers, those counted repeating then, now, and now but not by full."""
    rows = [r for r in result.get("items", []) if isinstance(r, dict) and isinstance(r.get("answer"), str)]
    full = {r["item"]: degenerate_repetition(r["answer"]) for r in rows if r["method"] == "full"}
    counts: dict[str, dict[str, int]] = {}
    for row in rows:
        now = degenerate_repetition(row["answer"])
        then = bool(row.get("repetition"))
        mine = counts.setdefault(row["method"], {"answers": 0, "then": 0, "now": 0, "new": 0,
                                                 "new_where_full_does_not": 0})
        mine["answers"] += 1
        mine["then"] += then
        mine["now"] += now
        if now and not then:
            mine["new"] += 1
            mine["new_where_full_does_not"] += not full.get(row["item"], False)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="where to write the JSON")
    parser.add_argument("results", type=Path, nargs="+", help="bench quality result files")
    args = parser.parse_args()
    found = {}
    for path in sorted(args.results):
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(result, dict) or result.get("benchmark") != "quality":
            continue
        counts = recount(result)
        if any(c["new"] for c in counts.values()):
            found[path.name] = counts
            for method, c in counts.items():
                if c["new"]:
                    print(f"{path.name}: {method}: {c['new']} more of {c['answers']} "
                          f"({c['new_where_full_does_not']} where full's does not)")
    args.out.write_text(json.dumps({"read": [p.name for p in sorted(args.results)], "more_repeating": found},
                                   indent=1) + "\n")


if __name__ == "__main__":
    main()
