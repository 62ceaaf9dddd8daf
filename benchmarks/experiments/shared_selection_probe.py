"""Does one selection for every layer and head keep a mentioned fact? A diagnostic, not a shipped policy.

    python benchmarks/experiments/shared_selection_probe.py [--threads 2]

Inf-MLLM chooses per layer and KV head, each from its own attention. At a mention of a fact's subject
some layer-heads attend to the statement and keep it (with `score_pool`, the value beside the subject);
the layer-heads that read the value at the question need not be among them, and the value is held in a
scatter of layer-heads that thins out as the fact ages (`relay_trace.json`). Here every layer and head
keeps the same tokens, chosen once per eviction after the whole forward pass from the attention of
every layer: the decayed sum A of each layer-head, divided by that layer-head's mean over the
candidates (so that a layer-head whose attention is spread thin counts as much as one that is
concentrated), averaged over the layer-heads; then pooled and biased by age as Inf-MLLM's score. The
value is then held whole or not at all. Also with a slower memory (decay 0.99 per prompt instead of
0.9), since a fact mentioned at ages 768 and 1536 must outlast 12 prompts without attention.

One fact at a time (seeds 0 and 1's first), told after 10 or 15 paragraphs, mentioned at ages 192,
384, 768 and 1536, asked about at about 2,100 tokens; cache 512, Qwen2.5-0.5B, float32.
Results: benchmarks/results/shared_selection_trace.json, one record per message pushed.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F

from inf_mllm_ros.engine.cache import BoundedKVCache
from inf_mllm_ros.engine.policies import InfMLLMPolicy, SlotView, register

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: recall.py, common.py

from tracing import trace_variants  # noqa: E402


@dataclass
class SharedSelectionPolicy(InfMLLMPolicy):
    name: ClassVar[str] = "inf_mllm_shared"

    def select(self, view: SlotView, keep: int) -> torch.Tensor:
        raise RuntimeError("inf_mllm_shared selects for every layer at once (evict_all_layers)")


def evict_all_layers(cache: BoundedKVCache) -> int:
    """One selection, applied to every layer and head (they all hold the same tokens in the same order)."""
    policy, keep = cache.policy, cache.capacity
    views = [SlotView(fill=layer.fill, num_heads=layer.num_heads, seq=layer.seq[:, : layer.fill],
                      window_attention=layer.window_attention[:, : layer.fill], window_queries=layer.window_queries,
                      new=layer.fill - layer.window_start, stream_end=cache.staged.seq_end,
                      stats={k: s[:, : layer.fill] for k, s in layer.stats.items()}) for layer in cache.layers]
    first = views[0]
    sinks, recent = policy.regions(first, keep)
    # Inf-MLLM's memory update per layer-head, without its pooling and bias (applied once, below).
    bias, pool = policy.attention_bias, policy.score_pool
    policy.score_pool = 1
    try:
        attention = torch.cat([policy.drawn(v, sinks, recent).exp() for v in views])  # [layer-heads, candidates]
    finally:
        policy.score_pool = pool
    relative = attention / attention.mean(-1, keepdim=True).clamp(min=1e-30)
    score = torch.log(relative.mean(0).clamp(min=1e-30))[None]
    if pool > 1 and score.shape[-1] > 1:
        score = F.max_pool1d(score[:, None], pool, stride=1, padding=pool // 2)[:, 0]
    if bias > 0.0 and score.shape[-1]:
        age = (float(first.stream_end) - first.stats["born"][:1, sinks : first.fill - recent]).clamp(min=1.0)
        score = score - bias * torch.log(age)
    best = torch.topk(score[0], keep - sinks - recent, sorted=False).indices + sinks
    idx = torch.cat([torch.arange(sinks), torch.sort(best).values, torch.arange(first.fill - recent, first.fill)])
    evicted = first.fill - keep
    for layer in cache.layers:
        layer._gather(idx.expand(layer.num_heads, -1).contiguous())
        layer.fill, layer.window_queries, layer.window_start = keep, 0, keep
        layer.window_attention[:, :keep] = 0
    return evicted


def select_once_for_all_layers() -> None:
    """From now on, for the probe's policy, eviction (and re-packing) waits for the last layer, then covers
    them all; other policies evict as shipped."""
    if getattr(BoundedKVCache.after_attention, "selects_once", False):
        return
    shipped = BoundedKVCache.after_attention

    def after_attention(self, layer_idx, query, key, scaling, scores=None):
        if self.policy.name != SharedSelectionPolicy.name:
            return shipped(self, layer_idx, query, key, scaling, scores)
        evict_after_last_layer(self, layer_idx, query, key, scaling, scores)

    after_attention.selects_once = True
    BoundedKVCache.after_attention = after_attention


def evict_after_last_layer(cache, layer_idx, query, key, scaling, scores=None):
    """The probe policy's `after_attention`: scores observed per layer, one eviction after the last."""
    if cache.wants_scores:
        cache.layers[layer_idx].observe(query, key, scaling, scores)
    if layer_idx != len(cache.layers) - 1:
        return
    if cache.evict_after_prompt and cache.layers[-1].fill > cache.capacity:
        cache.tokens_evicted += evict_all_layers(cache)
        cache.evictions += 1
    if cache.pack_after_prompt:
        for layer in cache.layers:
            if layer.frontier > layer.fill:
                layer.pack_positions(cache.rope_inv_freq)


VARIANTS = [
    ("inf_mllm", {}),
    ("inf_mllm_shared", {}),
    ("inf_mllm_shared", {"memory_decay": 0.99}),
]


def main() -> None:
    register(SharedSelectionPolicy)
    select_once_for_all_layers()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    trace_variants(VARIANTS, "shared_selection_trace.json", seeds=(0, 1), threads=args.threads)


if __name__ == "__main__":
    main()
