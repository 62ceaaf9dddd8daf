"""Shared by the eviction policies' tests: a constructed slot view, the slots a policy keeps of it, and the
inf_mllm policy built with the shipped or the plain settings."""

from __future__ import annotations

import torch

from inf_mllm_ros.engine.memory.policies import SlotView, make_policy

FILL, KEEP, HEADS = 80, 40, 2
SHIPPED = {}  # make_policy's defaults: the settings StreamConfig and the node ship
PLAIN = {"score_memory": False, "score_pool": 1, "text_share": 0.0}  # no score memory, pooling or text share


def view(window_attention=None, queries=8, new=0, policy=None) -> SlotView:
    zeros = torch.zeros(HEADS, FILL)
    names = policy.slot_stats if policy is not None else ()
    seq = torch.arange(FILL).expand(HEADS, FILL)
    # As if every token had come in a block of its own: each is one token older than the next.
    stats = {name: (seq.float() + 1 if name == "born" else zeros.clone()) for name in names}
    return SlotView(
        fill=FILL,
        num_heads=HEADS,
        seq=seq,
        window_attention=zeros.clone() if window_attention is None else window_attention,
        window_queries=queries,
        stream_end=FILL,
        new=new,
        stats=stats,
    )


def kept(policy, v, keep=KEEP) -> set[int]:
    idx = policy.select(v, keep)
    assert idx.shape == (HEADS, keep)
    assert torch.equal(idx, idx.sort(dim=-1).values), "kept slots must stay in stream order"
    assert torch.equal(idx[0], idx[1])
    return set(idx[0].tolist())


def uniform_with_saddle(saddle: int, weight: float = 0.5) -> torch.Tensor:
    attn = torch.full((HEADS, FILL), 1.0 / FILL)
    attn[:, saddle] = weight
    return attn * 8  # summed over 8 window queries


def inf(variant=SHIPPED, **kw):
    return make_policy("inf_mllm", capacity=KEEP, **{**variant, **kw})
