"""Recall of planted facts at distances of 1K to 8K tokens, per policy and cache size.

    python -m inf_mllm_ros.engine.models.loading --prepare-qwen    # once: the 0.5B evaluation model
    python benchmarks/recall.py                              # caches 512 and 1024, mentioned and forgotten
    python benchmarks/recall.py --settings pinned --policies full inf_mllm
    python benchmarks/recall.py --plot-only

Facts ("The code of the red locker is 4817.") are planted along one stream of text messages
(paragraphs of a novel, pushed as a robot's messages would be), one every `--fact-every` tokens, each
after a random number of the paragraph's words so that facts sit at varied offsets in the stream and
in its chunks; with `--fact-alone`, each fact is a message of its own, as a robot is told one (the
paragraphs before it still vary its offset). Every fact is asked about ("What is the code of the red
locker?") as the stream moves each of `--distances` tokens past it: one stream per policy, cache and
setting. The settings:
- `forgotten`: the fact is never referred to again. No eviction by attention can be expected to keep
  it; reported anyway.
- `mentioned`: its subject comes up again now and then without its value ("Someone walked past the
  red locker."), which is what attention saddles are for: on each fact's own schedule, when the fact
  is `--first-mention` tokens old and then twice, four times, ... as old (192, 384, 768, ... tokens,
  each 20 % either way at random), so every fact is mentioned about three quarters of the way to each
  question, however many facts are alive. With `--mention-gap N`, every N tokens of the fact's age
  instead (how often a subject must come up for a policy to keep its fact).
- `pinned`: as `forgotten`, but each fact's message is pinned (`push_text(..., pin=True)`): what a
  caller can do for what must stay. Policies other than inf_mllm ignore pins.
The full cache is the ceiling. Questions are not kept in memory, so they do not disturb the stream.
Results: benchmarks/results/recall.json, one record per fact and distance.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from common import (RESULTS, add_matrix_options, load_records, machine, matrix, policy_names, read_text, run_child,
                    synchronize)

DISTANCES = [1024, 2048, 4096, 8192]  # default of --distances
COLOURS = ["red", "blue", "green", "yellow", "white", "black", "orange", "purple", "grey", "brown"]
OBJECTS = ["locker", "cabinet"]
COLOURS_BY_POLICY = {"full": "tab:blue", "window": "tab:grey", "streaming_llm": "tab:green", "h2o": "tab:red",
                     "inf_mllm": "tab:orange"}


def make_facts(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    subjects = [f"the {c} {o}" for o in OBJECTS for c in COLOURS]
    rng.shuffle(subjects)
    return [{
        "fact_id": i,
        "subject": subject,
        "value": (code := str(rng.randint(1000, 9999))),
        "statement": f"The code of {subject} is {code}.",
        "mention": f"Someone walked past {subject}.",
        "question": f"What is the code of {subject}?",
    } for i, subject in enumerate(subjects)]


def paragraphs(text: str, chars: int = 260) -> list[str]:
    """The novel cut into messages of about 60 tokens, on sentence ends where possible."""
    words, out, cur = text.split(), [], []
    for w in words:
        cur.append(w)
        if sum(len(x) + 1 for x in cur) >= chars and w[-1:] in ".!?;" or sum(len(x) + 1 for x in cur) >= 2 * chars:
            out.append(" ".join(cur))
            cur = []
    return out


def value_positions(adapter, message: str, told: int, value: str) -> list[int]:
    """Stream indices of the tokens that spell `value`, its last occurrence in a message whose turn ended at
    `told` tokens."""
    suffix = adapter.chat.user_suffix
    closing = len(adapter.tokenize(suffix)) if suffix else 0
    turn = adapter.tokenize(adapter.chat.user(message)).tolist()
    body = turn[: len(turn) - closing]
    first = next((i for i in range(len(body) - 1, -1, -1) if value in adapter.decode(body[i:])), None)
    if first is None:
        return []
    last = next(j for j in range(first + 1, len(body) + 1) if value in adapter.decode(body[first:j]))
    return [told - closing - (len(body) - i) for i in range(first, last)]


def value_kept(stream, positions: list[int]) -> float:
    """Share of the cache's layer-heads that hold every token of the value: a smoother figure than the
    answer, which also depends on how well the model reads what is kept."""
    import torch

    if not positions:
        return 0.0
    shares = [torch.stack([(stream.cache.cached_seq(i) == p).any(-1) for p in positions]).all(0).float().mean()
              for i in range(len(stream.cache.layers))]
    return round(float(torch.stack(shares).mean()), 4)


def run_one(args) -> list[dict]:
    from inf_mllm_ros.engine.models.loading import load_model
    from inf_mllm_ros.engine.runtime.stream import KVStream
    from inf_mllm_ros.engine.stream_config import StreamConfig

    import torch

    torch.set_num_threads(args.threads)
    adapter = load_model(args.model, device=args.device, dtype=args.dtype)
    rng = random.Random(args.seed)
    jitter = random.Random(args.seed + 1)  # mentions' own: the facts sit where they did before mentions had schedules
    facts = make_facts(args.seed)[: args.facts]
    distances = args.distances
    filler = iter(paragraphs(read_text(args.text)))
    capacity = args.cache
    limit = None
    if args.policy == "full":
        limit = adapter.max_context - 512
        capacity = limit
    knobs = {**getattr(args, "policy_settings", {}),
             **{k: v for k, v in (("attention_bias", args.bias), ("score_pool", args.pool)) if v is not None}}
    stream = KVStream(adapter, StreamConfig(capacity=capacity, policy=args.policy, chunk_size=64, policy_settings=knobs))
    planted: dict[int, int] = {}  # fact -> tokens seen when it was stated
    mention_at: dict[int, list[int]] = {}  # fact -> stream positions of its mentions still to come
    mentioned: dict[int, int] = {}  # fact -> mentions so far
    where: dict[int, list[int]] = {}  # fact -> stream indices of its value's tokens
    pending = list(facts)
    records, asked = [], set()
    push_s = 0.0  # seconds spent taking in the stream, questions apart

    def push(text: str, pin: bool = False) -> None:
        nonlocal push_s
        t = time.perf_counter()
        stream.push_text(text, pin=pin)
        synchronize()
        push_s += time.perf_counter() - t

    t0 = time.perf_counter()
    while len(asked) < len(facts) * len(distances):
        if pending and stream.tokens_seen >= args.fact_every * (len(facts) - len(pending) + 1):
            # Plant the next fact after a random part of a paragraph, or alone.
            fact = pending.pop(0)
            words = next(filler).split()
            cut = rng.randint(0, min(40, len(words)))  # drawn either way: the same facts and schedules
            told = fact["statement"] if args.fact_alone else " ".join(words[:cut] + [fact["statement"]])
            push(told, pin=args.setting == "pinned")
            fid = fact["fact_id"]
            planted[fid] = stream.tokens_seen
            where[fid] = value_positions(adapter, told, stream.tokens_seen, fact["value"])
            mentioned[fid] = 0
            if args.mention_gap:
                ages = list(range(args.mention_gap, max(distances), args.mention_gap))
            else:
                ages = [args.first_mention * 2**k for k in range(16) if args.first_mention * 2**k < max(distances)]
            # Each fact on its own schedule (not round robin, where after its first mention a fact waits
            # its turn behind every live one: with twenty alive, one mention in 2,000-3,000 tokens).
            mention_at[fid] = sorted(planted[fid] + round(age * jitter.uniform(0.8, 1.2)) for age in ages)
        else:
            due = [f for f in facts if mention_at.get(f["fact_id"]) and stream.tokens_seen >= mention_at[f["fact_id"]][0]]
            if args.setting == "mentioned" and due:
                fact = min(due, key=lambda f: mention_at[f["fact_id"]][0])  # the longest overdue first
                mention_at[fact["fact_id"]].pop(0)
                mentioned[fact["fact_id"]] += 1
                push(fact["mention"])
            else:
                push(next(filler))
        for fact in facts:
            fid = fact["fact_id"]
            for distance in distances:
                if fid in planted and (fid, distance) not in asked and stream.tokens_seen - planted[fid] >= distance:
                    asked.add((fid, distance))
                    kept = value_kept(stream, where[fid])
                    answer = stream.ask(fact["question"], max_new_tokens=12)
                    records.append({
                        "policy": args.policy,
                        "cache_size": capacity if args.policy != "full" else "all",
                        "setting": args.setting,
                        "fact_id": fid,
                        "distance": distance,
                        "actual_distance": stream.tokens_seen - planted[fid],
                        "mentions_before": mentioned[fid] if args.setting == "mentioned" else 0,
                        "fact_alone": args.fact_alone,
                        "value": fact["value"],
                        "answer": answer.text,
                        "recalled": fact["value"] in answer.text,
                        "value_kept_in_layer_heads": kept,
                        **({"policy_settings": stream.policy.describe()} if args.policy == "inf_mllm" else {}),
                    })
        if limit is not None and stream.cache.fill > limit - 600:
            break  # the full cache is out of context: the remaining facts cannot be asked
    seconds = time.perf_counter() - t0
    for r in records:
        r.update({"tokens_streamed": stream.tokens_seen, "seconds": round(seconds, 1),
                  "ms_per_token": round(1000 * push_s / stream.tokens_seen, 3), "device": machine(),
                  "dtype": args.dtype, "model": args.model, "seed": args.seed, "facts": len(facts),
                  **({"mention_gap": args.mention_gap, "first_mention": args.first_mention}
                     if args.setting == "mentioned" else {})})
    return records


def plot(name: str = "recall.json") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = load_records(name)
    if not records:
        return
    settings = [s for s in ("forgotten", "mentioned", "pinned") if any(r["setting"] == s for r in records)]
    caches = sorted({r["cache_size"] for r in records if r["cache_size"] != "all"})
    fig, axes = plt.subplots(len(settings), len(caches), figsize=(5 * len(caches), 3.5 * len(settings)), sharey=True,
                             squeeze=False)
    for i, setting in enumerate(settings):
        for j, cache in enumerate(caches):
            ax = axes[i][j]
            for policy, colour in COLOURS_BY_POLICY.items():
                # Pins change nothing for the full cache: its ceiling is the forgotten setting's.
                same = ("forgotten", "pinned") if policy == "full" and setting == "pinned" else (setting,)
                rs = [r for r in records if r["setting"] in same and r["policy"] == policy
                      and (r["cache_size"] == cache or policy == "full")]
                if not rs:
                    continue
                xs = sorted({r["distance"] for r in rs})
                ys = [sum(r["recalled"] for r in rs if r["distance"] == x) / sum(1 for r in rs if r["distance"] == x)
                      for x in xs]
                ax.plot(xs, ys, marker="o", color=colour, label=policy if policy != "full" else "full cache (ceiling)")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{setting}, cache {cache}")
            ax.set_xlabel("distance (tokens)")
            ax.grid(alpha=0.3)
        axes[i][0].set_ylabel("recall")
    handles = {h.get_label(): h for ax in axes.flat for h in ax.get_lines()}  # one legend for every panel
    axes[0][-1].legend(handles.values(), handles.keys(), fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / name.replace(".json", ".png"), dpi=110)


# The options of a few seconds' run on the small models (run.py --smoke).
# A smoke run: one fact, mentioned once (at 64 tokens of age), asked 160 tokens on, full cache and inf_mllm.
SMOKE = ["--model", "smollm2", "--caches", "128", "--facts", "1", "--fact-every", "64", "--first-mention", "64",
         "--distances", "160", "--policies", "full", "inf_mllm", "--settings", "mentioned"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", default=None)
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--caches", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--facts", type=int, default=20)
    p.add_argument("--fact-every", type=int, default=400, help="tokens between planted facts")
    p.add_argument("--fact-alone", action="store_true",
                   help="each fact is a message of its own (as a robot is told one), not the end of a paragraph")
    p.add_argument("--distances", type=int, nargs="+", default=DISTANCES)
    # window is streaming_llm without its sinks: not worth a 0.5B stream by default.
    p.add_argument("--policies", nargs="+", default=[n for n in policy_names() if n != "window"],
                   choices=policy_names())
    p.add_argument("--settings", nargs="+", default=["mentioned", "forgotten"],
                   choices=["mentioned", "forgotten", "pinned"])
    p.add_argument("--bias", type=float, default=None, help="inf_mllm attention_bias (default: shipped)")
    p.add_argument("--pool", type=int, default=None, help="inf_mllm score_pool (default: shipped)")
    p.add_argument("--first-mention", type=int, default=192,
                   help="mentioned: a fact's age in tokens at its first mention; each later one at twice the age")
    p.add_argument("--mention-gap", type=int, default=0,
                   help="mentioned: instead, a mention every this many tokens of the fact's age (0: the doubling ages)")
    add_matrix_options(p, out="recall.json", setting="mentioned")
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args)))
        return
    if not args.plot_only:
        records = load_records(args.out) if args.resume else []
        done = {(r["policy"], str(r["cache_size"]), r["setting"]) for r in records}
        for setting, cache, policy in matrix(args.settings, args.caches, args.policies):
            if (policy, "all" if policy == "full" else str(cache), setting) in done:
                continue
            cmd = [sys.executable, __file__, "--one", "--policy", policy, "--cache", str(cache),
                   "--setting", setting, "--model", args.model, "--threads", str(args.threads),
                   "--device", args.device, "--dtype", args.dtype, "--seed", str(args.seed),
                   "--first-mention", str(args.first_mention), "--mention-gap", str(args.mention_gap), "--facts", str(args.facts),
                   "--fact-every", str(args.fact_every), "--distances", *map(str, args.distances)]
            cmd += ["--fact-alone"] if args.fact_alone else []
            cmd += ["--text", args.text] if args.text else []
            for flag, value in (("--bias", args.bias), ("--pool", args.pool)):
                cmd += [flag, str(value)] if value is not None else []
            t = time.time()
            new = run_child(cmd, records, args.out)
            hit = sum(r["recalled"] for r in new)
            print(f"{setting:9s} {policy:14s} cache={cache:5d} recalled {hit}/{len(new)} "
                  f"({time.time() - t:.0f} s)", flush=True)
    plot(args.out)


if __name__ == "__main__":
    main()
