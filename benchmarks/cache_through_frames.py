"""Facts told as text, then camera frames well past the cache, asked from the bounded cache alone (no archive).

    python benchmarks/cache_through_frames.py                # the default model, seeds 0, 1 and 2, checked
    python benchmarks/cache_through_frames.py --seeds 3 4    # other seeds, recorded, not checked

The robot's case for the cache itself: four codes ("The code of the red locker is 4817."), each in its own message,
then 320x240 frames of noise (about 80 tokens each on the embedded default, well past a 512-token cache), with a
subject named again in every fourth step ("Someone walked past the red locker."); every fact is asked after 16
frames and after 40 (an answer not kept leaves the memory as it was, so one stream serves both counts), by Inf-MLLM
on every seed and by StreamingLLM on the first (which keeps only the sinks and the newest frames). The archive is
off: what is recalled is what the cache kept. Seeds vary the subjects, values, the words around each fact and the
frames. benchmarks/camera_flood.py is the wider matrix (policies, caches, the archive on and off).

On the default model and seeds the run checks what the suite held it to (slow tests of `test_recall.py` until the
default model's frames outgrew the suite's time; the suite runs this benchmark's smoke run): StreamingLLM recalls
none; Inf-MLLM at least 6 of 12 after 16 frames and at least 4 of 12 after 40 (the mentions, text too and newer
than the facts, then outgrow the text's share: ranked by the attention drawn, age aside, a fact keeps its place
among the mentions of its subject). Results: benchmarks/results/cache_through_frames.json, a record per fact,
policy, seed and frame count.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from common import machine, shown, write_records

MODEL = "onevision-qwen2.5-0.5b"
SEEDS = (0, 1, 2)
ASK_AFTER = (16, 40)
CAPACITY = 512
COLOURS = ["red", "blue", "green", "yellow", "white", "black", "orange", "purple"]
SMOKE = ["--model", "smolvlm-smollm2", "--seeds", "0", "--ask-after", "4", "--capacity", "128",
         "--out", "cache_through_frames.json"]


def camera_flood(adapter, policy: str, seed: int, ask_after: tuple[int, ...], capacity: int) -> dict[int, list]:
    """One stream (see the module's docstring): {frames seen: [(recalled, answer) per fact]}."""
    import numpy as np

    from inf_mllm_ros.engine.runtime.stream import KVStream
    from inf_mllm_ros.engine.stream_config import StreamConfig

    rng = random.Random(seed)
    subjects = rng.sample([f"the {c} {o}" for c in COLOURS for o in ("locker", "cabinet")], 4)
    values = [str(rng.randint(1000, 9999)) for _ in subjects]
    stream = KVStream(adapter, StreamConfig(capacity=capacity, policy=policy, chunk_size=128, archive_size=0))
    for i, (subject, value) in enumerate(zip(subjects, values)):
        stream.push_text(rng.choice(["", "Note: ", "Update from the shift lead. "]) + f"The code of {subject} is {value}.",
                         stamp=float(i))
    pixels = np.random.default_rng(seed)
    answers = {}
    for n in range(max(ask_after)):
        stream.push_frame(pixels.integers(0, 256, (240, 320, 3), dtype=np.uint8), stamp=10.0 + n)
        if n % 4 == 3:
            stream.push_text(f"Someone walked past {subjects[n // 4 % len(subjects)]}.", stamp=10.5 + n)
        if n + 1 in ask_after:
            if stream.stats().tokens_evicted <= capacity:
                raise RuntimeError(f"only {stream.stats().tokens_evicted} tokens evicted after {n + 1} frames: the "
                                   "facts were not due to go; ask later")
            texts = [stream.ask(f"What is the code of {subject}?", max_new_tokens=12).text for subject in subjects]
            answers[n + 1] = [(value in text, text) for value, text in zip(values, texts)]
    return answers


def check(inf: list[dict[int, list]], streaming: dict[int, list]) -> None:
    """What the suite held the default model to on the default seeds (measured in the suite once: 9 of 12 after 16
    frames, 3, 2 and 4 by seed; 7 of 12 after 40, 3, 2 and 2; this benchmark's first run, results/
    cache_through_frames.json: 6 of 12 after 16, 3, 1 and 2; 6 of 12 after 40, 2 each. Without text_share the frames
    push the facts out, and with the age term in the text's ranking none is recalled after 40)."""
    assert not any(ok for ok, _ in streaming[16]), f"streaming_llm keeps only the newest frames: {streaming}"
    after_16 = sum(ok for run in inf for ok, _ in run[16])
    assert after_16 >= 6, f"inf_mllm recalls after the flood: {after_16} of 12"
    after_40 = sum(ok for run in inf for ok, _ in run[40])
    assert after_40 >= 4, f"inf_mllm recalls 40 frames after the facts: {after_40} of 12"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    p.add_argument("--ask-after", type=int, nargs="+", default=list(ASK_AFTER), help="frame counts to ask after")
    p.add_argument("--capacity", type=int, default=CAPACITY)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default="cache_through_frames.json")
    args = p.parse_args(argv)
    import torch

    from inf_mllm_ros.engine.models.loading import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    adapter = load_model(args.model, device="cpu", dtype="float32")
    shipped = (args.model == MODEL and args.seeds == list(SEEDS) and args.ask_after == list(ASK_AFTER)
               and args.capacity == CAPACITY)
    ask_after = tuple(sorted(args.ask_after))
    start = time.monotonic()
    records, inf = [], []
    runs = [("inf_mllm", seed) for seed in args.seeds] + [("streaming_llm", args.seeds[0])]
    for policy, seed in runs:
        answers = camera_flood(adapter, policy, seed, ask_after, args.capacity)
        if policy == "inf_mllm":
            inf.append(answers)
        else:
            streaming = answers
        records += [{"kind": "fact", "policy": policy, "seed": seed, "frames": n, "fact": k, "recalled": ok,
                     "answer": text} for n, per_fact in answers.items() for k, (ok, text) in enumerate(per_fact)]
        print(f"{policy} seed {seed}: " + ", ".join(f"{sum(ok for ok, _ in a)}/{len(a)} after {n} frames"
                                                     for n, a in answers.items()), flush=True)
    records.append({"kind": "summary", "model": args.model, "seeds": args.seeds, "ask_after": list(ask_after),
                    "capacity": args.capacity, "device": machine(), "seconds": round(time.monotonic() - start, 1)})
    path = write_records(args.out, records)
    print(f"wrote {shown(path)}")
    if shipped:
        check(inf, streaming)
        print("checked: as the suite held it", flush=True)
    else:
        print(json.dumps({n: sum(ok for run in inf for ok, _ in run[n]) for n in ask_after}), file=sys.stderr)


if __name__ == "__main__":
    main()
