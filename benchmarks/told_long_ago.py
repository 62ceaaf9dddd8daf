"""Facts told more than four caches back, on the shipped settings, asked with the archive and without it.

    python benchmarks/told_long_ago.py                 # the 0.5B evaluation model, tuning seeds 0, 1 and 2, checked
    python benchmarks/told_long_ago.py --seeds 3 4     # other seeds, recorded, not checked

Each stream is drawn from a tuning seed of `inf_mllm_ros.testing.recall_facts`: six facts, of every kind in turn from
one the seed picks (codes, people's names, places, colours, counts), each at a random point of a paragraph of the
filler genre the seed picks, after a random number of paragraphs; then paragraphs with a subject named again (in the
style the seed picks) in every third message, until the newest fact is more than four caches back. Every fact is
asked with the archive's retrieval and without it. Then two of the subjects are told a new value inside a paragraph,
one paragraph follows, and both are asked with the archive, whose old values must not displace the new.

On the 0.5B model and the default seeds the run checks what the suite held it to (a slow test of `test_recall.py`
until its three streams, each more than four caches long on the 0.5B model, outgrew the suite's time; the suite runs
this benchmark's smoke run): at most 2 of 18 recalled without the archive,
at least 11 with it, at least 10 only with it, at least 16 questions that retrieve, at least 4 of 6 new values given
and not the old. Results: benchmarks/results/told_long_ago.json, a record per fact and per value told again.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from common import machine, shown, write_records

FACTS_AT_ONCE = 6
STREAM_SEEDS = (0, 1, 2)  # tuning seeds: a genre, a mention style and a first kind each
UPDATED = 2
MODEL = "qwen2.5-0.5b"
SMOKE = ["--model", "smollm2", "--seeds", "0", "--facts", "2", "--capacity", "128", "--max-new-tokens", "4",
         "--out", "told_long_ago.json"]


def told_long_ago(adapter, seed: int, *, facts_at_once: int = FACTS_AT_ONCE, capacity: int | None = None,
                  max_new_tokens: int = 16) -> tuple[list, list]:
    """One stream (see the module's docstring): (recalled with, recalled without, answer with, retrieved) per fact,
    and (new value given, old value given, answer) per subject told again."""
    from inf_mllm_ros.engine.runtime.stream import KVStream
    from inf_mllm_ros.engine.stream_config import StreamConfig
    from inf_mllm_ros.testing.recall_facts import GENRES, KINDS, MENTIONS, facts, filler, told_again

    rng = random.Random(300 + seed)
    told = facts(seed, facts_at_once, kinds=KINDS[seed % len(KINDS):] + KINDS[: seed % len(KINDS)])
    style = seed % len(MENTIONS)
    source = iter(filler(GENRES[seed % len(GENRES)], seed))
    stream = KVStream(adapter, StreamConfig() if capacity is None else StreamConfig(capacity=capacity))

    def inside_a_paragraph(message: str) -> None:
        words = next(source).split()
        stream.push_text(" ".join(words[: rng.randint(0, len(words))] + [message]))

    for fact in told:
        for _ in range(rng.randint(1, 6)):
            stream.push_text(next(source))
        inside_a_paragraph(fact.message)
    told_at, message = stream.tokens_seen, 0
    while stream.tokens_seen - told_at < 4 * stream.config.capacity + 100:
        message += 1
        stream.push_text(told[message // 3 % facts_at_once].mentions[style] if message % 3 == 0 else next(source))
    results = []
    for fact in told:
        with_archive = stream.ask(fact.question, max_new_tokens=max_new_tokens)
        budget = stream.reconfigure(retrieve_tokens=0)
        without = stream.ask(fact.question, max_new_tokens=max_new_tokens)
        stream.reconfigure(**budget)
        assert without.retrieved_tokens == 0
        results.append((fact.recalled(with_archive.text), fact.recalled(without.text), with_archive.text,
                        with_archive.retrieved_tokens > 0))
    updated = [(fact, told_again(fact, seed)) for fact in told[:UPDATED]]
    for _, again in updated:
        inside_a_paragraph(again.message)
    stream.push_text(next(source))
    answers = [stream.ask(fact.question, max_new_tokens=max_new_tokens).text for fact, _ in updated]
    return results, [(again.recalled(answer), old.recalled(answer), answer)
                     for (old, again), answer in zip(updated, answers)]


def check(results: list, updated: list) -> None:
    """What the suite held the default run to (measured: 14 of 18 with the archive, 0 without, 18 of 18 retrieved,
    5 of 6 new values)."""
    # The bounded cache alone loses them. With the archive, six facts of every kind, siblings of one form among
    # them, are told apart (the retrieval heads; the messages that name the question nearest it): measured 14 of
    # 18 with it (the misses: a sibling's code, a colour and two names given wrong or made up), 0 without.
    assert sum(without for _, without, _, _ in results) <= 2, results
    assert sum(with_ for with_, _, _, _ in results) >= 11, results
    assert sum(with_ and not without for with_, without, _, _ in results) >= 10, results
    # The facts are long gone from the cache: every question retrieves (measured: 18 of 18).
    assert sum(retrieved for *_, retrieved in results) >= 16, results
    # A value told again just now is held by the cache, its old one archived and retrieved: the new one, copied
    # after the old, is nearest the question and given (measured: 5 of 6; with the rule that retrieved nothing
    # where the cache held a block scoring as high, 3 of 4 on the codes-only streams before).
    assert sum(new and not old for new, old, _ in updated) >= 4, updated


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--seeds", type=int, nargs="+", default=list(STREAM_SEEDS))
    p.add_argument("--facts", type=int, default=FACTS_AT_ONCE, help="facts per stream (at least 2)")
    p.add_argument("--capacity", type=int, default=None, help="cache size (default: the shipped one)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default="told_long_ago.json")
    args = p.parse_args(argv)
    if args.facts < UPDATED:
        raise SystemExit(f"--facts must be at least {UPDATED}")
    import torch

    from inf_mllm_ros.engine.models.loading import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    adapter = load_model(args.model, device="cpu", dtype="float32")
    shipped = (args.model == MODEL and sorted(args.seeds) == list(STREAM_SEEDS) and args.facts == FACTS_AT_ONCE
               and args.capacity is None and args.max_new_tokens == 16)
    start = time.monotonic()
    results, updated, records = [], [], []
    for seed in args.seeds:
        told, new = told_long_ago(adapter, seed, facts_at_once=args.facts, capacity=args.capacity,
                                  max_new_tokens=args.max_new_tokens)
        results += told
        updated += new
        records += [{"kind": "fact", "seed": seed, "with_archive": w, "without": wo, "answer": a, "retrieved": r}
                    for w, wo, a, r in told]
        records += [{"kind": "told_again", "seed": seed, "new": n, "old": o, "answer": a} for n, o, a in new]
        print(f"seed {seed}: {sum(r[0] for r in told)}/{len(told)} with the archive, {sum(r[1] for r in told)} "
              f"without; new values {sum(n and not o for n, o, _ in new)}/{len(new)}", flush=True)
    records.append({"kind": "summary", "model": args.model, "seeds": args.seeds, "facts": args.facts,
                    "capacity": args.capacity, "device": machine(), "seconds": round(time.monotonic() - start, 1)})
    path = write_records(args.out, records)
    print(f"wrote {shown(path)}")
    if shipped:
        check(results, updated)
        print("checked: as the suite held it", flush=True)
    else:
        print(json.dumps({"with": sum(r[0] for r in results), "without": sum(r[1] for r in results),
                          "of": len(results)}), file=sys.stderr)


if __name__ == "__main__":
    main()
