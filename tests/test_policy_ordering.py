"""The chunk order that lets stored caches fit a request, against orders worked out by hand."""

from __future__ import annotations

from cachecraft.policy.ordering import cache_order, links_kept


def test_no_links_keep_the_given_order():
    assert cache_order([set(), set(), set()]) == (0, 1, 2)
    assert cache_order([]) == ()


def test_a_chunk_moves_right_after_the_chunk_its_variant_was_made_after():
    # chunk 1 has a variant made after chunk 2: chains [0] and [2, 1], laid out by earliest position
    after = [set(), {2}, set()]
    assert cache_order(after) == (0, 2, 1)
    assert links_kept((0, 2, 1), after) == 1 and links_kept((0, 1, 2), after) == 0


def test_a_loop_is_never_closed():
    # each of two chunks was made after the other: one link only, the first chunk linked first
    after = [{1}, {0}]
    assert cache_order(after) == (1, 0)
    assert links_kept((1, 0), after) == 1


def test_the_chunk_with_fewest_choices_is_linked_first():
    # chunk 2 can follow only chunk 0; chunk 1 can follow 0 or 3, and takes 3, which fewer want:
    # in the given order chunk 1 would take 0 and leave chunk 2 unlinked (1 link, not 2)
    after = [set(), {0, 3}, {0}, set()]
    assert cache_order(after) == (0, 2, 3, 1)
    assert links_kept((0, 2, 3, 1), after) == 2


def test_a_chain_that_can_start_the_prompt_comes_first():
    # chunk 2 has a variant made after the system prompt alone: exact in first place
    assert cache_order([set(), set(), set()], starts={2}) == (2, 0, 1)
    assert links_kept((2, 0, 1), [set(), set(), set()], starts={2}) == 1
    # where the earliest chain can start too, it stays first
    assert cache_order([set(), {2}, set()], starts={0, 2}) == (0, 2, 1)


def test_every_chunk_appears_once_and_out_of_range_positions_are_ignored():
    after = [{1, 7}, {2}, {0}, {-1, 3}]
    order = cache_order(after)
    assert sorted(order) == [0, 1, 2, 3]
    # 0 <- 1 <- 2 would close a loop with 2 <- 0; chunk 3 cannot follow itself
    assert links_kept(order, after) == 2


def test_a_taken_place_is_freed_by_moving_its_holder_elsewhere():
    # chunks 0-2 can each follow the other two, chunk 3 can follow 1 or 2. Linked one by one
    # without moving earlier links, two links is where it gets stuck (e.g. 1 after 2 and
    # 0 after 1 leave 2 and 3 nowhere); moving a link makes room for three, the most four
    # chunks can have: 2, then 0, then 1, then 3
    after = [{1, 2}, {0, 2}, {0, 1}, {1, 2}]
    assert cache_order(after) == (2, 0, 1, 3)
    assert links_kept((2, 0, 1, 3), after) == 3

