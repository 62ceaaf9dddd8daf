"""What shapes a stream's memory: `StreamConfig`, the settings a `KVStream` (engine/runtime/stream.py) is made with."""

from __future__ import annotations

from dataclasses import dataclass, field

from .models.chat import MarkerClock

DEFAULT_SYSTEM_PROMPT = (
    "You are the memory of a mobile robot. Camera frames and messages arrive with their time in seconds. "
    "Answer questions about what happened briefly and precisely."
)

# How an answer is decoded, and an input's blocks taken in (engine/memory/decode_step.py, engine/memory/ingest_step.py).
STEP_MODES = ("auto", "eager", "static", "compiled")

# The settings a stream takes while it runs (`KVStream.reconfigure`), from its next input or question: how it answers,
# what it takes in and what an answer retrieves. The others shape its cache and archive when it is made.
RECONFIGURABLE = frozenset({"system_prompt", "max_new_tokens", "answer_prompt", "when_prompt", "max_frame_pixels",
                            "max_text_chars", "retrieve_tokens", "evidence"})

# The smallest memory that still holds the sinks, a recent window and a few candidates.
MIN_CAPACITY = 8


@dataclass
class StreamConfig:
    """Everything that shapes the memory. Sizes are in tokens."""

    capacity: int = 1024
    policy: str = "inf_mllm"
    # The policy's own settings by name (see its knobs in policies/); the ones left out take its defaults.
    policy_settings: dict = field(default_factory=dict)
    chunk_size: int = 128  # longest block pushed before an eviction
    headroom: int | None = None  # slots beyond capacity; default max(chunk_size, 256)
    position_mode: str = "cache"  # "cache": positions re-packed inside the cache; "original"
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    max_new_tokens: int = 64
    # Said after each question's own words, in its turn (not in its words that retrieval reads): how to answer. A
    # planner wants a few words: on LoCoMo's tuning conversation 26 this prompt halved the answers' length and
    # doubled their F1 on single-hop questions, and the codes recalled from the cache after a camera flood were 19
    # and 17 of 32 with it against 20 and 17 without (benchmarks/cache_alone.py, docs/benchmarks.md). "" says nothing.
    answer_prompt: str = "Answer in a few words."
    # Said in its place after a question that asks when (engine/answering.py `asks_when`): a planner asking when
    # wants the moment, not the question's words said back. On LoCoMo's tuning conversations 26 and 41 (their 64
    # temporal questions, every one asked with each prompt) it took F1 from 0.31 to 0.51 with the answers naming the
    # gold date level (0.58, 0.56); "Answer with the date only." gave 0.48 but 0.49 (a date made up for "last week"),
    # "Answer with a short phrase, not a whole sentence." 0.38 and 0.54 (docs/benchmarks.md). "": answer_prompt.
    when_prompt: str = "Answer with when only, as the memory says it."
    # After the words of a question that asks when or how long ago, its heaviest stamped evidence restated with its
    # moment, or the time since it (engine/answering.py `time_note`): the model copies the moment next to the
    # question where it would write another line's, and cannot subtract times itself.
    time_note: bool = True
    max_frame_pixels: int | None = None  # bound on a frame's resolution before the vision tower
    max_text_chars: int | None = None  # longest text, question or recall text taken, in characters (None: any)
    scoring_backend: str = "auto"
    # The archive of the stream's KV in host memory (engine/archive/archive.py): its bound (0: none), its block, and
    # the most archived tokens placed before a question. The headroom makes room for them whether or not the
    # archive is on, so that the cache is the same either way.
    archive_size: int = 32768
    archive_block: int = 32
    retrieve_tokens: int = 256
    # How an answer not kept in memory is decoded (engine/memory/decode_step.py): "eager" (a forward per token through
    # the cache), "static" (one fixed-shape step per token over the cache's storage), "compiled" (that step
    # under torch.compile; CUDA graphs on a GPU), "auto" (compiled on CUDA, else eager). Same tokens either way.
    decode_step: str = "auto"
    # How an input's blocks go through the model (engine/memory/ingest_step.py), with the same choices: "static" pads
    # each block to one of a few sizes and takes it in one fixed-shape step over the cache's storage. The same
    # memory either way.
    ingest_step: str = "auto"
    # How an input's time reads to the model (engine/models/chat.py, `MarkerClock`): "stream" (h:mm:ss.s since the
    # memory's first input) or "wall" (the time of day of its stamp in `time_zone`, as hh:mm:ss).
    clock: str = "stream"
    time_zone: str = "UTC"
    # On the wall clock, a text's relative dates ("yesterday", "last Friday", "last month") are followed by the date
    # they mean on the text's day (engine/date_words.py), so that the memory can say it weeks later.
    resolve_dates: bool = True
    # A question that names one of the memory's speakers ("Nate: ...") whose heaviest evidence that speaker never said
    # is answered as not mentioned (engine/archive/attribution.py): the memory holds it of someone else.
    check_speaker: bool = True
    # A question that asks whether the robot saw a thing (its form: "Did you see ...", "Was there ...") that no archived
    # text names or is like in meaning is answered as not seen (engine/archive/existence.py), with nothing decoded.
    check_seen: bool = True
    # The most inputs an answer names as its evidence (engine/archive/evidence.py; 0: none). Scored with the archive's
    # retrieval: an answer with retrieval on pays nothing more for it.
    evidence: int = 5
    # The sentence encoder that weighs how alike in meaning a question and each archived message are, beside attention
    # and words (engine/archive/sentences.py): an embedded encoder's name or a folder; "" for none. Loaded with the
    # model where the archive is on (before the first question), once per process.
    sentence_encoder: str = "all-MiniLM-L6-v2"

    def __post_init__(self):
        if self.capacity < MIN_CAPACITY:
            raise ValueError(f"capacity must be at least {MIN_CAPACITY} tokens, got {self.capacity}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.slots_headroom < self.chunk_size:
            # A full cache takes each block in its headroom before evicting.
            raise ValueError(f"headroom {self.slots_headroom} is smaller than chunk_size {self.chunk_size}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.archive_size < 0:
            raise ValueError(f"archive_size must be >= 0, got {self.archive_size}")
        if self.archive_block < 1:
            raise ValueError(f"archive_block must be >= 1, got {self.archive_block}")
        if self.retrieve_tokens < 0:
            raise ValueError(f"retrieve_tokens must be >= 0, got {self.retrieve_tokens}")
        MarkerClock(self.clock, self.time_zone)  # ValueError for an unknown clock or time zone
        if self.evidence < 0:
            raise ValueError(f"evidence must be >= 0, got {self.evidence}")
        for name in ("decode_step", "ingest_step"):
            if getattr(self, name) not in STEP_MODES:
                raise ValueError(f"{name} must be one of {STEP_MODES}, got {getattr(self, name)!r}")

    @property
    def slots_headroom(self) -> int:
        return self.headroom if self.headroom is not None else max(self.chunk_size, 256) + self.retrieve_tokens
