"""Facts given as text, then a camera flood, then the questions: the robot's case, where frames push
text out of memory.

    python benchmarks/camera_flood.py                 # caches 512 and 1024, inf_mllm, streaming_llm, h2o, full
    python benchmarks/camera_flood.py --plot-only

The model is the embedded default (`onevision-qwen2.5-0.5b`: LLaVA-OneVision's shape with the real
Qwen2.5-0.5B language weights and an untrained vision part whose frames carry no content), so the
frames cost what frames cost and the answers can only come from the texts. A stream starts with
`--facts` codes ("The code of the red locker is 4817."), each in its own message, then takes
synthetic 640x480 camera frames at 1 frame/s of stream time. Every `--ask-every` frames every fact
is asked about (the question is not kept in memory), with the archive's retrieval and without it (the
same stream: an answer not kept leaves the memory as it was; the full cache is asked once). In the `mentioned` setting, one text message
every `--mention-every` frames names a subject without its value ("Someone walked past the red
locker."), as a robot's narration would; in `forgotten` nothing refers to the facts again.
One stream per policy, cache and setting; the full cache is the ceiling. Results:
benchmarks/results/camera_flood.json (one record per fact and question time, with how many slots per
layer-head hold the facts' and the mentions' tokens then) and .png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from common import RESULTS, add_matrix_options, load_records, machine, matrix, run_child
from recall import make_facts

POLICIES = ["inf_mllm", "streaming_llm", "h2o", "full"]


def frames(seed: int):
    """Endless 640x480 camera frames: noise over a drifting gradient, as different as real ones."""
    rng = np.random.default_rng(seed)
    base = np.linspace(0, 255, 640, dtype=np.float32)[None, :, None].repeat(480, 0).repeat(3, 2)
    i = 0
    while True:
        noise = rng.integers(0, 40, (480, 640, 3))
        yield np.clip(np.roll(base, 7 * i, axis=1) + noise, 0, 255).astype(np.uint8)
        i += 1


def slots_held(stream, ranges: list[tuple[int, int]]) -> float:
    """Slots per layer-head (mean) holding a token from one of the stream index ranges [start, end)."""
    import torch

    counts = []
    for i in range(len(stream.cache.layers)):
        seq = stream.cache.cached_seq(i)
        inside = torch.zeros_like(seq, dtype=torch.bool)
        for start, end in ranges:
            inside |= (seq >= start) & (seq < end)
        counts.append(inside.sum(-1).float().mean())
    return round(float(torch.stack(counts).mean()), 1)


def run_one(args) -> list[dict]:
    import torch

    from inf_mllm_ros.engine.models.loading import load_model
    from inf_mllm_ros.engine.runtime.stream import KVStream
    from inf_mllm_ros.engine.stream_config import StreamConfig

    torch.set_num_threads(args.threads)
    adapter = load_model(args.model, device="cpu", dtype="float32")
    facts = make_facts(args.seed)[: args.facts]
    capacity = adapter.max_context - 512 if args.policy == "full" else args.cache
    settings = {"text_share": args.text_share} if args.policy == "inf_mllm" and args.text_share is not None else {}
    stream = KVStream(adapter, StreamConfig(capacity=capacity, policy=args.policy, chunk_size=128,
                                            policy_settings=settings))
    budget = stream.config.retrieve_tokens
    spans = {"fact": [], "mention": []}  # stream index ranges of the facts' and the mentions' messages

    def tell(kind: str, text: str, stamp: float) -> None:
        start = stream.tokens_seen
        stream.push_text(text, stamp=stamp)
        spans[kind].append((start, stream.tokens_seen))

    t = 0.0
    for fact in facts:
        tell("fact", fact["statement"], t)
        t += 1.0
    after_facts = stream.tokens_seen
    camera = frames(args.seed)
    records, mentioned = [], 0
    t0 = time.perf_counter()
    for n in range(1, args.frames + 1):
        stream.push_frame(next(camera), stamp=t)
        t += 1.0
        if args.setting == "mentioned" and n % args.mention_every == 0:
            tell("mention", facts[mentioned % len(facts)]["mention"], t)
            mentioned += 1
        if n % args.ask_every == 0:
            held = {f"{kind}_slots_held": slots_held(stream, ranges) for kind, ranges in spans.items()}
            for archive in (True, False) if args.policy != "full" else (False,):
                stream.reconfigure(retrieve_tokens=budget if archive else 0)
                for fact in facts:
                    answer = stream.ask(fact["question"], max_new_tokens=12)
                    records.append({
                        "policy": args.policy, "cache_size": "all" if args.policy == "full" else capacity,
                        "setting": args.setting, "archive": archive, "fact_id": fact["fact_id"], "frames_after": n,
                        "tokens_after": stream.tokens_seen - after_facts, "value": fact["value"],
                        "answer": answer.text, "recalled": fact["value"] in answer.text,
                        "retrieved_tokens": answer.retrieved_tokens,
                        "text_share": stream.policy.describe().get("text_share"), **held,
                    })
                print(f"  {args.policy} {capacity} {args.setting} archive {archive}: {n} frames, "
                      f"{sum(r['recalled'] for r in records[-len(facts):])}/{len(facts)}", file=sys.stderr, flush=True)
            stream.reconfigure(retrieve_tokens=budget)
    seconds = time.perf_counter() - t0
    for r in records:
        r.update({"tokens_streamed": stream.tokens_seen, "seconds": round(seconds, 1), "device": machine(),
                  "dtype": "float32", "model": args.model, "seed": args.seed,
                  "kv_bytes": stream.stats().as_dict().get("kv_bytes")})
    return records


def plot(name: str = "camera_flood.json") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = load_records(name)
    settings = sorted({r["setting"] for r in records})
    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        def key(r):
            return r["policy"], str(r["cache_size"]), r.get("text_share"), r.get("archive", False)

        for k in sorted({key(r) for r in records if r["setting"] == setting}, key=str):
            rows = [r for r in records if r["setting"] == setting and key(r) == k]
            xs = sorted({r["frames_after"] for r in rows})
            ys = [100 * np.mean([r["recalled"] for r in rows if r["frames_after"] == x]) for x in xs]
            share = "" if k[2] is None else f", text_share {k[2]:g}"
            ax.plot(xs, ys, "-" if k[3] or k[0] == "full" else "--", marker="o",
                    label=f"{k[0]}, cache {k[1]}{share}" + (", archive" if k[3] else ""))
        ax.set(title=f"facts, then frames ({setting})", xlabel="frames since the facts (1 frame/s)",
               ylabel="facts recalled (%)", ylim=(-5, 105))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / name.replace(".json", ".png"), dpi=110)


# The options of a few seconds' run on the small models (run.py --smoke).
SMOKE = ["--model", "smolvlm-smollm2", "--caches", "256", "--policies", "inf_mllm", "--settings", "mentioned", "--facts", "2", "--frames", "4", "--ask-every", "2"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="onevision-qwen2.5-0.5b")
    p.add_argument("--caches", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--policies", nargs="+", default=POLICIES)
    p.add_argument("--settings", nargs="+", default=["mentioned", "forgotten"])
    p.add_argument("--facts", type=int, default=8)
    p.add_argument("--frames", type=int, default=60, help="frames after the facts (1 frame/s of stream time)")
    p.add_argument("--ask-every", type=int, default=15, help="ask every fact after this many frames")
    p.add_argument("--mention-every", type=int, default=5, help="mentioned: a subject named every N frames")
    p.add_argument("--text-share", type=float, default=None, help="inf_mllm text_share (default: shipped)")
    add_matrix_options(p, out="camera_flood.json", setting="mentioned")
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args)))
        return
    if not args.plot_only:
        records = load_records(args.out) if args.resume else []
        from inf_mllm_ros.engine.memory.policies import policy_defaults

        # Streams measured before the archive (records without "archive") are measured again with it.
        done = {(r["policy"], str(r["cache_size"]), r["setting"], r.get("text_share")) for r in records
                if "archive" in r or r["policy"] == "full"}
        shipped_share = policy_defaults("inf_mllm")["text_share"]
        for setting, cache, policy in matrix(args.settings, args.caches, args.policies):
            share = (shipped_share if args.text_share is None else args.text_share) if policy == "inf_mllm" else None
            key = (policy, "all" if policy == "full" else str(cache), setting, share)
            if key in done:
                continue
            records[:] = [r for r in records  # the same stream measured before the archive, replaced
                          if (r["policy"], str(r["cache_size"]), r["setting"], r.get("text_share")) != key]
            cmd = [sys.executable, __file__, "--one", "--policy", policy, "--cache", str(cache),
                   "--setting", setting, "--model", args.model, "--threads", str(args.threads),
                   "--seed", str(args.seed), "--facts", str(args.facts), "--frames", str(args.frames),
                   "--ask-every", str(args.ask_every), "--mention-every", str(args.mention_every)]
            cmd += ["--text-share", str(args.text_share)] if args.text_share is not None else []
            t = time.time()
            new = run_child(cmd, records, args.out)
            last = max(r["frames_after"] for r in new)
            hit = [r["recalled"] for r in new if r["frames_after"] == last]
            print(f"{setting:9s} {policy:14s} cache={cache:5d} recalled {sum(hit)}/{len(hit)} after "
                  f"{last} frames, {sum(r['recalled'] for r in new)}/{len(new)} in all "
                  f"({time.time() - t:.0f} s)", flush=True)
    plot(args.out)


if __name__ == "__main__":
    main()
