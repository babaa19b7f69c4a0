"""Regenerate the result tables of README.md and RESULTS.md from the JSON files in
``benchmarks/results/``.

``python -m cachecraft.bench.readme`` replaces each block between
``<!-- results:NAME -->`` and ``<!-- /results:NAME -->`` with a table built from
``benchmarks/results/NAME.json``; blocks whose JSON is missing are left alone.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from cachecraft.config import named_drift_estimator


def _commit(data: dict) -> str:
    """``, commit 0123456789`` for a result that recorded the commit it was made at, else nothing."""
    commit = (data.get("code") or {}).get("commit")
    return f", commit {commit[:10]}" if commit else ""


def _made(data: dict, *facts: str) -> str:
    """The opening of a table's source line: the command, then (model, ``facts``, date and
    commit, machine; the caller closes the parenthesis."""
    parts = [data["model"], *facts, f"{data['date'][:10]}{_commit(data)}", data["machine"]["cpu"],
             f"{data['machine']['cores']} cores"]
    return f"`{data['command']}` (" + ", ".join(parts)


def _ci(m: dict, key: str, mean_key: str, digits: int) -> str:
    interval = m["intervals"][key]
    return f"{m[mean_key]:.{digits}f} [{interval['low']:.{digits}f}, {interval['high']:.{digits}f}]"


def _repeats(m: dict) -> str:
    """Repeating answers (where full's do not), and how many were answered again from a full prefill."""
    text = f"{m['repetitions']} ({m['repetitions_where_full_does_not']})"
    return text + (f"; {m['escalations']} answered again" if m.get("escalations") else "")


def yardstick_table(data: dict) -> str:
    """Markdown table of a ``bench quality`` result with intervals and paired verdicts."""
    repeats = all("repetitions" in m for m in data["methods"].values())  # runs since repetition is detected
    lines = [_made(data, f"{data['limit']} items") + "; [95% bootstrap interval])", "",
             "| method | TTFT median (s) | speedup vs full | recompute | answer KL vs full | token agreement | "
             "first-token KL | answer agreement F1 | exact match | gold F1 |"
             + (" repeats (where full does not) |" if repeats else ""), "|---" * (11 if repeats else 10) + "|"]
    for label, m in data["methods"].items():
        lines.append(f"| {label} | {m['ttft_s_median']:.2f} | {m['speedup_vs_full_median']:.1f}x | "
                     f"{m['recompute_fraction_mean']:.3f} | {_ci(m, 'answer_kl', 'answer_kl_mean', 4)} | "
                     f"{_ci(m, 'token_agreement', 'token_agreement_mean', 3)} | {_ci(m, 'kl', 'kl_mean', 4)} | "
                     f"{_ci(m, 'agreement_f1', 'agreement_f1_mean', 3)} | {m['exact_match_rate']:.2f} | "
                     f"{_ci(m, 'gold_f1', 'gold_f1_mean', 3)} |"
                     + (f" {_repeats(m)} |" if repeats else ""))
    lines += ["", "Paired, item by item (method - baseline, [95% interval]); \"better\"/\"worse\" only where the "
              "interval excludes zero:", "",
              "| method | against | answer KL | token agreement | first-token KL | gold F1 |", "|---" * 6 + "|"]
    for label, against in data.get("comparisons", {}).items():
        for base, figures in against.items():
            cells = [f"{figures[k]['verdict']} ({figures[k]['mean']:+.3f} [{figures[k]['low']:+.3f}, "
                     f"{figures[k]['high']:+.3f}])" for k in ("answer_kl", "token_agreement", "kl", "gold_f1")]
            lines.append(f"| {label} | {base.removeprefix('vs ')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def quality_table(data: dict) -> str:
    """Markdown table of a ``bench quality`` result (with intervals where it has them)."""
    if data.get("comparisons"):
        return yardstick_table(data)
    lines = [_made(data, f"{data['limit']} items") + ")", "",
             "| method | TTFT median (s) | speedup vs full | recompute | KL vs full | answer agreement F1 | "
             "exact match vs full | gold F1 |", "|---|---|---|---|---|---|---|---|"]
    for label, m in data["methods"].items():
        lines.append(f"| {label} | {m['ttft_s_median']:.2f} | {m['speedup_vs_full_median']:.1f}x | "
                     f"{m['recompute_fraction_mean']:.3f} | {m['kl_mean']:.4f} | {m['agreement_f1_mean']:.3f} | "
                     f"{m['exact_match_rate']:.2f} | {m['gold_f1_mean']:.3f} |")
    return "\n".join(lines)


def workload_table(data: dict) -> str:
    """Markdown table of a ``bench workload`` result; with a warm-up, also how often a
    request reused a variant whose whole old prefix it held and the variants each store kept;
    where the result counts them, the requests computed in full once to keep their chunk
    order exact (and the later asks those keeps served exactly, where it counts those), and,
    where its rows say so, the requests that reused every chunk exactly: from a keep, or
    from caches an earlier request made in the same order."""
    warm = bool(data.get("warm"))
    kept = any("kept_exact_requests" in m for m in data["methods"].values())
    served = any("keep_asks_served" in m for m in data["methods"].values())
    exact = {}  # method -> requests answered from exact caches, counted from the rows
    if kept and data["requests"] and all("reused_exact" in r and "method" in r for r in data["requests"]):
        for row in data["requests"]:
            exact[row["method"]] = exact.get(row["method"], 0) + bool(row["reused_exact"])
    lines = [f"`{data['command']}` ({data['model']}, {len(data['requests']) // max(1, len(data['methods']))} "
             f"requests, {data['unique_requests']} distinct, corpus of {data['corpus_chunks']} chunks, "
             f"top-{data['top_k']}, {data['date'][:10]}{_commit(data)})", "",
             "| method | TTFT mean (s) | TTFT p95 (s) | requests/s | recompute | chunk hit rate | "
             "compute saved vs full | vs prefix | agreement F1 vs full |"
             + (" whole-prefix reuse | chunks with 2+ variants, after warm-up / at the end |" if warm else "")
             + ((" kept exact (asks they served) |" if served else " kept exact |") if kept else "")
             + (" reused exactly |" if exact else ""),
             "|---" * (9 + 2 * warm + kept + bool(exact)) + "|"]
    for label, m in data["methods"].items():
        vs_prefix = f"{m['compute_reduction_vs_prefix']:.0%}" if "compute_reduction_vs_prefix" in m else "-"
        line = (f"| {label} | {m['ttft_s_mean']:.2f} | {m['ttft_s_p95']:.2f} | {m['throughput_rps']:.3f} | "
                f"{m['recompute_fraction_mean']:.3f} | {m['hit_rate']:.2f} | "
                f"{m['compute_reduction_vs_full']:.0%} | {vs_prefix} | {m['agreement_f1_mean']:.3f} |")
        if warm:
            after, end = (m.get("warm") or {}).get("variants_after"), m.get("variants") or {}
            several = "-" if not after else (f"{after['chunks_with_several']}/{after['chunks']} / "
                                             f"{end.get('chunks_with_several', 0)}/{end.get('chunks', 0)}")
            line += f" {m.get('whole_prefix_reuse_rate', 0.0):.2f} | {several} |"
        if kept:
            line += f" {m.get('kept_exact_requests', 0)}"
            line += f" ({m['keep_asks_served']}) |" if "keep_asks_served" in m else " |"
        if exact:
            line += f" {exact.get(label, 0)} |"
        lines.append(line)
    return "\n".join(lines)


def workload_compare_table(data: dict) -> str:
    """Markdown table of a ``bench compare-workloads`` result: each trace's two runs side by
    side, then the pooled paired differences with their intervals."""
    from cachecraft.bench.workload import comparison_verdicts

    traces = len(data["traces"])
    lines = [_made(data, f"{traces} trace{'s' * (traces != 1)}, {data['requests']} requests in {data['clusters']} "
                         "chunk orders") + ")", "",
             "| trace: base / other | agreement F1 vs full | TTFT mean (s) | kept exact | reused exactly |",
             "|---|---|---|---|---|"]
    for base, other, trace in zip(data["base"], data["other"], data["traces"]):
        b, o = trace["base"], trace["other"]
        lines.append(f"| `{Path(base).name}` / `{Path(other).name}` | {b['agreement_f1']:.3f} / "
                     f"{o['agreement_f1']:.3f} | {b['ttft_s_mean']:.2f} / {o['ttft_s_mean']:.2f} | "
                     f"{b['kept_exact']} / {o['kept_exact']} | {b['reused_exact']} / {o['reused_exact']} |")
    lines += ["", "Pooled, request by request (95% intervals resampling whole chunk orders): "
                  + comparison_verdicts(data) + "."]
    return "\n".join(lines)


def store_table(data: dict) -> str:
    """Markdown table of a ``bench store`` result (headed by its command when it names one)."""
    env = data.get("environment", {})
    made = f"{str(data.get('created', ''))[:10]}{_commit(data)}"
    head = [f"`{data['command']}` ({made}, {env.get('cpu_count')} cores)", ""] if data.get("command") else []
    lines = [*head, "| tier | put (GB/s) | get, stored dtype (GB/s) | get, compute dtype (GB/s) | layer by layer (GB/s) |",
             "|---|---|---|---|---|"]
    for tier, t in data["tiers"].items():
        lines.append(f"| {tier} | {t['put_gbps']:.2f} | {t['get_stored_gbps']:.2f} | {t['get_compute_gbps']:.2f} | "
                     f"{t['layers_gbps']:.2f} |")
    return "\n".join(lines)


def scaling_table(data: dict) -> str:
    """Markdown table of a ``bench scaling`` result: TTFT (speedup vs full) per method and size."""
    lines = [_made(data) + ")"]
    for sweep, size, unit in (("context", "context_tokens", "prompt tokens"), ("chunks", "n_chunks", "chunks")):
        rows = [r for r in data["scaling"] if r["sweep"] == sweep]
        if not rows:
            continue
        methods = list(dict.fromkeys(r["method"] for r in rows))
        sizes = sorted({r[size] for r in rows})
        cell = {(r["method"], r[size]): r for r in rows}
        lines += ["", f"| {unit} | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
        for n in sizes:
            cells = []
            for m in methods:
                r = cell.get((m, n))
                cells.append("-" if r is None else
                             f"{r['ttft_s']:.2f} s ({r['speedup_vs_full']:.1f}x, F1 {r['agreement_f1']:.2f})")
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def method_rows_table(data: dict) -> str:
    """Markdown table of a one-context ``bench scaling`` result (``--revisit``, a ratio
    sweep): one row per method."""
    rows = [r for r in data["scaling"] if r["sweep"] == "context"]
    lines = [_made(data, f"{rows[0]['repeats']} questions") + ")", "",
             "| method | prompt tokens | TTFT (s) | speedup vs full | recompute | KL vs full | agreement F1 | "
             "prefix overlap |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        overlap = "-" if r.get("prefix_overlap") is None else f"{r['prefix_overlap']:.2f}"
        lines.append(f"| {r['method']} | {r['context_tokens']} | {r['ttft_s']:.2f} | {r['speedup_vs_full']:.1f}x | "
                     f"{r['recompute_fraction']:.3f} | {r['kl']:.4f} | {r['agreement_f1']:.3f} | {overlap} |")
    return "\n".join(lines)


def eviction_table(data: dict) -> str:
    """Markdown table of a ``bench eviction`` replay: hit rate and compute saved per policy and budget."""
    summary = data["summary"]
    lines = [f"`{data['command']}` ({data['model']} sizes, {data['requests']} requests, "
             f"{summary['distinct_chunks']} distinct chunks, top-{data['top_k']}, "
             f"{data['date'][:10]}{_commit(data)})", ""]
    policies = list(dict.fromkeys(r["policy"] for r in data["rows"]))
    lines += ["| budget | " + " | ".join(policies) + " |", "|---" * (len(policies) + 1) + "|"]
    for fraction in dict.fromkeys(r["budget_fraction"] for r in data["rows"]):
        cell = {r["policy"]: r for r in data["rows"] if r["budget_fraction"] == fraction}
        mib = next(iter(cell.values()))["budget_bytes"] / 2 ** 20
        lines.append(f"| {fraction:.0%} ({mib:.0f} MiB) | " + " | ".join(
            f"hits {cell[p]['hit_rate']:.3f}, saved {cell[p]['compute_saved']:.1%}" for p in policies) + " |")
    return "\n".join(lines)


def cluster_table(data: dict) -> str:
    """Markdown tables of a ``bench cluster`` result: phases side by side, then the tier timing."""
    kept = any("kept_exact_requests" in m for m in data["phases"].values())  # results before it lack it
    lines = [_made(data, f"{data['nodes']} node processes", f"{data['requests']} requests",
                   f"{data['unique_requests']} distinct", f"top-{data['top_k']}") + ")", "",
             "| phase | hit rate | from redis | from cpu | from disk | recompute | TTFT median (s) | "
             "prefill work (token-layers) |" + (" kept exact |" if kept else ""), "|---" * (8 + kept) + "|"]
    for phase, m in data["phases"].items():
        tiers = m["hit_rate_by_tier"]
        lines.append(f"| {phase} | {m['hit_rate']:.0%} | " + " | ".join(f"{tiers.get(t, 0):.0%}"
                                                                   for t in ("redis", "cpu", "disk"))
                     + f" | {m['recompute_fraction_mean']:.3f} | {m['ttft_s_median']:.3f} | {m['token_layers']:,} |"
                     + (f" {m.get('kept_exact_requests', 0)} |" if kept else ""))
    saved = data["prefill_work_saved_vs_isolated"]
    timing = data["tier_timing"]
    lines += ["", f"Prefill work saved by sharing: {saved:.0%}." if saved is not None else "", "",
              f"TTFT of `reuse` by where every chunk-cache came from ({timing['prompts_from_one_tier']} prompts, "
              "medians):", "", "| source | TTFT (s) | against the CPU tier | speed-up vs full |", "|---" * 4 + "|"]
    for source in ("redis", "cpu", "disk"):
        t = timing["summary"][source]
        if t["ttft_s_median"] is None:
            continue
        lines.append(f"| {source} | {t['ttft_s_median']:.3f} | {t['vs_cpu_median']:.2f}x | "
                     f"{t['speedup_vs_full_median']:.1f}x |")
    full = timing["summary"]["full"]["ttft_s_median"]
    if full is not None:
        lines.append(f"| full prefill | {full:.3f} | | 1.0x |")
    return "\n".join(lines)


def serve_table(data: dict) -> str:
    """Markdown table of a ``bench serve`` result: one row per method and client count."""
    requests = len(data["runs"][0]["rows"]) if data["runs"] else 0
    lines = [_made(data, f"{requests} requests", f"{data['unique_requests']} distinct", f"top-{data['top_k']}") + ")",
             "",
             "| method | clients | requests/s | client TTFT p50 (s) | p90 | p99 | server TTFT median (s) | mean | "
             "hit rate | errors |", "|---" * 10 + "|"]
    for r in data["runs"]:
        t = r["client_ttft_s"]
        # Reused and computed requests sit far apart, so the median can land in the gap
        # between them and jump with one request; the mean weighs both sides.
        server = [row["server_ttft_s"] for row in r["rows"] if row.get("server_ttft_s") is not None]
        mean = f"{sum(server) / len(server):.3f}" if server else "-"
        lines.append(f"| {r['method']} | {r['clients']} | {r['throughput_rps']:.2f} | {t['p50']:.2f} | "
                     f"{t['p90']:.2f} | {t['p99']:.2f} | {r['server_ttft_s_median']:.3f} | {mean} | "
                     f"{r['hit_rate']:.0%} | {len(r['errors'])} |")
    return "\n".join(lines)


def diagnose_table(data: dict) -> str:
    """``bench diagnose``: answer KL (token agreement) of each run, one column per cache
    context, then where the values deviate most and by how much per position."""
    summary = data["summary"]
    contexts = list(summary)
    lines = [_made(data, f"{data['limit']} items from #{data['skip']}") + "; means over items)", "",
             "| run | " + " | ".join(f"made after: {c}" for c in contexts) + " |", "|---" * (len(contexts) + 1) + "|"]
    for label in summary[contexts[0]]["runs"]:
        cells = [f"{summary[c]['runs'][label]['answer_kl']:.3f} ({summary[c]['runs'][label]['token_agreement']:.3f})"
                 for c in contexts]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Answer KL (token agreement) against full. Relative deviation of the reused values from "
                  "full's:", "", "| made after | layer 1 | layer with most (value) | mean over layers | "
                  + " | ".join(f"position {b}" for b in summary[contexts[0]]["positions_v"]) + " |",
              "|---" * (4 + len(summary[contexts[0]]["positions_v"])) + "|"]
    for c in contexts:
        v = summary[c]["layers_v"]
        peak = max(range(len(v)), key=v.__getitem__)
        lines.append(f"| {c} | {v[1]:.3f} | {peak} ({v[peak]:.3f}) | {sum(v) / len(v):.3f} | "
                     + " | ".join(f"{x:.3f}" for x in summary[c]["positions_v"].values()) + " |")
    return "\n".join(lines)


def calibrate_table(data: dict) -> str:
    """Markdown table of a ``calibrate`` result: every candidate, the chosen one marked."""
    # a relevance column only where a candidate had one (results from before it keep their table)
    relevance = any(r.get("relevance", 0.0) for r in data["rows"])
    chosen = (*(data[k] for k in ("policy_floor", "policy_sink_tokens", "policy_drift_shift")),
              named_drift_estimator(data, "policy_"), data.get("policy_relevance", 0.0))
    lines = [_made(data, f"{data['limit']} items from #{data['skip']}") + f"; full's TTFT median "
             f"{data['full_ttft_s_median']:.1f} s; means over items, TTFT a median)", "",
             "| alpha | floor | sink tokens | drift shift | " + ("relevance | " if relevance else "")
             + "recompute | answer KL | token agreement | first-token KL | TTFT (s) |", "|---" * (10 if relevance else 9) + "|"]
    for r in data["rows"]:
        estimator = named_drift_estimator(r)
        own = (r["floor"], r["sink_tokens"], r.get("drift_shift", 0.0), estimator, r.get("relevance", 0.0))
        mark = " (chosen)" if own == chosen else ""
        shift = f"{r.get('drift_shift', 0.0):g}" + ("" if estimator == "mean" else f" {estimator}")
        lines.append(f"| {r['alpha']:g} | {r['floor']:g} | {r['sink_tokens']} | "
                     + (f"{shift} | {r['relevance']:g}{mark} | " if relevance else f"{shift}{mark} | ")
                     + f"{r['recompute']:.3f} | {r['answer_kl']:.4f} | {r['token_agreement']:.3f} | {r['kl']:.4f} | "
                     f"{r['ttft_s']:.2f} |")
    return "\n".join(lines)


def gpu_table(data: dict) -> str:
    """Markdown tables of a ``bench gpu`` result: TTFT (speedup over full; recompute where
    the method recomputes) per prompt length and method, one table per tier, then peak GPU
    memory at the longest prompt."""
    from cachecraft.bench.plots import gpu_label, gpu_per_point

    machine = data["machine"]
    made = [f"{machine.get('gpu', 'GPU')}", f"torch {machine['torch']}", "random weights",
            f"{data['date'][:10]}{_commit(data)}"]
    lines = [f"`{data['command']}` (" + ", ".join(made) + f"; {gpu_per_point(data['runs'])})"]
    for run in data["runs"]:
        rows = run["scaling"]
        methods = list(dict.fromkeys(r["method"] for r in rows))
        cell = {(r["method"], r["context_tokens"]): r for r in rows}
        lines += ["", f"{run['shape']} ({run['parameters'] / 1e9:.1f}B parameters, "
                  f"{run['kv_bytes_per_token'] // 1024} KiB of chunk-cache per token), caches in the "
                  f"**{run['tier']}** tier:", "",
                  "| prompt tokens | " + " | ".join(gpu_label(m) for m in methods) + " |",
                  "|---" * (len(methods) + 1) + "|"]
        for n in sorted({r["context_tokens"] for r in rows}):
            cells = []
            for m in methods:
                r = cell.get((m, n))
                if r is None:
                    cells.append("-")
                elif m == "full":
                    cells.append(f"{r['ttft_s']:.2f} s")
                else:
                    share = "" if m in ("prefix", "reuse") else f", {r['recompute_fraction']:.0%}"
                    cells.append(f"{r['ttft_s']:.2f} s ({r['speedup_vs_full']:.1f}x{share})")
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    gpu_runs = [run for run in data["runs"] if run["tier"] == "gpu"] or data["runs"][:1]
    for run in gpu_runs:
        top = max(r["context_tokens"] for r in run["scaling"])
        peaks = [f"{gpu_label(r['method'])} {r['peak_gpu_mb'] / 1024:.1f}" for r in run["scaling"]
                 if r["context_tokens"] == top and r.get("peak_gpu_mb") is not None]
        if peaks:
            lines += ["", f"Peak GPU memory (GiB) at {top} tokens, caches in the {run['tier']} tier (the model's "
                      "weights and the tier's caches included): " + ", ".join(peaks) + "."]
    return "\n".join(lines)


# A result is rendered by the kind of benchmark that wrote it (its JSON's "benchmark" field);
# the names here are results whose table differs from their kind's.
BY_BENCHMARK = {"quality": quality_table, "calibrate": calibrate_table, "cluster": cluster_table,
                "diagnose": diagnose_table, "serve": serve_table, "workload": workload_table,
                "workload_compare": workload_compare_table,
                "store": store_table, "eviction": eviction_table, "scaling": scaling_table, "gpu": gpu_table}
RENDERERS = {"scaling_8k_revisit": method_rows_table, "scaling_8k_sweep": method_rows_table}
BLOCK = re.compile(r"<!-- results:([\w.\-]+) -->\n")


def renderer_for(name: str, data: dict):
    """The table function for result ``name`` (its JSON ``data``), or None for an unknown kind."""
    return RENDERERS.get(name) or BY_BENCHMARK.get(str(data.get("benchmark")))


DOCUMENTS = ("README.md", "RESULTS.md")  # the files whose marked blocks are rendered


def update(readme: Path, results: Path) -> list[str]:
    """Rewrite the marked blocks of ``readme``; returns the names updated."""
    text = readme.read_text(encoding="utf-8")
    updated = []
    for name in dict.fromkeys(BLOCK.findall(text)):  # each block once, in the README's order
        source = results / f"{name}.json"
        pattern = re.compile(rf"(<!-- results:{re.escape(name)} -->\n)(?:.*?\n)?(<!-- /results:{re.escape(name)} -->)", re.S)
        if not source.is_file() or not pattern.search(text):
            continue
        data = json.loads(source.read_text(encoding="utf-8"))
        render = renderer_for(name, data)
        if render is None:
            continue
        table = render(data)
        text = pattern.sub(lambda m: m.group(1) + table + "\n" + m.group(2), text)
        updated.append(name)
    readme.write_text(text, encoding="utf-8")
    return updated


def update_documents(root: Path) -> dict[str, list[str]]:
    """Rewrite the marked blocks of each of :data:`DOCUMENTS` under ``root`` that exists
    from ``root/benchmarks/results``; returns the names updated per document."""
    return {doc: update(root / doc, root / "benchmarks" / "results") for doc in DOCUMENTS if (root / doc).is_file()}


if __name__ == "__main__":
    for doc, names in update_documents(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")).items():
        print(f"{doc} updated:", ", ".join(names) or "nothing")
