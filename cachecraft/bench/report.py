"""``cachecraft bench report``: one Markdown page with PNG plots from the benchmark JSONs.

Reads the results of ``bench quality``, ``bench workload`` and ``bench scaling``
(any may be missing: its section then says how to make it) and an optional GPU
result, and writes ``report.md`` and the plots into one folder.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Callable

from cachecraft.bench import findings, plots
from cachecraft.bench.runs import command

SMALL_MODEL_GOLD = 0.15  # gold F1 below this for every method, full included, says the model cannot answer


def gold_note(methods: dict) -> str:
    """What gold-answer F1 says here: near zero with a model too small for MuSiQue."""
    gold = [m["gold_f1_mean"] for m in methods.values() if m and "gold_f1_mean" in m]
    if not gold:
        return "No gold-answer F1 in this result."
    if max(gold) < SMALL_MODEL_GOLD:
        return (f"Gold-answer F1 is near zero for every method, full prefill included (at most {max(gold):.3f}): "
                "the bundled 135M model is too small to answer MuSiQue's multi-hop questions. Agreement with "
                "full's answer and first-token KL against full are the quality figures that carry signal here; "
                "gold F1 matters with larger models.")
    return (f"Gold-answer F1 reaches {max(gold):.3f}; read it next to agreement with full, which isolates what "
            "cache reuse changes.")


def load_result(path: Path | None) -> dict | None:
    """A result JSON, or ``None`` when the file does not exist."""
    if path is None or not Path(path).is_file():
        return None
    return json.loads(Path(path).read_text(encoding="utf-8"))


def provenance(data: dict, source: Path) -> list[str]:
    """Where a result came from: file, command, model, dataset, machine, date."""
    m = data.get("machine") or {}
    machine = f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, torch {m.get('torch', '?')}"
    machine += f", GPU {m['gpu']}" if m.get("gpu") else ", no GPU"
    return [f"- result: `{source}`", f"- command: `{data.get('command', '?')}`", f"- code: {describe_code(data)}",
            f"- model: {data.get('model', '?')}", f"- dataset: {data.get('dataset', '?')}", f"- machine: {machine}",
            f"- date: {data.get('date', '?')}", ""]


def describe_code(data: dict) -> str:
    """The code a result was made with, as a report line (results older than this record say so)."""
    code = data.get("code")
    if not code:
        return "not recorded"
    text = f"cachecraft {code.get('version', '?')}"
    if code.get("commit"):
        text += f", commit {code['commit'][:10]}"
        if code.get("modified"):
            text += " with uncommitted changes"
    else:
        text += ", not from a git checkout"
    return text


def _plots(out: Path, data: dict, makers: list[tuple[str, Callable, str]]) -> list[str]:
    lines = []
    for name, make, caption in makers:
        if make(data, out / name) is not None:
            lines += [f"![{caption}]({name})", ""]
        else:
            lines += [f"_{caption}: not in this result._", ""]
    return lines


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(r) + " |" for r in rows), ""]


def quality_section(data: dict, source: Path, out: Path, tag: str = "") -> list[str]:
    """A ``bench quality`` result; ``tag`` tells its plots' file names apart from another
    quality section's (another model's)."""
    title = "## Quality and speed on the same requests" + (f" ({data['model']}: {Path(source).stem})"
                                                           if data.get("model") else "")
    lines = [title, "", *provenance(data, source)]
    lines += _plots(out, data, [(f"quality_tradeoff{tag}.png", plots.quality_tradeoff, "trade-off curves: quality against speed"),
                                (f"quality_intervals{tag}.png", plots.quality_intervals,
                                 "answer-level divergence with 95% intervals"),
                                (f"quality_bars{tag}.png", plots.quality_bars, "figures per method")])
    rows = [[label, f"{m['ttft_s_median']:.2f}", f"{m.get('speedup_vs_full_median', float('nan')):.1f}x",
             f"{m['recompute_fraction_mean']:.3f}", f"{m['kl_mean']:.4f}", f"{m['agreement_f1_mean']:.3f}",
             f"{m.get('exact_match_rate', float('nan')):.2f}", f"{m.get('gold_f1_mean', float('nan')):.3f}"]
            for label, m in (data.get("methods") or {}).items() if m]
    lines += _table(["method", "TTFT median (s)", "speedup vs full", "recompute", "KL vs full", "agreement F1",
                     "exact match vs full", "gold F1"], rows)
    return lines + [f"Note: {gold_note(data.get('methods') or {})}", ""]


def workload_section(data: dict, source: Path, out: Path) -> list[str]:
    lines = ["## Workload: a RAG trace with repeats and overlapping retrievals", "", *provenance(data, source)]
    budgets = data.get("budgets") or {}
    if budgets:
        lines += ["Budgets: " + ", ".join(f"{t} {b / 2**20:.0f} MiB" for t, b in budgets.items()), ""]
    lines += _plots(out, data, [("workload_compute.png", plots.workload_compute, "compute saved"),
                                ("workload_ttft.png", plots.workload_ttft, "TTFT distribution"),
                                ("workload_hits.png", plots.workload_hits, "cumulative hit rate per tier"),
                                ("workload_bytes.png", plots.workload_bytes, "bytes per tier against budgets")])
    rows = []
    for label, m in (data.get("methods") or {}).items():
        if plots.EVICTION.match(label):
            continue
        vs_prefix = f"{m['compute_reduction_vs_prefix']:.0%}" if "compute_reduction_vs_prefix" in m else "-"
        rows.append([label, f"{m['ttft_s_mean']:.2f}", f"{m['ttft_s_median']:.2f}", f"{m['ttft_s_p95']:.2f}",
                     f"{m.get('throughput_rps', float('nan')):.3f}", f"{m['recompute_fraction_mean']:.3f}",
                     f"{m['hit_rate']:.2f}", f"{m['compute_reduction_vs_full']:.0%}", vs_prefix,
                     f"{m['agreement_f1_mean']:.3f}"])
    lines += _table(["method", "TTFT mean (s)", "median (s)", "p95 (s)", "requests/s", "recompute", "hit rate",
                     "compute saved vs full", "vs prefix", "agreement F1"], rows)
    if any(plots.EVICTION.match(label) for label in data.get("methods") or {}):
        lines += eviction_policies(data, out)
    return lines


def eviction_section(data: dict, source: Path, out: Path) -> list[str]:
    """A separate `bench workload --evictions ...` run: its own trace and budgets."""
    lines = ["## Eviction policies", "", *provenance(data, source)]
    budgets = data.get("budgets") or {}
    if budgets:
        lines += ["Budgets: " + ", ".join(f"{t} {b / 2**20:.0f} MiB" for t, b in budgets.items()), ""]
    return lines + eviction_policies(data, out)


def eviction_policies(data: dict, out: Path) -> list[str]:
    """Plot and table of the ``cachecraft[policy]`` runs of a workload result."""
    lines = ["### Eviction policies on the same trace", ""]
    policies = {k: v for k, v in (data.get("methods") or {}).items() if plots.EVICTION.match(k)}
    if not policies:
        return lines + ["_No eviction-policy runs in this result (methods labelled like `cachecraft[lru]`)._", ""]
    lines += _plots(out, data, [("workload_evictions.png", plots.workload_evictions, "eviction policies")])
    return lines + _table(["policy", "hit rate", "compute saved vs full", "TTFT mean (s)", "agreement F1"],
                          [[label, f"{m.get('hit_rate', float('nan')):.2f}",
                            f"{m.get('compute_reduction_vs_full', float('nan')):.0%}",
                            f"{m.get('ttft_s_mean', float('nan')):.2f}",
                            f"{m.get('agreement_f1_mean', float('nan')):.3f}"]
                           for label, m in policies.items()])


def replay_section(data: dict, source: Path, out: Path, tag: str = "") -> list[str]:
    """A `bench eviction` replay: the policies on a long trace, without the model."""
    trace = f"seed {data.get('seed', '?')}"
    if data.get("shift_every"):
        trace += f", popularity drawn anew every {data['shift_every']} requests"
    lines = [f"## Eviction policies on a long trace ({trace})", "", *provenance(data, source)]
    summary = data.get("summary") or {}
    lines += [f"{data.get('requests', '?')} requests, {summary.get('lookups', '?')} chunk lookups over "
              f"{summary.get('distinct_chunks', '?')} distinct chunks, replayed through each policy alone "
              "(no model runs: only what eviction decides is measured).", ""]
    lines += _plots(out, data, [(f"eviction_replay{tag}.png", plots.eviction_replay,
                                 "eviction policies against budget")])
    return lines + _table(["budget", "policy", "hit rate", "compute saved", "evictions"],
                          [[f"{r['budget_fraction']:.0%} ({r['budget_bytes'] / 2**20:.0f} MiB)", r["policy"],
                            f"{r['hit_rate']:.3f}", f"{r['compute_saved']:.1%}", str(r["evictions"])]
                           for r in data.get("rows") or []])


def scaling_section(data: dict, source: Path, out: Path) -> list[str]:
    lines = ["## Scaling: context length and number of chunks", "", *provenance(data, source)]
    setup = data.get("setup") or {}
    for key in ("chunk_caches", "prefix"):
        if key in setup:
            lines.append(f"- setup, {key.replace('_', ' ')}: {setup[key]}")
    lines.append("")
    lines += _plots(out, data, [("scaling_context.png", plots.scaling_context, "TTFT and agreement against context"),
                                ("scaling_chunks.png", plots.scaling_chunks, "TTFT against number of chunks"),
                                ("scaling_memory.png", plots.scaling_memory, "peak memory against context")])
    rows = [[r["sweep"], r["method"], str(r["context_tokens"]), str(r["n_chunks"]), f"{r['ttft_s']:.2f}",
             f"{r['speedup_vs_full']:.1f}x", f"{r['work_ratio_vs_full']:.1f}x" if "work_ratio_vs_full" in r else "-",
             f"{r['agreement_f1']:.3f}", f"{r.get('kl', float('nan')):.4f}",
             f"{r['recompute_fraction']:.3f}", f"{r['peak_rss_mb']:.0f}"] for r in data.get("scaling") or []]
    lines += _table(["sweep", "method", "tokens", "chunks", "TTFT (s)", "speedup vs full", "less work than full",
                     "agreement F1", "KL", "recompute", "peak RSS (MB)"], rows)
    lines += ["\"Less work than full\" is full's prefill token-layers over the method's (look-ahead included): "
              "the speedup that compute alone predicts, unaffected by other load on the machine.", ""]
    return lines + _goal_line(data.get("summary") or {})


def revisit_section(data: dict, source: Path, out: Path) -> list[str]:
    """A `bench scaling --revisit` result: requests whose chunks an earlier request saw, shuffled."""
    lines = ["## Chunks seen before, in another order", "", *provenance(data, source)]
    setup = data.get("setup") or {}
    for key in ("chunk_caches", "revisit", "prefix"):
        if setup.get(key):
            lines.append(f"- setup, {key.replace('_', ' ')}: {setup[key]}")
    lines.append("")
    lines += _plots(out, data, [("revisit.png", plots.revisit_bars, "methods on requests whose chunks were seen "
                                                                     "before")])
    num = lambda v, fmt: "-" if v is None else fmt.format(v)  # noqa: E731
    rows = [[r["method"], str(r["context_tokens"]), str(r["repeats"]), f"{r['ttft_s']:.2f}",
             f"{r['speedup_vs_full']:.1f}x", f"{r['recompute_fraction']:.3f}", f"{r['kl']:.4f}",
             f"{r['agreement_f1']:.3f}", num(r.get("prefix_overlap"), "{:.2f}")]
            for r in data.get("scaling") or [] if r["sweep"] == "context"]
    lines += _table(["method", "tokens", "questions", "TTFT (s)", "speedup vs full", "recompute", "KL",
                     "agreement F1", "prefix overlap (beta')"], rows)
    lines += ["Prefix overlap is the policy's mean beta' over the chunks: the share of a chunk's cached "
              "cross-attention that went to chunks also before it now (order-weighted); 0 for caches made "
              "ahead of time after the warm context.", ""]
    summary = data.get("summary") or {}
    again = summary.get("goal_revisit")
    if again:
        lines += [_goal_sentence(again["method"], again["speedup"], again["agreement_f1"], again["met"],
                                 summary["goal"]), ""]
    return lines + _goal_line(summary)


def tradeoff_section(data: dict, source: Path, out: Path) -> list[str]:
    """A `bench scaling` result at one long context over a sweep of recompute ratios: how
    much agreement each method buys with its recompute, against the goal."""
    lines = ["## Recompute against agreement at the longest context", "", *provenance(data, source)]
    setup = data.get("setup") or {}
    if setup.get("chunk_caches"):
        lines.append(f"- setup, chunk caches: {setup['chunk_caches']}")
    lines.append("")
    goal = (data.get("summary") or {}).get("goal") or {}
    speedup, agreement = goal.get("speedup", 10.0), goal.get("agreement_f1", findings.AGREEMENT_BAR)
    lines += _plots(out, data, [("goal_tradeoff.png",
                                 lambda d, p: plots.goal_tradeoff(d, p, speedup, agreement),
                                 "agreement and KL against speedup, goal shaded")])
    rows = [r for r in data.get("scaling") or [] if r["sweep"] == "context"]
    lines += _table(["method", "tokens", "questions", "TTFT (s)", "speedup vs full", "recompute", "KL",
                     "agreement F1", "exact match"],
                    [[r["method"], str(r["context_tokens"]), str(r["repeats"]), f"{r['ttft_s']:.2f}",
                      f"{r['speedup_vs_full']:.1f}x", f"{r['recompute_fraction']:.3f}", f"{r['kl']:.4f}",
                      f"{r['agreement_f1']:.3f}", f"{r.get('exact_match', float('nan')):.2f}"] for r in rows])
    lines += [f"Against the goal ({speedup:g}x sooner than full at agreement >= {agreement:g}):", ""]
    lines += [f"- {line}" for line in findings.goal_reach(data, speedup, agreement)]
    return lines + [""]


def loading_section(data: dict, source: Path, out: Path) -> list[str]:
    """A `bench scaling --whole-read` result: chunk-caches streamed in during the prefill,
    against the same caches read whole before it."""
    setup = data.get("setup") or {}
    lines = ["## Loading: streamed in during the prefill, or read whole first", "", *provenance(data, source),
             f"- setup, tier: {setup.get('tier', '?')}"]
    for key in ("chunk_caches", "whole_read"):
        if setup.get(key):
            lines.append(f"- setup, {key.replace('_', ' ')}: {setup[key]}")
    for setting, bandwidths in (setup.get("loading_bandwidths") or {}).items():
        seen = ", ".join(f"{tier} {_bandwidth(b)}" for tier, b in bandwidths.items())
        lines.append(f"- loading controller's bandwidths, {LOADING_SETTINGS.get(setting, setting)}: {seen}")
    lines.append("")
    rows = [[streamed["method"], str(streamed["context_tokens"]), f"{whole['ttft_s']:.2f}",
             f"{streamed['ttft_s']:.2f}", f"{streamed['ttft_s'] / whole['ttft_s'] - 1:+.0%}",
             f"{whole['peak_rss_mb']:.0f}", f"{streamed['peak_rss_mb']:.0f}",
             f"{whole['agreement_f1']:.3f} / {streamed['agreement_f1']:.3f}"]
            for streamed, whole in findings.loading_pairs(data)]
    if not rows:
        return lines + ["_This result has no whole-read rows: make it with `--whole-read`._", ""]
    lines += _table(["method", "tokens", "TTFT, read whole (s)", "TTFT, streamed (s)", "change",
                     "peak RSS, read whole (MB)", "peak RSS, streamed (MB)", "agreement F1 (whole / streamed)"],
                    rows)
    return lines + ["Both rows of a method use the same chunk-caches from the same tier; only when and how "
                    "the bytes are read differs, and with it the bandwidth the loading controller has timed, "
                    "which sets how many tokens cachecraft recomputes to hide a load. Streaming overlaps "
                    "reading with compute, which pays where compute leaves a core or the accelerator idle "
                    "while bytes arrive.", ""]


LOADING_SETTINGS = {"warm": "streamed", "whole": "read whole"}


def _bandwidth(value) -> str:
    """A bandwidth from a result's setup: bytes/s as GB/s, or the reason it has none."""
    return f"{value / 1e9:.2f} GB/s" if isinstance(value, (int, float)) else str(value)


def _goal_line(summary: dict) -> list[str]:
    if summary.get("speedup_at_max_context") is None:
        return []
    goal = summary["goal"]
    return [f"At the longest context ({summary['max_context_tokens']} tokens) "
            + _goal_sentence(summary["method"], summary["speedup_at_max_context"],
                             summary["agreement_at_max_context"], goal["met"], goal), ""]


def _goal_sentence(method: str, speedup: float, agreement: float, met: bool, goal: dict) -> str:
    return (f"`{method}` is **{speedup:.1f}x** faster than full prefill at agreement {agreement:.3f}; goal >= "
            f"{goal['speedup']:g}x at >= {goal['agreement_f1']:g}: **{'met' if met else 'not met'}**.")


def gpu_section(gpu: dict | None, source: Path | None, others: list[dict]) -> list[str]:
    lines = ["## GPU", ""]
    if gpu is not None:
        name = (gpu.get("machine") or {}).get("gpu", "unknown GPU")
        lines += [f"GPU results exist: `{source}` ({gpu.get('benchmark', 'benchmark')} on {name}).", "",
                  *provenance(gpu, source)]
        num = lambda v: f"{v:.3f}" if isinstance(v, (int, float)) else "-"  # noqa: E731
        methods = {k: m for k, m in (gpu.get("methods") or {}).items() if m}
        if methods:
            lines += _table(["method", "TTFT median (s)", "TTFT mean (s)", "agreement F1"],
                            [[label, num(m.get("ttft_s_median")), num(m.get("ttft_s_mean")),
                              num(m.get("agreement_f1_mean"))] for label, m in methods.items()])
        lines += _goal_line(gpu.get("summary") or {})
        return lines
    on_gpu = [d for d in others if (d.get("machine") or {}).get("gpu")]
    if on_gpu:
        return lines + ["Some results above were measured with a GPU: " +
                        ", ".join(f"{d.get('benchmark')} on {d['machine']['gpu']}" for d in on_gpu) + ".", ""]
    return lines + ["No GPU run was made on this machine: every figure above is from the CPU. Pass "
                    "`--gpu-json FILE` to include a result measured on a GPU.", ""]


def diagnose_section(data: dict, source: Path, out: Path, tag: str = "") -> list[str]:
    """A ``bench diagnose`` result: where reused caches drift, and what each selector buys."""
    title = "## Why reuse drifts: layers, tokens, cache context, selectors"
    lines = [title + (f" ({data['model']})" if data.get("model") else ""), "", *provenance(data, source)]
    lines += _plots(out, data, [(f"diagnose{tag}.png", plots.diagnose_profiles,
                                 "deviation from full by layer and by position in the chunk")])
    summary = data.get("summary") or {}
    rows = [[context, label, f"{m['recompute_fraction']:.3f}", f"{m['answer_kl']:.4f}",
             f"{m['token_agreement']:.3f}", f"{m['kl']:.4f}"]
            for context, s in summary.items() for label, m in s["runs"].items()]
    lines += _table(["cache made after", "run", "recompute", "answer KL", "token agreement", "first-token KL"], rows)
    return lines + findings.diagnose_findings(data) + [""]


SECTIONS = {"quality": quality_section, "workload": workload_section, "eviction": eviction_section,
            "replay": replay_section, "scaling": scaling_section, "revisit": revisit_section,
            "loading": loading_section, "tradeoff": tradeoff_section, "diagnose": diagnose_section}


def write_report(out: Path, sources: dict[str, Path], gpu_source: Path | None = None,
                 dataset: Path | str | None = None) -> Path:
    """Write ``out/report.md`` and its PNGs from the JSONs at ``sources`` (keys: quality,
    workload, scaling, ...; ``quality:TAG`` for a further quality result, another model's
    say); returns the Markdown path. ``dataset`` goes into the commands
    shown for missing results (``DATASET`` when not given)."""
    dataset = dataset or "DATASET"
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results = {name: load_result(path) for name, path in sources.items()}
    gpu = load_result(gpu_source)
    if gpu_source is not None and gpu is None:
        raise FileNotFoundError(f"GPU result not found: {gpu_source}")
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    lines = ["# cachecraft benchmark report", "", f"Generated {now} by `cachecraft bench report` from:", ""]
    lines += [f"- {name}: `{path}`" + ("" if results[name] else " (missing)") for name, path in sources.items()]
    lines.append("")
    for name, path in sources.items():
        if results[name] is not None:
            kind, _, tag = name.partition(":")  # "quality:smollm2": a second quality result
            section = SECTIONS[kind]
            lines += (section(results[name], path, out, "_" + tag) if tag
                      else section(results[name], path, out))
        else:
            lines += [f"## {name.capitalize()}", "", f"_No result at `{path}`. Make it with:_", "",
                      f"    {command(name.partition(':')[0], path, dataset)}", ""]
    losses = (sum((findings.quality_losses(results[n]) for n in sources if n.partition(":")[0] == "quality"), [])
              + findings.workload_losses(results.get("workload"))
              + findings.eviction_losses(results.get("workload")) + findings.eviction_losses(results.get("eviction"))
              + sum((findings.replay_losses(results[n]) for n in sources if n.partition(":")[0] == "replay"), [])
              + findings.scaling_losses(results.get("scaling"))
              + findings.scaling_losses(results.get("revisit"), what="Revisit")
              + findings.loading_losses(results.get("loading"))
              + findings.scaling_losses(results.get("tradeoff"), what="Recompute sweep"))
    lines += ["## Where cachecraft loses", "",
              "Read off the results above: every case where another method is faster, closer to full, or saves "
              "more, and every setting that falls below 0.95 agreement with full.", ""]
    lines += [f"- {line}" for line in losses] or ["- No such case in these results."]
    lines.append("")
    lines += gpu_section(gpu, gpu_source, [r for r in results.values() if r])
    lines += ["## Reproduce", "", "Each result records the command that made it and, run from a git checkout, the "
              "commit of the code (each section's `code` line):", "", "```"]
    lines += [results[n]["command"] if results[n] else command(n.partition(":")[0], p, dataset)
              for n, p in sources.items()]
    lines += [f"cachecraft bench report --out {out}"
              + "".join(f" --{'also-' if ':' in n else ''}{n.partition(':')[0]} {p}" for n, p in sources.items())
              + (f" --gpu-json {gpu_source}" if gpu_source else ""), "```", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
