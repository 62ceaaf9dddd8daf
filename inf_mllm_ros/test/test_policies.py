"""Eviction policies on constructed attention: each keeps what it is meant to keep."""

from __future__ import annotations

import pytest
import torch

from inf_mllm_ros.engine.cache import BoundedKVCache, PromptPositions
from inf_mllm_ros.engine.policies import POLICIES, SlotView, make_policy

FILL, KEEP, HEADS = 40, 16, 2


def view(window_attention=None, accumulated=None, queries=8.0) -> SlotView:
    zeros = torch.zeros(HEADS, FILL)
    return SlotView(
        fill=FILL,
        num_heads=HEADS,
        seq=torch.arange(FILL).expand(HEADS, FILL),
        window_attention=zeros.clone() if window_attention is None else window_attention,
        window_queries=torch.full((FILL,), queries),
        accumulated_attention=zeros.clone() if accumulated is None else accumulated,
        history=zeros.clone(),
    )


def kept(policy, v, keep=KEEP) -> set[int]:
    idx = policy.select(v, keep)
    assert idx.shape == (HEADS, keep)
    assert torch.equal(idx, idx.sort(dim=-1).values), "kept slots must stay in stream order"
    return set(idx[0].tolist())


def uniform_with_saddle(saddle: int, weight: float = 0.5) -> torch.Tensor:
    attn = torch.full((HEADS, FILL), 1.0 / FILL)
    attn[:, saddle] = weight
    return attn * 8  # summed over 8 window queries


def test_inf_mllm_keeps_scattered_saddle_that_window_drops():
    v = view(window_attention=uniform_with_saddle(saddle=7))
    inf = make_policy("inf_mllm", capacity=KEEP, recent_size=4, attention_bias=1e-3)
    window = make_policy("window", capacity=KEEP)
    assert 7 in kept(inf, v)
    assert 7 not in kept(window, v)
    assert kept(window, v) == set(range(FILL - KEEP, FILL))


def test_recent_tokens_are_always_kept():
    v = view(window_attention=uniform_with_saddle(saddle=3))
    for name in ("inf_mllm", "h2o"):
        policy = make_policy(name, capacity=KEEP, recent_size=6)
        assert set(range(FILL - 6, FILL)) <= kept(policy, v)


def test_streaming_llm_keeps_sinks_and_recent_window():
    policy = make_policy("streaming_llm", capacity=KEEP, sink_size=4)
    assert kept(policy, view()) == set(range(4)) | set(range(FILL - (KEEP - 4), FILL))


def test_h2o_ranks_by_accumulated_attention_inf_mllm_by_the_newest_window():
    accumulated = torch.zeros(HEADS, FILL)
    accumulated[:, 5] = 10.0  # a heavy hitter of earlier steps, ignored by the newest prompt
    window = uniform_with_saddle(saddle=9)
    v = view(window_attention=window, accumulated=accumulated)
    h2o = make_policy("h2o", capacity=KEEP, recent_size=4)
    inf = make_policy("inf_mllm", capacity=KEEP, recent_size=4)
    assert 5 in kept(h2o, v)
    assert 9 in kept(inf, v) and 5 not in kept(inf, v)


def test_h2o_accumulates_across_steps_in_the_cache():
    """Through the real cache: attention paid in an early step still counts for h2o later on."""
    torch.manual_seed(0)
    heads, dim, capacity = 1, 8, 6
    cache = BoundedKVCache(1, capacity, make_policy("h2o", capacity=capacity, recent_size=2), headroom=8,
                           position_mode="original")
    layer = cache.layers[0]
    keys = torch.randn(1, heads, 10, dim) * 0.01
    keys[0, 0, 1] = torch.ones(dim) * 3  # token 1 is what the first prompt's queries look for
    query_hit = torch.ones(1, heads, 4, dim) * 3
    cache.stage(PromptPositions.contiguous(0, 0, 8), evict=False)
    layer.update(keys[:, :, :8], keys[:, :, :8])
    cache.after_attention(0, query_hit, layer.keys[:, :, :8], 1.0)
    # Next prompt: queries orthogonal to token 1; then eviction down to the capacity.
    cache.stage(PromptPositions.contiguous(8, 8, 2), evict=True)
    layer.update(keys[:, :, 8:10], keys[:, :, 8:10])
    cache.after_attention(0, -query_hit[:, :, :2], layer.keys[:, :, :10], 1.0)
    assert layer.fill == capacity
    assert 1 in cache.cached_seq(0)[0].tolist()


def bias_view() -> SlotView:
    # Older tokens draw slightly more attention than newer ones (as early tokens do in practice),
    # by a margin far below a real saddle's.
    attn = torch.linspace(2e-3, 1e-3, FILL).expand(HEADS, FILL).clone()
    attn[:, 10] = 0.3  # a real saddle
    return view(window_attention=attn * 8)


def test_without_bias_old_tokens_monopolise_the_cache():
    policy = make_policy("inf_mllm", capacity=KEEP, recent_size=4, attention_bias=0.0)
    non_recent = kept(policy, bias_view()) - set(range(FILL - 4, FILL))
    assert non_recent == set(range(KEEP - 4)), "the oldest tokens (and the saddle among them) win"


def test_bias_moves_the_cache_forward_and_keeps_real_saddles():
    policy = make_policy("inf_mllm", capacity=KEEP, recent_size=4, attention_bias=1e-2)
    non_recent = kept(policy, bias_view()) - set(range(FILL - 4, FILL))
    assert 10 in non_recent, "a saddle far above the bias must survive"
    newest_rest = set(range(FILL - 4 - (KEEP - 4 - 1), FILL - 4))
    assert non_recent - {10} == newest_rest


def test_bias_is_validated_and_changeable():
    policy = make_policy("inf_mllm", capacity=KEEP)
    policy.attention_bias = 5e-3
    assert policy.describe()["attention_bias"] == 5e-3
    with pytest.raises(ValueError):
        policy.attention_bias = -1.0
    with pytest.raises(ValueError):
        make_policy("lru", capacity=KEEP)
    with pytest.raises(ValueError):
        make_policy("h2o", capacity=8, recent_size=9)


def test_registry_lists_all_policies():
    assert set(POLICIES) == {"inf_mllm", "streaming_llm", "h2o", "window", "full"}


def test_score_pool_keeps_a_saddle_with_its_whole_group():
    policy = make_policy("inf_mllm", capacity=KEEP, recent_size=4, attention_bias=0.0, score_pool=4)
    attn = torch.full((HEADS, FILL), 1e-3)
    attn[:, 9] = 0.5  # group 8..11 holds a saddle
    assert set(range(8, 12)) <= kept(policy, view(window_attention=attn * 8))


def test_score_decay_remembers_earlier_prompts():
    policy = make_policy("inf_mllm", capacity=KEEP, recent_size=4, attention_bias=0.0, score_decay=0.9)
    v = view()
    v.history[:, 6] = 0.5  # drew attention in earlier prompts, none in this one
    assert 6 in kept(policy, v)
