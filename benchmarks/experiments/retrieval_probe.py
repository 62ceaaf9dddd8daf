"""Which scoring and placement of the archive tell apart facts of the same form told close together? A diagnostic.

    python benchmarks/experiments/retrieval_probe.py [--set tuning] [--trials 1] [--threads 2]

Twelve facts told in a row (1 to 3 narration paragraphs before each), then narration with each subject
named again in turn in every third message, as `archive_recall.py recall --facts-at-once 12`; Qwen2.5-0.5B,
float32, cache 512. At 2K, 4K and 8K tokens after the last fact, every fact is asked once per placement:
the rank of the fact's own block among the candidates, how many other facts' blocks were placed with it,
and whether the answer holds the value. The scoring is the engine's (engine/retrieval_index.py); the
placements of what it chose:
- `best_last`: the best block nearest the question, after the cache's positions (the placement before);
- `stream_order`: in stream order (the placement before);
- `cap64`, `cap128`: the budget cut to 64 or 128 tokens (fewer facts of the same form beside the right one),
  in stream order; `cap128_best_last`: cut, best last;
- `cache_answers_skip`: as the engine does now: best last, and nothing placed where a block the cache holds
  scores about as high as the best archived one (rows with `probe` 3). Rows with the placements
  `before_cache` (probe 2) and `cache_answers` (probe 3) were measured with a placement no longer in
  the engine: the blocks at positions before the cache's own, always or where the cache held an answer as
  good.
After the questions at each distance, three of the subjects are told a new value, and asked after one more
paragraph (`kind` "updated"; the old value is in the archive, the new one in the cache); later questions
about them (`kind` "updated_before") expect the new value.
Results: benchmarks/results/retrieval_probe.json (rows written after every distance; resumable by trial).
Rows whose `scoring` is `middle_layers` were measured with the scoring before the retrieval heads (every
head of the middle half of the layers), `maxsim_middle_layers` and `maxsim_noref_middle_layers` with each
question token's best logit summed over the question instead of the best over it (worse: recall 2 and 1
of 12 at 2K where the largest over the question gave 5).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from inf_mllm_ros.engine import answering
from inf_mllm_ros.engine.retrieval_index import RetrievalIndex
from inf_mllm_ros.engine.answering import best_last as placed_best_last

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

from archive_recall import FACTS, fact_set, paragraphs  # noqa: E402
from common import RESULTS  # noqa: E402

OUT = RESULTS / "retrieval_probe.json"


LAST: dict = {}
# Rows of earlier scorings stay in the file under their name: "middle_layers" (every head of the middle half
# of the layers) before the retrieval heads.
SCORING = "retrieval_heads"
# Rows with "probe" 2 or 3 are of the probe with the updated facts (3: ranks among the blocks the cache holds
# too); those without it were measured before it.
PROBE = 3
# name: (budget cap, best last, whether nothing is placed where the cache holds an answer as good as the
# archive's, as the engine does: engine/answering.py; without it the margin is -inf, so it never does)
SHIPPED_MARGIN = answering.CACHE_ANSWERS_MARGIN
PLACEMENTS = {"best_last": (None, True, False), "stream_order": (None, False, False), "cap64": (64, False, False),
              "cap128": (128, False, False), "cap128_best_last": (128, True, False),
              "cache_answers_skip": (None, True, True)}


def patch_placement(answering_class, name: str) -> None:
    """The stream's retrieval with the budget cut and/or the chosen blocks placed best last, and/or nothing
    placed where the cache holds an answer as good."""
    cap, best_last, skip = PLACEMENTS[name]
    answering.CACHE_ANSWERS_MARGIN = SHIPPED_MARGIN if skip else float("-inf")

    def retrieve(self, ids, content, budget):
        chosen = self._choose_blocks(ids, content, min(budget, cap) if cap else budget)
        if chosen:
            self._place_blocks(placed_best_last(chosen) if best_last else sorted(chosen, key=lambda b: b.first_seq))

    answering_class._retrieve = retrieve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", choices=("tuning", "report"), default="tuning")
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--first-trial", type=int, default=0)
    ap.add_argument("--placements", nargs="+", default=["best_last", "cache_answers_skip"])
    ap.add_argument("--distances", nargs="+", type=int, default=[2000, 4000, 8000])
    ap.add_argument("--cache", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from inf_mllm_ros.engine.loading import load_model
    from inf_mllm_ros.engine.answering import Answering
    from inf_mllm_ros.engine.stream import KVStream, StreamConfig

    def scored(index, question, blocks):
        scores = shipped_scores(index, question, blocks)
        LAST["order"] = [blocks[i] for i in torch.argsort(scores, descending=True, stable=True).tolist()]
        return scores

    shipped_scores = RetrievalIndex.scores
    RetrievalIndex.scores = scored
    rows = json.loads(OUT.read_text()) if OUT.exists() else []
    adapter = load_model("qwen2.5-0.5b", device="cpu", dtype="float32")
    paras = paragraphs(args.set)
    for trial in range(args.first_trial, args.first_trial + args.trials):
        if all(any(r["trial"] == trial and r["set"] == args.set and r["placement"] == v and r["scoring"] == SCORING
                   and r.get("probe") == PROBE for r in rows)
               for v in args.placements):
            continue
        rng = random.Random(f"{args.set}-{trial}-12")  # the streams of archive_recall.py
        facts = fact_set(FACTS[args.set], rng, 12)
        stream = KVStream(adapter, StreamConfig(capacity=args.cache, policy="inf_mllm", chunk_size=128))
        source = iter(paras[rng.randint(0, len(paras) - 400):])
        for fact in facts:
            for _ in range(rng.randint(1, 3)):
                stream.push_text(next(source))
            before = stream.tokens_seen
            stream.push_text(fact["message"])
            fact["seq"] = (before, stream.tokens_seen)
        told, k = stream.tokens_seen, 0
        for distance in args.distances:
            start = time.monotonic()
            while stream.tokens_seen - told < distance:
                k += 1
                if k % 3 == 0:
                    stream.push_text(facts[(k // 3) % len(facts)]["mention"])
                else:
                    stream.push_text(next(source))
            fact_blocks = {f["subject"]: {b.index for b in stream.archive.blocks
                                          if b.first_seq < f["seq"][1] and b.seq_end > f["seq"][0]} for f in facts}
            for name in args.placements:
                patch_placement(Answering, name)
                for fact in facts:
                    LAST.clear()
                    answer = stream.ask(fact["question"], max_new_tokens=24)
                    own = fact_blocks[fact["subject"]]
                    order = [b.index for b in LAST.get("order", [])]
                    rank = min((order.index(i) + 1 for i in own if i in order), default=None)
                    chosen = {b.index for b in stream._retrieved}
                    others = sum(bool(chosen & fact_blocks[f["subject"]]) for f in facts if f is not fact)
                    rows.append({"set": args.set, "scoring": SCORING, "probe": PROBE, "trial": trial, "distance": distance, "placement": name,
                                 "subject": fact["subject"], "kind": "updated_before" if fact.get("updated") else "old",
                                 "rank_of_fact_block": rank,
                                 "candidates": len(order), "own_placed": bool(chosen & own),
                                 "other_facts_placed": others, "recalled": fact["value"] in answer.text,
                                 "answer": answer.text})
                got = [r for r in rows if r["trial"] == trial and r["distance"] == distance and r["placement"] == name
                       and r.get("probe") == PROBE and r["kind"] != "updated"]
                print(f"trial {trial} {distance} {name}: recalled {sum(r['recalled'] for r in got)}/12, own placed "
                      f"{sum(r['own_placed'] for r in got)}/12, ranks {[r['rank_of_fact_block'] for r in got]}, "
                      f"others placed {[r['other_facts_placed'] for r in got]}", flush=True)
            # Recent facts, which the cache still holds while older ones of the same form are retrieved: three
            # subjects told a new value (the old one is in the archive), then one paragraph, then asked.
            updated = facts[3 * (args.distances.index(distance)) : 3 * (args.distances.index(distance) + 1)]
            for fact in updated:
                new_value = str(rng.randint(1000, 9999)) if FACTS[args.set] == "A" else f"new{rng.randint(10, 99)}"
                stream.push_text(fact["message"].replace(fact["value"], new_value))
                fact["value"], fact["updated"] = new_value, True
            stream.push_text(next(source))
            for name in args.placements:
                patch_placement(Answering, name)
                for fact in updated:
                    answer = stream.ask(fact["question"], max_new_tokens=24)
                    rows.append({"set": args.set, "scoring": SCORING, "probe": PROBE, "trial": trial, "distance": distance,
                                 "placement": name, "subject": fact["subject"], "kind": "updated",
                                 "recalled": fact["value"] in answer.text, "answer": answer.text,
                                 "retrieved_tokens": answer.retrieved_tokens})
                got = [r for r in rows if r["trial"] == trial and r["distance"] == distance and r["placement"] == name
                       and r.get("probe") == PROBE and r["kind"] == "updated"]
                print(f"trial {trial} {distance} {name}: updated just now, recalled "
                      f"{sum(r['recalled'] for r in got)}/{len(got)}", flush=True)
            print(f"  ({time.monotonic() - start:.0f} s)", flush=True)
            OUT.write_text(json.dumps(rows, indent=0) + "\n")


if __name__ == "__main__":
    main()
