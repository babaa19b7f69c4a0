"""PNG plots of the benchmark JSONs (matplotlib, Agg backend; the ``bench`` extra).

Each function takes one result (the parsed JSON) and a path, writes the plot and
returns the path, or returns ``None`` when the result lacks what the plot needs.
Importing this module without matplotlib raises :class:`~cachecraft.bench.common.MissingExtra`.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Sequence

from cachecraft.bench.common import pyplot

plt = pyplot()
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator  # noqa: E402

COLORS = {"full": "#222222", "prefix": "#8c8c8c", "reuse": "#ff7f0e", "cacheblend": "#1f77b4",
          "cachecraft": "#2ca02c", "qguided": "#9467bd", "inter": "#8c564b", "firstk": "#e377c2",
          "cachecraft+nb1": "#bcbd22", "qguided+nb1": "#17becf"}
TIER_COLORS = {"gpu": "#d62728", "cpu": "#1f77b4", "disk": "#ff7f0e", "all": "#222222"}
STYLE = {"font.size": 12, "axes.titlesize": 14, "axes.labelsize": 12, "legend.fontsize": 10,
         "xtick.labelsize": 10, "ytick.labelsize": 10, "axes.grid": True, "grid.alpha": 0.3,
         "figure.dpi": 100, "savefig.bbox": "tight"}
MARKERS = "osD^vPX*"
EVICTION = re.compile(r"^(?P<method>[\w-]+)\[(?P<policy>[\w-]+)\]$")


IN_CONTEXT = re.compile(r"\+nb\d+$")
CHAT = "+chat"  # a follow-up in a chat (the quality benchmark's label suffix)
OTHER_COLOR = "#17becf"


def family(label: str) -> str:
    """``cacheblend@0.15`` -> ``cacheblend``; ``cachecraft[lru]`` -> ``cachecraft``; ``prefix revisit`` -> ``prefix``;
    an in-context run keeps its suffix (``cachecraft@0.08+nb1`` -> ``cachecraft+nb1``), a series of its own, and so
    does a chat's follow-up (``cachecraft@0.08+chat`` -> ``cachecraft+chat``, ``full+chat`` -> ``full+chat``)."""
    chat = label.endswith(CHAT)
    label = label.removesuffix(CHAT)
    base = re.split(r"[@\[ ]", label, maxsplit=1)[0]
    suffix = IN_CONTEXT.search(label)
    base = base + suffix.group(0) if suffix and not base.endswith(suffix.group(0)) else base
    return base + CHAT if chat else base


def family_color(name: str) -> str:
    """A family's colour; a chat's follow-up takes its method's, paler, so the two turns
    of one method read as a pair."""
    if name.endswith(CHAT) and name not in COLORS:
        from matplotlib.colors import to_hex, to_rgb
        base = to_rgb(family_color(name.removesuffix(CHAT)))
        return to_hex(tuple(c + (1.0 - c) * 0.45 for c in base))
    return COLORS.get(name, OTHER_COLOR)


def color(label: str) -> str:
    """The colour of a method label: its family's."""
    return family_color(family(label))


def ratio(label: str) -> float | None:
    """The ``@ratio`` of a label, if any."""
    _, sep, value = IN_CONTEXT.sub("", label.removesuffix(CHAT)).partition("@")
    try:
        return float(value) if sep else None
    except ValueError:
        return None


def _log_axis(ax, which: str) -> None:
    """Log scale with plain tick labels (0.5, 1, 2, 5, 10) rather than powers of ten."""
    axis = ax.xaxis if which == "x" else ax.yaxis
    (ax.set_xscale if which == "x" else ax.set_yscale)("log")
    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _family_legend(ax, labels: Sequence[str], **kwargs) -> None:
    from matplotlib.patches import Patch
    families = list(dict.fromkeys(family(label) for label in labels))
    ax.legend(handles=[Patch(color=family_color(f), label=f) for f in families], **kwargs)


# -- quality ----------------------------------------------------------------------------------

def _ratio_families(ax, points: list[tuple[float, float, str]]) -> None:
    """Plot (x, y, label) points, one line per method family in order of ratio, each point
    with a ratio labelled by it."""
    groups: dict[str, list[tuple[float, float, str]]] = {}
    for point in points:
        groups.setdefault(family(point[2]), []).append(point)
    for name, mine in groups.items():
        mine.sort(key=lambda p: (ratio(p[2]) or 0.0, p[0]))
        ax.plot([p[0] for p in mine], [p[1] for p in mine], "o-" if len(mine) > 1 else "o",
                color=family_color(name), markersize=8, linewidth=1.5, label=name)
        for x, y, label in mine:
            if ratio(label) is not None:
                ax.annotate(f"{ratio(label):g}", (x, y), textcoords="offset points", xytext=(6, 5), fontsize=9,
                            color=family_color(name))


def quality_tradeoff(data: dict, path: Path) -> Path | None:
    """Trade-off curves, one line per selector through its ratios: answer-level KL and token
    agreement against the speedup over full where the result has them (the yardstick),
    else answer agreement and first-token KL against median TTFT."""
    methods = {k: v for k, v in (data.get("methods") or {}).items() if v}
    if not methods:
        return None
    yardstick = all("answer_kl_mean" in m for m in methods.values())
    if yardstick:
        x_key, x_label = "speedup_vs_full_median", "median speedup of the first token over full (log scale)"
        panels = (("answer_kl_mean", "answer-level KL(full || method) (nats)", "Answer-level KL (lower is better)"),
                  ("token_agreement_mean", "token agreement with full's answer", "Token agreement (higher is better)"))
    else:
        x_key, x_label = "ttft_s_median", "median time to first token (s, log scale)"
        panels = (("agreement_f1_mean", "answer agreement with full (token F1)", "Answer agreement (higher is better)"),
                  ("kl_mean", "first-token KL(full || method) (nats)", "First-token KL (lower is better)"))
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
        for ax, (key, ylabel, title) in zip(axes, panels):
            _ratio_families(ax, [(m[x_key], m[key], label) for label, m in methods.items()])
            _log_axis(ax, "x")
            ax.set_xlabel(x_label)
            ax.set_ylabel(ylabel)
            ax.set_title(title)
        handles, names = axes[0].get_legend_handles_labels()
        fig.legend(handles, names, loc="lower center", ncol=min(len(names), 5),
                   title="method (point labels: ratio / alpha)", bbox_to_anchor=(0.5, -0.01))
        fig.suptitle(f"{'Trade-off curves' if yardstick else 'Quality against TTFT'}, {data.get('model', '?')}, "
                     f"{data.get('limit', '?')} requests", fontsize=15)
        fig.tight_layout(rect=(0, 0.17 if len(names) > 5 else 0.13, 1, 1))
        return _save(fig, path)


def quality_intervals(data: dict, path: Path) -> Path | None:
    """Answer-level KL and token agreement against speedup over full, one point per
    method with its 95% interval as a bar (results with intervals only)."""
    methods = {k: v for k, v in (data.get("methods") or {}).items() if v and v.get("intervals")}
    if not methods:
        return None
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
        for ax, key, mean_key, ylabel in (
                (axes[0], "answer_kl", "answer_kl_mean", "answer-level KL(full || method), mean per token (nats)"),
                (axes[1], "token_agreement", "token_agreement_mean", "token agreement with full's answer")):
            for label, m in methods.items():
                interval = m["intervals"][key]
                y = m[mean_key]
                ax.errorbar(m["speedup_vs_full_median"], y, yerr=[[y - interval["low"]], [interval["high"] - y]],
                            fmt="o", color=color(label), capsize=4, markersize=7)
                ax.annotate(label, (m["speedup_vs_full_median"], y), textcoords="offset points", xytext=(6, 4),
                            fontsize=8, color=color(label))
            _log_axis(ax, "x")
            ax.set_xlabel("median speedup of the first token over full (log scale)")
            ax.set_ylabel(ylabel)
        axes[0].set_title("Answer-level KL (lower is better)")
        axes[1].set_title("Token agreement (higher is better)")
        _family_legend(axes[1], list(methods), loc="lower left", title="method")
        fig.suptitle(f"The yardstick: {data.get('model', '?')}, {data.get('limit', '?')} items, 95% intervals",
                     fontsize=15)
        fig.tight_layout()
        return _save(fig, path)


def quality_bars(data: dict, path: Path) -> Path | None:
    """One horizontal bar per method for TTFT, recompute, KL, agreement and gold F1."""
    methods = {k: v for k, v in (data.get("methods") or {}).items() if v}
    if not methods:
        return None
    panels = (("ttft_s_median", "median TTFT", "seconds"),
              ("recompute_fraction_mean", "recompute fraction", "recomputed / context tokens"),
              ("kl_mean", "first-token KL vs full", "nats"),
              ("agreement_f1_mean", "answer agreement with full", "token F1 (0-1)"),
              ("gold_f1_mean", "gold-answer F1", "token F1 (0-1)"))
    labels = list(methods)
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(2, 3, figsize=(16, 4 + 0.45 * len(labels)))
        for ax, (key, title, unit) in zip(axes.flat, panels):
            values = [methods[label].get(key, float("nan")) for label in labels]
            ax.barh(range(len(labels)), values, color=[color(label) for label in labels])
            ax.set_yticks(range(len(labels)), labels)
            ax.invert_yaxis()
            ax.set_title(title)
            ax.set_xlabel(unit)
            for i, v in enumerate(values):
                ax.annotate(f"{v:.3g}", (v, i), xytext=(3, 0), textcoords="offset points", va="center", fontsize=9)
            ax.margins(x=0.18)
        legend_ax = axes.flat[-1]
        legend_ax.axis("off")
        _family_legend(legend_ax, labels, loc="center", title="method", fontsize=12)
        fig.suptitle(f"Methods on the same requests, {data.get('model', '?')}", fontsize=15)
        fig.tight_layout()
        return _save(fig, path)


# -- workload ---------------------------------------------------------------------------------

def _plain_methods(data: dict) -> dict[str, dict]:
    return {k: v for k, v in (data.get("methods") or {}).items() if not EVICTION.match(k)}


def workload_compute(data: dict, path: Path) -> Path | None:
    """Compute saved (token-layers) against ``full`` and ``prefix``, per method."""
    methods = _plain_methods(data)
    if not methods:
        return None
    labels = list(methods)
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(max(8, 1.5 * len(labels)), 5))
        width = 0.38
        for offset, key, name, hatch in ((-width / 2, "compute_reduction_vs_full", "vs full", ""),
                                         (width / 2, "compute_reduction_vs_prefix", "vs prefix", "//")):
            values = [100 * methods[m].get(key, float("nan")) for m in labels]
            bars = ax.bar([i + offset for i in range(len(labels))], values, width, label=name, hatch=hatch,
                          color=[color(m) for m in labels], edgecolor="white")
            ax.bar_label(bars, fmt="%.0f%%", fontsize=9, padding=2)
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(labels)), labels)
        ax.set_ylabel("prefill compute saved (% of token-layers)")
        ax.set_title("Workload: compute saved against full prefill (plain) and prefix caching (hatched)")
        ax.legend(title="reduction")
        return _save(fig, path)


def workload_ttft(data: dict, path: Path) -> Path | None:
    """TTFT distribution per method over the trace (box: quartiles; marker: p95)."""
    rows = data.get("requests") or []
    labels = [m for m in _plain_methods(data) if any(r["method"] == m for r in rows)]
    if not labels:
        return None
    samples = [[r["ttft_s"] for r in rows if r["method"] == m] for m in labels]
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(max(8, 1.5 * len(labels)), 5.5))
        box = ax.boxplot(samples, patch_artist=True, widths=0.55, medianprops={"color": "black"})
        for patch, label in zip(box["boxes"], labels):
            patch.set_facecolor(color(label))
            patch.set_alpha(0.6)
        p95 = [sorted(s)[min(len(s) - 1, round(0.95 * (len(s) - 1)))] for s in samples]
        ax.plot(range(1, len(labels) + 1), p95, "v", color="#d62728", markersize=10, label="p95")
        ax.plot(range(1, len(labels) + 1), [statistics.fmean(s) for s in samples], "D", color="white",
                markeredgecolor="black", markersize=7, label="mean")
        ax.plot([], [], color="black", label="median (box line)")
        ax.set_xticks(range(1, len(labels) + 1), labels)
        _log_axis(ax, "y")
        ax.set_ylabel("time to first token (s, log scale)")
        ax.set_title(f"Workload: TTFT per request over a {len(samples[0])}-request trace")
        ax.legend(loc="best")
        return _save(fig, path)


def _cumulative_hits(rows: list[dict]) -> dict[str, list[float]]:
    tiers = sorted({t for r in rows for t in r.get("hits", {}) if t != "miss"})
    chunks, counts = 0, {t: 0 for t in tiers}
    curves: dict[str, list[float]] = {t: [] for t in [*tiers, "all"]}
    for r in sorted(rows, key=lambda r: r["request"]):
        chunks += r["chunks"]
        for t in tiers:
            counts[t] += r["hits"].get(t, 0)
            curves[t].append(counts[t] / chunks if chunks else 0.0)
        curves["all"].append(sum(counts.values()) / chunks if chunks else 0.0)
    return curves


def workload_hits(data: dict, path: Path) -> Path | None:
    """Cumulative chunk hit rate by tier against request number, one panel per method."""
    rows = data.get("requests") or []
    labels = [m for m in (data.get("methods") or {})
              if any(r["method"] == m and set(r.get("hits", {})) - {"miss"} for r in rows)]
    if not labels:
        return None
    cols = min(3, len(labels))
    nrows = -(-len(labels) // cols)
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 4.2 * nrows), squeeze=False, sharey=True)
        for ax, label in zip(axes.flat, labels):
            curves = _cumulative_hits([r for r in rows if r["method"] == label])
            for tier, ys in curves.items():
                total = tier == "all"  # drawn wide and underneath, so a tier that holds every hit shows on it
                ax.plot(range(1, len(ys) + 1), ys, color=TIER_COLORS.get(tier, "#17becf"),
                        linewidth=4 if total else 1.8, linestyle="-" if total else "--", alpha=0.5 if total else 1,
                        zorder=2 if total else 3, label="any tier" if total else tier)
            ax.set_title(label)
            ax.set_xlabel("request number")
            ax.set_ylabel("cumulative hit rate (share of chunks)")
            ax.set_ylim(0, 1.05)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if ax is axes.flat[0]:
                ax.legend(loc="upper left", ncol=2)
        return _finish_grid(fig, axes, len(labels), "Workload: where chunk-caches were found, cumulative over the trace", path)


def _finish_grid(fig, axes, used: int, title: str, path: Path) -> Path:
    """Hide the unused panels of a per-method grid, title it and save it."""
    for ax in list(axes.flat)[used:]:
        ax.axis("off")
    fig.suptitle(title, fontsize=15)
    fig.tight_layout()
    return _save(fig, path)


def workload_bytes(data: dict, path: Path) -> Path | None:
    """Bytes held per tier against the budgets: over the trace when the rows carry
    ``store_bytes``, else the final usage per method."""
    rows = [r for r in data.get("requests") or [] if r.get("store_bytes")]
    budgets = data.get("budgets") or {}
    if rows:
        return _bytes_over_trace(rows, budgets, path)
    usage = {m: v["store_usage"] for m, v in (data.get("methods") or {}).items() if v.get("store_usage")}
    if not usage:
        return None
    tiers = sorted({t for u in usage.values() for t in u})
    labels = list(usage)
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(labels)), 5))
        width = 0.8 / len(tiers)
        for k, tier in enumerate(tiers):
            xs = [i + (k - (len(tiers) - 1) / 2) * width for i in range(len(labels))]
            ax.bar(xs, [usage[m].get(tier, {}).get("bytes", 0) / 2**20 for m in labels], width,
                   color=TIER_COLORS.get(tier, "#17becf"), label=f"{tier} bytes held")
            budget = budgets.get(tier) or next((u[tier]["budget"] for u in usage.values() if tier in u), None)
            if budget:
                ax.axhline(budget / 2**20, color=TIER_COLORS.get(tier, "#17becf"), linestyle=":",
                           label=f"{tier} budget ({budget / 2**20:.0f} MiB)")
        ax.set_xticks(range(len(labels)), labels)
        ax.margins(y=0.12)
        ax.set_ylabel("MiB held")
        ax.set_title("Workload: store bytes per tier at the end of the trace, against the budgets")
        ax.legend(loc="best")
        return _save(fig, path)


def _bytes_over_trace(rows: list[dict], budgets: dict, path: Path) -> Path:
    labels = list(dict.fromkeys(r["method"] for r in rows))
    cols = min(3, len(labels))
    nrows = -(-len(labels) // cols)
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 4.2 * nrows), squeeze=False, sharey=True)
        for ax, label in zip(axes.flat, labels):
            mine = sorted((r for r in rows if r["method"] == label), key=lambda r: r["request"])
            tiers = sorted({t for r in mine for t in r["store_bytes"]})
            for tier in tiers:
                c = TIER_COLORS.get(tier, "#17becf")
                ax.plot([r["request"] + 1 for r in mine], [r["store_bytes"].get(tier, 0) / 2**20 for r in mine],
                        color=c, linewidth=2, label=f"{tier} held")
                if budgets.get(tier):
                    ax.axhline(budgets[tier] / 2**20, color=c, linestyle=":", label=f"{tier} budget")
            ax.set_title(label)
            ax.set_xlabel("request number")
            ax.set_ylabel("MiB held")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if ax is axes.flat[0]:
                ax.legend(loc="best")
        return _finish_grid(fig, axes, len(labels), "Workload: bytes per tier over the trace, against the budgets", path)


def workload_evictions(data: dict, path: Path) -> Path | None:
    """Hit rate and compute saved per eviction policy (methods labelled ``name[policy]``)."""
    methods = {k: v for k, v in (data.get("methods") or {}).items() if EVICTION.match(k)}
    if not methods:
        return None
    labels = list(methods)
    policies = [EVICTION.match(label)["policy"] for label in labels]
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
        palette = plt.get_cmap("tab10")
        for ax, key, title in ((axes[0], "hit_rate", "chunk hit rate (share of chunks)"),
                               (axes[1], "compute_reduction_vs_full", "compute saved vs full (%)")):
            scale = 100 if key.startswith("compute") else 1
            values = [scale * methods[m].get(key, float("nan")) for m in labels]
            bars = ax.bar(range(len(labels)), values, color=[palette(i) for i in range(len(labels))],
                          label=policies)
            ax.axhline(0, color="black", linewidth=0.8)
            ax.bar_label(bars, fmt="%.0f%%" if scale == 100 else "%.2f", fontsize=9, padding=2)
            ax.set_xticks(range(len(labels)), policies)
            ax.set_xlabel("eviction policy")
            ax.set_ylabel(title)
            ax.set_title(title.split(" (")[0])
            ax.margins(y=0.15)
        handles, names = axes[0].get_legend_handles_labels()
        fig.legend(handles, names, title="eviction policy", loc="lower center", ncol=len(names))
        fig.suptitle(f"Eviction policies on the same trace ({family(labels[0])}, same budgets)", fontsize=15)
        fig.tight_layout(rect=(0, 0.12, 1, 1))
        return _save(fig, path)


def eviction_replay(data: dict, path: Path) -> Path | None:
    """Hit rate and compute saved against the cache budget, one line per eviction policy."""
    rows = data.get("rows") or []
    if not rows:
        return None
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
        for ax, key, label in ((axes[0], "hit_rate", "chunk hit rate (share of lookups)"),
                               (axes[1], "compute_saved", "prefill compute saved (%)")):
            scale = 100 if key == "compute_saved" else 1
            for i, policy in enumerate(dict.fromkeys(r["policy"] for r in rows)):
                mine = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["budget_fraction"])
                ax.plot([100 * r["budget_fraction"] for r in mine], [scale * r[key] for r in mine], "-",
                        marker=MARKERS[i % len(MARKERS)], linewidth=2, markersize=8, label=policy)
            ax.set_xlabel("cache budget (% of the trace's distinct chunks' KV bytes)")
            ax.set_ylabel(label)
            ax.set_title(label.split(" (")[0].capitalize() + " against budget")
        axes[1].legend(title="eviction policy", loc="lower right")
        fig.suptitle(f"Eviction policies on a {data.get('requests', '?')}-request trace, replayed without the model",
                     fontsize=15)
        fig.tight_layout()
        return _save(fig, path)


# -- scaling ----------------------------------------------------------------------------------

def _scaling_lines(ax, rows: list[dict], x: str, y: str) -> None:
    # distinct markers keep methods apart where their lines coincide (agreement 1.0 for full and prefix)
    for i, label in enumerate(dict.fromkeys(r["method"] for r in rows)):
        mine = sorted((r for r in rows if r["method"] == label), key=lambda r: r[x])
        ax.plot([r[x] for r in mine], [r[y] for r in mine], "-", marker=MARKERS[i % len(MARKERS)],
                color=color(label), linewidth=2, markersize=9 - i, alpha=0.9, label=label)


def _legend_right(ax) -> None:
    ax.legend(title="method", loc="upper left", bbox_to_anchor=(1.01, 1.0))


def scaling_context(data: dict, path: Path) -> Path | None:
    """TTFT (log) and agreement against context length, per method."""
    rows = [r for r in data.get("scaling") or [] if r["sweep"] == "context"]
    if not rows:
        return None
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
        _scaling_lines(axes[0], rows, "context_tokens", "ttft_s")
        _log_axis(axes[0], "y")
        axes[0].set_ylabel("time to first token (s, log scale)")
        axes[0].set_title("TTFT against context length")
        _scaling_lines(axes[1], rows, "context_tokens", "agreement_f1")
        axes[1].set_ylabel("answer agreement with full (token F1)")
        axes[1].set_ylim(-0.02, 1.05)
        axes[1].set_title("Agreement against context length")
        _legend_right(axes[1])
        for ax in axes:
            ax.set_xlabel("prompt length (tokens)")
        fig.suptitle(f"Scaling with context length, {data.get('model', '?')}", fontsize=15)
        fig.tight_layout()
        return _save(fig, path)


def scaling_chunks(data: dict, path: Path) -> Path | None:
    """TTFT against the number of chunks at a fixed context length."""
    rows = [r for r in data.get("scaling") or [] if r["sweep"] == "chunks"]
    if not rows:
        return None
    tokens = round(statistics.fmean(r["context_tokens"] for r in rows))
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(9, 5.5))
        _scaling_lines(ax, rows, "n_chunks", "ttft_s")
        _log_axis(ax, "y")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        _legend_right(ax)
        ax.set_xlabel("number of chunks")
        ax.set_ylabel("time to first token (s, log scale)")
        ax.set_title(f"TTFT against number of chunks (about {tokens} tokens), {data.get('model', '?')}")
        return _save(fig, path)


def scaling_memory(data: dict, path: Path) -> Path | None:
    """Peak process RSS during the request against context length."""
    rows = [r for r in data.get("scaling") or [] if r["sweep"] == "context"]
    if not rows:
        return None
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(9, 5.5))
        _scaling_lines(ax, rows, "context_tokens", "peak_rss_mb")
        _legend_right(ax)
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("peak resident memory of the process (MB)")
        ax.set_title(f"Peak memory against context length, {data.get('model', '?')}")
        return _save(fig, path)


def longest_context_rows(data: dict | None) -> list[dict]:
    """The context-sweep rows of a ``bench scaling`` result at its longest target length."""
    rows = [r for r in (data or {}).get("scaling") or [] if r["sweep"] == "context"]
    top = max((r["target_tokens"] for r in rows), default=None)
    return [r for r in rows if r["target_tokens"] == top]


def revisit_bars(data: dict, path: Path) -> Path | None:
    """TTFT, first-token KL and agreement per method at one context length, with the
    rows of requests whose chunks an earlier request saw (``... revisit``) hatched."""
    rows = longest_context_rows(data)
    if not any(r["method"].endswith(" revisit") for r in rows):
        return None
    labels = [r["method"] for r in rows]
    panels = (("ttft_s", "time to first token", "seconds (log scale)"),
              ("kl", "first-token KL vs full", "nats"),
              ("agreement_f1", "answer agreement with full", "token F1 (0-1)"))
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, 3, figsize=(17, 1.8 + 0.55 * len(labels)), sharey=True)
        for ax, (key, title, unit) in zip(axes, panels):
            values = [r[key] for r in rows]
            ax.barh(range(len(labels)), values, color=[color(label) for label in labels],
                    hatch=["//" if label.endswith(" revisit") else "" for label in labels], edgecolor="white")
            for i, v in enumerate(values):
                ax.annotate(f"{v:.3g}", (v, i), xytext=(3, 0), textcoords="offset points", va="center", fontsize=9)
            if key == "ttft_s":
                _log_axis(ax, "x")
            ax.margins(x=0.2)
            ax.set_title(title)
            ax.set_xlabel(unit)
        axes[0].set_yticks(range(len(labels)), labels)
        axes[0].invert_yaxis()
        axes[2].set_xlim(0, 1.15)
        from matplotlib.patches import Patch
        axes[2].legend(handles=[Patch(facecolor="#999999", label="first sight (caches made ahead)"),
                                Patch(facecolor="#999999", hatch="//", edgecolor="white",
                                      label="chunks seen before, shuffled (revisit)")],
                       loc="upper left", bbox_to_anchor=(1.02, 1.0), title="request")
        tokens = round(statistics.fmean(r["context_tokens"] for r in rows))
        fig.suptitle(f"Chunks seen before in another order, {tokens}-token prompts, "
                     f"{rows[0].get('repeats', '?')} questions, {data.get('model', '?')}", fontsize=15)
        fig.tight_layout()
        return _save(fig, path)


def goal_tradeoff(data: dict, path: Path, goal_speedup: float = 10.0, goal_agreement: float = 0.95) -> Path | None:
    """Agreement and first-token KL against speedup over full at the longest context, one
    point per method and ratio, with the goal region (fast enough and close enough) shaded."""
    rows = [r for r in longest_context_rows(data) if family(r["method"]) != "full"]
    if not rows:
        return None
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, 2, figsize=(14, 5.8))
        for ax, key, ylabel in ((axes[0], "agreement_f1", "answer agreement with full (token F1)"),
                                (axes[1], "kl", "first-token KL(full || method) (nats, log scale)")):
            _ratio_families(ax, [(r["speedup_vs_full"], r[key], r["method"]) for r in rows])
            _log_axis(ax, "x")
            ax.set_xlabel("speedup of the first token over full prefill (x, log scale)")
            ax.set_ylabel(ylabel)
        right = max(goal_speedup * 1.5, max(r["speedup_vs_full"] for r in rows) * 1.4)
        for ax in axes:
            ax.set_xlim(right=right)
        if all(r["kl"] > 0 for r in rows):
            _log_axis(axes[1], "y")
        axes[0].fill_between([goal_speedup, right], goal_agreement, 1.02, color="#2ca02c", alpha=0.18,
                             label=f"goal: >= {goal_speedup:g}x at >= {goal_agreement:g}")
        axes[0].set_ylim(min(0.5, min(r["agreement_f1"] for r in rows) - 0.05), 1.02)
        axes[0].set_title("Answer agreement (goal region shaded)")
        axes[1].set_title("First-token KL (lower is better)")
        handles, names = axes[0].get_legend_handles_labels()
        fig.legend(handles, names, loc="lower center", ncol=len(names),
                   title="method (point labels: recompute ratio / alpha)", bbox_to_anchor=(0.5, -0.01))
        tokens = round(statistics.fmean(r["context_tokens"] for r in rows))
        fig.suptitle(f"How much recompute buys how much agreement, {tokens}-token prompts, "
                     f"{rows[0].get('repeats', '?')} questions, {data.get('model', '?')}", fontsize=15)
        fig.tight_layout(rect=(0, 0.13, 1, 1))
        return _save(fig, path)


CONTEXT_COLORS = {"system": "#1f77b4", "warm": "#d62728", "previous": "#2ca02c"}


def diagnose_profiles(data: dict, path: Path) -> Path | None:
    """``bench diagnose``: per-layer deviation of reused values and keys from full's, and the
    values' deviation by position inside the chunk, one line or bar group per cache context."""
    summary = data.get("summary") or {}
    if not summary:
        return None
    with plt.rc_context(STYLE):
        fig, (by_layer, by_position) = plt.subplots(1, 2, figsize=(13, 4.6))
        for context, s in summary.items():
            c = CONTEXT_COLORS.get(context, "#17becf")
            by_layer.plot(range(len(s["layers_v"])), s["layers_v"], "-o", color=c, ms=3, label=f"{context}: V")
            by_layer.plot(range(len(s["layers_k"])), s["layers_k"], "--", color=c, alpha=0.6, label=f"{context}: K")
        by_layer.set(xlabel="layer", ylabel="relative deviation from full", title="which layers")
        by_layer.xaxis.set_major_locator(MaxNLocator(integer=True))
        by_layer.legend(ncol=2)
        buckets = list(next(iter(summary.values()))["positions_v"])
        width = 0.8 / len(summary)
        for i, (context, s) in enumerate(summary.items()):
            by_position.bar([j + i * width for j in range(len(buckets))], [s["positions_v"][b] for b in buckets],
                            width, color=CONTEXT_COLORS.get(context, "#17becf"), label=context)
        by_position.set_xticks([j + width * (len(summary) - 1) / 2 for j in range(len(buckets))], buckets)
        by_position.set(xlabel="position inside the chunk (tokens)", ylabel="relative deviation of V (mean "
                        "over layers)", title="which tokens")
        by_position.legend()
        fig.suptitle(f"reused chunk-caches against full prefill ({data.get('model', '?')}, "
                     f"{len(data.get('rows') or [])} items)")
        return _save(fig, path)


# -- GPU ----------------------------------------------------------------------------------------

FIXED_FRACTION = re.compile(r"^cachecraft@0/F(?P<fraction>[\d.]+)(?P<setting>( \w+)?)$")


def gpu_label(label: str) -> str:
    """``cachecraft@0/F0.05`` (the policy at a fixed fraction) -> ``cachecraft 5%`` (``... cold`` ->
    ``cachecraft 5% cold``); others as they are."""
    fixed = FIXED_FRACTION.match(label)
    return f"cachecraft {float(fixed['fraction']) * 100:g}%{fixed['setting']}" if fixed else label


def gpu_per_point(runs: Sequence[dict]) -> str:
    """How many questions each point of a ``bench gpu`` result's ``runs`` stands for, in words."""
    questions = max((r.get("repeats", 1) for run in runs for r in run["scaling"]), default=1)
    return "one question per point" if questions == 1 else f"means of {questions} questions a point"


def gpu_speedups(results: Sequence[dict], path: Path, published: tuple[float, float] = (2.2, 3.3)) -> Path | None:
    """Speedup over full against prompt length: one panel per (model shape, tier) of
    ``bench gpu`` results, one line per method, CacheBlend's published range shaded."""
    runs = [run for data in results for run in data.get("runs") or []]
    if not runs:
        return None
    shapes = list(dict.fromkeys(run["shape"] for run in runs))
    tiers = list(dict.fromkeys(run["tier"] for run in runs))
    device = next((data["machine"].get("gpu") for data in results if data.get("machine")), None) or "GPU"
    methods = list(dict.fromkeys(r["method"] for run in runs for r in run["scaling"]))
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(len(shapes), len(tiers), figsize=(5.2 * len(tiers), 4.4 * len(shapes)),
                                 squeeze=False, sharey=True)
        for run in runs:
            ax = axes[shapes.index(run["shape"])][tiers.index(run["tier"])]
            ax.axhspan(*published, color="#1f77b4", alpha=0.08, label="CacheBlend's paper: 2.2-3.3x")
            ax.axhline(1.0, color=COLORS["full"], linewidth=1, linestyle=":")
            rows = [r for r in run["scaling"] if r["method"] != "full"]
            for label in dict.fromkeys(r["method"] for r in rows):
                i = methods.index(label)  # the same marker for a method in every panel
                mine = sorted((r for r in rows if r["method"] == label), key=lambda r: r["context_tokens"])
                fixed = FIXED_FRACTION.match(label)
                ax.plot([r["context_tokens"] for r in mine], [r["speedup_vs_full"] for r in mine],
                        "--" if fixed else "-", marker=MARKERS[i % len(MARKERS)], color=color(label), linewidth=2,
                        markersize=7, alpha=0.9, label=gpu_label(label))
            _log_axis(ax, "x")
            _log_axis(ax, "y")
            ax.set_title(f"{run['shape']}, caches in the {run['tier']} tier")
            ax.set_xlabel("prompt length (tokens)")
            ax.set_ylabel("speedup over full prefill (TTFT, x)")
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), title="method")
        fig.suptitle(f"Time to first token on an {device}, random weights ({gpu_per_point(runs)})", fontsize=15)
        fig.tight_layout()
        return _save(fig, path)
