"""The h2o eviction policy: it ranks by the attention accumulated over every step, through the real cache too."""

from __future__ import annotations

import torch

from inf_mllm_ros.engine.memory.cache import BoundedKVCache, ForwardPlan, PromptPositions
from inf_mllm_ros.engine.memory.policies import make_policy

from policy_helpers import KEEP, PLAIN, inf, kept, uniform_with_saddle, view


def test_h2o_ranks_by_accumulated_attention_inf_mllm_by_the_newest_window():
    h2o = make_policy("h2o", capacity=KEEP, recent_size=4)
    policy = inf(PLAIN)
    views = [view(uniform_with_saddle(saddle=9), policy=p) for p in (h2o, policy)]
    # The same heavy hitter of earlier steps for both: h2o adds it up, the plain method sees the newest
    # window only.
    views[0].stats["accumulated"][:, 25] = 10.0
    views[1].stats["attention_sum"][:, 25] = 10.0
    assert {9, 25} <= kept(h2o, views[0])
    assert 9 in kept(policy, views[1]) and 25 not in kept(policy, views[1])


def test_h2o_accumulates_across_steps_in_the_cache():
    """Through the real cache: attention paid in an early step still counts for h2o later on."""
    torch.manual_seed(0)
    heads, dim, capacity = 1, 8, 6
    cache = BoundedKVCache(1, capacity, make_policy("h2o", capacity=capacity, recent_size=2), headroom=8,
                           position_mode="original")
    layer = cache.layers[0]
    keys = torch.randn(1, heads, 12, dim) * 0.01
    keys[0, 0, 1] = torch.ones(dim) * 3  # token 1 is what the first prompt's queries look for
    query_hit = torch.ones(1, heads, 4, dim) * 3
    cache.stage(ForwardPlan(PromptPositions.contiguous(0, 0, 8), evict=True))
    cache.update(keys[:, :, :8], keys[:, :, :8], 0)
    cache.after_attention(0, query_hit, layer.keys[:, :, :8], 1.0)
    assert layer.fill == capacity and 1 in cache.cached_seq(0)[0].tolist()
    # Two more prompts whose queries look away from token 1, each evicting: its retrieval windows pay it
    # the least of all, so only the attention of the first prompt, carried across evictions, keeps it.
    for start in (8, 10):
        cache.stage(ForwardPlan(PromptPositions.contiguous(start, start, 2), evict=True))
        cache.update(keys[:, :, start : start + 2], keys[:, :, start : start + 2], 0)
        cache.after_attention(0, -query_hit[:, :, :2], layer.keys[:, :, : layer.fill], 1.0)
        assert layer.fill == capacity
    assert 1 in cache.cached_seq(0)[0].tolist()
