"""Recall of facts told long ago, with and without the KV archive, and what the archive costs.

Data sets, one to choose defaults on and the others to report on (never tuned on):
- tuning: the Gutenberg novel beside the repository and fact set A (access codes of lockers and cabinets);
- report: Python's own documentation topics (`pydoc_data.topics`, shipped with every Python) and fact set B
  (wifi passwords of rooms), with other mention sentences;
- wide: the report seeds of `inf_mllm_ros.testing.recall_facts`: five kinds of value (codes, people's names,
  places, colours, counts) in turn, several phrasings, a mention style and a filler genre (documentation, an
  operations log, small talk) per trial.

`recall`: each stream tells one fact (`--facts-at-once 1`) or twelve, then narration paragraphs as text
messages, the fact's subject named again in every third message (`--mention`) or never; at each distance
(tokens since the last fact) every fact is asked, with the archive's retrieval and without it (the same
stream: an answer not kept leaves the memory as it was), on the shipped settings unless told. The full
cache is the ceiling. Rows are written after every stream; a run that is stopped resumes where it was. Runs
over other trials may share one file (`--first-trial T --trials N --threads 1` each, one per core).

`perplexity`: one text through two streams, the archive on and off: perplexity per 4K tokens, and the
largest difference of their logits (the archive copies what goes in and changes nothing of it).

`latency`: time per 64-token chunk with the archive on and off; answer latency on the shipped settings with
no archive, 16K and 64K archived tokens; host bytes per archived token; resident memory over a long run once
a small archive is full. On a GPU: `--device cuda --dtype bfloat16 --out archive_latency_gpu.json`.

    python benchmarks/archive_recall.py recall --set report --policy inf_mllm --cache 512 --trials 4
    python benchmarks/archive_recall.py latency
    python benchmarks/archive_recall.py perplexity --tokens 65536 --model smollm2
"""

from __future__ import annotations

import argparse
import fcntl
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from common import RESULTS, machine, peak_rss_bytes, read_text, synchronize, tile_archive, trial_interval, wilson

DISTANCES = (1000, 2000, 4000, 8000, 16000)
COLOURS = ["red", "blue", "green", "yellow", "white", "black", "orange", "purple"]
ROOMS = ["the server room", "the loading bay", "the paint shop", "the north stairwell", "the cold store",
         "the tool crib", "the break room", "the battery room", "the clean room", "the mail room",
         "the control room", "the boiler room", "the print shop", "the first aid room"]
WORDS = ["falcon", "copper", "maple", "harbor", "quartz", "meadow", "signal", "timber", "violet", "anchor"]


def fact_set(name: str, rng: random.Random, n: int) -> list[dict]:
    """n facts of set A (tuning) or B (report), each with its message, question, value and mention."""
    if name == "A":
        subjects = rng.sample([f"the {c} {o}" for c in COLOURS for o in ("locker", "cabinet")], n)
        return [{"subject": s, "value": (v := str(rng.randint(1000, 9999))),
                 "message": f"The access code of {s} is {v}.", "question": f"What is the access code of {s}?",
                 "mention": f"Someone walked past {s}."} for s in subjects]
    subjects = rng.sample(ROOMS, n)
    return [{"subject": s, "value": (v := f"{rng.choice(WORDS)}{rng.randint(10, 99)}"),
             "message": f"For the record, the wifi password of {s} is {v}.",
             "question": f"What is the wifi password of {s}?",
             "mention": f"A technician checked {s} again."} for s in subjects]


def paragraphs(data_set: str, chars: int = 260) -> list[str]:
    if data_set == "tuning":
        text = read_text(None)
    else:
        from pydoc_data.topics import topics

        text = "\n".join(topics[k] for k in sorted(topics))
    words = text.split()
    out, cur = [], []
    for w in words:
        cur.append(w)
        if sum(len(x) + 1 for x in cur) >= chars:
            out.append(" ".join(cur))
            cur = []
    return out


FACTS = {"tuning": "A", "report": "B"}


def wide_facts(trial: int, n: int, tuning: bool = False) -> tuple[list[dict], list[str]]:
    """The wide set's facts and filler for one trial: report seeds, or with `tuning` the tuning seeds below them.
    Each fact also carries the message that tells it again with a new value (`again`, `new_value`)."""
    from inf_mllm_ros.testing.recall_facts import GENRES, KINDS, MENTIONS, REPORT_SEED_BASE, facts, filler, told_again

    seed = trial if tuning else REPORT_SEED_BASE + trial
    genre = GENRES[trial % len(GENRES)]
    style = trial // len(GENRES) % len(MENTIONS)
    told = facts(seed, n, kinds=tuple(KINDS[(trial + i) % len(KINDS)] for i in range(len(KINDS))))
    again = [told_again(f, seed) for f in told]
    return ([{"subject": f.subject, "value": f.value, "message": f.message, "question": f.question,
              "mention": f.mentions[style], "kind": f.kind, "genre": genre, "again": a.message,
              "new_value": a.value} for f, a in zip(told, again)],
            filler(genre, seed))


def run_stream(adapter, paras, args, policy: str, cache: int, trial: int) -> list[dict]:
    from inf_mllm_ros.engine.runtime.stream import KVStream
    from inf_mllm_ros.engine.stream_config import StreamConfig

    rng = random.Random(f"{args.set}-{trial}-{args.facts_at_once}")
    if args.set.startswith("wide"):
        facts, paras = wide_facts(trial, args.facts_at_once, tuning=args.set == "wide-tuning")
    else:
        facts = fact_set(FACTS[args.set], rng, args.facts_at_once)
    distances = [d for d in args.distances if d <= args.max_distance]
    settings = {"chunk_size": 128}
    if args.retrieve_tokens is not None:
        settings["retrieve_tokens"] = args.retrieve_tokens
    if args.archive_block is not None:
        settings["archive_block"] = args.archive_block
    if policy == "full":
        cache = max(distances) + 2000 + 300 * len(facts)
    stream = KVStream(adapter, StreamConfig(capacity=cache, policy=policy, **settings))
    budget = stream.config.retrieve_tokens
    source = iter(paras[rng.randint(0, len(paras) - 400):])
    for fact in facts:
        for _ in range(rng.randint(1, 3)):
            stream.push_text(next(source))
        stream.push_text(fact["message"])
    told = stream.tokens_seen
    k = 0

    def bury(tokens: int) -> None:
        nonlocal k
        while stream.tokens_seen - told < tokens:
            k += 1
            if args.mention and k % 3 == 0:
                stream.push_text(facts[(k // 3) % len(facts)]["mention"])
            else:
                stream.push_text(next(source))

    if args.told_again:
        # The old values two caches and more back, then each told again with a new value: distances count
        # from the new one, and only the new value without the old counts as recalled.
        bury(args.told_again)
        for fact in facts:
            stream.push_text(next(source))
            stream.push_text(fact["again"])
        told = stream.tokens_seen
    rows, start = [], time.monotonic()
    for distance in distances:
        bury(distance)
        for fact in facts:
            for archive in (True, False) if policy != "full" and args.baseline else (True,):
                stream.reconfigure(retrieve_tokens=budget if archive else 0)
                answer = stream.ask(fact["question"], max_new_tokens=24)
                text = answer.text.lower()
                recalled = (fact["new_value"].lower() in text and fact["value"].lower() not in text
                            if args.told_again else fact["value"].lower() in text)
                rows.append({"set": args.set, "facts_at_once": args.facts_at_once, "mention": args.mention,
                             "told_again": args.told_again,
                             "policy": policy, "cache": cache, "trial": trial, "distance": distance,
                             "archive": archive, "retrieve_tokens": budget,
                             "archive_block": stream.config.archive_block,
                             "recalled": recalled, "answer": answer.text,
                             "kind": fact.get("kind", "code"), "genre": fact.get("genre"),
                             "retrieved_tokens": answer.retrieved_tokens, "latency_s": round(answer.latency, 3)})
        stream.reconfigure(retrieve_tokens=budget)
    print(f"{policy}@{cache} trial {trial}: {sum(r['recalled'] for r in rows if r['archive'])}/"
          f"{sum(r['archive'] for r in rows)} with the archive, "
          f"{sum(r['recalled'] for r in rows if not r['archive'])}/{sum(not r['archive'] for r in rows)} without "
          f"({time.monotonic() - start:.0f} s)", flush=True)
    return rows


def load_rows(out: Path) -> list[dict]:
    return json.loads(out.read_text()) if out.exists() else []


def add_rows(out: Path, rows: list[dict]) -> None:
    """Add one stream's rows to the file under a lock, so that runs over other trials (`--first-trial`) can
    share it: on a CPU, two runs of one thread each take more streams an hour than one run of two threads."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(Path(tempfile.gettempdir()) / f"archive_recall-{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        written = out.with_name(out.name + ".part")
        written.write_text(json.dumps(load_rows(out) + rows, indent=0) + "\n")
        written.replace(out)


def recall(args) -> None:
    import torch

    from inf_mllm_ros.engine.models.loading import load_model

    torch.set_num_threads(args.threads)
    out = RESULTS / args.out
    done = {(r["set"], r["facts_at_once"], r["mention"], r["policy"], r["cache"], r["trial"], r["retrieve_tokens"],
             r["archive_block"]) for r in load_rows(out) if r.get("told_again", 0) == args.told_again}
    adapter = load_model(args.model, device="cpu", dtype="float32")
    paras = paragraphs(args.set) if not args.set.startswith("wide") else []
    for trial in range(args.first_trial, args.first_trial + args.trials):
        for policy in args.policy:
            for cache in args.cache:
                key = (args.set, args.facts_at_once, args.mention, policy,
                       cache if policy != "full" else None, trial)
                if any(d[:5] == key[:5] and (d[4] == cache or policy == "full") and d[5] == trial
                       and (args.retrieve_tokens is None or d[6] == args.retrieve_tokens)
                       and (args.archive_block is None or d[7] == args.archive_block) for d in done):
                    continue
                add_rows(out, run_stream(adapter, paras, args, policy, cache, trial))
                if policy == "full":
                    break


def latency(args) -> None:
    """Answer latency with no archive, 16K and 64K archived tokens (the stream's blocks written again up to
    that, as scoring costs the same whatever the blocks hold); host bytes per token; resident memory while a
    small archive fills and then stays full."""
    import torch

    from inf_mllm_ros.engine.models.loading import load_model
    from inf_mllm_ros.engine.runtime.stream import KVStream
    from inf_mllm_ros.engine.stream_config import StreamConfig

    torch.set_num_threads(args.threads)
    adapter = load_model(args.model, device=args.device, dtype=args.dtype)
    paras = paragraphs("report")
    facts = fact_set("B", random.Random(0), 3)
    record = {"machine": machine(), "model": args.model, "dtype": args.dtype}
    record["ingest"] = ingest_times(adapter, paras)
    print("ingest", record["ingest"], flush=True)
    stream = KVStream(adapter, StreamConfig(archive_size=65536))
    record["settings"] = {k: getattr(stream.config, k) for k in ("capacity", "chunk_size", "retrieve_tokens",
                                                                 "archive_block", "evidence")}
    source = iter(paras)
    for fact in facts:
        stream.push_text(fact["message"])
    while stream.tokens_seen < args.stream_tokens:
        stream.push_text(next(source))

    def timed(archived: str) -> None:
        # Without: no retrieval and no evidence (nothing scored); with: as shipped (retrieval and evidence, from
        # one scoring); and retrieval without evidence, for what the evidence adds.
        runs = {}
        for name, retrieve, evidence in (("without", 0, 0), ("with", record["settings"]["retrieve_tokens"],
                                                                record["settings"]["evidence"]),
                                         ("with_no_evidence", record["settings"]["retrieve_tokens"], 0)):
            stream.reconfigure(retrieve_tokens=retrieve, evidence=evidence)
            times = [stream.ask(f["question"], max_new_tokens=16).latency for f in facts for _ in range(2)]
            runs[name] = statistics.median(times)
        stream.reconfigure(retrieve_tokens=record["settings"]["retrieve_tokens"],
                           evidence=record["settings"]["evidence"])
        record[archived] = {**runs, "ratio": runs["with"] / runs["without"],
                            "evidence_ratio": runs["with"] / runs["with_no_evidence"],
                            "archive_tokens": stream.archive.tokens}
        print(archived, record[archived], flush=True)

    tile_archive(stream, 16384)
    timed("16K")
    tile_archive(stream, 65536 - 64)
    timed("64K")
    record["bytes_per_token"] = stream.archive.bytes_per_token()
    record["archive_bytes"] = stream.archive.nbytes()
    # Host memory over a long run with a small archive: flat once it is full.
    small = KVStream(adapter, StreamConfig(archive_size=2048))
    rss = []
    while small.tokens_seen < 4 * 2048:
        small.push_text(next(source))
        rss.append((small.tokens_seen, small.archive.tokens, _rss()))
    record["rss_small_archive"] = rss[:: max(1, len(rss) // 40)]
    record["peak_rss_bytes"] = peak_rss_bytes()
    (RESULTS / args.out).write_text(json.dumps(record, indent=1) + "\n")


def ingest_times(adapter, paras: list[str], chunks: int = 48) -> dict:
    """Milliseconds per 64-token chunk once the cache is full, the archive on (shipped) and off, in turns on
    the same text: what recording every block costs (on a GPU, a copy to host memory per chunk)."""
    from inf_mllm_ros.engine.runtime.stream import KVStream
    from inf_mllm_ros.engine.stream_config import StreamConfig

    ids = adapter.tokenize("\n\n".join(paras))
    streams = {archive: KVStream(adapter, StreamConfig(chunk_size=64, system_prompt="",
                                                       **({} if archive else {"archive_size": 0})))
               for archive in (True, False)}
    fill = 2 * streams[True].config.capacity
    for stream in streams.values():
        stream.push_tokens(ids[:fill])
    taken = {archive: [] for archive in streams}
    for i in range(chunks):
        chunk = ids[fill + 64 * i : fill + 64 * (i + 1)]
        for archive, stream in streams.items():
            synchronize()
            start = time.perf_counter()
            stream.push_tokens(chunk)
            synchronize()
            taken[archive].append(time.perf_counter() - start)
    with_, without = statistics.median(taken[True]), statistics.median(taken[False])
    return {"ms_per_chunk_with": round(1000 * with_, 2), "ms_per_chunk_without": round(1000 * without, 2),
            "ratio": round(with_ / without, 3), "chunks": chunks, "clock": "wall"}


def perplexity(args) -> None:
    """Perplexity of one text through two streams, the archive on (shipped) and off, chunk by chunk: the
    archive only copies what goes in, so the two must agree to the last bit (logits compared)."""
    import torch
    import torch.nn.functional as F

    from inf_mllm_ros.engine.models.loading import load_model
    from inf_mllm_ros.engine.runtime.stream import KVStream
    from inf_mllm_ros.engine.stream_config import StreamConfig

    torch.set_num_threads(args.threads)
    adapter = load_model(args.model, device="cpu", dtype="float32")
    ids = adapter.tokenize("\n\n".join(paragraphs("report", chars=2000)))[: args.tokens]
    streams = {archive: KVStream(adapter, StreamConfig(capacity=args.cache, chunk_size=64, headroom=64 + 256,
                                                       system_prompt="", **({} if archive else {"archive_size": 0})))
               for archive in (True, False)}
    nll = {archive: [] for archive in streams}
    last = dict.fromkeys(streams)
    record = {"machine": machine(), "model": args.model, "dtype": "float32", "cache": args.cache, "chunk": 64,
              "text": "report set (pydoc topics)", "bins": [], "largest_logit_difference": 0.0}
    start = time.monotonic()
    for pos in range(0, len(ids), 64):
        chunk = ids[pos : pos + 64]
        logits = {}
        for archive, stream in streams.items():
            logits[archive] = stream.push_tokens(chunk, return_logits=True)
            preds = logits[archive][:-1] if last[archive] is None else torch.cat([last[archive], logits[archive][:-1]])
            nll[archive].append(F.cross_entropy(preds, chunk[1:] if last[archive] is None else chunk, reduction="none"))
            last[archive] = logits[archive][-1:]
        record["largest_logit_difference"] = max(record["largest_logit_difference"],
                                                 float((logits[True] - logits[False]).abs().max()))
        done = pos + len(chunk)
        if done % 4096 == 0 or done == len(ids):
            record["bins"].append({"tokens": done, **{("with" if a else "without"): round(float(
                torch.cat(nll[a]).mean().exp()), 4) for a in streams}, "archive_tokens": streams[True].archive.tokens,
                "seconds": round(time.monotonic() - start)})
            nll = {archive: [] for archive in streams}
            print(record["bins"][-1], record["largest_logit_difference"], flush=True)
            (RESULTS / "archive_perplexity.json").write_text(json.dumps(record, indent=1) + "\n")


def cell_text(per_trial: dict[int, list[int]]) -> str:
    """Hits of questions with the Wilson interval; where a trial asks several questions (several facts at once),
    also the interval over trials, which is the one to read when misses cluster in trials."""
    hits, n = (sum(t[i] for t in per_trial.values()) for i in (0, 1))
    low, high = wilson(hits, n)
    text = f"{hits}/{n} ({low:.0%}-{high:.0%}"
    if n > len(per_trial) > 1:
        low, high = trial_interval([tuple(t) for t in per_trial.values()])
        text += f"; trials {low:.0%}-{high:.0%}"
    return text + ")"


def summary(args) -> None:
    """Recall per setting, policy, cache and distance, with and without the archive, as a Markdown table; each
    cell with its 95 % interval (Wilson, and over trials where a trial asks several questions). The last column
    pools every distance: one trial's facts are asked at each distance, so only the interval over trials holds
    there. Several files (runs of one retrieval split by distance or cache) make one table."""
    rows = [r for name in args.out for r in json.loads((RESULTS / name).read_text())]
    groups: dict[tuple, dict] = {}
    for r in rows:
        key = (r["facts_at_once"], r["mention"], r["policy"], r["cache"] if r["policy"] != "full" else "-",
               r.get("told_again", 0))
        cell = groups.setdefault(key, {}).setdefault((r["distance"], r["archive"]), {})
        trial = cell.setdefault(r["trial"], [0, 0])
        trial[0] += r["recalled"]
        trial[1] += 1
    distances = sorted({r["distance"] for r in rows})
    print("| Facts at once | Subject named again | Told again | Policy | Cache | Archive | "
          + " | ".join(f"{d / 1000:g}K back" for d in distances) + " | All |")
    print("|---|---|---|---|---|---|" + "---:|" * (len(distances) + 1))
    for key in sorted(groups, key=lambda k: (k[4], k[0], not k[1], k[2] != "full", k[2],
                                              k[3] if k[3] != "-" else 0)):
        for archive in (True, False):
            cells = [groups[key].get((d, archive)) for d in distances]
            if not any(cells):
                continue
            pooled: dict[int, list[int]] = {}
            for c in filter(None, cells):
                for trial, (hits, n) in c.items():
                    pooled.setdefault(trial, [0, 0])
                    pooled[trial][0] += hits
                    pooled[trial][1] += n
            text = [cell_text(c) if c else "" for c in cells] + [cell_text(pooled)]
            label = "-" if key[2] == "full" else ("on" if archive else "off")
            again = f"{key[4]} tokens later" if key[4] else "no"
            print(f"| {key[0]} | {'yes' if key[1] else 'no'} | {again} | {key[2]} | {key[3]} | {label} | "
                  + " | ".join(text) + " |")
    if args.misses_by:
        misses_by(rows, args.misses_by)


def misses_by(rows: list[dict], field: str) -> None:
    """Questions missed with the archive (or by the full cache), by the kind of value or the filler's genre, for
    each setting and for the near (4K back and less) and far distances apart."""
    counts: dict[tuple, dict[str, list[int]]] = {}
    for r in rows:
        if not r["archive"]:
            continue
        key = (r["facts_at_once"], "yes" if r["mention"] else "no", r["policy"],
               r["cache"] if r["policy"] != "full" else "-", "1K-4K" if r["distance"] <= 4000 else "over 4K")
        cell = counts.setdefault(key, {}).setdefault(str(r.get(field)), [0, 0])
        cell[0] += not r["recalled"]
        cell[1] += 1
    values = sorted({v for c in counts.values() for v in c})
    print(f"\nMissed, by {field}\n")
    print("| Facts at once | Subject named again | Policy | Cache | Back | " + " | ".join(values) + " |")
    print("|---|---|---|---|---|" + "---:|" * len(values))
    for key in sorted(counts, key=str):
        cells = [f"{counts[key][v][0]}/{counts[key][v][1]}" if v in counts[key] else "" for v in values]
        print("| " + " | ".join(map(str, key)) + " | " + " | ".join(cells) + " |")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


# The options of a few seconds' run on the small models (run.py --smoke).
SMOKE = ["recall", "--model", "smollm2", "--cache", "128", "--trials", "1", "--max-distance", "1000", "--out", "archive_recall.json"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("recall")
    r.add_argument("--set", choices=("tuning", "report", "wide", "wide-tuning"), default="report")
    r.add_argument("--policy", nargs="+", default=["inf_mllm"])
    r.add_argument("--cache", nargs="+", type=int, default=[512])
    r.add_argument("--facts-at-once", type=int, default=1)
    r.add_argument("--mention", action=argparse.BooleanOptionalAction, default=True)
    r.add_argument("--told-again", type=int, default=0, metavar="TOKENS",
                   help="tell each fact again with a new value this many tokens after the first; ask for the new one")
    r.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="ask each question without the archive too")
    r.add_argument("--trials", type=int, default=4)
    r.add_argument("--first-trial", type=int, default=0)
    r.add_argument("--max-distance", type=int, default=16000)
    r.add_argument("--distances", type=int, nargs="+", default=list(DISTANCES), help="tokens back to ask at")
    r.add_argument("--retrieve-tokens", type=int, default=None, help="default: the shipped setting")
    r.add_argument("--archive-block", type=int, default=None, help="default: the shipped setting")
    r.add_argument("--out", default="archive_recall.json")
    lat = sub.add_parser("latency")
    lat.add_argument("--stream-tokens", type=int, default=8192, help="real stream before the archive is tiled")
    lat.add_argument("--device", default="cpu")
    lat.add_argument("--dtype", default="float32")
    lat.add_argument("--out", default="archive_latency.json")
    for p in (r, lat):
        p.add_argument("--model", default="qwen2.5-0.5b")
        p.add_argument("--threads", type=int, default=2)
    ppl = sub.add_parser("perplexity")
    ppl.add_argument("--tokens", type=int, default=65536)
    ppl.add_argument("--cache", type=int, default=512)
    ppl.add_argument("--model", default="qwen2.5-0.5b")
    ppl.add_argument("--threads", type=int, default=2)
    summ = sub.add_parser("summary")
    summ.add_argument("--out", nargs="+", default=["archive_recall_report.json"])
    summ.add_argument("--misses-by", choices=("kind", "genre"), help="also a table of the misses by this")
    args = ap.parse_args(argv)
    {"recall": recall, "latency": latency, "perplexity": perplexity, "summary": summary}[args.command](args)


if __name__ == "__main__":
    main()
