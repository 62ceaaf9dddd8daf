"""Which sighting a question in other words points to, for variants of retrieval's ranking: the route bags' narration
(bags/route_scenario.py) pushed into one stream in-process, stamped at its times on the wall clock, and every
question but the did-you-see ones (never_seen, seen_check) asked as a recall (no answer decoded). A question counts where the recall's first moment is
the asked sighting (its stamp within 2 s), and where it is any sighting of the asked thing. Tuning data only (the
route seeds through the node, `where_when.py`, are the report).

Variants: `shipped`, or parts joined by "+": the retriever's constants set by name ("SEMANTIC_WEIGHT=12"),
`order_words_matched` (the words that ask for the newest or the oldest moment, "first", "last", matched as the
question's other words are, as before they were set aside), `same_thing_by_weight` (the sightings of the heaviest
entry's thing, among which "first" and "last" choose, taken by their weight alone, as before the encoder's likeness),
`meaning_of_thing` (the encoder reads only the words that name the question's thing, `existence.thing_words`).

    python benchmarks/run.py route_recall --seeds 0,1,2,200007 --variants SEMANTIC_WEIGHT=0 SEMANTIC_WEIGHT=8
    python benchmarks/run.py route_recall --seeds 200015,200016 --questions every --variants shipped order_words_matched

`--names said` asks the same questions in the narration's words ("the pallet jack", not "the pump truck"): what is
left to miss where the vocabulary is not.

`--did-you-see` asks the did-you-see questions instead (never_seen, and seen_check, its control, of the "every"
set), answered by the model (default tokens), each with `check_seen` on and, where it fires, off: never_seen is right where the answer
says it was not seen, seen_check where it does not (where_when's `says_not_seen`); and the check as it was before a
name's held half stopped holding the thing (`false_friends_matched`, from the same answers).

    python benchmarks/run.py route_recall --did-you-see --seeds 0,1,2 --out route_recall_did_you_see.json

`--times` asks the questions whose answer is a moment (when_first, when_last, how_long_ago, of the "every" set), each
answered by the model (default tokens) with `time_note` on and off, asked at the drive's end (`asked_at`): when_first
and when_last are right where the answer's first time of day is the asked sighting's within 2 s, how_long_ago where
the time it says (where_when's `elapsed_seconds`) is within 10 % or 5 s; `top` where the heaviest evidence is the asked
sighting.

    python benchmarks/run.py route_recall --times --seeds 0,1,2,3 --out route_recall_times.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

from common import RESULTS, shown, wilson

SMOKE = ["--model", "smollm2", "--seeds", "0", "--duration", "60", "--variants", "SEMANTIC_WEIGHT=0", "shipped",
         "--out", "route_recall_smoke.json"]
STAMP_S = 2.0


@contextlib.contextmanager
def variant(name: str):
    """The retriever as the variant `name` has it, for the duration: `shipped`, or its parts joined by "+", each
    `order_words_matched`, `same_thing_by_weight`, `meaning_of_thing` or one of the retriever's constants set by name
    ("SEMANTIC_WEIGHT=12+MEANING_POWER=3")."""
    from inf_mllm_ros.engine.archive import retriever

    shipped = dict(vars(retriever))
    same_thing, meaning = retriever.Retriever.same_thing, retriever.Retriever.meaning
    friends = retriever.false_friends
    try:
        for part in [] if name == "shipped" else name.split("+"):
            if part == "order_words_matched":
                retriever.without_order = lambda question: question
            elif part == "meaning_of_thing":
                retriever.Retriever.meaning = lambda self, question, texts, power=1.0: meaning(
                    self, retriever.thing_words(question) or question, texts, power)
            elif part == "false_friends_matched":
                retriever.false_friends = lambda question, held: set()
            elif part == "same_thing_by_weight":
                retriever.Retriever.same_thing = lambda self, entries, blocks, texts: None
            elif "=" in part and part.partition("=")[0].isupper() and hasattr(retriever, part.partition("=")[0]):
                key, _, value = part.partition("=")
                setattr(retriever, key, float(value))
            else:
                raise ValueError(f"unknown variant {part!r}")
        yield
    finally:
        retriever.Retriever.same_thing, retriever.Retriever.meaning = same_thing, meaning
        retriever.false_friends = friends
        for key, value in shipped.items():
            if getattr(retriever, key) is not value:
                setattr(retriever, key, value)


def run_seed(adapter, seed: int, duration: float, cache: int, variants: list[str], questions: str,
             names: str = "asked") -> list[dict]:
    import torch

    from inf_mllm_ros.bags.route_scenario import SEEN_CHECK, build_route
    from inf_mllm_ros.engine.runtime.stream import KVStream
    from inf_mllm_ros.settings import DEFAULTS, stream_config

    scenario = build_route(seed, duration, questions=questions, names=names)
    stream = KVStream(adapter, stream_config(dict(DEFAULTS) | {"cache_size": cache, "clock": "wall"}))
    stream.time_origin = 8 * 3600.0
    records = []
    with torch.inference_mode():
        for line in scenario.narration:
            stream.push_text(line.text, line.time_s)
        for q in scenario.questions:
            if q.kind in ("never_seen", SEEN_CHECK):
                continue
            seen = [s.time_s for s in scenario.sightings_of(q.thing)]
            record = {"seed": seed, "kind": q.kind, "question": q.question, "thing": q.thing, "names": names,
                      "sightings": len(seen), "variants": {}}
            for name in variants:
                with variant(name):
                    top = stream.recall(q.question, limit=1)
                stamp = top[0].stamp if top else None
                record["variants"][name] = {
                    "asked": stamp is not None and abs(stamp - q.expected["time_s"]) <= STAMP_S,
                    "thing": stamp is not None and min(abs(stamp - t) for t in seen) <= STAMP_S,
                    "top": top[0].text if top else ""}
            records.append(record)
    return records


def run_did_you_see(adapter, seed: int, duration: float, cache: int) -> list[dict]:
    """The drive's did-you-see questions (never_seen and seen_check) answered with `check_seen` off and on."""
    import dataclasses

    import torch
    from where_when import says_not_seen

    from inf_mllm_ros.bags.route_scenario import SEEN_CHECK, build_route
    from inf_mllm_ros.engine.archive.existence import NOT_SEEN, thing_held, thing_terms
    from inf_mllm_ros.engine.runtime.stream import KVStream
    from inf_mllm_ros.settings import DEFAULTS, stream_config

    scenario = build_route(seed, duration, questions="every")
    stream = KVStream(adapter, stream_config(dict(DEFAULTS) | {"cache_size": cache, "clock": "wall"}))
    stream.time_origin = 8 * 3600.0
    shipped = stream.config  # check_seen on
    records = []
    with torch.inference_mode():
        for line in scenario.narration:
            stream.push_text(line.text, line.time_s)
        for q in scenario.questions:
            if q.kind not in ("never_seen", SEEN_CHECK):
                continue
            # What the check reads, so that its bound can be chosen from the records: the best cosine of any text
            # to the question, and whether a word of the thing's is held.
            blocks = list(stream.archive.blocks)
            texts = stream.retriever.message_texts(blocks)
            held = set().union(*(t.terms for t in texts.values()))
            record = {"seed": seed, "kind": q.kind, "question": q.question, "thing": q.thing, "variants": {},
                      "likeness": round(float(stream.retriever.likeness(q.question, texts).max()), 4),
                      "thing_word_held": bool(thing_terms(q.question) & held),
                      # as the check reads it: a name's held half beside a word none holds aside
                      "thing_word_held_whole": thing_held(q.question, held)}
            # The check changes nothing but the answer where it fires (retrieval and decoding are the same): the
            # model is asked again only then.
            answers = {"check_seen": stream.ask(q.question).text}
            if answers["check_seen"] == NOT_SEEN:
                stream.config = dataclasses.replace(shipped, check_seen=False)
                answers["model"] = stream.ask(q.question).text
                stream.config = shipped
            else:
                answers["model"] = answers["check_seen"]
            for name, answer in answers.items():
                record["variants"][name] = {"right": says_not_seen(answer) == (q.kind == "never_seen"),
                                            "answer": answer}
            records.append(record)
    return records


def run_times(adapter, seed: int, duration: float, cache: int) -> list[dict]:
    """The drive's when and how-long questions answered with `time_note` on and off."""
    import dataclasses

    import torch
    from where_when import TIME_S, elapsed_bound, elapsed_seconds

    from inf_mllm_ros.bags.route_scenario import build_route
    from inf_mllm_ros.bags.stream_inputs import times_of_day
    from inf_mllm_ros.bags.warehouse_layout import SHIFT_START
    from inf_mllm_ros.engine.runtime.stream import KVStream
    from inf_mllm_ros.settings import DEFAULTS, stream_config

    scenario = build_route(seed, duration, questions="every")
    stream = KVStream(adapter, stream_config(dict(DEFAULTS) | {"cache_size": cache, "clock": "wall"}))
    # As the node keeps it: stream time 0 at the first input, on the bag's date (a marker says the date where it
    # changes, so the first one does).
    first = scenario.narration[0].time_s
    stream.time_origin = SHIFT_START.timestamp() + first
    midnight = SHIFT_START.hour * 3600 + SHIFT_START.minute * 60 + SHIFT_START.second
    shipped = stream.config  # time_note on
    records = []
    with torch.inference_mode():
        for line in scenario.narration:
            stream.push_text(line.text, line.time_s - first)
        for q in scenario.questions:
            if q.kind not in ("when_first", "when_last", "how_long_ago"):
                continue
            record = {"seed": seed, "kind": q.kind, "question": q.question, "thing": q.thing, "expected": q.expected,
                      "variants": {}}
            for name, config in (("time_note", shipped), ("no_time_note", dataclasses.replace(shipped, time_note=False))):
                stream.config = config
                answer = stream.ask(q.question, asked_at=q.asked_s - first)
                if q.kind == "how_long_ago":
                    said = elapsed_seconds(answer.text, midnight + q.asked_s)
                    expected = q.expected["seconds"]
                    right = said is not None and abs(said - expected) <= elapsed_bound(expected)
                else:
                    written = times_of_day(answer.text)
                    right = bool(written) and abs(written[0] - midnight - q.expected["time_s"]) <= TIME_S
                top = next((e.stamp + first for e in answer.evidence if e.stamp is not None), None)
                record["variants"][name] = {"right": right, "answer": answer.text, "note": answer.time_note,
                                            "top": top is not None and abs(top - q.expected["time_s"]) <= STAMP_S}
            stream.config = shipped
            records.append(record)
    return records


def times_summary(records: list[dict]) -> dict:
    out = {}
    for name in ("time_note", "no_time_note"):
        cells = {}
        for kind in ("when_first", "when_last", "how_long_ago", "all"):
            rs = [r for r in records if kind in ("all", r["kind"])]
            for score in ("right", "top"):
                hits = sum(r["variants"][name][score] for r in rs)
                low, high = wilson(hits, len(rs))
                cells[f"{kind}/{score}"] = {"hits": hits, "n": len(rs), "rate": round(hits / max(len(rs), 1), 3),
                                            "interval": [round(low, 3), round(high, 3)]}
        out[name] = cells
    return out


def did_you_see_summary(records: list[dict]) -> dict:
    """The model alone, the check as shipped, and the check as it was before a name's held half stopped holding the
    thing (`false_friends_matched`: where that half alone is held, the check did not fire and the model answered)."""

    def right(r: dict, name: str) -> bool:
        if name == "false_friends_matched":
            name = "model" if r.get("thing_word_held") and not r.get("thing_word_held_whole") else "check_seen"
        return r["variants"][name]["right"]

    out = {}
    for name in ("model", "check_seen", "false_friends_matched"):
        cells = {}
        for kind in ("never_seen", "seen_check"):
            rs = [r for r in records if r["kind"] == kind]
            hits = sum(right(r, name) for r in rs)
            low, high = wilson(hits, len(rs))
            cells[kind] = {"hits": hits, "n": len(rs), "rate": round(hits / max(len(rs), 1), 3),
                           "interval": [round(low, 3), round(high, 3)]}
        out[name] = cells
    return out


def summary(records: list[dict], variants: list[str]) -> dict:
    out = {}
    for key in variants:
        cells = {}
        for name in ("asked", "thing"):
            hits = sum(r["variants"][key][name] for r in records)
            low, high = wilson(hits, len(records))
            cells[name] = {"hits": hits, "n": len(records), "rate": round(hits / max(len(records), 1), 3),
                           "interval": [round(low, 3), round(high, 3)]}
        out[key] = cells
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2,200007")
    p.add_argument("--variants", nargs="+", default=["SEMANTIC_WEIGHT=0", "shipped"],
                   help="variants of retrieval's ranking (see above)")
    p.add_argument("--questions", default="drawn", choices=("drawn", "every"),
                   help="the drive's drawn questions, or every kind about every thing seen (as where_when asks)")
    p.add_argument("--names", default="asked", choices=("asked", "said"),
                   help="the questions' own names of things (other words), or the narration's")
    p.add_argument("--duration", type=float, default=300.0)
    p.add_argument("--cache", type=int, default=512)
    p.add_argument("--model", default="onevision-qwen2.5-0.5b")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--did-you-see", action="store_true",
                   help="answer the did-you-see questions with check_seen off and on (no variants)")
    p.add_argument("--times", action="store_true",
                   help="answer the when and how-long questions with time_note on and off (no variants)")
    p.add_argument("--out", default="route_recall.json")
    args = p.parse_args(argv)
    import torch

    from inf_mllm_ros.engine.models.loading import load_model

    torch.set_num_threads(args.threads)
    variants = args.variants
    for name in variants:  # an unknown variant refused before the model loads
        with variant(name):
            pass
    adapter = load_model(args.model, device="cpu", dtype=args.dtype)
    records, started = [], time.monotonic()
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / args.out
    for seed in (int(s) for s in args.seeds.split(",")):
        if args.did_you_see:
            records += run_did_you_see(adapter, seed, args.duration, args.cache)
        elif args.times:
            records += run_times(adapter, seed, args.duration, args.cache)
        else:
            records += run_seed(adapter, seed, args.duration, args.cache, variants, args.questions, args.names)
        print(f"seed {seed}: {len(records)} questions so far, {time.monotonic() - started:.0f} s", flush=True)
        result = {"settings": vars(args), "records": records,
                  "summary": (did_you_see_summary(records) if args.did_you_see else times_summary(records)
                              if args.times else summary(records, variants))}
        path.write_text(json.dumps(result, indent=1) + "\n")  # after each seed
    if args.times:
        for name, cells in result["summary"].items():
            print(f"{name}: " + ", ".join(f"{k} {c['hits']}/{c['n']}" for k, c in cells.items()))
        print(f"wrote {shown(path)}")
        return
    if args.did_you_see:
        for name, cells in result["summary"].items():
            print(f"{name}: never seen said not seen {cells['never_seen']['hits']}/{cells['never_seen']['n']} "
                  f"{cells['never_seen']['interval']}, seen not denied {cells['seen_check']['hits']}/"
                  f"{cells['seen_check']['n']} {cells['seen_check']['interval']}")
        print(f"wrote {shown(path)}")
        return
    for name, cells in result["summary"].items():
        print(f"{name}: asked sighting {cells['asked']['hits']}/{cells['asked']['n']} "
              f"{cells['asked']['interval']}, the thing {cells['thing']['hits']}/{cells['thing']['n']}")
    print(f"wrote {shown(path)}")


if __name__ == "__main__":
    main()
