"""Does crediting a phrase's first copy keep a mentioned fact? A diagnostic, not a shipped policy.

    python benchmarks/experiments/first_copy_probe.py

When a subject keeps coming up, each mention draws attention to the one before it, and the mentions,
not the statement they refer to, become the saddles (docs/experiments.md). Here a later copy of a rare
phrase (`span` tokens, three by default) is treated as redundant with its first copy still in the cache:
the attention it draws is credited to the first copy, and it is not kept for its own sake (its score is
lowered below every other candidate's after pooling); with `renew`, the first copy and the tokens pooled
with it also become as young as the repeat. With the later copies gone, the next mention can only draw
attention to the statement, whose pooling keeps the value beside the subject. A phrase counts as rare
while the stream has seen it at most `max_copies` times (chat markers and "of the" come up far more
often). Inf-MLLM otherwise as shipped. `--recall` runs recall.py's twenty-facts stream (mentioned,
cache 512) instead: results/recall_first_copy.json. One fact (the first of seeds 0 and 1, mentioned at ages 192, 384, 768 and 1536),
the share of layer-heads holding its value as it ages. Results: benchmarks/results/first_copy_trace.json.
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

from common import load_records, write_records  # noqa: E402
from tracing import mentioned_run, tell_policies_token_ids, trace_variants  # noqa: E402


@dataclass
class FirstCopyPolicy(InfMLLMPolicy):
    name: ClassVar[str] = "inf_mllm_first_copy"
    slot_stats: ClassVar[tuple[str, ...]] = ("attention_sum", "born", "pair")
    max_copies: int = knob(8, "A phrase seen at most this many times in the stream is rare.", low=1, high=1 << 20)
    renew: bool = knob(True, "A repeat of a rare phrase makes its first copy, and the tokens pooled with it, as young "
                       "as the repeat.")
    span: int = knob(3, "Tokens in a phrase: a pair, or more.", low=2, high=8)

    def __post_init__(self):
        super().__post_init__()
        self.pending: list[int] = []  # pair ids of the tokens pushed since the last eviction (0: none)
        self.ids: dict[tuple[int, int], int] = {}
        self.counts: list[int] = [1 << 30]  # times the stream has seen each pair id; id 0 is never rare
        self.previous: tuple[int, ...] = ()
        self._redundant: torch.Tensor | None = None

    def told(self, prompt) -> None:
        if prompt.token_ids is None:  # a frame: no pairs
            self.pending += [0] * len(prompt)
            self.previous = ()
            return
        for t in prompt.token_ids.tolist():
            if len(self.previous) < self.span - 1:
                self.pending.append(0)
            else:
                key = self.previous + (t,)
                pid = self.ids.setdefault(key, len(self.counts))
                if pid == len(self.counts):
                    self.counts.append(0)
                self.counts[pid] += 1
                self.pending.append(pid)
            self.previous = (self.previous + (t,))[-(self.span - 1):]

    def select(self, view: SlotView, keep: int) -> torch.Tensor:
        pair = view.stats["pair"]
        if view.new:
            codes = ([0] * view.new + self.pending)[-view.new:]
            self.pending = codes  # the same ids serve the next layer of this eviction
            pair[:, view.fill - view.new:] = torch.tensor(codes, dtype=torch.float32)
        sinks, recent = self.regions(view, keep)
        end = view.fill - recent
        self._redundant = None
        if end > sinks:
            cand = pair[:, sinks:end]
            counts = torch.tensor(self.counts)
            rare = counts[cand.long()] <= self.max_copies
            same = (cand[:, :, None] == cand[:, None, :]) & rare[:, :, None]
            n = cand.shape[-1]
            earlier = same & torch.ones(n, n, dtype=torch.bool).tril(-1)  # [h, i, j]: j < i holds the same pair
            has_first = earlier.any(-1)
            first = earlier.to(torch.int8).argmax(-1)  # the first such j per i
            attention = view.window_attention[:, sinks:end]
            moved = torch.where(has_first, attention, torch.zeros_like(attention))
            attention.scatter_add_(-1, first, moved)
            attention.sub_(moved)
            self._redundant = has_first
            if self.renew and bool(has_first.any()):
                born = view.stats["born"][:, sinks:end]
                young = torch.zeros_like(born).scatter_reduce_(
                    -1, first, torch.where(has_first, born, torch.zeros_like(born)), reduce="amax")
                if self.score_pool > 1:
                    young = torch.nn.functional.max_pool1d(young[:, None], self.score_pool, stride=1,
                                                           padding=self.score_pool // 2)[:, 0]
                born.copy_(torch.maximum(born, young))
        return super().select(view, keep)

    def drawn(self, view: SlotView, sinks: int, recent: int) -> torch.Tensor:
        drawn = super().drawn(view, sinks, recent)
        if self._redundant is not None and self._redundant.shape == drawn.shape:
            drawn = drawn.masked_fill(self._redundant, -1e4)
        return drawn


def main() -> None:
    register(FirstCopyPolicy)
    tell_policies_token_ids()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-copies", type=int, nargs="+", default=[8])
    p.add_argument("--span", type=int, default=3, help="tokens in a phrase")
    p.add_argument("--no-renew", dest="renew", action="store_false",
                   help="a repeat does not make the first copy young again")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--skip-shipped", action="store_true")
    p.add_argument("--recall", action="store_true",
                   help="recall.py's twenty-facts stream, mentioned, cache 512, instead of the one-fact trace")
    p.add_argument("--out", default="recall_first_copy.json")
    args = p.parse_args()
    settings = {"max_copies": args.max_copies[0], "span": args.span, "renew": args.renew}
    if args.recall:
        records = load_records(args.out)
        for seed in args.seeds:
            found = mentioned_run("inf_mllm_first_copy", seed, settings, threads=args.threads)
            for r in found:
                r["policy_settings"] = settings
            records += found
            for d in (1024, 2048, 4096, 8192):
                at = [r for r in found if r["distance"] == d]
                print(f"seed {seed} distance {d}: recalled {sum(r['recalled'] for r in at)}/{len(at)}, value held "
                      f"{sum(r['value_kept_in_layer_heads'] for r in at) / max(len(at), 1):.3f}", flush=True)
            write_records(args.out, records)
        return
    variants = ([] if args.skip_shipped else [("inf_mllm", {})]) + [
        ("inf_mllm_first_copy", {"max_copies": m, "span": args.span, "renew": args.renew}) for m in args.max_copies]
    trace_variants(variants, "first_copy_trace.json", seeds=tuple(args.seeds), threads=args.threads)


if __name__ == "__main__":
    main()
