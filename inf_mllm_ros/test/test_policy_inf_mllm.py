"""The inf_mllm eviction policy on constructed attention and through the real cache: the sinks, the recent
window and the new prompt kept, saddles kept, the attention bias against age, the score pool, the score
memory, the text's share and the pins."""

from __future__ import annotations

import math

import pytest
import torch

from inf_mllm_ros.engine.memory.cache import BoundedKVCache, ForwardPlan, PromptPositions
from inf_mllm_ros.engine.memory.policies import SlotView, make_policy, policy_defaults

from policy_helpers import FILL, HEADS, KEEP, PLAIN, SHIPPED, inf, kept, uniform_with_saddle, view

VARIANTS = pytest.mark.parametrize("variant", [SHIPPED, PLAIN], ids=["shipped", "plain"])


def candidates_kept(policy, v, keep=KEEP) -> set[int]:
    """The kept slots other than the sinks and the recent window (those are kept whatever they score)."""
    sinks, recent = policy.regions(v, keep)
    return {i for i in kept(policy, v, keep) if sinks <= i < v.fill - recent}


@VARIANTS
def test_inf_mllm_keeps_scattered_saddle_that_window_drops(variant):
    policy = inf(variant)
    window = make_policy("window", capacity=KEEP)
    assert 17 in kept(policy, view(uniform_with_saddle(saddle=17), policy=policy))
    assert 17 not in kept(window, view(uniform_with_saddle(saddle=17)))
    assert kept(window, view()) == set(range(FILL - KEEP, FILL))


@VARIANTS
def test_inf_mllm_keeps_the_sinks_whatever_their_attention(variant):
    policy = inf(variant, attention_bias=50.0)  # a bias that would otherwise keep only the newest tokens
    attn = torch.full((HEADS, FILL), 1e-2 * 8)
    attn[:, :4] = 0.0
    assert set(range(4)) <= kept(policy, view(attn, policy=policy))


@VARIANTS
def test_recent_tokens_and_the_whole_new_prompt_are_always_kept(variant):
    for policy in (inf(variant, recent_size=6), make_policy("h2o", capacity=KEEP, recent_size=6)):
        assert set(range(FILL - 6, FILL)) <= kept(policy, view(uniform_with_saddle(saddle=3), policy=policy))
    # The prompt just pushed (10 slots) is longer than the recent window: none of it is judged by its own
    # queries, even when they look only at an old token.
    policy = inf(variant, recent_size=6)
    attn = torch.zeros(HEADS, FILL)
    attn[:, 12] = 8.0
    assert set(range(FILL - 10, FILL)) <= kept(policy, view(attn, new=10, policy=policy))


SADDLE_REGION = set(range(14, 27))  # the saddle and the neighbours the shipped score_pool keeps with it


def bias_view(policy, scale: float = 1.0) -> SlotView:
    # Older tokens draw slightly more attention than newer ones (as early tokens do in practice), by a
    # margin far below a real saddle's.
    attn = torch.linspace(2e-3, 1e-3, FILL).expand(HEADS, FILL).clone()
    attn[:, 20] = 0.3  # a real saddle
    return view(window_attention=attn * 8 * scale, policy=policy)


@VARIANTS
def test_without_bias_old_tokens_monopolise_the_cache(variant):
    policy = inf(variant, attention_bias=0.0)
    non_recent = candidates_kept(policy, bias_view(policy))
    assert min(non_recent - SADDLE_REGION) == 4, "the oldest candidates win"
    assert max(non_recent - SADDLE_REGION) < FILL // 2


@VARIANTS
def test_bias_moves_the_cache_forward_and_keeps_real_saddles(variant):
    policy = inf(variant)  # the shipped bias
    v = bias_view(policy)
    non_recent = candidates_kept(policy, v)
    assert 20 in non_recent, "a saddle 200 times above its neighbours must survive"
    assert max(non_recent - SADDLE_REGION) == FILL - policy.regions(v, KEEP)[1] - 1, "the newest candidates win"
    assert min(non_recent - SADDLE_REGION) > FILL // 2


@VARIANTS
def test_bias_means_the_same_at_any_attention_scale(variant):
    # Summing over a larger query group, or averaging over more keys, scales every candidate alike.
    for bias in (0.0, 0.3, 1.0, 4.0):
        policies = [inf(variant, attention_bias=bias) for _ in range(2)]
        chosen = [kept(p, bias_view(p, scale)) for p, scale in zip(policies, (1.0, 37.0))]
        assert chosen[0] == chosen[1]


@pytest.mark.parametrize("bias", [0.5, 1.0, 2.0])
def test_a_token_twice_as_old_needs_two_to_the_bias_times_the_attention(bias):
    """score = log A - bias * log(age): between two candidates, age and attention trade off as ratios."""
    policy = make_policy("inf_mllm", capacity=9, recent_size=4, attention_bias=bias, **PLAIN)
    seq = torch.tensor([0, 1, 2, 3, 101, 301, 496, 497, 498, 501]).expand(HEADS, 10)  # ages 400 and 200
    for ratio, old_kept in ((0.95 * 2 ** bias, False), (1.05 * 2 ** bias, True)):
        attn = torch.full((HEADS, 10), 1e-2)
        attn[:, 4], attn[:, 5] = 1e-3 * ratio, 1e-3
        v = SlotView(fill=10, num_heads=HEADS, seq=seq, window_attention=attn, window_queries=1, stream_end=502,
                     stats={"attention_sum": torch.zeros(HEADS, 10), "born": seq.float() + 1})
        idx = policy.select(v, 9)[0].tolist()
        assert (4 in idx, 5 in idx) == (old_kept, not old_kept), (bias, ratio)


def test_score_pool_keeps_a_saddle_with_the_tokens_around_it():
    policy = inf(attention_bias=0.0)
    half = policy.score_pool // 2
    for saddle in (29, 30, 31, 32):  # any offset: no fixed groups
        attn = torch.full((HEADS, FILL), 1e-3)
        attn[:, saddle] = 0.5
        assert set(range(saddle - half, saddle + half + 1)) <= kept(policy, view(attn * 8, policy=policy))


def test_score_memory_keeps_a_saddle_of_earlier_prompts():
    policy = inf(attention_bias=0.0, score_pool=1)
    v = view(policy=policy)
    v.stats["attention_sum"][:, 6] = 0.5  # drew half the attention in earlier windows ...
    v.window_attention[:] = 1e-2 * 8  # ... and none in this one, where every other token drew 1 %
    v.window_attention[:, 6] = 0.0
    assert 6 in kept(policy, v)
    assert 6 not in kept(inf(PLAIN, attention_bias=0.0), v), "the plain score knows the newest window only"


@pytest.mark.parametrize("decay", [policy_defaults("inf_mllm")["memory_decay"], 0.5, 0.99])
@pytest.mark.parametrize("ratio, enters", [(0.9, False), (1.1, True)])
def test_attention_that_keeps_coming_adds_up_against_a_newcomer(decay, ratio, enters):
    """Saddles keep drawing attention: an incumbent that drew 1 % in every window for long counts
    1 / (1 - memory_decay) times that (the decayed sum: ten times at 0.9), so a newcomer judged once takes
    its slot only with more, or by the bias."""
    newcomers = set(range(40, FILL))
    for bias, expected in ((0.0, enters), (50.0, True)):
        policy = inf(attention_bias=bias, score_pool=1, memory_decay=decay)
        v = view(policy=policy)
        v.stats["attention_sum"][:, 4:40] = 1e-2 / (1 - decay)  # incumbents: 1 % of attention for many windows ...
        v.window_attention[:, 4:40] = 1e-2 * 8  # ... and now
        v.window_attention[:, 40:] = 1e-2 * ratio / (1 - decay) * 8  # newcomers, judged for the first time
        assert (candidates_kept(policy, v) <= newcomers) == expected, (bias, ratio)


@pytest.mark.parametrize("bias", [0.5, 1.0, 2.0])
def test_remembered_attention_trades_against_age_like_attention_now(bias):
    """A fact drew attention in earlier prompts (its subject came up) and none now; a younger token draws
    some now. The fact keeps its slot while its decayed sum is more than 2^bias times that at twice the age."""
    policy = make_policy("inf_mllm", capacity=9, recent_size=4, attention_bias=bias, score_pool=1)
    seq = torch.tensor([0, 1, 2, 3, 101, 301, 496, 497, 498, 501]).expand(HEADS, 10)  # ages 400 and 200
    for ratio, old_kept in ((0.95 * 2 ** bias, False), (1.05 * 2 ** bias, True)):
        attn = torch.full((HEADS, 10), 1e-2)
        attn[:, 4], attn[:, 5] = 0.0, 1e-3  # the fact draws nothing now
        total = torch.zeros(HEADS, 10)
        total[:, 4] = 1e-3 * ratio / policy.memory_decay  # its subject's mentions, decayed once more at this eviction
        v = SlotView(fill=10, num_heads=HEADS, seq=seq, window_attention=attn, window_queries=1, stream_end=502,
                     stats={"attention_sum": total, "born": seq.float() + 1})
        idx = policy.select(v, 9)[0].tolist()
        assert (4 in idx, 5 in idx) == (old_kept, not old_kept), (bias, ratio)


def test_a_hit_is_remembered_across_evictions_in_the_cache():
    """Through the real cache: a token the first prompt looked at survives later prompts that look
    elsewhere with the score memory, and goes without it, or with a memory that keeps nothing (set at run
    time)."""
    torch.manual_seed(0)
    heads, dim, capacity = 1, 8, 10
    survived = {}
    for memory, decay in ((True, None), (False, None), (True, 0.0)):
        policy = make_policy("inf_mllm", capacity=capacity, recent_size=2, sink_size=1, attention_bias=0.0,
                             score_pool=1, score_memory=memory)
        if decay is not None:
            policy.set_knob("memory_decay", decay)
        cache = BoundedKVCache(1, capacity, policy, headroom=8, position_mode="original")
        layer = cache.layers[0]
        keys = torch.randn(1, heads, 40, dim) * 0.01
        keys[0, 0, 3] = torch.ones(dim) * 3  # token 3: what the second prompt's queries look for
        seen = 0
        for prompt in range(5):
            n = 12 if prompt == 0 else 4
            cache.stage(ForwardPlan(PromptPositions.contiguous(seen, seen, n), evict=True))
            cache.update(keys[:, :, seen : seen + n], keys[:, :, seen : seen + n], 0)
            query = torch.ones(1, heads, n, dim) * (3 if prompt == 1 else -3)  # then away from token 3
            query[0, 0, :, 0] = 0.0
            cache.after_attention(0, query, layer.keys[:, :, : layer.fill], 1.0)
            seen += n
        survived[memory, decay] = 3 in cache.cached_seq(0)[0].tolist()
    assert survived == {(True, None): True, (False, None): False, (True, 0.0): False}


@VARIANTS
def test_every_candidate_s_score_is_set_by_the_queries_that_all_see_it(variant):
    """Through the real cache: a prompt's keys are not judged by its own queries (at the first eviction
    every slot is new, so only the sinks and the prompt's end are kept); the next prompt's queries judge
    them, and keep what they looked at."""
    policy = inf(variant)
    cache = BoundedKVCache(1, KEEP, policy, headroom=8, position_mode="original")
    layer = cache.layers[0]
    torch.manual_seed(0)
    keys = torch.randn(1, 1, 52, 8) * 0.1
    keys[0, 0, 30] = torch.ones(8) * 3  # what the second prompt's queries look for
    views = []
    original = policy.select

    def spy(v, keep):
        views.append({"new": v.new, "fill": v.fill, "regions": policy.regions(v, keep)})
        return original(v, keep)

    policy.select = spy
    cache.stage(ForwardPlan(PromptPositions.contiguous(0, 0, 48), evict=True))
    cache.update(keys[:, :, :48], keys[:, :, :48], 0)
    # The first prompt's queries look hardest at its own last tokens, as local attention does.
    cache.after_attention(0, keys[:, :, 40:48] * 30, layer.keys[:, :, :48], 1.0)
    assert views[0] == {"new": 48, "fill": 48, "regions": (4, KEEP - 4)}
    assert cache.cached_seq(0)[0].tolist() == [0, 1, 2, 3, *range(12, 48)], "sinks, then the end of the prompt"
    cache.stage(ForwardPlan(PromptPositions.contiguous(48, 48, 4), evict=True))
    cache.update(keys[:, :, 48:], keys[:, :, 48:], 0)
    cache.after_attention(0, torch.ones(1, 1, 4, 8) * 3, layer.keys[:, :, : layer.fill], 1.0)
    sinks, recent = views[1]["regions"]
    held = cache.cached_seq(0)[0].tolist()
    assert views[1]["new"] == 4 and len(held) == KEEP
    # Candidates are stream tokens 12 .. 52 - recent; four of them go.
    assert 30 in held and len([t for t in range(12, 52 - recent) if t not in held]) == 4
    half = policy.score_pool // 2
    assert set(range(30 - half, 31 + half)) <= set(held), "the tokens around what was looked at stay too"


def mixed_view(policy) -> SlotView:
    """Slots 0-39 text drawing little attention, 40-79 frame tokens drawing more."""
    attention = torch.full((HEADS, FILL), 0.5)
    attention[:, 40:] = 4.0
    attention[:, 10] = 1.0  # the text token the text's own ranking puts first
    v = view(attention, policy=policy)
    v.frame = torch.zeros(HEADS, FILL, dtype=torch.bool)
    v.frame[:, 40:] = True
    return v


@pytest.mark.parametrize("share", [0.0, 0.25, 0.5, 1.0])
def test_text_keeps_its_share_of_the_candidates_against_a_flood_of_frames(share):
    policy = inf(text_share=share, attention_bias=0.0, score_pool=1)
    v = mixed_view(policy)
    sinks, recent = policy.regions(v, KEEP)
    best = KEEP - sinks - recent
    kept_text = {i for i in kept(policy, v) if sinks <= i < 40}
    assert len(kept_text) == int(share * best)
    if share:
        assert 10 in kept_text  # the text that drew the most


def test_the_text_share_goes_to_the_text_that_drew_the_most_whatever_its_age():
    """An old fact that draws the most attention keeps the text's share against newer mentions that draw a
    little less but more for their age: the bias keeps the frames moving, not the text's share."""
    policy = inf(score_pool=1)  # the shipped bias and share; single tokens, so that each block is exact
    v = mixed_view(policy)
    v.window_attention[:, 4:40] = 0.5
    v.window_attention[:, 6:13] = 0.75  # old text that drew the most
    v.window_attention[:, 20:40] = 0.6  # newer text, the best of the text by score (age included)
    sinks, recent = policy.regions(v, KEEP)
    share = int(policy.text_share * (KEEP - sinks - recent))
    assert 7 < share < 7 + 20  # room for the old text, not for all the newer text
    kept_text = {i for i in kept(policy, v) if sinks <= i < 40}
    assert len(kept_text) == share and set(range(6, 13)) <= kept_text


def test_the_text_share_never_takes_more_than_the_text_there_is():
    policy = inf(text_share=1.0, attention_bias=0.0)
    v = mixed_view(policy)
    v.frame[:, 8:40] = True  # text: the sinks and slots 4-7 only
    chosen = kept(policy, v)  # KEEP slots all the same: frames fill what the text cannot
    assert {4, 5, 6, 7} <= chosen


def pinned_view(policy, pins) -> SlotView:
    """Frames drawing the most attention, text drawing little, and the given slots pinned."""
    v = mixed_view(policy)
    v.pinned = torch.zeros(HEADS, FILL, dtype=torch.bool)
    v.pinned[:, list(pins)] = True
    return v


@VARIANTS
def test_pinned_tokens_are_kept_whatever_their_attention(variant):
    # Without the text share, so that only the pins can keep text against the frames.
    policy = inf(variant, attention_bias=0.0, text_share=0.0)
    pins = [5, 6, 7, 20, 21]  # text that draws the least attention of all
    assert set(pins) <= kept(policy, pinned_view(policy, pins))
    unpinned = inf(variant, attention_bias=0.0, text_share=0.0, pin_share=0.0)
    assert not set(pins) & kept(unpinned, pinned_view(unpinned, pins))


@pytest.mark.parametrize("share", [0.25, 0.5])
def test_pins_beyond_their_share_give_way_oldest_first(share):
    policy = inf(text_share=0.0, attention_bias=0.0, score_pool=1, pin_share=share)
    v = pinned_view(policy, range(4, 34))  # more pins than the share holds
    sinks, _ = policy.regions(v, KEEP)
    room = int(share * (KEEP - sinks))  # a share of every slot but the sinks
    chosen = kept(policy, v)
    assert {i for i in chosen if 4 <= i < 34} == set(range(34 - room, 34)), "the newest pins"


def test_pins_outrank_the_oldest_of_a_recent_window_that_would_take_every_slot():
    # At the first eviction the whole stream is new: its recent window alone would fill the cache.
    policy = inf()
    v = pinned_view(policy, range(10, 20))
    v.new = FILL
    assert policy.regions(v, KEEP)[1] == KEEP - 4
    assert set(range(10, 20)) <= kept(policy, v)


@VARIANTS
def test_a_candidate_among_the_window_s_own_tokens_is_averaged_over_the_queries_that_see_it(variant):
    """When pins take the recent window's room at the first eviction, the window's own tokens are candidates:
    slot j is seen by the queries from j on, and its attention is averaged over those alone."""
    policy = inf(variant)  # every slot is new: all are equally old, so the bias weighs them alike
    seen_by = torch.arange(FILL, 0, -1, dtype=torch.float32)  # slot j: queries j .. FILL - 1
    v = view(window_attention=(1e-2 * seen_by).expand(HEADS, FILL).clone(), queries=FILL, new=FILL, policy=policy)
    score = policy.aged(v, policy.drawn(v, sinks=4, recent=10), sinks=4)
    assert torch.allclose(score, torch.full_like(score, math.log(1e-2))), "the same attention per query"
