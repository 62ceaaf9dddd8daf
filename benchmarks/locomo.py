"""LoCoMo: long conversations written by others, streamed into the memory turn by turn and asked at the end.

LoCoMo (Maharana et al., ACL 2024; public repository snap-research/locomo) holds conversations between two people
over months, with questions whose answers and evidence turns are annotated. The data is read from a folder
(`--data`, default `../shared/data/locomo` beside the checkout); it is never copied into the project. Conversations
26 and 41 are the tuning set, 42, 43 and 44 the report set (declared in the report results file before its first
run, with the commit and the settings; a report run whose misses lead to a change makes that conversation tuning
data).

Each turn goes in as a text, "Speaker: words" (a shared photo as its caption), stamped at its session's date and
time (turns of a session 30 s apart, in order) on the wall clock (`clock: wall`, UTC), in batches of a few turns as
the node takes texts that wait. At the end, each question of categories 1 (multi-hop), 2 (temporal), 4 (single-hop)
and 5 (adversarial: the right answer is that it was never said) is asked with the shipped prompt and settings, and
not kept in memory. Scored as LoCoMo scores:

- token F1 of the answer against the gold answer (normalised: lower case, no punctuation or articles; no
  stemming); multi-hop: the mean over the gold's comma-separated parts of the best F1 against the answer's parts;
  adversarial: 1 where the answer says it was not mentioned (`said_not_mentioned`), else 0;
- evidence hit@5: an annotated evidence turn among the answer's five heaviest evidence entries;
- temporal: whether the answer names the gold date (day and month; month and year where the gold is a month; the
  year where it is a year).

Settings side by side in one run: `archive` (as shipped), `no_archive` (the cache alone), `streaming_archive`
(StreamingLLM with the archive), `full` (a cache that holds the whole conversation: the ceiling) and `bm25`
(BM25 over the turns, `bm25s`, the question as its query: evidence hit@5 only, no answer); `no_time_note` (as
shipped but `time_note` off: nothing restated after a question that asks when; with `--memories` it answers from the
memory `archive` saved). Intervals: a percentile bootstrap over questions.

    python benchmarks/run.py locomo --set tuning                        # conversations 26 and 41
    python benchmarks/run.py locomo --set report --resume               # 42-44, going on where a run stopped
    python benchmarks/run.py locomo --set tuning --per-category 10      # a quick look: 10 questions a category
    python benchmarks/run.py locomo --summary --out locomo_report.json  # the table of the recorded runs

Results: results/locomo_<set>.json, {"declared": {...}, "records": [...], "summary": {...}}.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import string
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone
from pathlib import Path

from common import RESULTS, ROOT, machine

DATA = ROOT.parent / "shared" / "data" / "locomo"
SETS = {"tuning": ["26", "41"], "report": ["42", "43", "44"]}
CATEGORIES = {1: "multi-hop", 2: "temporal", 4: "single-hop", 5: "adversarial"}
# The ceiling: the model's whole context (Qwen2.5's 32,768 tokens, less the headroom for the question and answer).
# It holds conversation 26 and 42 whole (23K and 29K tokens with their markers); of the longer ones (34K-35K tokens)
# the newest 32K and the first (StreamingLLM's sinks), nothing placed from the archive (its scores give the evidence).
FULL_CACHE = 32512
SETTINGS = {
    "archive": {},
    "no_archive": {"archive_size": 0},
    "streaming_archive": {"eviction_policy": "streaming_llm"},
    "full": {"cache_size": FULL_CACHE, "eviction_policy": "streaming_llm", "retrieve_tokens": 0, "archive_size": 65536},
    "bm25": None,  # retrieval only: no stream
    "no_time_note": {"time_note": False},  # as shipped, nothing restated after a question that asks when
}
# Settings that change only how a question is answered: with --memories they take the memory the shipped one saved.
SAME_MEMORY = {"no_time_note": "archive"}
TURN_SPACING_S = 30.0
EVIDENCE_K = 5
MONTHS = {name.lower(): i for i, name in enumerate(
    ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November",
     "December"], 1)}
MONTHS |= {name[:3]: i for name, i in list(MONTHS.items())} | {"sept": 9}
# An answer says the thing was never said (category 5) where it holds one of these (LoCoMo's own check is the first
# two; the others are how this model says it).
NOT_MENTIONED = ("not mentioned", "no information", "not mention", "no mention", "not say", "not said",
                 "not stated", "not specified", "not provided", "don't know", "do not know", "unknown",
                 "not known", "no record", "not in the memory", "no details")

# The options of a short run on the small models (run.py --smoke).
SMOKE = ["--model", "smollm2", "--conversations", "26", "--sessions", "2", "--per-category", "1",
         "--settings", "archive,no_archive,bm25", "--caches", "128", "--max-new-tokens", "8"]


# --- the data ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Turn:
    dia_id: str
    text: str
    stamp: float  # seconds since the conversation's first session


@dataclass(frozen=True)
class Question:
    index: int
    category: int
    question: str
    gold: str
    evidence: tuple[str, ...]


def session_time(text: str) -> datetime:
    """A session's "1:56 pm on 8 May, 2023" as a time (UTC)."""
    return datetime.strptime(" ".join(text.split()), "%I:%M %p on %d %B, %Y").replace(tzinfo=timezone.utc)


def load_conversation(data: Path, name: str, sessions: int | None = None) -> tuple[list[Turn], list[Question], float]:
    """The turns of conversation `name` (its first `sessions`), its questions of CATEGORIES, and the epoch seconds
    of its first session (stream time 0)."""
    path = data / f"{name}.json"
    if not path.exists():
        raise SystemExit(f"LoCoMo conversation {path} not found (pass --data: the folder of its .json files)")
    conv = json.loads(path.read_text())
    numbers = sorted(int(m.group(1)) for k in conv if (m := re.fullmatch(r"session_(\d+)", k)))[:sessions]
    origin = session_time(conv[f"session_{numbers[0]}_date_time"]).timestamp()
    turns = []
    for n in numbers:
        start = session_time(conv[f"session_{n}_date_time"]).timestamp() - origin
        for i, t in enumerate(conv[f"session_{n}"]):
            text = f"{t['speaker']}: {t['text']}"
            if t.get("blip_caption"):
                text += f" [shares a photo of {t['blip_caption']}]"
            turns.append(Turn(t["dia_id"], text, start + i * TURN_SPACING_S))
    said = {t.dia_id for t in turns}
    questions = []
    for i, q in enumerate(conv["qa"]):
        if q["category"] not in CATEGORIES:
            continue
        evidence = tuple(e.strip() for e in q.get("evidence", []))
        if sessions is not None and not any(e in said for e in evidence):
            continue  # a short smoke run: only what its sessions hold
        gold = "Not mentioned in the conversation" if q["category"] == 5 else str(q["answer"])
        questions.append(Question(i, q["category"], q["question"], gold, evidence))
    return turns, questions, origin


def chosen_questions(questions: list[Question], per_category: int | None, seed: int,
                     categories: tuple[int, ...] = tuple(CATEGORIES),
                     not_drawn_by: tuple[tuple[int, int], ...] = ()) -> list[Question]:
    """The questions of `categories`: all, or `per_category` of each drawn with `seed`, in the conversation's
    order; with `not_drawn_by` ((per_category, seed), ...), only among those that earlier runs' draws of every scored
    category did not take (the questions no earlier run asked), each draw made among what the ones before it left."""
    for draw in not_drawn_by:
        taken = {q.index for q in chosen_questions(questions, *draw)}
        questions = [q for q in questions if q.index not in taken]
    questions = [q for q in questions if q.category in categories]
    if per_category is None:
        return questions
    rng = random.Random(seed)
    out = []
    for category in categories:
        those = [q for q in questions if q.category == category]
        out += rng.sample(those, min(per_category, len(those)))
    return sorted(out, key=lambda q: q.index)


# --- scoring (LoCoMo's) -----------------------------------------------------------------------------------------
def normalized_tokens(text: str) -> list[str]:
    text = str(text).lower().replace(",", " ")
    text = "".join(c for c in text if c not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the|and)\b", " ", text)
    return text.split()


def token_f1(prediction: str, gold: str) -> float:
    p, g = normalized_tokens(prediction), normalized_tokens(gold)
    common = sum((Counter(p) & Counter(g)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def multi_f1(prediction: str, gold: str) -> float:
    """Multi-hop: the mean over the gold's comma-separated parts of the best F1 against the answer's parts."""
    parts = [p.strip() for p in prediction.split(",")]
    golds = [g.strip() for g in gold.split(",")]
    return statistics.mean(max(token_f1(p, g) for p in parts) for g in golds)


def said_not_mentioned(answer: str) -> bool:
    low = answer.lower().replace("\u2019", "'")
    return any(phrase in low for phrase in NOT_MENTIONED)


def score(category: int, answer: str, gold: str) -> float:
    if category == 5:
        return float(said_not_mentioned(answer))
    if category == 1:
        return multi_f1(answer, gold)
    return token_f1(answer, gold)


_DAY = r"(\d{1,2})(?:st|nd|rd|th)?"
_MONTH = r"(" + "|".join(sorted(MONTHS, key=len, reverse=True)) + r")\.?"


def dates_in(text: str) -> set[tuple]:
    """The dates a text names: ("dm", day, month), ("my", month, year), ("y", year)."""
    low = str(text).lower()
    out = set()
    for m in re.finditer(rf"\b{_DAY}\s+(?:of\s+)?{_MONTH}\b", low):
        out.add(("dm", int(m.group(1)), MONTHS[m.group(2)]))
    for m in re.finditer(rf"\b{_MONTH}\s+{_DAY}\b", low):
        out.add(("dm", int(m.group(2)), MONTHS[m.group(1)]))
    for m in re.finditer(r"\b(\d{4})-(\d{2})-(\d{2})\b", low):
        out.add(("dm", int(m.group(3)), int(m.group(2))))
    for m in re.finditer(rf"\b{_MONTH},?\s+(\d{{4}})\b", low):
        out.add(("my", MONTHS[m.group(1)], int(m.group(2))))
    for m in re.finditer(rf"\b{_DAY}\s+(?:of\s+)?{_MONTH},?\s+(\d{{4}})\b", low):
        out.add(("my", MONTHS[m.group(2)], int(m.group(3))))
    for m in re.finditer(r"\b(19\d{2}|20\d{2})\b", low):
        out.add(("y", int(m.group(1))))
    return out


_WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")


def gold_dates(gold: str) -> set[tuple]:
    """The dates a gold answer names, and the day that "the Friday before 15 July 2023" (or "the day before ...")
    means: an answer that says that day, 14 July, names the gold's date as well as one that says the 15th."""
    out = dates_in(gold)
    m = re.search(rf"\bthe (day|{'|'.join(_WEEKDAYS)}) before {_DAY}\s+{_MONTH},?\s+(\d{{4}})\b", str(gold).lower())
    if m:
        anchor = date(int(m.group(4)), MONTHS[m.group(3)], int(m.group(2)))
        back = 1 if m.group(1) == "day" else (anchor.weekday() - _WEEKDAYS.index(m.group(1))) % 7 or 7
        meant = anchor - timedelta(days=back)
        out.add(("dm", meant.day, meant.month))
    return out


def names_gold_date(answer: str, gold: str) -> bool | None:
    """Whether the answer names the gold's date: its day and month where the gold has them, else its month and
    year, else its year; None where the gold names no date ("last week")."""
    wanted, said = gold_dates(gold), dates_in(answer)
    for kind in ("dm", "my", "y"):
        of_kind = {d for d in wanted if d[0] == kind}
        if of_kind:
            return bool(of_kind & said)
    return None


def bootstrap(values: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 95 % percentile bootstrap interval of a mean over questions."""
    if not values:
        return (0.0, 0.0)
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    return means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


# --- the runs --------------------------------------------------------------------------------------------------
def bm25_records(conv: str, turns: list[Turn], questions: list[Question]) -> list[dict]:
    import bm25s

    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize([t.text for t in turns], stopwords="en", show_progress=False),
                    show_progress=False)
    records = []
    for q in questions:
        found, _ = retriever.retrieve(bm25s.tokenize([q.question], stopwords="en", show_progress=False),
                                      k=min(EVIDENCE_K, len(turns)), show_progress=False)
        top = [turns[int(i)].dia_id for i in found[0]]
        records.append(base_record(conv, "bm25", 0, q) | {"evidence_ids": top, "hit5": bool(set(top) & set(q.evidence))})
    return records


def base_record(conv: str, setting: str, cache: int, q: Question) -> dict:
    return {"conversation": conv, "setting": setting, "cache": cache, "index": q.index, "category": q.category,
            "question": q.question, "gold": q.gold, "evidence": list(q.evidence)}


def ingest(stream, turns: list[Turn], batch: int) -> list[tuple[int, int, str]]:
    """The turns into the stream, `batch` to a call; each turn's stream indices [first, end), to tell which turns
    an archived block holds."""
    spans = []
    for i in range(0, len(turns), batch):
        part = turns[i : i + batch]
        counts = stream.push_texts([(t.text, t.stamp) for t in part])
        first = stream.tokens_seen - sum(counts)
        for t, n in zip(part, counts):
            spans.append((first, first + n, t.dia_id))
            first += n
    return spans


def stream_records(adapter, conv: str, setting: str, names: list[str], cache: int, turns: list[Turn],
                   questions: list[Question], origin: float, args, done: dict, write) -> None:
    """One conversation into a fresh stream with one setting, then its questions; `write` gets each record. The
    archive's stream also answers as `no_archive` (retrieval off) where that is asked: the cache is the same with
    the archive on or off (engine/stream_config.py), so one stream serves both."""
    from inf_mllm_ros.engine.runtime.stream import KVStream
    from inf_mllm_ros.settings import DEFAULTS, stream_config

    unknown = set(SETTINGS[setting]) - set(DEFAULTS)
    if unknown:  # a setting the parameter table does not read would silently run the shipped one
        raise ValueError(f"setting {setting!r}: not node parameters: {sorted(unknown)}")
    values = dict(DEFAULTS) | {"model": args.model, "cache_size": cache, "clock": "wall", "time_zone": "UTC"}
    values |= SETTINGS[setting]
    if args.max_new_tokens:
        values["max_new_tokens"] = args.max_new_tokens
    stream = KVStream(adapter, stream_config(values))
    if args.answer_prompt is not None:
        stream.reconfigure(answer_prompt=args.answer_prompt)
    if args.when_prompt is not None:
        stream.reconfigure(when_prompt=args.when_prompt)
    stream.time_origin = origin
    started = time.monotonic()
    memory = (Path(args.memories) / f"{conv}_{SAME_MEMORY.get(setting, setting)}_{values['cache_size']}.mem"
              if args.memories else None)
    if memory is not None and memory.exists():
        from inf_mllm_ros.engine.persistence.memory_file import load_memory

        load_memory(stream, memory)
        spans = [tuple(s) for s in json.loads(memory.with_suffix(".spans.json").read_text())]
    else:
        spans = ingest(stream, turns, args.batch)
        if memory is not None:
            from inf_mllm_ros.engine.persistence.memory_file import save_memory

            memory.parent.mkdir(parents=True, exist_ok=True)
            save_memory(stream, memory)
            memory.with_suffix(".spans.json").write_text(json.dumps(spans))
    ingest_s = time.monotonic() - started
    blocks = {b.first_seq: b for b in stream.archive.blocks}

    def held_turns(first_seq: int) -> list[str]:
        """The turns of the archived block that begins at `first_seq` (a block may hold two short turns)."""
        block = blocks.get(first_seq)
        end = block.seq_end if block is not None else first_seq + 1
        return [dia for a, b, dia in spans if a < end and b > first_seq]

    print(f"{conv} {setting} cache {values['cache_size']}: {len(turns)} turns, {stream.tokens_seen} tokens in "
          f"{ingest_s:.0f} s", flush=True)
    if args.scores:
        dump_scores(stream, conv, setting, values["cache_size"], questions, held_turns, Path(args.scores))
        return
    if args.ablation:
        write(*ablation(stream, conv, values["cache_size"], questions, held_turns,  # one save: its summary is slow
                        args.ablation_variants))
        return
    if args.latency:
        write(latency(stream, conv, values["cache_size"], questions))
        return
    if args.speaker_check:
        write(*speaker_check(stream, conv, values["cache_size"], questions))
        return
    for name in names:  # the setting's own, then no_archive where the archive's stream serves it too
        if name == "no_archive":
            stream.reconfigure(retrieve_tokens=0, evidence=0)
        answer_all(stream, conv, name, values["cache_size"], questions, held_turns, done.get(name, set()), args,
                   write)


def answer_all(stream, conv: str, setting: str, cache: int, questions: list[Question], held_turns, done: set, args,
               write) -> None:
    """Each question not `done` asked of the stream and judged; `write` gets each record."""
    for q in questions:
        if q.index in done:
            continue
        answer = stream.ask(q.question)
        entries = [held_turns(e.first_seq) for e in answer.evidence[:EVIDENCE_K]]
        ids = [dia for entry in entries for dia in entry]
        record = base_record(conv, setting, cache, q) | {
            "answer": answer.text, "f1": round(score(q.category, answer.text, q.gold), 4),
            "hit5": bool(set(ids) & set(q.evidence)) if answer.evidence else None, "evidence_ids": entries,
            "names_date": names_gold_date(answer.text, q.gold) if q.category == 2 else None,
            "ask_s": round(answer.latency, 3), "retrieved_tokens": answer.retrieved_tokens,
            "not_decoded": answer.tokens_generated == 0,  # answered as not mentioned by the speaker check
            "answer_prompt": stream.config.answer_prompt, "when_prompt": stream.config.when_prompt,
            "tokens_seen": stream.tokens_seen, "model": args.model,
            "machine": machine()}
        write(record)
        print(json.dumps({k: record[k] for k in ("conversation", "setting", "category", "gold", "answer", "f1",
                                                 "hit5")}), flush=True)


def dump_scores(stream, conv: str, setting: str, cache: int, questions: list[Question], held_turns,
                folder: Path) -> None:
    """For tuning retrieval without answers: each question's attention scores of every archived block (the
    retrieval index's, before words are added), with each block's turn, message, text and whether the cache holds
    it, to `folder`/scores_<conv>_<setting>_<cache>.pt."""
    import torch

    retriever = stream.retriever
    blocks = list(stream.archive.blocks)
    held = retriever.held(blocks)
    quotes = {}
    for b in blocks:
        if b.message not in quotes:
            quotes[b.message] = retriever.quote(b)
    rows = []
    for q in questions:
        ids, content = stream.question_ids(stream.adapter.chat.question_parts(q.question))
        question = stream.content_queries(ids, content)
        rows.append({"index": q.index, "category": q.category, "question": q.question, "gold": q.gold,
                     "evidence": list(q.evidence), "text": retriever.question_text(ids, content),
                     "attention": retriever.index(question[0]).scores(question, blocks).clone()})
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"blocks": [{"stamp": b.stamp, "message": b.message, "held": h, "length": b.length,
                            "turns": held_turns(b.first_seq)}
                           for b, h in zip(blocks, held)],
                "quotes": quotes, "questions": rows}, folder / f"scores_{conv}_{setting}_{cache}.pt")
    print(f"{conv} {setting}: scores of {len(rows)} questions over {len(blocks)} blocks", flush=True)


# What each part of retrieval's ranking adds (`--ablation`): attention on the retrieval heads alone, then the word
# shares, then BM25, then the reply lift, then the sentence encoder's meaning at several weights and powers, and the
# words that ask for the newest or the oldest moment matched as before, and a name's held half matched beside a word no
# message holds (`false_friends`). The retriever's names, set for each.
ABLATION = {
    "attention": {"WORD_MATCH_WEIGHT": 0.0, "LEXICAL_WEIGHT": 0.0, "REPLY_SHARE": 0.0, "SEMANTIC_WEIGHT": 0.0},
    "+word_shares": {"LEXICAL_WEIGHT": 0.0, "REPLY_SHARE": 0.0, "SEMANTIC_WEIGHT": 0.0},
    "+bm25": {"REPLY_SHARE": 0.0, "SEMANTIC_WEIGHT": 0.0},
    "+reply": {"SEMANTIC_WEIGHT": 0.0},
    "+meaning_3": {"SEMANTIC_WEIGHT": 3.0},
    "+meaning_5": {"SEMANTIC_WEIGHT": 5.0},
    "+meaning_12": {"SEMANTIC_WEIGHT": 12.0},
    "+meaning_20": {"SEMANTIC_WEIGHT": 20.0},
    "meaning_8_power_1": {"SEMANTIC_WEIGHT": 8.0, "MEANING_POWER": 1.0},
    "meaning_8_power_2": {"SEMANTIC_WEIGHT": 8.0, "MEANING_POWER": 2.0},
    "meaning_12_power_2": {"SEMANTIC_WEIGHT": 12.0, "MEANING_POWER": 2.0},
    "meaning_12_power_4": {"SEMANTIC_WEIGHT": 12.0, "MEANING_POWER": 4.0},
    "meaning_16_power_4": {"SEMANTIC_WEIGHT": 16.0, "MEANING_POWER": 4.0},
    "order_words_matched": {"without_order": lambda question: question},
    "unsaid_alike": {"UNSAID_SEMANTIC_WEIGHT": 8.0, "UNSAID_MEANING_POWER": 1.0},
    "unsaid_12_power_2": {"UNSAID_SEMANTIC_WEIGHT": 12.0, "UNSAID_MEANING_POWER": 2.0},
    "unsaid_16_power_4": {"UNSAID_SEMANTIC_WEIGHT": 16.0, "UNSAID_MEANING_POWER": 4.0},
    "false_friends_matched": {"false_friends": lambda question, held: set()},
    "shipped": {},
}


def ablation(stream, conv: str, cache: int, questions: list[Question], held_turns,
             variants: list[str] | None = None) -> list[dict]:
    """Each question's five best moments (`recall`, ranked as an answer's evidence is) under each ABLATION variant:
    evidence hit@5 only, no answer."""
    from inf_mllm_ros.engine.archive import retriever

    shipped = {name: getattr(retriever, name) for variant in ABLATION.values() for name in variant}
    records = []
    forward, asked = stream.content_queries, {}

    def content_queries(ids, content):  # a question's forward is the same in every variant: run it once
        key = (tuple(ids.tolist()), content.start, content.stop)
        if key not in asked:
            asked[key] = forward(ids, content)
        return asked[key]

    stream.content_queries = content_queries
    try:
        for variant, weights in ABLATION.items():
            if variants and variant not in variants:
                continue
            for name, value in shipped.items():
                setattr(retriever, name, weights.get(name, value))
            for q in questions:
                if q.category == 5:
                    continue
                entries = [held_turns(m.first_seq) for m in stream.recall(q.question, limit=EVIDENCE_K)]
                ids = {dia for entry in entries for dia in entry}
                records.append(base_record(conv, f"ablation:{variant}", cache, q)
                               | {"hit5": bool(ids & set(q.evidence)), "evidence_ids": entries})
    finally:
        del stream.content_queries
        for name, value in shipped.items():
            setattr(retriever, name, value)
    return records


def speaker_check(stream, conv: str, cache: int, questions: list[Question], depths: tuple[int, ...] = (1, 2, 3)
                  ) -> list[dict]:
    """For choosing the speaker check's depth without answers (`--speaker-check`): each question's heaviest evidence
    (`recall`, ranked as an answer's evidence is), and whether the check answers it as not mentioned at each depth."""
    from inf_mllm_ros.engine.archive.attribution import speaker, unattributed

    speakers = {t.speaker for t in stream.retriever.message_texts(list(stream.archive.blocks)).values() if t.speaker}
    records = []
    for q in questions:
        moments = stream.recall(q.question, limit=max(depths))
        records.append(base_record(conv, "speaker_check", cache, q)
                       | {"speakers": [speaker(m.text) for m in moments],
                          "not_mentioned": {str(d): bool(unattributed(q.question, moments, speakers, d))
                                            for d in depths}})
    return records


def latency(stream, conv: str, cache: int, questions: list[Question], new_tokens: int = 16) -> dict:
    """Answer time with the archive as shipped, with no day placed after retrieved blocks, and without retrieval,
    the same questions in turn on the same memory: seconds per answer (median), and the day turns computed."""
    computed: list[str] = []
    place_turn, place_day, budget = stream.place_turn, stream.retriever.place_day, stream.config.retrieve_tokens
    stream.place_turn = lambda text: computed.append(text) or place_turn(text)
    out = {"conversation": conv, "setting": "latency", "cache": cache, "questions": len(questions),
           "max_new_tokens": new_tokens, "machine": machine(), "commit": commit(),
           "day_turns": "each day's turn computed once, then placed as kept"}
    stream.ask("What happened?", max_new_tokens=2)  # the retrieval heads and the index, once
    for name in ("archive", "no_days", "no_archive"):
        stream.reconfigure(retrieve_tokens=0 if name == "no_archive" else budget)
        stream.retriever.place_day = (lambda turn, spare: 0) if name == "no_days" else place_day
        computed.clear()
        times = []
        for q in questions:
            start = time.perf_counter()
            stream.ask(q.question, max_new_tokens=new_tokens)
            times.append(time.perf_counter() - start)
        out[name] = {"answer_s_median": round(statistics.median(times), 3), "day_turns": len(computed)}
    stream.retriever.place_day = place_day
    stream.reconfigure(retrieve_tokens=budget)
    for name in ("archive", "no_days"):
        out[name]["of_no_archive"] = round(out[name]["answer_s_median"] / out["no_archive"]["answer_s_median"], 3)
    print(json.dumps(out), flush=True)
    return out


# --- the summary -----------------------------------------------------------------------------------------------
def _mean(values: list[float]) -> dict:
    low, high = bootstrap(values)
    return {"mean": round(statistics.mean(values), 3) if values else None, "n": len(values),
            "interval_95": [round(low, 3), round(high, 3)]}


def cell(records: list[dict]) -> dict:
    out: dict = {}
    for category, name in [(None, "all")] + list(CATEGORIES.items()):
        rows = [r for r in records if category is None or r["category"] == category]
        if not rows:
            continue
        figures = {}
        if "f1" in rows[0]:
            figures["f1"] = _mean([r["f1"] for r in rows])
        hits = [float(r["hit5"]) for r in rows if r.get("hit5") is not None and r["category"] != 5]
        if hits:
            figures["hit5"] = _mean(hits)
        if category == 2 and "names_date" in rows[0]:
            figures["names_date"] = _mean([float(r["names_date"]) for r in rows if r["names_date"] is not None])
        if "not_mentioned" in rows[0]:  # --speaker-check: the share it answers as not mentioned, at each depth
            figures["check_not_mentioned"] = {d: _mean([float(r["not_mentioned"][d]) for r in rows])
                                              for d in rows[0]["not_mentioned"]}
        if category == 5 and "answer" in rows[0]:
            figures["said_not_mentioned"] = _mean([float(said_not_mentioned(r["answer"])) for r in rows])
        out[name] = figures
    entries = [len(e) for r in records for e in r.get("evidence_ids", []) if isinstance(e, list)]
    if entries:
        out["turns_per_entry"] = round(statistics.mean(entries), 2)  # an archive block may hold two short turns
    asks = [r["ask_s"] for r in records if "ask_s" in r]
    if asks:
        out["ask_s_median"] = round(statistics.median(asks), 3)
    return out


def summary(records: list[dict]) -> dict:
    records = [r for r in records if "category" in r]  # a latency record stands apart
    cells = {}
    for setting, cache in sorted({(r["setting"], r["cache"]) for r in records}):
        cells[f"{setting}/{cache}"] = cell([r for r in records if (r["setting"], r["cache"]) == (setting, cache)])
    return {"conversations": sorted({r["conversation"] for r in records}), "cells": cells}


def table(result: dict) -> str:
    """The summary as a markdown table: F1 and hit@5 per category for each setting."""
    lines = ["| setting | " + " | ".join(f"{n} F1 | {n} hit@5" for n in ["all", *CATEGORIES.values()])
             + " | temporal names date | ask s |",
             "|---" * (2 + 2 * (len(CATEGORIES) + 1) + 1) + "|"]

    def fig(cell, name, what):
        f = cell.get(name, {}).get(what)
        return "" if not f or f["mean"] is None else f"{f['mean']:.2f} ({f['interval_95'][0]:.2f}-{f['interval_95'][1]:.2f})"

    for key, c in result["cells"].items():
        row = [key] + [fig(c, n, w) for n in ["all", *CATEGORIES.values()] for w in ("f1", "hit5")]
        row += [fig(c, "temporal", "names_date"), str(c.get("ask_s_median", ""))]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=DATA, help="the folder of LoCoMo's conversation files")
    p.add_argument("--set", choices=sorted(SETS), default="tuning")
    p.add_argument("--conversations", default="", help="conversations separated by commas (default: the set's)")
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--caches", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--model", default="onevision-qwen2.5-0.5b")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="turns pushed in one call")
    p.add_argument("--per-category", type=int, default=None, help="questions drawn of each category (default all)")
    p.add_argument("--seed", type=int, default=0, help="the draw of --per-category")
    p.add_argument("--categories", default=",".join(map(str, CATEGORIES)),
                   help="the categories asked, separated by commas (default all that are scored)")
    p.add_argument("--not-drawn-by", nargs="*", default=[], metavar="PER_CATEGORY,SEED",
                   help="draw only among the questions those draws did not take, each made among what the ones "
                        "before it left (the questions earlier runs never asked)")
    p.add_argument("--sessions", type=int, default=None, help="only the first sessions (a smoke run)")
    p.add_argument("--max-new-tokens", type=int, default=0, help="0: the shipped setting")
    p.add_argument("--answer-prompt", default=None, help="said after each question (default: the shipped one)")
    p.add_argument("--when-prompt", default=None, help="said after each question that asks when (default: the "
                   "shipped one)")
    p.add_argument("--note", default="", help="what the results file's declaration should say of this run")
    p.add_argument("--resume", action="store_true", help="keep the recorded answers, run the rest")
    p.add_argument("--summary", action="store_true", help="only print the summary of the recorded runs")
    p.add_argument("--out", default="", help="the results file (with --summary: several, separated by commas)")
    p.add_argument("--memories", default="", help="save each stream's memory here after its turns, and load it "
                   "from here when it is there (for tuning the answers; remove it when what goes in changes)")
    p.add_argument("--latency", action="store_true", help="only answer times: as shipped, with no day placed, "
                   "without retrieval (the same questions, the same memory)")
    p.add_argument("--speaker-check", action="store_true", help="only whether the speaker check answers each "
                   "question as not mentioned, at depths 1 to 3, from its evidence (no answers)")
    p.add_argument("--ablation-variants", nargs="*", default=None, metavar="VARIANT",
                   help="with --ablation, only these of ABLATION (default: all)")
    p.add_argument("--ablation", action="store_true", help="only evidence hit@5 for each part of retrieval's "
                   "ranking (ABLATION), no answers")
    p.add_argument("--scores", default="", help="only dump each question's attention scores to this folder")
    args = p.parse_args(argv)
    if args.summary and "," in args.out:  # runs that shared the work, each in its own file
        records = [r for name in args.out.split(",") for r in json.loads((RESULTS / name).read_text())["records"]]
        print(table(summary(records)))
        return
    path = RESULTS / (args.out or f"locomo_{args.set}.json")
    saved = json.loads(path.read_text()) if path.exists() and (args.resume or args.summary) else {}
    records: list[dict] = saved.get("records", [])
    declared = saved.get("declared")
    convs = [c for c in args.conversations.split(",") if c] or SETS[args.set]
    settings = [s for s in args.settings.split(",") if s]
    categories = tuple(int(c) for c in args.categories.split(",") if c)
    if set(categories) - set(CATEGORIES):
        p.error(f"--categories: only {sorted(CATEGORIES)} are scored")
    not_drawn_by = tuple(tuple(int(n) for n in draw.split(",")) for draw in args.not_drawn_by)
    if any(len(draw) != 2 for draw in not_drawn_by):
        p.error("--not-drawn-by: PER_CATEGORY,SEED ...")
    if declared is None:
        declared = {"set": args.set, "conversations": convs, "settings": settings, "caches": args.caches,
                    "model": args.model, "dtype": args.dtype, "per_category": args.per_category, "seed": args.seed,
                    "categories": list(categories), "not_drawn_by": [list(d) for d in not_drawn_by] or None,
                    "commit": commit(), **({"note": args.note} if args.note else {}),
                    "declared_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}

    def save() -> None:
        RESULTS.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"declared": declared, "records": records, "summary": summary(records)}, indent=1)
                        + "\n")

    if not args.summary:
        save()  # the declaration, before the first answer
        import torch

        from inf_mllm_ros.engine.models.loading import load_model

        torch.set_num_threads(args.threads)
        adapter = None
        for conv in convs:
            turns, questions, origin = load_conversation(args.data, conv, args.sessions)
            questions = chosen_questions(questions, args.per_category, args.seed, categories, not_drawn_by)
            for setting in settings:
                if setting == "no_archive" and "archive" in settings:
                    continue  # asked of the archive's stream
                for cache in ([0] if setting == "bm25" else [FULL_CACHE] if setting == "full" else args.caches):
                    names = [setting] + (["no_archive"] if setting == "archive" and "no_archive" in settings else [])
                    done = {name: {r.get("index") for r in records if (r["conversation"], r["setting"], r["cache"])
                                   == (conv, name, cache)} for name in names}
                    if all(q.index in done[name] for q in questions for name in names):
                        continue
                    if setting == "bm25":
                        records += [r for r in bm25_records(conv, turns, questions) if r["index"] not in done["bm25"]]
                        save()
                        continue
                    if adapter is None:
                        adapter = load_model(args.model, device=args.device, dtype=args.dtype)

                    def write(*new: dict) -> None:
                        records.extend(new)
                        save()

                    with torch.inference_mode():
                        stream_records(adapter, conv, setting, names, cache, turns, questions, origin, args, done, write)
        save()
    result = summary(records)
    print(table(result))


if __name__ == "__main__":
    main()
