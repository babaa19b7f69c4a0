"""Where cachecraft loses, read off the benchmark JSONs (for ``bench report``).

Each function returns Markdown bullet lines; none judges beyond the numbers given.
"""

from __future__ import annotations

import statistics

from cachecraft.bench.plots import CHAT, EVICTION, family, longest_context_rows, ratio

AGREEMENT_BAR = 0.95  # the agreement with full we aim to keep
TOLERANCE = 0.01  # agreement differences smaller than this are noise at these sample sizes
KL_MARGIN = 0.95  # a KL counts as lower only when at least 5% lower


def _craft(methods: dict, turn: str = "") -> dict[str, dict]:
    """The cachecraft settings among ``methods``; with ``turn`` ``"+chat"``, those answering a chat's follow-up."""
    return {k: v for k, v in methods.items() if v and family(k) == "cachecraft" + turn and not EVICTION.match(k)}


def quality_losses(data: dict | None) -> list[str]:
    """Baselines faster than every cachecraft setting, better agreement or KL, and ratios
    that degrade; a chat's follow-ups (``+chat`` rows) only against each other."""
    methods = {k: v for k, v in ((data or {}).get("methods") or {}).items() if v}
    if not methods:
        return []
    follow_ups = {k: v for k, v in methods.items() if k.endswith(CHAT)}
    first = {k: v for k, v in methods.items() if k not in follow_ups}
    if not _craft(first):
        return ["Quality: the quality JSON has no `cachecraft` run to compare."]
    lines = _turn_losses(first, "")
    if _craft(follow_ups, CHAT):
        lines += _turn_losses(follow_ups, CHAT)
    return lines + paired_losses(data)


def _turn_losses(methods: dict, turn: str) -> list[str]:
    """:func:`quality_losses` for the rows of one turn (``turn``: ``""`` or ``+chat``)."""
    crafts = _craft(methods, turn)
    lines = []
    fastest = min(crafts, key=lambda k: crafts[k]["ttft_s_median"])
    best = max(crafts, key=lambda k: (crafts[k]["agreement_f1_mean"], -crafts[k]["ttft_s_median"]))
    for label, m in methods.items():
        if label in crafts or label == "full" + turn:
            continue
        if m["ttft_s_median"] < crafts[fastest]["ttft_s_median"]:
            lines.append(f"Quality: `{label}` is faster than every cachecraft setting (median TTFT "
                         f"{m['ttft_s_median']:.2f} s vs {crafts[fastest]['ttft_s_median']:.2f} s for `{fastest}`), "
                         f"at agreement {m['agreement_f1_mean']:.3f} vs {crafts[fastest]['agreement_f1_mean']:.3f} "
                         f"and KL {m['kl_mean']:.4f} vs {crafts[fastest]['kl_mean']:.4f}.")
        if m["agreement_f1_mean"] > crafts[best]["agreement_f1_mean"] + TOLERANCE:
            lines.append(f"Quality: `{label}` agrees with full better than the best cachecraft setting "
                         f"({m['agreement_f1_mean']:.3f} vs {crafts[best]['agreement_f1_mean']:.3f} for `{best}`), "
                         f"at median TTFT {m['ttft_s_median']:.2f} s vs {crafts[best]['ttft_s_median']:.2f} s.")
        lowest_kl = min(c["kl_mean"] for c in crafts.values())
        if m["kl_mean"] < KL_MARGIN * lowest_kl and m["recompute_fraction_mean"] < 1.0:
            lines.append(f"Quality: `{label}` has a lower first-token KL ({m['kl_mean']:.4f}) than any cachecraft "
                         f"setting (best {lowest_kl:.4f}).")
    return lines + _ratio_losses(methods)


def paired_losses(data: dict | None) -> list[str]:
    """Every figure where a cachecraft setting is measurably worse than a baseline (its
    paired interval excludes zero on the worse side)."""
    lines = []
    for label, against in ((data or {}).get("comparisons") or {}).items():
        if family(label) not in ("cachecraft", "cachecraft" + CHAT):
            continue
        for base, figures in against.items():
            for key, f in figures.items():
                if f["verdict"] == "worse":
                    lines.append(f"Quality: `{label}` is worse than `{base.removeprefix('vs ')}` on {key} "
                                 f"(paired difference {f['mean']:+.4f}, 95% interval [{f['low']:+.4f}, "
                                 f"{f['high']:+.4f}]).")
    return lines


def _ratio_losses(methods: dict) -> list[str]:
    """Per ratio family: settings below the agreement bar, and a larger ratio doing worse."""
    lines = []
    families: dict[str, list[tuple[float, str]]] = {}
    for label in methods:
        if ratio(label) is not None:
            families.setdefault(family(label), []).append((ratio(label), label))
    for name, settings in families.items():
        settings.sort()
        low = [(r, methods[label]["agreement_f1_mean"]) for r, label in settings
               if methods[label]["agreement_f1_mean"] < AGREEMENT_BAR]
        if low:
            shown = ", ".join(f"{r:g} ({a:.3f})" for r, a in low)
            lines.append(f"Quality: `{name}` stays below {AGREEMENT_BAR} agreement with full at ratio {shown}.")
        for (r1, l1), (r2, l2) in zip(settings, settings[1:]):
            a1, a2 = methods[l1]["agreement_f1_mean"], methods[l2]["agreement_f1_mean"]
            if a2 < a1 - TOLERANCE:
                lines.append(f"Quality: `{name}` agrees less at ratio {r2:g} ({a2:.3f}) than at {r1:g} ({a1:.3f}): "
                             "recomputing more did not help here.")
    return lines


def workload_losses(data: dict | None) -> list[str]:
    """Methods with lower mean or p95 TTFT, more compute saved, or better agreement than
    cachecraft; eviction policies that beat cachecraft's own on the same trace."""
    methods = (data or {}).get("methods") or {}
    if not methods:
        return []
    policies = {k: v for k, v in methods.items() if v and EVICTION.match(k)}
    crafts = _craft(methods)
    if not crafts:
        return [] if policies else ["Workload: the workload JSON has no `cachecraft` run to compare."]
    craft_label, craft = next(iter(crafts.items()))
    lines = []
    checks = (("ttft_s_mean", "mean TTFT", "{:.2f} s", -1), ("ttft_s_p95", "p95 TTFT", "{:.2f} s", -1),
              ("compute_reduction_vs_full", "compute saved vs full", "{:.0%}", 1),
              ("agreement_f1_mean", "agreement with full", "{:.3f}", 1))
    for label, m in methods.items():
        if label in crafts or label == "full" or label in policies:
            continue
        for key, what, fmt, sign in checks:
            if key not in m or key not in craft:
                continue
            margin = TOLERANCE if key == "agreement_f1_mean" else 0.0
            if sign * (m[key] - craft[key]) > margin:
                lines.append(f"Workload: `{label}` beats `{craft_label}` on {what}: "
                             f"{fmt.format(m[key])} vs {fmt.format(craft[key])}.")
    return lines


def eviction_losses(data: dict | None) -> list[str]:
    """Eviction policies with a higher hit rate or more compute saved than cachecraft's own."""
    methods = (data or {}).get("methods") or {}
    policies = {k: v for k, v in methods.items() if v and EVICTION.match(k)}
    own = next((v for k, v in policies.items() if EVICTION.match(k)["policy"] == "cachecraft"), None)
    if own is None:
        return []
    lines = []
    for label, m in policies.items():
        if m is own:
            continue
        for key, what, fmt in (("hit_rate", "hit rate", "{:.2f}"),
                               ("compute_reduction_vs_full", "compute saved vs full", "{:.0%}")):
            if key in m and key in own and m[key] > own[key]:
                lines.append(f"Eviction: `{label}` beats cachecraft's own policy on {what}: "
                             f"{fmt.format(m[key])} vs {fmt.format(own[key])}.")
    return lines


def replay_losses(data: dict | None) -> list[str]:
    """Budgets of a ``bench eviction`` replay where another policy saves more compute, or
    hits more often, than cachecraft's own."""
    rows = (data or {}).get("rows") or []
    lines = []
    for fraction in dict.fromkeys(r["budget_fraction"] for r in rows):
        mine = {r["policy"]: r for r in rows if r["budget_fraction"] == fraction}
        own = mine.get("cachecraft")
        if own is None:
            continue
        for policy, r in mine.items():
            for key, what, fmt in (("hit_rate", "hit rate", "{:.3f}"), ("compute_saved", "compute saved", "{:.1%}")):
                if policy != "cachecraft" and r[key] > own[key]:
                    lines.append(f"Eviction replay at a {fraction:.0%} budget: `{policy}` beats cachecraft's own "
                                 f"policy on {what}: {fmt.format(r[key])} vs {fmt.format(own[key])}.")
    return lines


def scaling_losses(data: dict | None, what: str = "Scaling") -> list[str]:
    """Points where another method is faster than cachecraft, cachecraft is slower than
    full, or its agreement falls below the bar; and the goal at the longest context.
    ``what`` starts each line (the report's name for the result)."""
    rows = (data or {}).get("scaling") or []
    if not rows:
        return []
    lines = []
    points: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        points.setdefault((r["sweep"], r["target_tokens"], r["n_chunks"]), {})[r["method"]] = r
    crafts = list(dict.fromkeys(r["method"] for r in rows if family(r["method"]) == "cachecraft"))
    for craft_label in crafts:
        faster: dict[str, list[str]] = {}
        slow, low = [], []
        for (sweep, _, n_chunks), by_method in points.items():
            craft = by_method.get(craft_label)
            if craft is None:
                continue
            where = f"{craft['context_tokens']} tok/{n_chunks} chunks"
            for k, v in by_method.items():
                if family(k) not in ("cachecraft", "full") and v["ttft_s"] < craft["ttft_s"]:
                    faster.setdefault(k, []).append(
                        f"{where} ({v['ttft_s']:.2f} s vs {craft['ttft_s']:.2f} s, "
                        f"agreement {v['agreement_f1']:.3f} vs {craft['agreement_f1']:.3f})")
            if craft["speedup_vs_full"] < 1.0:
                slow.append(f"{where} ({craft['speedup_vs_full']:.2f}x)")
            if craft["agreement_f1"] < AGREEMENT_BAR:
                low.append(f"{where} ({craft['agreement_f1']:.3f})")
        for k, where in faster.items():
            lines.append(f"{what}: `{k}` is faster than `{craft_label}` at {len(where)} of {len(points)} points: "
                         + "; ".join(where) + ".")
        if slow:
            lines.append(f"{what}: `{craft_label}` is slower than full prefill at " + "; ".join(slow) + ".")
        if low:
            lines.append(f"{what}: `{craft_label}` agrees with full below {AGREEMENT_BAR} at " + "; ".join(low) + ".")
    summary = data.get("summary") or {}
    goal = summary.get("goal") or {}
    if summary.get("speedup_at_max_context") is not None and not goal.get("met"):
        lines.append(f"{what}: the goal ({goal.get('speedup', 10):g}x faster than full at agreement >= "
                     f"{goal.get('agreement_f1', AGREEMENT_BAR):g} at the longest context) is not met: "
                     f"`{summary['method']}` is {summary['speedup_at_max_context']:.1f}x at agreement "
                     f"{summary['agreement_at_max_context']:.3f} with {summary['max_context_tokens']} tokens.")
    again = summary.get("goal_revisit")
    if again and not again["met"]:
        lines.append(f"{what}: with the chunks seen before, shuffled, the goal is not met either: `{again['method']}` "
                     f"is {again['speedup']:.1f}x at agreement {again['agreement_f1']:.3f}.")
    return lines


def loading_pairs(data: dict | None) -> list[tuple[dict, dict]]:
    """(streamed row, whole-read row) of each method a ``bench scaling --whole-read`` result
    timed both ways, at each point."""
    from cachecraft.bench.scaling import WHOLE

    rows = (data or {}).get("scaling") or []
    by_key = {(r["sweep"], r["target_tokens"], r["n_chunks"], r["method"]): r for r in rows}
    return [(by_key[(sweep, target, n, method[:-len(WHOLE)])], r)
            for (sweep, target, n, method), r in by_key.items()
            if method.endswith(WHOLE) and (sweep, target, n, method[:-len(WHOLE)]) in by_key]


def loading_losses(data: dict | None) -> list[str]:
    """Methods whose chunk-caches streamed in reach the first token later than read whole first."""
    return [f"Loading: streaming `{streamed['method']}`'s chunk-caches in during the prefill is slower than "
            f"reading them whole first at {streamed['context_tokens']} tokens ({streamed['ttft_s']:.2f} s vs "
            f"{whole['ttft_s']:.2f} s)." for streamed, whole in loading_pairs(data)
            if streamed["ttft_s"] > whole["ttft_s"]]


def goal_reach(data: dict | None, speedup: float = 10.0, agreement: float = AGREEMENT_BAR) -> list[str]:
    """At the longest context of a ``bench scaling`` result: per method family, the
    fastest setting that agrees with full at ``agreement`` or better and the closest
    setting at least ``speedup`` times sooner than full; and whether any setting has both."""
    rows = [r for r in longest_context_rows(data) if family(r["method"]) not in ("full", "prefix")]
    if not rows:
        return []
    lines = []
    for name in dict.fromkeys(family(r["method"]) for r in rows):
        mine = [r for r in rows if family(r["method"]) == name]
        if len(mine) == 1:
            r = mine[0]
            lines.append(f"`{r['method']}`: agreement {r['agreement_f1']:.3f} at {r['speedup_vs_full']:.1f}x "
                         f"(recompute {r['recompute_fraction']:.3f}).")
            continue
        close = [r for r in mine if r["agreement_f1"] >= agreement]
        fast = [r for r in mine if r["speedup_vs_full"] >= speedup]
        if close:
            best = max(close, key=lambda r: r["speedup_vs_full"])
            reach = (f"reaches {agreement:g} agreement at best at `{best['method']}`, "
                     f"{best['speedup_vs_full']:.1f}x sooner than full (recompute {best['recompute_fraction']:.3f})")
        else:
            best = max(mine, key=lambda r: r["agreement_f1"])
            reach = (f"stays below {agreement:g} agreement at every setting tried; its best is `{best['method']}`, "
                     f"{best['agreement_f1']:.3f} at {best['speedup_vs_full']:.1f}x (recompute "
                     f"{best['recompute_fraction']:.3f})")
        if fast:
            top_fast = max(fast, key=lambda r: r["agreement_f1"])
            reach += (f"; at {speedup:g}x or more its closest is `{top_fast['method']}`, agreement "
                      f"{top_fast['agreement_f1']:.3f}")
        lines.append(f"`{name}` {reach}.")
    both = [r for r in rows if r["agreement_f1"] >= agreement and r["speedup_vs_full"] >= speedup]
    lines.append("Settings with both: " + (", ".join(f"`{r['method']}`" for r in both) if both else "none") + ".")
    return lines


def diagnose_findings(data: dict | None) -> list[str]:
    """Plain sentences read off a ``bench diagnose`` result: which context leaves the caches
    closest to full, where the deviation sits, and which selector buys most at each budget."""
    summary = (data or {}).get("summary") or {}
    if not summary:
        return []
    lines = ["What it says:", ""]
    reuse = {context: s["runs"]["reuse"]["answer_kl"] for context, s in summary.items()}
    order = sorted(reuse, key=reuse.get)
    lines.append("- Caches reused untouched, answer KL by what they were made after: "
                 + ", ".join(f"{c} {reuse[c]:.4f}" for c in order) + ".")
    for context, s in summary.items():
        layers = s["layers_v"]
        peak = max(range(len(layers)), key=layers.__getitem__)
        positions = s["positions_v"]
        first, rest = positions.get("1"), [v for k, v in positions.items() if k != "1" and v == v]
        where = (f"the first token of a chunk deviates {first / statistics.fmean(rest):.1f}x as much as the "
                 "others on average" if first is not None and rest and statistics.fmean(rest) > 0 else "")
        lines.append(f"- {context}: values deviate most at layer {peak} of {len(layers)} ({layers[peak]:.3f}); "
                     + where + ".")
        budgets = sorted({label.partition("@")[2] for label in s["runs"] if "@" in label}, key=float)
        for budget in budgets:
            runs = {label: m for label, m in s["runs"].items() if label.endswith("@" + budget)}
            best = min(runs, key=lambda label: runs[label]["answer_kl"])
            real = {label: m for label, m in runs.items() if not label.startswith("oracle")}
            best_real = min(real, key=lambda label: real[label]["answer_kl"]) if real else best
            lines.append(f"  - at {float(budget):.0%}: best `{best_real}` (answer KL "
                         f"{runs[best_real]['answer_kl']:.4f}, token agreement {runs[best_real]['token_agreement']:.3f})"
                         + (f"; the oracle reaches {runs[best]['answer_kl']:.4f}" if best != best_real else "")
                         + f"; reuse {s['runs']['reuse']['answer_kl']:.4f}.")
    return lines
