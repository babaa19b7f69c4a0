"""The yardstick's figures in the README table, the report's plot and its list of losses."""

from __future__ import annotations

from cachecraft.bench.findings import paired_losses, quality_losses
from cachecraft.bench.plots import color, family, quality_intervals, ratio
from cachecraft.bench.quality import aggregate, compare_methods
from tests.test_bench_readme import render

LABELS = ["full", "cacheblend@0.15", "cachecraft@0.08"]


def _rows() -> list[dict]:
    """Three items by hand: cachecraft's answer KL is 0.1 above CacheBlend's on every item,
    its token agreement 0.1 below on one item and equal on the others."""
    rows = []
    for item in range(3):
        for label, answer_kl, agreement in (("full", 0.0, 1.0), ("cacheblend@0.15", 0.2 + item / 10, 0.8),
                                            ("cachecraft@0.08", 0.3 + item / 10, 0.7 if item == 0 else 0.8)):
            rows.append({"item": item, "method": label, "ttft_s": 1.0 if label != "full" else 10.0,
                         "speedup_vs_full": 10.0 if label != "full" else 1.0, "recompute_fraction": 0.1,
                         "kl": answer_kl / 2, "answer_kl": answer_kl, "token_agreement": agreement,
                         "agreement_f1": agreement, "exact_match": 0.0, "gold_f1": 0.1, "peak_rss_mb": 1.0,
                         "rss_growth_mb": 1.0, "kv_mb": 1.0})
    return rows


def _result() -> dict:
    rows = _rows()
    return {"benchmark": "quality", "command": "cachecraft bench quality --limit 3", "model": "m", "limit": 3, "date": "2026-11-24T00:00",
            "machine": {"cpu": "cpu", "cores": 2}, "items": rows,
            "methods": {label: aggregate(rows, label) for label in LABELS},
            "comparisons": compare_methods(rows, LABELS)}


def test_paired_verdicts_by_hand():
    vs_blend = _result()["comparisons"]["cachecraft@0.08"]["vs cacheblend@0.15"]
    assert vs_blend["answer_kl"]["verdict"] == "worse"  # +0.1 on every item: the interval is [0.1, 0.1]
    assert abs(vs_blend["answer_kl"]["low"] - 0.1) < 1e-9 and abs(vs_blend["answer_kl"]["high"] - 0.1) < 1e-9
    # differences -0.1, 0, 0: resampled means run from -0.1 to 0, so the interval touches zero
    assert vs_blend["token_agreement"]["verdict"] == "no measurable difference"
    assert vs_blend["gold_f1"]["verdict"] == "no measurable difference"  # identical
    assert _result()["comparisons"]["cachecraft@0.08"]["vs full"]["answer_kl"]["verdict"] == "worse"


def test_readme_table_plot_and_losses(tmp_path):
    data = _result()
    text = render(tmp_path, "quality", data)
    assert "| cachecraft@0.08 | cacheblend@0.15 | worse (+0.100 [+0.100, +0.100])" in text
    assert "[95% bootstrap interval]" in text
    png = quality_intervals(data, tmp_path / "intervals.png")
    assert png.is_file() and png.stat().st_size > 1000
    losses = paired_losses(data)
    assert any("`cachecraft@0.08` is worse than `cacheblend@0.15` on answer_kl" in line for line in losses)
    assert not any("token_agreement" in line and "cacheblend" in line for line in losses)


def test_in_context_runs_are_their_own_series_in_the_plots():
    assert (family("cachecraft@0.08+nb1"), ratio("cachecraft@0.08+nb1")) == ("cachecraft+nb1", 0.08)
    assert (family("qguided+nb2"), ratio("qguided+nb2")) == ("qguided+nb2", None)
    assert (family("cacheblend@0.15"), family("cachecraft[lru]")) == ("cacheblend", "cachecraft")


def test_a_chats_follow_up_is_a_series_of_its_own_in_its_methods_colour_made_paler():
    assert family("full+chat") == "full+chat" and family("cachecraft@0.08+chat") == "cachecraft+chat"
    assert family("cachecraft@0.08+nb1+chat") == "cachecraft+nb1+chat"
    assert ratio("cacheblend@0.15+chat") == 0.15 and ratio("full+chat") is None
    # cachecraft's green #2ca02c taken 45% of the way to white: 44 + 211 * 0.45 = 138.95 -> 0x8b,
    # 160 + 95 * 0.45 = 202.75 -> 0xcb
    assert color("cachecraft@0.08+chat") == "#8bcb8b" and color("cachecraft@0.08") == "#2ca02c"
    assert color("full+chat") == "#858585"  # full's #222222: 34 + 221 * 0.45 = 133.45 -> 0x85


def test_a_chats_follow_ups_are_weighed_only_against_each_other():
    def row(ttft, agreement, kl):
        return {"ttft_s_median": ttft, "agreement_f1_mean": agreement, "kl_mean": kl, "recompute_fraction_mean": 0.1}
    data = {"methods": {"full": {**row(10.0, 1.0, 0.0), "recompute_fraction_mean": 1.0},
                        "cachecraft@0.08": row(1.0, 0.90, 0.10), "cacheblend@0.15": row(3.0, 0.80, 0.20),
                        "full+chat": {**row(10.0, 1.0, 0.0), "recompute_fraction_mean": 1.0},
                        "cachecraft@0.08+chat": row(1.0, 0.50, 0.40), "cacheblend@0.15+chat": row(3.0, 0.60, 0.30)}}
    lines = quality_losses(data)
    # the follow-ups against each other: CacheBlend's agrees better (0.60 > 0.50 + 0.01) and its
    # KL is lower (0.30 < 0.95 * 0.40 = 0.38)
    assert any(line.startswith("Quality: `cacheblend@0.15+chat` agrees with full better than the best cachecraft "
                               "setting (0.600 vs 0.500 for `cachecraft@0.08+chat`)") for line in lines)
    assert any("`cacheblend@0.15+chat` has a lower first-token KL (0.3000) than any cachecraft setting (best 0.4000)"
               in line for line in lines)
    # nothing of the first turn is weighed against the follow-ups, nor full's follow-up against the first turn
    assert not any("`full+chat`" in line or "`cacheblend@0.15`" in line for line in lines)
    assert any("`cachecraft+chat` stays below 0.95 agreement with full at ratio 0.08 (0.500)" in line for line in lines)


def test_repeats_and_answers_given_again_are_counted_and_shown(tmp_path):
    """By hand: cachecraft's first tries loop on items 0 and 2, both answered again from a
    full prefill; item 2's kept answer still repeats, as full's does there."""
    rows = _rows()
    for r in rows:
        looped = r["method"] == "cachecraft@0.08" and r["item"] in (0, 2)
        r.update(repetition=float(r["item"] == 2 and r["method"] in ("full", "cachecraft@0.08")),
                 escalated=float(looped), first_try_repetition=float(looped))
    data = {**_result(), "items": rows, "methods": {label: aggregate(rows, label) for label in LABELS}}
    mine = data["methods"]["cachecraft@0.08"]
    assert (mine["repetitions"], mine["repetitions_where_full_does_not"]) == (1, 0)
    assert (mine["escalations"], mine["loops_before_escalation"]) == (2, 2)
    assert data["methods"]["cacheblend@0.15"]["escalations"] == 0
    text = render(tmp_path, "quality", data)
    assert "| 1 (0); 2 answered again |" in text and "| 0 (0) |" in text
