"""Where a mention's attention goes: to the fact's subject, or to its value?

    python benchmarks/experiments/mention_attention.py [--facts 8] [--seeds 0 1]

The recall benchmark's `mentioned` setting assumes that a message naming a fact's subject ("Someone
walked past the red locker.") draws attention to the fact, so that attention saddles keep it. This
measures it on the 0.5B evaluation model: the recall stream (facts every 300 tokens, a mention in every
third message, Inf-MLLM at cache 512 with the shipped settings), and at every eviction driven by a
mention whose fact is still in the cache, per layer and KV head, the share of the older slots that drew
more attention (per window query) than the value's best digit, and than the best token of the subject
("The code of the red locker is"). 0: the top of the cache; 0.5: the middle. Also, per part, its lift: the
attention a held token of the part drew, on average, over what an older slot drew on average (1: no
more than any). The parts: the value, the subject, and the earlier mentions' subject ("the red locker"
in each earlier "Someone walked past the red locker.", where held). With `--mention-gap N` each subject
comes up every N tokens of its fact's age instead (`--out mention_attention_gap.json`), so its earlier
mentions are still held when it comes up again. Results: benchmarks/results/mention_attention.json,
one record per seed and layer (medians over the mentions).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: recall.py, common.py

from common import machine, read_text, write_records  # noqa: E402
from recall import make_facts, paragraphs  # noqa: E402


def main() -> None:
    import torch

    from inf_mllm_ros.engine.loading import load_model
    from inf_mllm_ros.engine.policies import InfMLLMPolicy, SlotView, register
    from inf_mllm_ros.engine.stream import KVStream, StreamConfig

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--text", default=None)
    p.add_argument("--cache", type=int, default=512)
    p.add_argument("--facts", type=int, default=8)
    p.add_argument("--fact-every", type=int, default=300)
    p.add_argument("--after", type=int, default=1024, help="tokens streamed after the last fact")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mention-gap", type=int, default=0,
                   help="each fact mentioned every this many tokens of its age (0: every third message, round robin)")
    p.add_argument("--out", default="mention_attention.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    adapter = load_model(args.model, device="cpu", dtype="float32")

    @register
    @dataclass
    class Observed(InfMLLMPolicy):
        """The shipped policy, recording the attention that a watched window pays to given tokens."""

        name: ClassVar[str] = "inf_mllm_observed"
        watch: ClassVar[dict] = {}  # "value", "subject", "earlier": stream indices; set while a mention is pushed
        seen: ClassVar[list] = []  # (layer, {part: (share above its best token, lift)}) per KV head
        calls: ClassVar[list] = [0]  # every layer evicts at every eviction, in order: the call count tells the layer
        layers: ClassVar[int] = adapter.num_layers

        def select(self, view: SlotView, keep: int):
            layer = Observed.calls[0] % Observed.layers
            Observed.calls[0] += 1
            if Observed.watch:
                older = slice(self.protected(keep)[0], view.fill - view.new)
                attention = view.window_attention[:, older] / max(view.window_queries, 1)  # older than the window: all saw it
                seq = view.seq[:, older]
                for h in range(view.num_heads):
                    found = {}
                    for part, positions in Observed.watch.items():
                        held = torch.isin(seq[h], torch.tensor(positions, dtype=seq.dtype))
                        if held.any():
                            found[part] = (float((attention[h] > attention[h][held].max()).float().mean()),
                                           float(attention[h][held].mean() / attention[h].mean().clamp(min=1e-30)))
                    if "value" in found and "subject" in found:
                        Observed.seen.append((layer, found))
            return super().select(view, keep)

    records = []
    for seed in args.seeds:
        stream = KVStream(adapter, StreamConfig(capacity=args.cache, policy="inf_mllm_observed", chunk_size=64))
        Observed.seen.clear()
        Observed.calls[0] = 0
        rng = random.Random(seed)
        facts = make_facts(seed)[: args.facts]
        filler = iter(paragraphs(read_text(args.text))[seed * 300:])
        closing = len(adapter.tokenize(adapter.chat.user_suffix)) if adapter.chat.user_suffix else 0
        opening = len(adapter.tokenize(adapter.chat.user(""))) - closing  # the turn's tokens before its text
        where, last_mention, pending, message, last_told = {}, {}, list(facts), 0, 0
        echoes: dict[int, list[int]] = {}  # fact -> stream indices of the subject in its mentions so far
        told_at: dict[int, int] = {}

        def mention_due():
            """The fact whose subject comes up now, or None."""
            if not args.mention_gap:  # every third message, the subject mentioned longest ago
                return min(where, key=lambda f: last_mention.get(f, -1)) if message % 3 == 1 else None
            due = [f for f in where if stream.tokens_seen - last_mention.get(f, told_at[f]) >= args.mention_gap]
            return min(due, key=lambda f: last_mention.get(f, told_at[f])) if due else None

        lead = len(adapter.tokenize("Someone walked past"))  # the mention's tokens before its subject
        t0 = time.perf_counter()
        while pending or stream.tokens_seen < last_told + args.after:
            if pending and stream.tokens_seen >= args.fact_every * (len(facts) - len(pending) + 1):
                fact = pending.pop(0)
                words = next(filler).split()
                stream.push_text(" ".join(words[: rng.randint(0, min(40, len(words)))] + [fact["statement"]]))
                # The statement ends the message: "The code of <subject> is <value>." then the closing tokens.
                ids = adapter.tokenize(adapter.chat.user(fact["statement"])).tolist()[opening : -closing or None]
                end = stream.tokens_seen - closing
                digits = [end - (len(ids) - i) for i, t in enumerate(ids) if adapter.decode([t]).strip().isdigit()]
                subject = list(range(end - len(ids), digits[0]))  # "The code of the red locker is"
                where[fact["fact_id"]] = (digits, subject)
                told_at[fact["fact_id"]] = stream.tokens_seen
                last_told = stream.tokens_seen
            elif where and (fid := mention_due()) is not None:
                last_mention[fid] = stream.tokens_seen if args.mention_gap else message
                Observed.watch = {"value": where[fid][0], "subject": where[fid][1], "earlier": echoes.get(fid, [])}
                mention = next(f["mention"] for f in facts if f["fact_id"] == fid)
                stream.push_text(mention)
                Observed.watch = {}
                # "Someone walked past <subject>." then the closing tokens: the subject ends before the period.
                ids = adapter.tokenize(adapter.chat.user(mention)).tolist()[opening : -closing or None]
                end = stream.tokens_seen - closing
                echoes.setdefault(fid, []).extend(range(end - len(ids) + lead, end - 1))
            else:
                stream.push_text(next(filler))
            message += 1
        for layer in range(Observed.layers):
            rows = [found for seen_layer, found in Observed.seen if seen_layer == layer]
            if rows:
                medians = {}
                for part in ("value", "subject", "earlier"):
                    got = [found[part] for found in rows if part in found]
                    medians[f"{part}_share_above_median"] = round(statistics.median(a for a, _ in got), 3) if got else None
                    medians[f"{part}_lift_median"] = round(statistics.median(b for _, b in got), 2) if got else None
                records.append({
                    "policy": "inf_mllm", "cache_size": args.cache, "seed": seed, "layer": layer,
                    "mention_gap": args.mention_gap,
                    "mentions_with_fact_held": len(rows),
                    "mentions_with_earlier_held": sum("earlier" in found for found in rows),
                    **medians,
                    "tokens_streamed": stream.tokens_seen, "seconds": round(time.perf_counter() - t0, 1),
                    "model": args.model, "dtype": "float32", "device": machine(),
                })
        print(f"seed {seed}: {len(Observed.seen)} layer-head observations, {stream.tokens_seen} tokens", flush=True)
    write_records(args.out, records)
    for r in records:
        print(f"seed {r['seed']} layer {r['layer']:2d}: n={r['mentions_with_fact_held']:3d}  " + "  ".join(
            f"{part} {r[part + '_share_above_median']} (lift {r[part + '_lift_median']})"
            for part in ("value", "subject", "earlier")))


if __name__ == "__main__":
    main()
