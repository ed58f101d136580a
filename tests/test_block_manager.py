import pytest

from bus.sampling_params import SamplingParams
from engine.block_manager import BlockManager
from engine.request import Sequence

pytestmark = pytest.mark.unit


def seq(sid, tokens):
    return Sequence(sid, list(tokens), SamplingParams(), [0])


def computed(bm, sid, tokens, weight_epoch=0):
    """A sequence whose tokens are all in the cache, its full blocks registered for sharing."""
    q = seq(sid, tokens)
    bm.allocate(q, q.num_tokens)
    q.num_computed = q.num_tokens
    bm.commit_full_blocks(q, weight_epoch)
    return q


def test_allocate_is_all_or_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = seq("a", range(20))
    assert not bm.can_allocate(s, 20)  # needs 5 blocks
    assert bm.can_allocate(s, 16)
    bm.allocate(s, 16)
    assert len(s.block_table) == 4 and bm.num_free == 0
    bm.free_seq(s)
    assert bm.num_free == 4 and s.block_table == []


def test_prefix_blocks_are_shared_and_refcounted():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = computed(bm, "a", range(10))
    assert len(a.block_hashes) == 2
    b = seq("b", list(range(8)) + [99, 98, 97])
    assert bm.match_prefix(b, weight_epoch=0) == 8
    assert b.block_table == a.block_table[:2]
    assert bm.ref[a.block_table[0]] == 2
    bm.free_seq(a)
    assert bm.ref[b.block_table[0]] == 1  # still used by b


def test_prefix_cache_never_crosses_weight_versions():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = computed(bm, "a", range(9), weight_epoch=1)
    bm.free_seq(a)
    assert bm.match_prefix(seq("b", range(9)), weight_epoch=2) == 0
    assert bm.match_prefix(seq("c", range(9)), weight_epoch=1) == 8


def test_cache_salt_separates_prefixes_and_same_salt_shares():
    """vLLM's cache_salt: blocks are shared only between requests with the same salt (any block of the
    chain, since the salt enters the first block's hash)."""
    bm = BlockManager(num_blocks=16, block_size=4)

    def salted(sid, tokens, salt):
        return Sequence(sid, list(tokens), SamplingParams(cache_salt=salt), [0])

    a = salted("a", range(13), "tenant-a")
    bm.allocate(a, a.num_tokens)
    a.num_computed = a.num_tokens
    bm.commit_full_blocks(a, 0)
    bm.free_seq(a)
    assert bm.match_prefix(salted("b", range(13), "tenant-b"), 0) == 0
    assert bm.match_prefix(seq("plain", range(13)), 0) == 0
    assert bm.match_prefix(salted("a2", range(13), "tenant-a"), 0) == 12
    plain = computed(bm, "p", range(13))
    bm.free_seq(plain)
    assert bm.match_prefix(salted("c", range(13), "tenant-c"), 0) == 0  # an unsalted chain is not shared either


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = computed(bm, "a", range(9))
    bm.free_seq(a)
    assert bm.match_prefix(seq("b", range(9)), 0) == 8  # cache hit after free
    # Filling the cache with other content evicts the old hashes.
    bm2 = BlockManager(num_blocks=2, block_size=4)
    x = computed(bm2, "x", range(5))
    bm2.free_seq(x)
    y = seq("y", range(100, 108))
    bm2.allocate(y, 8)  # takes both blocks, overwriting x's
    assert bm2.match_prefix(seq("z", range(5)), 0) == 0


def test_whole_prompt_hit_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    computed(bm, "a", range(8))
    assert bm.match_prefix(seq("b", range(8)), 0) == 4


def test_disabled_prefix_caching():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    computed(bm, "a", range(9))
    assert bm.match_prefix(seq("b", range(9)), 0) == 0
