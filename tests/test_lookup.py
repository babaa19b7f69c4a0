"""One request's view of the stored chunk-caches: the catalog asked once, statistics read once."""

from __future__ import annotations

import torch

from cachecraft.catalog import VariantRecord
from cachecraft.config import Config
from cachecraft.kv import AttentionStats
from cachecraft.pipeline import Pipeline
from cachecraft.pipeline.lookup import PlannerStatsMemo, RequestLookup
from cachecraft.policy.planner import PolicyParams
from cachecraft.store import TieredStore
from tests.conftest import tiny_model
from tests.test_pipeline import CHUNKS, QUESTION


def stats(layers: int, prefix: int, tokens: int) -> AttentionStats:
    inter = torch.arange(layers * prefix, dtype=torch.float32).reshape(layers, prefix)
    return AttentionStats(outside=torch.zeros(layers, tokens), inter=inter, intra=torch.full((layers,), 1.0))


class FakeStore:
    """Answers variant lookups from a dict and counts how it was asked."""

    shared_first = False

    def __init__(self, records: dict[str, list[VariantRecord]], tiers: dict[str, str]):
        self._records, self._tiers = records, tiers
        self.asked: list[tuple[str, ...]] = []
        self.located: list[str] = []

    def variants_of_chunks(self, chunks):
        self.asked.append(tuple(chunks))
        return {c: list(self._records.get(c, [])) for c in chunks}

    def variants_of(self, chunk):
        self.asked.append((chunk,))
        return list(self._records.get(chunk, []))

    def locate(self, variant):
        self.located.append(variant)
        return self._tiers.get(variant)


def record(key: str, chunk: str, prefix: tuple[str, ...], tier: str | None) -> VariantRecord:
    return VariantRecord(key, chunk, prefix, 100, "float16", tier=tier)


def lookup_over(store: FakeStore, reads: list[str]) -> RequestLookup:
    table = {"a1": stats(2, 3, 5), "a2": stats(2, 2, 5), "b1": stats(2, 2, 7)}

    def read(variant):
        reads.append(variant)
        return table.get(variant)

    return RequestLookup(store, ["a", "b", "a"], PlannerStatsMemo(read), warm_prefix=lambda p: (p, "warm"),
                         chunk_tokens={"a": 5, "b": 7, "warm": 11}.get, r_load={"disk": 0.25, "cpu": 0.0}.get)


RECORDS = {"a": [record("a1", "a", ("sys", "b", "warm"), "disk"), record("a2", "a", ("sys", "warm"), "cpu"),
                 record("a3", "a", ("other", "warm"), "disk")],
           "b": [record("b1", "b", ("sys", "warm"), None)]}


def test_a_request_asks_the_catalog_once_for_all_its_chunks_and_then_never_again():
    store, reads = FakeStore(RECORDS, {"b1": "disk"}), []
    lookup = lookup_over(store, reads)
    assert store.asked == []  # nothing asked until a method asks
    infos = lookup.variant_infos("a", "sys")
    assert [i.variant for i in infos] == ["a1", "a2"]  # a3 was made under another system prompt
    assert lookup.variant_count("a") == 3 and lookup.variant_count("b") == 1
    assert lookup.variant_count("a", "sys") == 2 and lookup.variant_count("a", "other") == 1
    assert lookup.variant_count("b", "other") == 0
    assert lookup.independent_variant("a", "sys") == "a2"  # made after the warm context alone
    assert lookup.independent_variant("b", "sys") == "b1"
    assert store.asked == [("a", "b")]  # once, each chunk once


def test_variant_infos_carry_the_statistics_the_planner_reads_without_the_system_prefix():
    store, reads = FakeStore(RECORDS, {}), []
    a1 = lookup_over(store, reads).variant_infos("a", "sys")[0]
    assert a1.prefix == ("b", "warm") and a1.prefix_tokens == (7, 11) and a1.chunk_tokens == 5
    assert a1.inter.tolist() == [[1.0, 2.0], [4.0, 5.0]]  # column 0 (the system prefix) dropped
    assert a1.intra.tolist() == [1.0, 1.0]


def test_statistics_are_read_once_per_variant_across_requests():
    store, reads = FakeStore(RECORDS, {}), []
    memo_lookup = lookup_over(store, reads)
    memo_lookup.variant_infos("a", "sys")
    again = RequestLookup(store, ["a"], memo_lookup._stats, warm_prefix=lambda p: None,
                          chunk_tokens=lambda k: 1, r_load=lambda t: 0.0)
    again.variant_infos("a", "sys")
    assert reads == ["a1", "a2"]  # a3 is not under "sys": never read


def test_a_bounded_memo_forgets_the_least_recently_used_and_never_remembers_a_miss():
    reads = []
    table = {"x": stats(1, 1, 1), "y": stats(1, 1, 2), "z": stats(1, 1, 3)}
    memo = PlannerStatsMemo(lambda v: reads.append(v) or table.get(v), capacity=2)
    for variant in ("x", "y", "x", "z", "x", "y", "gone", "gone"):
        memo.get(variant)
    # x, y read; x used again; z read and y dropped (least recent); x kept; y read again
    assert reads == ["x", "y", "z", "y", "gone", "gone"]
    assert memo.get("z") is not None and reads[-1] == "z"  # z was dropped when y came back


def test_load_fractions_come_from_the_tier_the_record_names_else_the_store():
    store, reads = FakeStore(RECORDS, {"b1": "disk"}), []
    lookup = lookup_over(store, reads)
    assert lookup.load_fraction("a1") == 0.25 and lookup.load_fraction("a2") == 0.0
    assert lookup.tier_of("a1") == "disk" and store.located == []
    assert lookup.load_fraction("b1") == 0.25 and store.located == ["b1"]  # its record names no tier
    assert lookup.tier_of("nowhere") is None
    assert lookup.hide_fraction("a1") == 0.25 and lookup.hide_fraction("nowhere") is None  # no r_hide: r_load's
    hiding = RequestLookup(store, ["a", "b"], PlannerStatsMemo(lambda v: None), warm_prefix=lambda p: None,
                           chunk_tokens=lambda k: 1, r_load={"disk": 0.25}.get, r_hide={"disk": 0.1}.get)
    assert hiding.hide_fraction("a1") == 0.1 and hiding.load_fraction("a1") == 0.25
    store.shared_first = True  # a disk record may then load from the shared tier: the store says
    assert lookup.tier_of("a1") is None and store.located[-1] == "a1"


def test_planning_a_request_from_disk_asks_the_catalog_for_variants_once(cache_dir, monkeypatch):
    config = Config.load(overrides={"cache_dir": cache_dir, "max_new_tokens": 2}, environ={})
    with TieredStore(config, tiers=("disk",)) as store:
        # exact_after_asks 2: the reordered chunks' second ask is planned, not kept exact
        pipe = Pipeline(config, lm=tiny_model("llama"), store=store,
                        policy=PolicyParams(alpha=0.5, check_layer=2, exact_after_asks=2))
        pipe.answer(CHUNKS, QUESTION)  # makes a variant of every chunk
        calls = {"many": 0, "one": 0, "stats": 0}
        for name, counter in (("variants_of_chunks", "many"), ("variants_of", "one"), ("stats_of", "stats")):
            real = getattr(store, name)
            monkeypatch.setattr(store, name, lambda *a, _r=real, _c=counter: calls.__setitem__(_c, calls[_c] + 1)
                                or _r(*a))
        reordered = [CHUNKS[1], CHUNKS[0], CHUNKS[2], CHUNKS[3]]
        first = pipe.answer(reordered, QUESTION)
        assert calls == {"many": 1, "one": 0, "stats": 4}
        with store.catalog.read() as tx:
            made = len(tx.stored_variants()) - 5  # the system prefix's and the four made before
        assert made >= 1  # the first chunk, now with nothing before it, was made again in full
        pipe.answer(reordered, QUESTION)
        assert calls == {"many": 2, "one": 0, "stats": 4 + made}  # only the new variants' statistics read
    assert 0 < first.recompute_fraction < 1
    assert [c.tier for c in first.chunks] == ["disk"] * 4


def test_variants_slower_to_load_than_to_recompute_are_not_planned_with_nor_read(cache_dir, monkeypatch):
    from cachecraft.policy.loading import CostModel
    from tests.test_pipeline import traced

    config = Config.load(overrides={"cache_dir": cache_dir, "max_new_tokens": 2, "kv_dtype": "float32"}, environ={})
    with TieredStore(config, tiers=("disk",)) as store:
        pipe = Pipeline(config, lm=tiny_model("llama"), store=store, policy=PolicyParams(alpha=0.5, check_layer=2),
                        keep_new_variants=False)
        pipe.warm(CHUNKS)
        layers = pipe.lm.adapter.num_layers
        # r_load = 100 bytes / (1e5 B/s * 1e-3 s) per token and layer = 1.0: loading takes as long as recomputing
        pipe.cost_model = CostModel(1e-3, 100, layers, {"gpu": float("inf"), "cpu": 1e9, "disk": 1e5})
        reads = []
        monkeypatch.setattr(store, "stats_of", lambda key: reads.append(key))
        monkeypatch.setattr(store, "iter_layers", lambda *a, **k: reads.append("bytes"))
        answer = traced(pipe, CHUNKS, QUESTION)
        full = traced(pipe, CHUNKS, QUESTION, method="full")
    assert reads == []  # neither the statistics nor the bytes of a variant not worth loading
    assert answer.recompute_fraction == 1.0 and all(c.tier == "miss" for c in answer.chunks)
    assert (answer.logits - full.logits).abs().max() < 1e-4  # computed in full: a full prefill's answer


def test_a_chunk_whose_variants_are_not_worth_loading_keeps_new_ones_only_up_to_the_cap(cache_dir):
    from cachecraft.policy.loading import CostModel
    from cachecraft.policy.rules import MAX_VARIANTS_PER_CHUNK

    config = Config.load(overrides={"cache_dir": cache_dir, "max_new_tokens": 2}, environ={})
    with TieredStore(config, tiers=("disk",)) as store:
        pipe = Pipeline(config, lm=tiny_model("llama"), store=store, policy=PolicyParams(alpha=0.5, check_layer=2))
        pipe.warm(CHUNKS)  # one variant of each chunk
        layers = pipe.lm.adapter.num_layers
        # r_load = 1.0 from disk (as in the test above): no variant is worth loading, so
        # each request computes every chunk in full, in its own order's context
        pipe.cost_model = CostModel(1e-3, 100, layers, {"gpu": float("inf"), "cpu": 1e9, "disk": 1e5})
        orders = [[CHUNKS[i] for i in order] for order in
                  ([1, 0, 2, 3], [2, 1, 0, 3], [3, 2, 1, 0], [0, 3, 1, 2], [1, 3, 0, 2], [2, 0, 3, 1])]
        for order in orders:
            answer = pipe.answer(order, QUESTION)
            assert answer.recompute_fraction == 1.0 and all(c.tier == "miss" for c in answer.chunks)
        with store.catalog.read() as tx:
            per_chunk = {}
            for variant in tx.stored_variants():
                per_chunk[variant.chunk_key] = per_chunk.get(variant.chunk_key, 0) + 1
    # six orders put every chunk after six different contexts, yet each keeps only the cap
    chunk_counts = sorted(n for chunk, n in per_chunk.items() if chunk in {c.chunk for c in answer.chunks})
    assert chunk_counts == [MAX_VARIANTS_PER_CHUNK] * 4


def test_room_for_another_variant_ends_at_the_cap():
    from cachecraft.policy.rules import room_for_variant

    assert room_for_variant(0) and room_for_variant(3)
    assert not room_for_variant(4) and not room_for_variant(9)
    assert room_for_variant(1, cap=2) and not room_for_variant(2, cap=2)


def test_a_variant_is_worth_loading_only_while_its_recompute_would_hide_less_than_the_whole_chunk():
    from cachecraft.policy.rules import worth_loading

    assert worth_loading(0.0) and worth_loading(0.999)
    assert not worth_loading(1.0) and not worth_loading(3.3) and not worth_loading(None)


def test_at_the_cap_an_exact_variant_replaces_the_one_used_least():
    from cachecraft.policy.rules import variant_to_replace

    def made(key, hits, last_used, created_at):
        return VariantRecord(key, "c", ("sys", "x"), 100, "float16", hits=hits, last_used=last_used,
                             created_at=created_at)

    assert variant_to_replace([]) is None
    # fewest hits first, whatever their age
    assert variant_to_replace([made("a", 3, 10.0, 1.0), made("b", 1, 50.0, 2.0), made("c", 2, 5.0, 3.0)]) == "b"
    # equal hits: the one used longest ago; one never used counts from when it was made
    assert variant_to_replace([made("a", 1, 40.0, 1.0), made("b", 1, 20.0, 2.0)]) == "b"
    assert variant_to_replace([made("a", 0, None, 30.0), made("b", 0, None, 7.0), made("c", 0, 9.0, 1.0)]) == "b"
    # an inexact one before any exact one, even one used more; among exact ones, as above
    assert variant_to_replace([made("a", 0, None, 1.0), made("b", 3, 50.0, 2.0)], exact={"a"}) == "b"
    assert variant_to_replace([made("a", 1, 40.0, 1.0), made("b", 0, None, 2.0), made("c", 2, 9.0, 3.0)],
                              exact={"a", "b", "c"}) == "b"


def test_only_variants_neither_independent_nor_exact_and_reused_as_often_as_asked_may_give_way():
    from cachecraft.pipeline.lookup import MADE_EXACTLY

    exact = VariantRecord("c3", "c", ("sys", "a", "b"), 100, "float16", stats={MADE_EXACTLY: 1.0}, hits=1)
    records = {"c": [record("c1", "c", ("sys", "warm"), "cpu"), record("c2", "c", ("sys", "a"), "disk"), exact,
                     record("c4", "c", ("sys", "b"), "cpu"), record("c5", "c", ("other", "a"), "cpu")]}
    lookup = RequestLookup(FakeStore(records, {}), ["c"], PlannerStatsMemo(lambda v: None),
                           warm_prefix=lambda p: (p, "warm"), chunk_tokens=lambda k: 5, r_load=lambda t: 0.0)
    # warm's (c1) is the fallback for every order, c3 is exact, c5 is another system prompt's
    assert [r.key for r in lookup.replaceable_variants("c", "sys")] == ["c2", "c4"]
    # c3, reused once, gives way only to a keep earned by two asks or more
    assert [r.key for r in lookup.replaceable_variants("c", "sys", asked=1)] == ["c2", "c4"]
    assert [r.key for r in lookup.replaceable_variants("c", "sys", asked=2)] == ["c2", "c3", "c4"]
