"""A long dialogue kept in memory: facts told in some rounds, asked about many rounds later.

    python benchmarks/dialogue.py                 # cache 1024, inf_mllm, streaming_llm, h2o, full
    python benchmarks/dialogue.py --archive --policies inf_mllm   # the same with the archive
    python benchmarks/dialogue.py --plot-only

Every round is one exchange kept in memory (`ask(..., keep_in_memory=True)`), the user's message and
the model's reply, as a planner's conversation with the robot would be. A round either tells a fact
("Please remember: the code of the red locker is 4817."), asks about one told `--gaps` rounds earlier
("What is the code of the red locker? Reply with the number only."), or is small talk (a passage of a
novel the user is reading, "(Reply with OK.)"). The system prompt asks for short replies, so that every
reply kept in memory is complete.
Each fact is asked once; the gaps take turns, so every part of the dialogue has short and long ones.
At about 80 tokens a round, a cache of 1024 holds the last 13 rounds or so: a fact asked 4 rounds
later is still in the recent window, one asked 24 or more rounds later is kept only if the policy kept
it. The full cache (Qwen's 32K context holds all 300 rounds) is the ceiling. Accuracy per bucket of
rounds shows whether the memory holds up as the dialogue grows.
Results: benchmarks/results/dialogue.json (one record per question) and .png.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from common import RESULTS, add_matrix_options, load_records, machine, matrix, read_text, run_child
from recall import COLOURS, paragraphs

POLICIES = ["inf_mllm", "streaming_llm", "h2o", "full"]
GAPS = [4, 24, 60, 120]  # default of --gaps: rounds between telling a fact and asking it
OBJECTS = ["locker", "cabinet", "safe", "gate", "door"]
# Short, complete replies: a reply cut off by the token limit and kept in memory would teach the model,
# in context, to stop answers early.
SYSTEM = ("You are the memory of a mobile robot. When the user tells you something or shares a passage, "
          "reply only: OK. When the user asks for a code, reply with the code only.")


def schedule(rounds: int, tell_every: int, gaps: list[int], seed: int) -> dict[int, tuple[str, dict]]:
    """What each round that is not small talk does: round -> ("tell" | "ask", fact).

    A fact is told every `tell_every` rounds and asked `gap` rounds later, the gaps in turn; an ask that
    falls on a taken round moves to the next free one. Facts whose question would fall past the last
    round are not told."""
    rng = random.Random(seed)
    subjects = [f"the {c} {o}" for o in OBJECTS for c in COLOURS]
    rng.shuffle(subjects)
    plan: dict[int, tuple[str, dict]] = {}
    for i, subject in enumerate(subjects):
        told, gap = 1 + i * tell_every, gaps[i % len(gaps)]
        asked = told + gap
        while asked in plan or (asked - 1) % tell_every == 0:  # not on a round that tells a fact
            asked += 1
        if asked > rounds:
            continue
        value = str(rng.randint(1000, 9999))
        fact = {"fact_id": i, "subject": subject, "value": value, "gap": gap, "told": told,
                "statement": f"Please remember: the code of {subject} is {value}.",
                "question": f"What is the code of {subject}? Reply with the number only."}
        plan[told] = ("tell", fact)
        plan[asked] = ("ask", fact)
    return plan


def run_one(args) -> list[dict]:
    import torch

    from inf_mllm_ros.engine.models.loading import load_model
    from inf_mllm_ros.engine.runtime.stream import KVStream
    from inf_mllm_ros.engine.stream_config import StreamConfig

    torch.set_num_threads(args.threads)
    adapter = load_model(args.model, device="cpu", dtype="float32")
    capacity = adapter.max_context - 512 if args.policy == "full" else args.cache
    archive = {} if args.archive else {"archive_size": 0}
    stream = KVStream(adapter, StreamConfig(capacity=capacity, policy=args.policy, chunk_size=64, system_prompt=SYSTEM,
                                            **archive))
    plan = schedule(args.rounds, args.tell_every, args.gaps, args.seed)
    small_talk = iter(paragraphs(read_text(args.text), chars=200))
    told_at: dict[int, int] = {}  # fact -> tokens seen once it was told
    records = []
    t0 = time.perf_counter()
    for n in range(1, args.rounds + 1):
        kind, fact = plan.get(n, ("talk", None))
        message = {"tell": lambda: fact["statement"], "ask": lambda: fact["question"],
                   "talk": lambda: f"A passage of the novel I am reading: {next(small_talk)} (Reply with OK.)"}[kind]()
        answer = stream.ask(message, max_new_tokens=args.reply_tokens, keep_in_memory=True)
        if kind == "tell":
            told_at[fact["fact_id"]] = stream.tokens_seen
        elif kind == "ask":
            records.append({
                "policy": args.policy, "cache_size": "all" if args.policy == "full" else capacity,
                "archive": stream.archive.enabled, "round": n, "gap": fact["gap"], "rounds_back": n - fact["told"],
                "tokens_back": stream.tokens_seen - told_at[fact["fact_id"]], "fact_id": fact["fact_id"],
                "value": fact["value"], "answer": answer.text, "recalled": fact["value"] in answer.text,
            })
            print(f"  round {n}, gap {fact['gap']}: {fact['value']} -> {answer.text!r}", file=sys.stderr, flush=True)
        if n % 25 == 0:
            print(f"  {args.policy} {capacity}: round {n}, {stream.tokens_seen} tokens, "
                  f"{sum(r['recalled'] for r in records)}/{len(records)} recalled, "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - t0
    stats = stream.stats().as_dict()
    for r in records:
        r.update({"tokens_streamed": stream.tokens_seen, "seconds": round(seconds, 1), "device": machine(),
                  "dtype": "float32", "model": args.model, "seed": args.seed, "kv_bytes": stats["kv_bytes"],
                  "policy_settings": stats["policy_settings"]})
    return records


def buckets(rounds: int, size: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + size - 1, rounds)) for lo in range(1, rounds + 1, size)]


def plot(name: str = "dialogue.json", bucket: int = 60) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = load_records(name)
    if not records:
        return
    rounds = max(r["round"] for r in records)
    spans = buckets(rounds, bucket)
    gaps = sorted({r["gap"] for r in records})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    runs = sorted({(r["policy"], r.get("archive", False)) for r in records}, key=lambda k: (POLICIES.index(k[0]), k[1]))
    for policy, archive in runs:
        rows = [r for r in records if r["policy"] == policy and r.get("archive", False) == archive]
        cache = rows[0]["cache_size"]
        label = "full cache (ceiling)" if policy == "full" else f"{policy}, cache {cache}" + (", archive" if archive else "")
        # Early rounds can only ask about recent facts: short and long gaps are drawn apart.
        line = None
        for style, near in (("-", True), ("--", False)):
            xs, ys = [], []
            for lo, hi in spans:
                got = [r["recalled"] for r in rows if lo <= r["round"] <= hi and (r["gap"] == gaps[0]) == near]
                if got:
                    xs.append((lo + hi) / 2)
                    ys.append(100 * sum(got) / len(got))
            line = axes[0].plot(xs, ys, style, marker="o", label=label if near else None,
                                color=None if line is None else line[0].get_color())
        ys = [100 * sum(r["recalled"] for r in rows if r["gap"] == g) / max(1, sum(r["gap"] == g for r in rows))
              for g in gaps]
        axes[1].plot(gaps, ys, marker="o", label=label)
    axes[0].set(title=f"questions answered right, per {bucket} rounds (gap {gaps[0]}: solid, longer: dashed)",
                xlabel="round", ylabel="%", ylim=(-5, 105))
    axes[1].set(title="per gap", xlabel="rounds between telling and asking", ylabel="%", ylim=(-5, 105))
    axes[1].set_xscale("log", base=2)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / name.replace(".json", ".png"), dpi=110)


# The options of a few seconds' run on the small models (run.py --smoke).
# A smoke run: eight rounds, two facts told, each asked four rounds on, replies of four tokens.
SMOKE = ["--model", "smollm2", "--caches", "128", "--policies", "full", "inf_mllm", "--rounds", "8", "--tell-every", "3",
         "--gaps", "4", "--reply-tokens", "4"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--text", default=None)
    p.add_argument("--caches", type=int, nargs="+", default=[1024])
    p.add_argument("--policies", nargs="+", default=POLICIES)
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--tell-every", type=int, default=6, help="a fact is told every N rounds")
    p.add_argument("--gaps", type=int, nargs="+", default=GAPS, help="rounds between telling and asking")
    p.add_argument("--reply-tokens", type=int, default=8, help="longest reply (the replies asked for take 2 to 5)")
    p.add_argument("--archive", action=argparse.BooleanOptionalAction, default=False,
                   help="with the archive (the shipped archive_size) or without it (archive_size 0)")
    add_matrix_options(p, out="dialogue.json", setting="dialogue")
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args)))
        return
    if not args.plot_only:
        records = load_records(args.out) if args.resume else []
        done = {(r["policy"], str(r["cache_size"]), r.get("archive", False)) for r in records}
        for _, cache, policy in matrix(["dialogue"], args.caches, args.policies):
            if (policy, "all" if policy == "full" else str(cache), args.archive) in done:
                continue
            cmd = [sys.executable, __file__, "--one", "--policy", policy, "--cache", str(cache),
                   "--archive" if args.archive else "--no-archive",
                   "--model", args.model, "--threads", str(args.threads), "--seed", str(args.seed),
                   "--rounds", str(args.rounds), "--tell-every", str(args.tell_every),
                   "--reply-tokens", str(args.reply_tokens), "--gaps", *map(str, args.gaps)]
            cmd += ["--text", args.text] if args.text else []
            t = time.time()
            new = run_child(cmd, records, args.out)
            print(f"{policy:14s} cache={cache:5d} recalled {sum(r['recalled'] for r in new)}/{len(new)} "
                  f"({time.time() - t:.0f} s)", flush=True)
    plot(args.out)


if __name__ == "__main__":
    main()
