"""What the bounded cache alone keeps (no archive) on the embedded models, over streams too long for the suite.

    python benchmarks/cache_alone.py                         # both parts, the shipped models and seeds, checked
    python benchmarks/cache_alone.py --part pinned --seeds 3 4   # other seeds, recorded, not checked

- **pinned** (the 0.5B evaluation model `qwen2.5-0.5b`, cache 512): four codes ("The code of the red locker is
  4817.") told between paragraphs of the shared novel, pinned or not, never referred to again; then 1,500 tokens of
  paragraphs and every code asked. Pinned on two seeds, unpinned on the first. Per fact: recalled, and the share of
  layer-heads whose cache holds every digit of its value.
- **frames** (the embedded default `onevision-qwen2.5-0.5b`, cache 512): four codes, each in its own message, then
  320x240 frames of noise (about 80 tokens each, well past the cache), with a subject named again in every fourth
  step ("Someone walked past the red locker."); every code asked after 16 frames and after 40 (an answer not kept
  leaves the memory as it was, so one stream serves both counts), by Inf-MLLM on eight seeds and by StreamingLLM on
  the first (which keeps only the sinks and the newest frames). benchmarks/camera_flood.py is the wider matrix
  (policies, caches, the archive on and off).

Seeds vary the subjects, values, where the facts fall, the words around them and the frames. On the shipped models
and seeds each part checks what the suite held it to (slow tests of `test_recall.py` until they outgrew the suite's
time; the suite runs this benchmark's smoke run): pinned values held in every layer-head and at least 6 of 8
recalled, unpinned ones mostly evicted (held in under 0.8 layer-heads' worth in all) and at most 1 of 4 recalled,
the first pinned seed recalling more than the unpinned; StreamingLLM recalls no code after the frames, Inf-MLLM at
least 16 of 32 after 16 frames and at least 11 of 32 after 40 (the mentions, text too and newer than the facts, then
outgrow the text's share: ranked by the attention drawn, age aside, a fact keeps its place among the mentions of
its subject). Results: benchmarks/results/cache_alone.json, a record per fact, part, policy, seed and frame count.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from common import machine, read_text, shown, write_records

CAPACITY = 512
COLOURS = ["red", "blue", "green", "yellow", "white", "black", "orange", "purple"]
# Per part: the model and seeds whose runs are checked.
PINNED_MODEL, PINNED_SEEDS, PINNED_AFTER = "qwen2.5-0.5b", (0, 1), 1500
FRAMES_MODEL, FRAMES_SEEDS, ASK_AFTER = "onevision-qwen2.5-0.5b", tuple(range(8)), (16, 40)
SMOKE = ["--pinned-model", "smollm2", "--frames-model", "smolvlm-smollm2", "--seeds", "0", "--capacity", "128",
         "--pinned-after", "300", "--ask-after", "4"]


def novel_paragraphs(path: str | None) -> list[str]:
    """The shared novel in messages of 45 words, from the first 120,000."""
    words = read_text(path).split()
    return [" ".join(words[i : i + 45]) for i in range(0, min(len(words), 120_000), 45)]


def code_positions(adapter, stream, statement: str) -> list[int]:
    """Stream indices of the digit tokens of a statement that has just gone in (before its turn's closing tokens)."""
    closing = len(adapter.tokenize(adapter.chat.user_suffix)) if adapter.chat.user_suffix else 0
    tail = adapter.tokenize(adapter.chat.user(statement)).tolist()[: -closing or None]
    return [stream.tokens_seen - closing - (len(tail) - i) for i, t in enumerate(tail)
            if adapter.decode([t]).strip().isdigit()]


def held(stream, positions: list[int]) -> float:
    """The share of layer-heads whose cache holds every one of these stream positions."""
    import torch

    return float(torch.stack([
        torch.stack([(stream.cache.cached_seq(i) == d).any(-1) for d in positions]).all(0).float().mean()
        for i in range(len(stream.cache.layers))
    ]).mean())


def pinned_facts(adapter, paragraphs: list[str], seed: int, pin: bool, capacity: int, after: int) -> list[tuple]:
    """One stream of the pinned part (the module's docstring): (recalled, share of layer-heads holding every digit
    of the value, answer) per fact."""
    from inf_mllm_ros.engine.runtime.stream import KVStream
    from inf_mllm_ros.engine.stream_config import StreamConfig

    rng = random.Random(100 + seed)
    subjects = rng.sample([f"the {c} {o}" for c in COLOURS for o in ("locker", "cabinet")], 4)
    values = [str(rng.randint(1000, 9999)) for _ in subjects]
    source = iter(paragraphs[rng.randint(0, len(paragraphs) - 200):])
    stream = KVStream(adapter, StreamConfig(capacity=capacity, policy="inf_mllm", chunk_size=64, archive_size=0))
    where = []
    for subject, value in zip(subjects, values):
        for _ in range(rng.randint(1, 4)):
            stream.push_text(next(source))
        statement = f"The code of {subject} is {value}."
        stream.push_text(statement, pin=pin)
        where.append(code_positions(adapter, stream, statement))
    told = stream.tokens_seen
    while stream.tokens_seen - told < after:
        stream.push_text(next(source))
    results = []
    for subject, value, digits in zip(subjects, values, where):
        kept = held(stream, digits)
        answer = stream.ask(f"What is the code of {subject}?", max_new_tokens=12).text
        results.append((value in answer, kept, answer))
    return results


def check_pinned(pinned: list[tuple], unpinned: list[tuple]) -> None:
    """What the suite held the 0.5B model to (measured there: pinned, 8 of 8 recalled and held in every layer-head;
    unpinned, 0 of 4 recalled, held in 15, 2, 0 and 0 % of layer-heads). Unpinned, nothing refers to the facts
    again: attention has no reason to keep them."""
    assert all(kept == 1.0 for _, kept, _ in pinned), f"pinned values held in every layer-head: {pinned}"
    assert sum(kept for _, kept, _ in unpinned) < 0.8, f"unpinned facts mostly evicted: {unpinned}"
    assert sum(ok for ok, _, _ in unpinned) <= 1, f"unpinned facts mostly lost: {unpinned}"
    assert sum(ok for ok, _, _ in pinned) >= 6, f"pinned facts recalled: {pinned}"
    assert sum(ok for ok, _, _ in pinned[:4]) > sum(ok for ok, _, _ in unpinned), (pinned, unpinned)


def camera_flood(adapter, policy: str, seed: int, ask_after: tuple[int, ...], capacity: int,
                 answer_prompt: str) -> dict[int, list]:
    """One stream of the frames part (the module's docstring): {frames seen: [(recalled, answer) per fact]}."""
    import numpy as np

    from inf_mllm_ros.engine.runtime.stream import KVStream
    from inf_mllm_ros.engine.stream_config import StreamConfig

    rng = random.Random(seed)
    subjects = rng.sample([f"the {c} {o}" for c in COLOURS for o in ("locker", "cabinet")], 4)
    values = [str(rng.randint(1000, 9999)) for _ in subjects]
    stream = KVStream(adapter, StreamConfig(capacity=capacity, policy=policy, chunk_size=128, archive_size=0,
                                            answer_prompt=answer_prompt))
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


def check_frames(inf: list[dict[int, list]], streaming: dict[int, list]) -> None:
    """What the suite held the default model to, on seeds 0-2 (measured there once: 9 of 12 after 16 frames, 3, 2 and
    4 by seed; 7 of 12 after 40, 3, 2 and 2; this benchmark's first run: 6 of 12 after 16, 3, 1 and 2; 6 of 12 after
    40, 2 each), over eight seeds: the same shares of 32 (measured with the answer prompt, results/
    cache_alone_answer_prompt.json: 19 of 32 after 16 frames, 17 after 40; without it 20 and 17).
    Without text_share the frames push the facts out, and with the age term in the text's ranking none is recalled
    after 40."""
    assert not any(ok for ok, _ in streaming[16]), f"streaming_llm keeps only the newest frames: {streaming}"
    after_16 = sum(ok for run in inf for ok, _ in run[16])
    facts = 4 * len(inf)
    assert after_16 >= facts // 2, f"inf_mllm recalls after the flood: {after_16} of {facts}"
    after_40 = sum(ok for run in inf for ok, _ in run[40])
    assert after_40 >= facts // 3, f"inf_mllm recalls 40 frames after the facts: {after_40} of {facts}"


def pinned_part(args, records: list):
    """Runs the pinned part into `records`; returns its check where the run is the shipped one, else None."""
    adapter = load(args.pinned_model)
    paragraphs = novel_paragraphs(args.text)
    pinned, unpinned = [], []
    for seed, pin in [(seed, True) for seed in args.seeds] + [(args.seeds[0], False)]:
        results = pinned_facts(adapter, paragraphs, seed, pin, args.capacity, args.pinned_after)
        (pinned if pin else unpinned).extend(results)
        records += [{"part": "pinned", "seed": seed, "pinned": pin, "fact": k, "recalled": ok, "held": round(kept, 3),
                     "answer": answer} for k, (ok, kept, answer) in enumerate(results)]
        print(f"pinned={pin} seed {seed}: {sum(r[0] for r in results)}/{len(results)} recalled, held "
              f"{[round(r[1], 2) for r in results]}", flush=True)
    shipped = (args.pinned_model, tuple(args.seeds), args.capacity, args.pinned_after) == (
        PINNED_MODEL, PINNED_SEEDS, CAPACITY, PINNED_AFTER)
    return (lambda: check_pinned(pinned, unpinned)) if shipped else None


def frames_part(args, records: list):
    """Runs the frames part into `records`; returns its check where the run is the shipped one, else None."""
    from inf_mllm_ros.engine.stream_config import StreamConfig

    adapter = load(args.frames_model)
    ask_after = tuple(sorted(args.ask_after))
    inf, streaming = [], {}
    for policy, seed in [("inf_mllm", seed) for seed in args.frame_seeds] + [("streaming_llm", args.frame_seeds[0])]:
        answers = camera_flood(adapter, policy, seed, ask_after, args.capacity, args.answer_prompt)
        if policy == "inf_mllm":
            inf.append(answers)
        else:
            streaming = answers
        records += [{"part": "frames", "policy": policy, "seed": seed, "frames": n, "fact": k, "recalled": ok,
                     "answer": text, "answer_prompt": args.answer_prompt}
                    for n, per_fact in answers.items() for k, (ok, text) in enumerate(per_fact)]
        print(f"{policy} seed {seed}: " + ", ".join(f"{sum(ok for ok, _ in a)}/{len(a)} after {n} frames"
                                                     for n, a in answers.items()), flush=True)
    print(json.dumps({n: sum(ok for run in inf for ok, _ in run[n]) for n in ask_after}), file=sys.stderr)
    shipped = (args.frames_model, tuple(args.frame_seeds), ask_after, args.capacity, args.answer_prompt) == (
        FRAMES_MODEL, FRAMES_SEEDS, ASK_AFTER, CAPACITY, StreamConfig.answer_prompt)
    return (lambda: check_frames(inf, streaming)) if shipped else None


def load(model: str):
    from inf_mllm_ros.engine.models.loading import load_model

    return load_model(model, device="cpu", dtype="float32")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["pinned", "frames", "both"], default="both")
    p.add_argument("--pinned-model", default=PINNED_MODEL)
    p.add_argument("--frames-model", default=FRAMES_MODEL)
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="stream seeds of both parts (default: pinned 0 1, frames 0 to 7)")
    p.add_argument("--capacity", type=int, default=CAPACITY)
    p.add_argument("--pinned-after", type=int, default=PINNED_AFTER, help="tokens of paragraphs after the facts")
    p.add_argument("--ask-after", type=int, nargs="+", default=list(ASK_AFTER), help="frame counts to ask after")
    p.add_argument("--answer-prompt", default=None,
                   help="said after each question of the frames part (default: the shipped `answer_prompt`)")
    p.add_argument("--text", default=None, help="the novel (default: the shared one beside the checkout)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default="cache_alone.json")
    args = p.parse_args(argv)
    args.frame_seeds = args.seeds or list(FRAMES_SEEDS)
    if args.answer_prompt is None:
        from inf_mllm_ros.engine.stream_config import StreamConfig

        args.answer_prompt = StreamConfig.answer_prompt
    args.seeds = args.seeds or list(PINNED_SEEDS)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.monotonic()
    records, checks = [], {}
    for part, run in (("pinned", pinned_part), ("frames", frames_part)):
        if args.part in (part, "both"):
            checks[part] = run(args, records)
            write_records(args.out, records)
    records.append({"kind": "summary", "parts": args.part, "pinned_model": args.pinned_model,
                    "frames_model": args.frames_model, "capacity": args.capacity, "device": machine(),
                    "seconds": round(time.monotonic() - start, 1)})
    print(f"wrote {shown(write_records(args.out, records))}")
    for part, check in checks.items():  # after the records are written, so that a failed check keeps them
        if check is not None:
            check()
            print(f"{part}: checked, as the suite held it", flush=True)


if __name__ == "__main__":
    main()
