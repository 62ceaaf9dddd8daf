"""Does attention passed back along references keep a mentioned fact? A diagnostic, not a shipped policy.

    python benchmarks/experiments/relay_probe.py [--seeds 0 1] [--relay 0.5]
    python benchmarks/experiments/relay_probe.py --trace --relay 2

A mention's queries go to the earlier mentions, not to the statement (`mention_attention.json`); but the
first mention, when it came, did attend to the statement's subject. Here each prompt remembers, per layer
and KV head, the older slots it attended to most (its references); when later windows attend to the
prompt's tokens, a share `--relay` of that attention is credited to its references, split as the prompt
split its attention. Inf-MLLM otherwise as shipped (score_pool keeps the value beside the subject). Run on
the recall stream with three facts alive (`recall_sparse.json`'s settings), cache 512.
Results: benchmarks/results/recall_relay.json. With `--trace`, one fact instead (seed 0's first, mentioned
at ages 192, 384, 768 and 1536), and the share of layer-heads holding its value as it ages, for Inf-MLLM
with and without the relay: benchmarks/results/relay_trace.json.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import torch

from inf_mllm_ros.engine.policies import InfMLLMPolicy, SlotView, knob, register

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: recall.py, common.py

from common import write_records  # noqa: E402
from recall import make_facts, run_one  # noqa: E402
from tracing import trace_fact  # noqa: E402

REFERENCES = 8  # older slots remembered per prompt, layer and head


@dataclass
class RelayPolicy(InfMLLMPolicy):
    name: ClassVar[str] = "inf_mllm_relay"
    relay: float = knob(0.5, "Share of a prompt's attention passed on to the slots it attended to most.",
                        low=0.0, high=10.0)
    hops: int = knob(1, "How far credit goes on: 1, to a prompt's references; 2, on to theirs; ...", low=1, high=16)

    def __post_init__(self):
        super().__post_init__()
        self._starts: list[int] = []  # stream index of each prompt's first token (shared by the layers)
        self._refs: dict[int, tuple[list, list]] = {}  # layer -> per prompt: ([heads, m] seq, [heads, m] weight)

    def drawn(self, view: SlotView, sinks: int, recent: int) -> torch.Tensor:
        if view.new and view.window_queries:
            self._remember_and_relay(view, sinks)
        return super().drawn(view, sinks, recent)

    def _remember_and_relay(self, view: SlotView, sinks: int) -> None:
        layer = view.stats["born"].data_ptr()
        seqs, weights = self._refs.setdefault(layer, ([], []))
        start = view.stream_end - view.new
        per_query = view.window_attention / view.window_queries
        older = per_query[:, sinks : view.fill - view.new]
        if seqs and older.shape[-1]:
            # What the windows paid each earlier prompt's tokens, relayed to that prompt's references.
            starts = torch.tensor(self._starts[: len(seqs)])
            block = torch.searchsorted(starts, view.seq.contiguous(), right=True) - 1  # [heads, fill]
            block[:, view.fill - view.new :] = -1  # the window's own tokens are no earlier prompt's
            paid = torch.zeros(view.num_heads, len(seqs)).scatter_add_(
                1, block.clamp(min=0), torch.where(block >= 0, per_query, 0.0))
            ref_seq = torch.stack(seqs, 1).flatten(1)  # [heads, prompts * m]
            ref_w = torch.stack(weights, 1)  # [heads, prompts, m]
            # Credit a prompt receives passes on to its own references, up to `hops` prompts back.
            ref_prompt = torch.searchsorted(starts, ref_seq, right=True) - 1
            total, passing = paid, paid
            for _ in range(self.hops - 1):
                flow = (self.relay * passing[:, :, None] * ref_w).flatten(1)
                passing = torch.zeros_like(paid).scatter_add_(1, ref_prompt.clamp(min=0),
                                                             torch.where(ref_prompt >= 0, flow, 0.0))
                total = total + passing
            credit = (self.relay * total[:, :, None] * ref_w).flatten(1)
            where = torch.searchsorted(view.seq.contiguous(), ref_seq).clamp(max=view.fill - 1)
            held = view.seq.gather(1, where) == ref_seq
            bonus = torch.zeros_like(per_query).scatter_add_(1, where, torch.where(held, credit, 0.0))
            # Credit joins the window's attention, so the score memory adds it up like any attention.
            view.window_attention.add_(bonus * view.window_queries)
        if not self._starts or self._starts[-1] != start:
            self._starts.append(start)
        if older.shape[-1]:
            m = min(REFERENCES, older.shape[-1])
            top, idx = older.topk(m, dim=-1)
            seqs.append(torch.nn.functional.pad(view.seq[:, sinks:].gather(1, idx), (0, REFERENCES - m), value=-1))
            weights.append(torch.nn.functional.pad(top / top.sum(-1, keepdim=True).clamp(min=1e-30),
                                                   (0, REFERENCES - m)))
        else:
            seqs.append(torch.full((view.num_heads, REFERENCES), -1, dtype=torch.long))
            weights.append(torch.zeros(view.num_heads, REFERENCES))


def trace(relay: float, hops: int, threads: int) -> None:
    from inf_mllm_ros.engine.loading import load_model
    from inf_mllm_ros.engine.stream import KVStream, StreamConfig

    torch.set_num_threads(threads)
    adapter = load_model("qwen2.5-0.5b", device="cpu", dtype="float32")
    fact = make_facts(0)[0]
    records = []
    for policy, settings in (("inf_mllm", {}), ("inf_mllm_relay", {"relay": relay, "hops": hops})):
        stream = KVStream(adapter, StreamConfig(capacity=512, policy=policy, chunk_size=64, policy_settings=settings))
        records += [{"policy": policy, "cache_size": 512, "relay": settings.get("relay", 0.0),
                     "hops": settings.get("hops", 0), **r} for r in trace_fact(stream, adapter, fact)]
        print(policy, [(r["age"], r["value_kept_in_layer_heads"]) for r in records if r["policy"] == policy][::4])
    write_records("relay_trace.json" if hops == 1 else f"relay_trace_{hops}_hops.json", records)


def main() -> None:
    register(RelayPolicy)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--relay", type=float, default=0.5)
    p.add_argument("--hops", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="recall_relay.json")
    p.add_argument("--trace", action="store_true", help="one fact's value held as it ages, with and without the relay")
    args = p.parse_args()
    if args.trace:
        return trace(args.relay, args.hops, args.threads)
    records = []
    for seed in args.seeds:
        run = SimpleNamespace(policy="inf_mllm_relay", cache=512, setting="mentioned", seed=seed, threads=args.threads,
                              model="qwen2.5-0.5b", device="cpu", dtype="float32", text=None, facts=6,
                              fact_every=1500, distances=[2048, 4096], bias=None, pool=None, first_mention=192,
                              mention_gap=0, policy_settings={"relay": args.relay, "hops": args.hops})
        found = run_one(run)
        for r in found:
            r["relay"], r["hops"] = args.relay, args.hops
        records += found
        print(f"seed {seed}: recalled {sum(r['recalled'] for r in found)}/{len(found)}, value held "
              f"{sum(r['value_kept_in_layer_heads'] for r in found) / len(found):.3f}", flush=True)
        write_records(args.out, records)


if __name__ == "__main__":
    main()
