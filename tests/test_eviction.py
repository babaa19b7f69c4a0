"""Eviction policies: orders checked against orders computed by hand."""

from __future__ import annotations

import pytest

from cachecraft.bench.eviction import replay
from cachecraft.config import _EVICTION
from cachecraft.store.eviction import (POLICIES, CacheCraftPolicy, DecayPolicy, EntryInfo, LFUPolicy,
                                       LRUPolicy, PGDSFPolicy, estimate_cost_s, make_policy, measured_quality)


def info(key: str, chunk: str | None = None, nbytes: int = 1, cost: float = 1.0, quality: float = 1.0,
         hits: int = 0) -> EntryInfo:
    return EntryInfo(key, chunk or key, nbytes, cost, quality, hits)


def test_every_config_name_has_a_policy():
    assert set(_EVICTION) == set(POLICIES)
    for name in _EVICTION:
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("fifo")


def test_lru_order():
    p = LRUPolicy()
    for k in "abc":
        p.on_put(info(k))
    assert p.candidates() == ["a", "b", "c"]
    p.on_hit("a")  # a becomes the most recent
    assert p.candidates() == ["b", "c", "a"]
    p.on_put(info("d"))
    p.on_hit("b")
    assert p.candidates() == ["c", "a", "d", "b"]
    p.on_evict("c")
    p.discard("d")
    assert p.candidates() == ["a", "b"]
    assert p.victim(exclude={"a"}) == "b"
    assert p.victim(exclude={"a", "b"}) is None


def test_lfu_order_with_ties_by_age():
    p = LFUPolicy()
    for k in "abc":
        p.on_put(info(k))
    p.on_hit("a")
    p.on_hit("a")
    p.on_hit("c")
    # frequencies: a=3, b=1, c=2
    assert p.candidates() == ["b", "c", "a"]
    p.on_put(info("d"))  # d=1, newer than b: b goes first among the ones
    assert p.candidates() == ["b", "d", "c", "a"]
    p.on_put(info("e", hits=4))  # carried-over hits: frequency 5
    assert p.candidates() == ["b", "d", "c", "a", "e"]
    assert p.frequency("e") == 5
    p.on_evict("b")
    assert p.candidates() == ["d", "c", "a", "e"]


def test_pgdsf_order_and_clock_ageing():
    p = PGDSFPolicy()
    p.on_put(info("a", nbytes=2, cost=4))  # 0 + 1*4/2 = 2
    p.on_put(info("b", nbytes=1, cost=1))  # 0 + 1*1/1 = 1
    p.on_put(info("c", nbytes=1, cost=3))  # 0 + 1*3/1 = 3
    assert p.priorities() == {"a": 2.0, "b": 1.0, "c": 3.0}
    assert p.candidates() == ["b", "a", "c"]
    p.on_evict("b")
    assert p.clock == 1.0  # raised to the evicted priority
    p.on_put(info("d", nbytes=2, cost=1))  # 1 + 1*1/2 = 1.5
    assert p.candidates() == ["d", "a", "c"]
    p.on_hit("a")  # freq 2, base 1: 1 + 2*4/2 = 5
    assert p.priorities()["a"] == 5.0
    assert p.candidates() == ["d", "c", "a"]
    p.on_evict("d")
    assert p.clock == 1.5
    p.on_put(info("e", nbytes=1, cost=1))  # 1.5 + 1 = 2.5, under c's 3 (made before any ageing)
    assert p.candidates() == ["e", "c", "a"]
    p.on_evict("e")
    p.on_evict("c")
    assert p.clock == 3.0
    p.on_put(info("f", nbytes=1, cost=1))  # 3 + 1 = 4, still under a's 5
    assert p.candidates() == ["f", "a"]
    p.discard("a")  # leaving for another reason does not age the clock
    assert p.clock == 3.0


def test_pgdsf_ties_go_to_the_older_entry():
    p = PGDSFPolicy()
    p.on_put(info("x"))
    p.on_put(info("y"))
    assert p.candidates() == ["x", "y"]
    p.on_hit("x")
    p.on_hit("y")
    assert p.candidates() == ["x", "y"]


def test_cachecraft_prefers_one_good_variant_over_redundant_ones():
    p = CacheCraftPolicy()
    p.on_put(info("x1", chunk="X"))
    p.on_put(info("x2", chunk="X"))
    p.on_put(info("y1", chunk="Y"))
    p.on_hit("x2")
    p.on_hit("x2")
    p.on_hit("y1")
    p.on_hit("x1")
    p.on_hit("x1")
    # freq: x1=3 (most recent), x2=3, y1=2. Chunk X ranks x1 first (equal value, more recent),
    # so x2 keeps half its value: x2 = 1.5, y1 = 2, x1 = 3.
    assert p.priorities() == {"x1": 3.0, "x2": 1.5, "y1": 2.0}
    assert p.candidates() == ["x2", "y1", "x1"]
    lfu = LFUPolicy()  # the frequency-only baseline would drop the lone variant of Y first
    for k in ("x1", "x2", "y1"):
        lfu.on_put(info(k))
    for k in ("x2", "x2", "y1", "x1", "x1"):
        lfu.on_hit(k)
    assert lfu.candidates()[0] == "y1"
    p.on_evict("x2")
    assert p.clock == 1.5
    assert p.priorities() == {"x1": 3.0, "y1": 2.0}  # x1 is alone now: full value
    p.on_put(info("z1", chunk="Z"))  # 1.5 + 1
    assert p.candidates() == ["y1", "z1", "x1"]


def test_decay_counts_outlive_eviction_and_seed_only_unknown_keys():
    p = DecayPolicy()
    p.on_put(info("a"))
    p.on_hit("a")
    p.on_hit("a")
    p.on_evict("a")
    assert p.keys() == set() and p.count("a") == 3.0
    p.on_put(info("a", hits=10))  # known here: its own count goes on, the carried hits are ignored
    assert p.count("a") == 4.0
    p.on_put(info("b", hits=4))  # never seen here: carried hits + 1
    assert p.count("b") == 5.0
    p.on_hit("zzz")  # an unknown key is not counted
    assert p.count("zzz") == 0.0


def test_decay_halves_every_count_after_history_factor_accesses_per_entry():
    p = DecayPolicy(history_factor=2)
    p.on_put(info("a"))  # 1 access, 1 entry: the period is 2 accesses
    p.on_put(info("b"))  # 2 accesses: halved, a 0.5, b 0.5
    assert (p.count("a"), p.count("b")) == (0.5, 0.5)
    for _ in range(3):
        p.on_hit("a")  # a 3.5; 2 entries: the period is 4 accesses
    p.on_hit("b")  # b 1.5, the 4th access: a 1.75, b 0.75
    assert (p.count("a"), p.count("b")) == (1.75, 0.75)
    p.on_evict("b")  # b's count stays; one entry left: the period is 2
    p.on_hit("a")
    p.on_hit("a")  # a 3.75 -> 1.875, b 0.375
    assert (p.count("a"), p.count("b")) == (1.875, 0.375)
    p.on_hit("a")
    p.on_hit("a")  # a 3.875 -> 1.9375, b 0.1875: under a quarter, a key not held is forgotten
    assert (p.count("a"), p.count("b")) == (1.9375, 0.0)
    assert p.priorities() == {"a": 1.9375}


def test_one_off_chunks_do_not_push_out_a_proven_one_as_pgdsf_s_clock_lets_them():
    """Room for two chunks of one byte each; A is used three times, then four one-off
    chunks pass, then A again. PGDSF's clock rises with each eviction (B 1, C 2, D 3), so
    E arrives at 4 and A's 3 goes first (in ``cachecraft`` too, which keeps that clock);
    decayed counts keep A (3 against the newcomers' 1)."""
    trace = [["A"], ["A"], ["A"], ["B"], ["C"], ["D"], ["E"], ["A"]]
    sizes = {k: 1 for k in "ABCDE"}
    costs = {k: 1.0 for k in "ABCDE"}
    assert replay(trace, sizes, costs, 2, "pgdsf").hits == replay(trace, sizes, costs, 2, "cachecraft").hits == 2
    assert replay(trace, sizes, costs, 2, "decay").hits == 3


def test_decay_ranks_a_chunks_variants_by_last_access():
    """A variant just made keeps its whole value against a sibling with more history
    (ranked by value, as ``cachecraft`` ranks them, it would keep half and go first)."""
    p = DecayPolicy()
    p.on_put(info("x1", chunk="X"))
    p.on_put(info("y1", chunk="Y"))
    p.on_hit("x1")
    p.on_hit("x1")  # x1: 3 accesses
    p.on_put(info("x2", chunk="X"))  # made last: ranks first with its 1; x1 keeps 3 / 2
    assert p.priorities() == {"x1": 1.5, "x2": 1.0, "y1": 1.0}
    assert p.candidates() == ["y1", "x2", "x1"]  # y1 and x2 tie: the older access goes first
    by_value = CacheCraftPolicy()
    for key in ("x1", "y1"):
        by_value.on_put(info(key, chunk=key[0].upper()))
    by_value.on_hit("x1")
    by_value.on_hit("x1")
    by_value.on_put(info("x2", chunk="X"))
    assert by_value.candidates()[0] == "x2"  # 1 / 2 against y1's 1
    p.on_hit("x1")  # x1 used again: 4, first of X; x2 keeps 1 / 2
    assert p.priorities() == {"x1": 4.0, "x2": 0.5, "y1": 1.0}
    p.on_measure("x1", 0.25)  # quality scales the value, not the rank: 4 * 0.25
    assert p.priorities() == {"x1": 1.0, "x2": 0.5, "y1": 1.0}
    p.on_evict("x2")
    p.on_put(info("x2", chunk="X"))  # back with its history, 1 + 1, and the most recent
    assert p.priorities() == {"x1": 0.5, "x2": 2.0, "y1": 1.0}


def test_cachecraft_weighs_compute_saved_per_byte():
    p = CacheCraftPolicy()
    p.on_put(info("big", nbytes=4, cost=4))  # 1*4*1/4 = 1
    p.on_put(info("fixy", nbytes=1, cost=1, quality=0.25))  # needs 75% recompute: 0.25
    p.on_put(info("good", nbytes=1, cost=2, quality=1.0))  # 2
    assert p.priorities() == {"big": 1.0, "fixy": 0.25, "good": 2.0}
    assert p.candidates() == ["fixy", "big", "good"]
    # a third variant of one chunk keeps a quarter of its value
    q = CacheCraftPolicy()
    for key, hits in (("a1", 3), ("a2", 1), ("a3", 0)):
        q.on_put(info(key, chunk="A", hits=hits))  # freq = hits + 1: 4, 2, 1
    assert q.priorities() == {"a1": 4.0, "a2": 1.0, "a3": 0.25}


def test_measured_quality_moves_halfway_to_what_a_use_saved():
    assert measured_quality(0.9, 0.5) == pytest.approx(0.7)
    assert measured_quality(0.7, 1.0) == pytest.approx(0.85)
    assert measured_quality(0.4, 0.0, weight=0.25) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="within"):
        measured_quality(0.9, 1.5)


def test_a_measured_use_reorders_the_variants_of_a_chunk_without_counting_an_access():
    p = CacheCraftPolicy()
    p.on_put(info("a1", chunk="A", quality=0.9))
    p.on_put(info("a2", chunk="A", quality=0.8))
    # value = freq * cost * quality / bytes = quality here; a1 ranks first, a2 keeps half
    assert p.priorities() == pytest.approx({"a1": 0.9, "a2": 0.4})
    p.on_measure("a1", measured_quality(0.9, 0.1))  # requests mostly recompute a1: 0.5
    assert p.priorities() == pytest.approx({"a1": 0.25, "a2": 0.8})
    assert p.candidates() == ["a1", "a2"]
    p.on_measure("nope", 0.3)  # unknown keys are ignored
    assert p.keys() == {"a1", "a2"}
    pg = PGDSFPolicy()  # the same order without quality: a measure changes nothing
    pg.on_put(info("a1", chunk="A"))
    pg.on_put(info("a2", chunk="A"))
    pg.on_measure("a1", 0.1)
    assert pg.priorities() == {"a1": 1.0, "a2": 1.0}
    lru = LRUPolicy()
    lru.on_put(info("x"))
    lru.on_measure("x", 0.5)  # orders that ignore quality ignore it
    assert lru.candidates() == ["x"]


def test_entry_info_rejects_nonsense():
    with pytest.raises(AssertionError):
        EntryInfo("k", "c", 0)
    with pytest.raises(AssertionError):
        EntryInfo("k", "c", 10, 1.0, 1.5)
    assert estimate_cost_s(600, 30) == pytest.approx(600 * 30 * 1.6e-4)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policies_track_exactly_their_keys(name):
    p = make_policy(name)
    for k in "abcd":
        p.on_put(info(k))
    p.on_hit("zzz")  # unknown keys are ignored
    p.on_evict("a")
    p.discard("b")
    p.discard("nope")
    assert p.keys() == {"c", "d"}
    assert sorted(p.candidates()) == ["c", "d"]
    assert len(p) == 2 and "c" in p
