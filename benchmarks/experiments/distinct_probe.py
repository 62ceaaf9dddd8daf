"""Do keys unlike the rest keep a fact? A diagnostic, not a shipped policy.

    python benchmarks/experiments/distinct_probe.py

A code's digits are rare in prose, and their keys (before rotation) are among the least like the mean key
in the middle layers. Here a share `distinct_share` of the candidate slots goes to the candidates whose
unrotated key is least like the mean one (cosine), Inf-MLLM otherwise as shipped. Two anchors: the mean of
the candidates' keys at each eviction (`birth=False`, pooled over `distinct_pool` slots), or the running
mean of every key the stream brought, each token judged once when it arrives (`birth=True`), ranked less
`distinct_bias` times the log of its age. One fact (seed 0's first, mentioned at ages 192, 384, 768 and
1536), the share of layer-heads holding its value as it ages, against Inf-MLLM as shipped.
Results: benchmarks/results/distinct_trace.json.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F

from inf_mllm_ros.engine import cache as cache_module
from inf_mllm_ros.engine.cache import shift_rotary
from inf_mllm_ros.engine.policies import InfMLLMPolicy, SlotView, _keep_ends_and_best, _lift_first, knob, register

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: recall.py, common.py

from tracing import trace_variants  # noqa: E402


def show_keys_to_policies() -> None:
    """A policy sees no keys: from now on, one is handed the layer's at each eviction, with the positions they
    were rotated to."""
    evict = cache_module.BoundedLayer.evict
    if getattr(evict, "shows_keys", False):
        return

    def evict_showing_keys(self, policy, keep):
        policy.keys, policy.positions, policy.inv_freq = self.keys[0, :, : self.fill], \
            self.pos_start[:, : self.fill], self.owner.rope_inv_freq
        return evict(self, policy, keep)

    evict_showing_keys.shows_keys = True
    cache_module.BoundedLayer.evict = evict_showing_keys


@dataclass
class DistinctPolicy(InfMLLMPolicy):
    name: ClassVar[str] = "inf_mllm_distinct"
    slot_stats: ClassVar[tuple[str, ...]] = ("attention_sum", "born", "distinct")
    distinct_share: float = knob(0.3, "Share of the candidate slots for the keys least like the mean.", low=0.0, high=1.0)
    distinct_pool: int = knob(1, "Centred window over which a slot takes its neighbours' best.", low=1, high=63, step=2)
    distinct_bias: float = knob(0.0, "Age bias inside the share (birth anchor).", low=0.0, high=10.0)
    birth: bool = knob(False, "Judge each token once, on arrival, against the stream's running mean key.")

    def unrotated(self, slots: slice) -> torch.Tensor:
        keys = self.keys[:, slots].float()
        return keys if self.inv_freq is None else shift_rotary(keys, -self.positions[:, slots], self.inv_freq).float()

    def select(self, view: SlotView, keep: int) -> torch.Tensor:
        sinks, recent = self.regions(view, keep)
        if self.birth and view.new:
            new = slice(view.fill - view.new, view.fill)
            keys = self.unrotated(new)
            if getattr(self, "mean", None) is None or self.mean.shape[0] != keys.shape[0]:
                self.mean, self.count = keys.mean(1), 0
            unlike = 1.0 - F.cosine_similarity(keys, self.mean[:, None], dim=-1)
            view.stats["distinct"][:, new] = torch.log(unlike.clamp(min=1e-6))
            self.mean = (self.mean * self.count + keys.sum(1)) / (self.count + keys.shape[1])
            self.count += keys.shape[1]
        score = self.aged(view, self.drawn(view, sinks, recent), sinks)
        cand = slice(sinks, view.fill - recent)
        room = int(self.distinct_share * max(keep - sinks - recent, 0))
        if room and score.shape[-1]:
            if self.birth:
                unlike = view.stats["distinct"][:, cand].clone()
                age = (float(view.stream_end) - view.stats["born"][:, cand]).clamp(min=1.0)
                unlike -= self.distinct_bias * torch.log(age)
            else:
                keys = self.unrotated(cand)
                unlike = torch.log((1.0 - F.cosine_similarity(keys, keys.mean(1, keepdim=True), dim=-1)).clamp(min=1e-6))
            if self.distinct_pool > 1:
                unlike = F.max_pool1d(unlike[:, None], self.distinct_pool, stride=1, padding=self.distinct_pool // 2)[:, 0]
            score = _lift_first(score, torch.ones_like(unlike, dtype=torch.bool), by=unlike, room=room)
        return _keep_ends_and_best(view, keep, sinks, recent, score)


VARIANTS = [
    ("inf_mllm", {}),
    ("inf_mllm_distinct", {"distinct_share": 0.3, "distinct_pool": 5}),
    ("inf_mllm_distinct", {"distinct_share": 0.3, "birth": True, "distinct_bias": 0.25}),
    ("inf_mllm_distinct", {"distinct_share": 0.3, "birth": True, "distinct_bias": 0.5, "distinct_pool": 3}),
]


def main() -> None:
    register(DistinctPolicy)
    show_keys_to_policies()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    trace_variants(VARIANTS, "distinct_trace.json", threads=args.threads)


if __name__ == "__main__":
    main()
