"""Do words that come up again keep what was said with them? A diagnostic, not a shipped policy.

    python benchmarks/experiments/echo_probe.py

A mention of a subject draws its attention to the subject's latest mention, not to the fact told about it
long before. Here, besides attention, a candidate text token whose token comes up again in the retrieval
window is credited, as if it had drawn `echo` times the mean candidate's attention, shared among the
candidates of the same token (a word that is everywhere earns each of them little; a rare one, a lot).
With the pooling, the words said with it stay too. Inf-MLLM otherwise as shipped. One fact (the first of
seeds 0 and 1, mentioned at ages 192, 384, 768 and 1536), the share of layer-heads holding its value as it
ages, against Inf-MLLM as shipped. Results: benchmarks/results/echo_trace.json.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from inf_mllm_ros.engine.policies import InfMLLMPolicy, SlotView, knob, register

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: recall.py, common.py

from tracing import tell_policies_token_ids, trace_variants  # noqa: E402


@dataclass
class EchoPolicy(InfMLLMPolicy):
    name: ClassVar[str] = "inf_mllm_echo"
    slot_stats: ClassVar[tuple[str, ...]] = ("attention_sum", "born", "token")
    echo: float = knob(8.0, "Credit of a candidate whose token comes up again, in mean candidate attentions.",
                       low=0.0, high=1000.0)

    def __post_init__(self):
        super().__post_init__()
        self.pending: list[torch.Tensor] = []

    def told(self, prompt) -> None:
        # A frame's tokens have no ids: -1 (then 0 in the slots: unknown).
        ids = prompt.token_ids
        self.pending.append(torch.full((len(prompt),), -1.0) if ids is None else ids.to(torch.float32))

    def select(self, view: SlotView, keep: int) -> torch.Tensor:
        token = view.stats["token"]
        if view.new:
            ids = torch.cat(self.pending)[-view.new:] if self.pending else torch.full((view.new,), -1.0)
            self.pending = [ids]  # the same ids serve the next layer of this eviction, if layers go one by one
            token[:, view.fill - view.new:] = ids.to(token.device) + 1.0  # 0: unknown (a frame, a restored slot)
        sinks, recent = self.regions(view, keep)
        end = view.fill - recent
        if self.echo > 0.0 and view.new and end > sinks and view.window_queries:
            window = token[:, view.fill - view.new:]
            cand = token[:, sinks:end]
            # Per head: which candidates' tokens come up in the window, and how many candidates share each.
            hit = (cand[:, :, None] == window[:, None, :]).any(-1) & (cand > 0)
            same = (cand[:, :, None] == cand[:, None, :]).sum(-1).clamp(min=1)
            mean = view.window_attention[:, sinks:end].mean(-1, keepdim=True) / max(view.window_queries, 1)
            credit = torch.where(hit, self.echo * mean / same, torch.zeros_like(mean))
            view.window_attention[:, sinks:end] += credit * max(view.window_queries, 1)
        return super().select(view, keep)


def main() -> None:
    register(EchoPolicy)
    tell_policies_token_ids()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--echo", type=float, nargs="+", default=[8.0, 32.0])
    args = p.parse_args()
    variants = [("inf_mllm", {})] + [("inf_mllm_echo", {"echo": e}) for e in args.echo]
    trace_variants(variants, "echo_trace.json", seeds=(0, 1), threads=args.threads)


if __name__ == "__main__":
    main()
