"""One endless stream through one model, in constant memory.

`KVStream` is single-threaded: it owns the model adapter and the bounded cache, turns text, frames
and questions into prompts, pushes them in chunks (evicting after each), and generates answers. The
threaded `StreamingEngine` wraps it for concurrent callers.

This module holds the stream's state and figures, the pushing of inputs and the answering of questions; its
configuration is `StreamConfig` (engine/stream_config.py), an answer's types are in engine/answering.py, and
retrieval from the archive for a question is the stream's `Retriever` (engine/archive/retriever.py).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import dataclasses
from dataclasses import asdict, dataclass
from typing import Callable, Generator

import numpy as np
import torch
from torch import Tensor

from ..models.adapters import ModelAdapter, Prompt
from ..answering import (
    DEFAULT_DESCRIPTION_PROMPT,
    Answer,
    AnswerCancelledError,
    AnswerTurn,
    Question,
    StreamStoppedError,
    TokenCallback,
    asks_when,
    time_note,
)
from ..archive.archive import ForwardRecording, KVArchive, Turn
from ..ops.attention import CACHE_ARGUMENT
from ..memory.cache import BoundedKVCache
from ..memory.forward_plan import ForwardPlan, PromptPositions
from ..models.chat import MarkerClock, check_stamp, stamped
from ..date_words import with_dates
from ..memory.decode_step import StaticDecoder, resolve_decode_step
from ..memory.ingest_step import StaticIngester
from ..memory.policies import make_policy
from ..stream_config import RECONFIGURABLE, StreamConfig
from ..archive.attribution import not_mentioned
from ..archive.existence import NOT_SEEN
from ..archive.evidence import Evidence
from ..poses import Pose
from ..archive.retrieval_heads import retrieval_heads
from ..archive.sentences import sentence_encoder
from ..archive.retriever import Retrieval, Retriever
from ..text_rules import CheckedText, checked_text
from ..value_rules import camera_problem, recall_problem



@dataclass
class StreamStats:
    """The memory's figures at one moment: the cache, the archive, the inputs taken, the policy in force."""

    capacity: int
    fill: int
    tokens_seen: int
    tokens_evicted: int
    evictions: int
    frames_ingested: int
    texts_ingested: int
    pinned_held: int  # tokens of pinned texts held in every layer and head
    kv_bytes: int
    cache_bytes: int
    archive_tokens: int  # tokens held in the archive (host memory)
    archive_blocks: int
    archive_bytes: int  # host bytes of the archive's storage, once full
    archive_size: int  # its bound, in tokens
    policy: str
    policy_settings: dict  # the policy's name and every setting, as it runs now
    position_mode: str
    next_position: int
    newest_frame_stamp: float | None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class MemoryExport:
    """A copy of what a memory file keeps of a stream (engine/persistence/memory_file.py), made by
    `KVStream.export_memory`."""

    cache: dict[str, Tensor]  # the cache's slots and counters
    clock: dict  # the stream's clock and counters (`clock_state`)
    held: list[int]  # the archive's blocks held, by index, oldest first
    new_blocks: dict[str, Tensor]  # the archive's blocks asked for, as named tensors
    tokens_seen: int
    fill: int


@dataclass
class StagedForward:
    """A forward planned and staged on a stream's cache, waiting to be run: by the stream alone
    (`KVStream.run_staged`), or with other streams' in one batch (engine/memory/batched_ingest.py)."""

    embeds: Tensor  # [q, hidden]
    position_ids: Tensor  # the model's position ids (`ModelAdapter.model_position_ids`)
    plan: ForwardPlan  # given to the cache (`BoundedKVCache.stage`)
    recording: ForwardRecording | None  # the archive's copy of it, where it is recorded
    static: bool = False  # alone, through the stream's static ingest step where the block fits it
    all_logits: bool = False  # every token's logits, not the last one's
    logits: bool = True  # any logits at all (a question's queries need none)


# A stream's steps: each forward staged on its cache is yielded, run by the caller, and its logits sent back.
Steps = Generator[StagedForward, "Tensor | None", object]


def run_steps(steps: Steps, run: Callable[[StagedForward], Tensor | None]):
    """Drive a stream's steps (`KVStream.push_steps` and those built like it), each staged forward run by `run` and
    its logits sent back; returns their value. On a failure the steps are closed (what is staged is taken back, and
    what the steps change for their forwards is undone as they undo it) and it is raised."""
    try:
        staged = next(steps)
        while True:
            staged = steps.send(run(staged))
    except StopIteration as done:
        return done.value
    except BaseException:
        steps.close()
        raise


@dataclass
class OpenAnswer:
    """An answer between its question and its tokens (`KVStream.open_answer`): the question, and what was retrieved
    for it, in the cache's headroom; its last logits; the most tokens it may have. `KVStream.close_answer` takes the
    cache back to where it was (and keeps the exchange, where asked): the decoding in between may be the stream's own
    or a batch of several streams' (engine/memory/batched_step.py)."""

    ids: Tensor  # the question turn's ids
    logits: Tensor  # the question's last logits [1, vocab]
    max_new: int  # the most tokens it may have: the room the headroom leaves
    asked: int  # the tokens asked for (an answer shorter than that without its stop token was cut by the headroom)
    keep: bool
    turn: AnswerTurn
    retrieval: Retrieval
    snapshot: tuple  # the cache's fill and frontiers and the clock, to go back to
    started: float  # time.monotonic() when asked


class KVStream:
    """Text, frames and questions into one model through a bounded KV cache.

    `request_stop()` (from any thread) ends the current answer at the next token, and a text message
    being pushed at the end of its current block (chunk_size tokens), with StreamStoppedError, so a shutdown
    waits for neither a long generation nor a long text. The blocks that went in stay (a message cut
    short, as when a push fails part-way); a frame (a few blocks at most) and a kept question or answer
    are finished first, so that a frame's layout and a dialogue turn stay whole. Either way the memory a
    shutdown saves is consistent: every block in it was attended and evicted after.

    Questions: `ask`, `describe`; `recall` finds the moments a text points to, without an answer.
    """

    stop_requested = False  # see `request_stop`

    def __init__(self, adapter: ModelAdapter, config: StreamConfig | None = None):
        self.adapter = adapter
        self.config = config or StreamConfig()
        cfg = self.config
        self.policy = make_policy(cfg.policy, capacity=cfg.capacity, **cfg.policy_settings)
        max_context = adapter.max_context
        if cfg.position_mode == "cache" and max_context and cfg.capacity + cfg.slots_headroom > max_context:
            raise ValueError(
                f"capacity {cfg.capacity} + headroom {cfg.slots_headroom} exceeds the model's context "
                f"of {max_context} tokens"
            )
        self.cache = BoundedKVCache(
            adapter.num_layers,
            cfg.capacity,
            self.policy,
            headroom=cfg.slots_headroom,
            position_mode=cfg.position_mode,
            rope_inv_freq=adapter.rope_inv_freq() if cfg.position_mode == "cache" else None,
            scoring_backend=cfg.scoring_backend,
        )
        try:
            inv_freq = adapter.rope_inv_freq()
        except (AttributeError, RuntimeError, ValueError):
            inv_freq = None  # no rotary embedding found: nothing can be re-placed, so nothing is archived
        self.archive = KVArchive(cfg.archive_size, cfg.archive_block, inv_freq)
        self.retriever = Retriever(self.archive, self.cache, adapter, self, self.retrieval_heads,
                                   functools.partial(sentence_encoder, cfg.sentence_encoder, str(adapter.device)))
        self._stop_ids = adapter.stop_token_ids
        step = resolve_decode_step(cfg.decode_step, adapter.device)
        # The fixed-shape step for answers not kept in memory; None: every token through `_forward`.
        self.static_decoder = None if step == "eager" else StaticDecoder(adapter, self.cache, step)
        step = resolve_decode_step(cfg.ingest_step, adapter.device, "ingest_step")
        # The fixed-shape step for an input's blocks; None: every block through the cache's layers.
        self.static_ingester = (None if step == "eager"
                                else StaticIngester(adapter, self.cache, cfg.chunk_size, step))
        # The caller's time of stream time 0 (the node: its clock's seconds at the first input). Saved with
        # the memory, so that after a restart new inputs are timed on the clock of the memory's; a reset
        # keeps it, as the caller's clock goes on.
        self.time_origin: float | None = None
        # The frame the poses kept with inputs are in (the caller's: the node's map frame), saved with the memory so
        # that a restarted node keeps its poses in it; "" until the caller names one.
        self.pose_frame = ""
        self.reset()

    # --- state ---------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget everything; the system prompt is pushed again with the next input."""
        self.cache.reset()
        self.archive.reset()
        self.tokens_seen = 0
        self.frames_ingested = 0
        self.texts_ingested = 0
        self.newest_frame_stamp: float | None = None
        self.newest_stamp: float | None = None  # the last stamped input's: the day its marker said
        # The stream index of the first input: the system turn before it is no input, so no evidence or recalled
        # moment (it drew the heaviest attention of a "when" question for one answer in seven on route bags).
        self.inputs_from = 0
        self._started = False

    def clock_state(self) -> dict:
        """The stream's clock and counters (saved with the memory; see memory_file)."""
        return {"tokens_seen": self.tokens_seen, "frames_ingested": self.frames_ingested,
                "texts_ingested": self.texts_ingested, "newest_frame_stamp": self.newest_frame_stamp,
                "started": self._started, "time_origin": self.time_origin, "newest_stamp": self.newest_stamp,
                "pose_frame": self.pose_frame, "inputs_from": self.inputs_from}

    def restore_clock(self, state: dict) -> None:
        self.tokens_seen = int(state["tokens_seen"])
        self.frames_ingested = int(state["frames_ingested"])
        self.texts_ingested = int(state["texts_ingested"])
        stamp = state["newest_frame_stamp"]
        self.newest_frame_stamp = None if stamp is None else float(stamp)
        self._started = bool(state["started"])
        origin = state["time_origin"]
        self.time_origin = None if origin is None else float(origin)
        newest = state.get("newest_stamp")  # absent from the memory files of earlier versions, as pose_frame is
        self.newest_stamp = None if newest is None else float(newest)
        self.pose_frame = str(state.get("pose_frame", ""))
        # Absent from earlier memory files: their system turn is the one this stream opens a memory with.
        inputs_from = state.get("inputs_from")
        self.inputs_from = int(inputs_from) if inputs_from is not None else (
            len(self._system_turn()) if self._started and self.config.system_prompt else 0)

    # --- persistence: what engine/persistence/memory_file.py reads and writes, and nothing else
    # ---------------------------
    @property
    def memory_id(self) -> str:
        """Names this memory's archived blocks on disk (engine/persistence/archive_log.py): new with each new memory."""
        return self.archive.memory_id

    @property
    def archives(self) -> bool:
        """Whether the stream keeps an archive at all."""
        return self.archive.enabled

    def memory_settings(self) -> dict:
        """What a saved memory must have been made with to be used by this stream."""
        return {"capacity": self.cache.capacity, "policy": self.policy.name, "position_mode": self.cache.position_mode,
                "dtype": str(self.adapter.dtype).replace("torch.", ""), "layers": len(self.cache.layers)}

    def model_fingerprint(self) -> str:
        """The model's fingerprint (engine/persistence/memory_file.py, `model_fingerprint`): a memory is used by this
        model only."""
        from ..persistence.memory_file import model_fingerprint

        return model_fingerprint(self.adapter)

    @property
    def fill(self) -> int:
        """Tokens the cache holds."""
        return self.cache.fill

    def version(self) -> tuple:
        """Changes whenever the memory does (an input, an eviction, a kept answer): a save is due only then."""
        return (self.tokens_seen, self.cache.fill, self.cache.evictions, self.texts_ingested, self.frames_ingested)

    def export_memory(self, blocks_after: int = -1) -> MemoryExport:
        """Copies of the memory: the cache, the clock, the archive's blocks held and those of index above
        `blocks_after`."""
        return MemoryExport(
            cache={name: t.clone() for name, t in self.cache.export_state().items()},  # a full layer's is a view
            clock=self.clock_state(), held=[b.index for b in self.archive.blocks],
            new_blocks=self.archive.export_state(newer_than=blocks_after), tokens_seen=self.tokens_seen,
            fill=self.cache.fill)

    def import_memory(self, cache: dict[str, Tensor], blocks: dict[str, Tensor], memory_id: str, clock: dict) -> None:
        """Replace the whole memory with a saved one: the cache's slots, the archive's blocks (named on disk by
        `memory_id`) and the clock. KeyError, ValueError or RuntimeError where they do not fit this stream or each
        other: the stream is then empty."""
        try:
            self.cache.import_state(cache, dtype=self.adapter.dtype, device=self.adapter.device)
            self.archive.import_state(blocks, dtype=self.adapter.dtype, memory_id=memory_id)
            self.restore_clock(clock)
        except (KeyError, ValueError, RuntimeError):
            self.reset()
            raise

    @property
    def marker_clock(self) -> MarkerClock:
        """How the next input's time reads to the model (the wall clock needs `time_origin`)."""
        return MarkerClock(self.config.clock, self.config.time_zone, self.time_origin, self.newest_stamp)

    def request_stop(self) -> None:
        """End the current answer at its next token and a text message at the end of its block, and refuse further
        work (StreamStoppedError); safe from any thread."""
        self.stop_requested = True

    def set_policy_knob(self, name: str, value) -> None:
        """Change one of the policy's live settings (from the next eviction); ValueError if it cannot."""
        self.policy.set_knob(name, value)
        self.config = dataclasses.replace(self.config, policy_settings={**self.config.policy_settings,
                                                                        name: getattr(self.policy, name)})

    def reconfigure(self, **changes) -> dict:
        """Change settings of `RECONFIGURABLE` (engine/stream_config.py) from the next input or question. The
        stream's configuration becomes a new object, checked whole (ValueError: nothing changes), so that no caller
        shares one with it. Returns the values replaced: `reconfigure(**returned)` puts them back."""
        fixed = sorted(set(changes) - RECONFIGURABLE)
        if fixed:
            raise ValueError(f"not a setting a stream takes while it runs: {', '.join(fixed)}")
        before = {name: getattr(self.config, name) for name in changes}
        self.config = dataclasses.replace(self.config, **changes)
        return before

    def stats(self) -> StreamStats:
        return StreamStats(
            capacity=self.cache.capacity,
            fill=self.cache.fill,
            tokens_seen=self.tokens_seen,
            tokens_evicted=self.cache.tokens_evicted,
            evictions=self.cache.evictions,
            frames_ingested=self.frames_ingested,
            texts_ingested=self.texts_ingested,
            pinned_held=self.cache.pinned_held(),
            kv_bytes=self.cache.kv_nbytes(),
            cache_bytes=self.cache.nbytes(),
            archive_tokens=self.archive.tokens,
            archive_blocks=len(self.archive.blocks),
            archive_bytes=self.archive.nbytes(),
            archive_size=self.archive.size,
            policy=self.policy.name,
            policy_settings=self.policy.describe(),
            position_mode=self.cache.position_mode,
            next_position=self.cache.next_position,
            newest_frame_stamp=self.newest_frame_stamp,
        )

    # --- input -----------------------------------------------------------------------------------------
    def push_text(self, text: str, stamp: float | None = None, *, pin: bool = False, pose: Pose | None = None) -> int:
        """Push one message as a user turn; returns the number of tokens it took. A pinned message is kept
        ahead of what attention chooses, within the policy's pin budget (`InfMLLMPolicy.pin_share`; the
        baselines ignore pins). `pose`: where the robot was at `stamp`, kept with the message's blocks."""
        return self.push_texts([(text, stamp, pin, pose)])[0]

    def push_texts(self, items: list[tuple]) -> list[int]:
        """Push several messages, each its own user turn with its own time marker, as one prompt.

        Items are (text, stamp), (text, stamp, pin) or (text, stamp, pin, pose). One model call (in chunk_size
        blocks) for all of them; the memory ends exactly as if each had been pushed with push_text in turn, apart
        from where evictions fall. Returns each message's token count.
        """
        return self.run_steps(self.text_steps(items))

    def text_steps(self, items: list[tuple]) -> Steps:
        """`push_texts` a block at a time (`push_steps`); its value is what `push_texts` returns."""
        items = [(text, stamp, bool(rest and rest[0]), rest[1] if len(rest) > 1 else None)
                 for text, stamp, *rest in items]
        if not items:
            return []
        items = [(self.check_text(text), stamp, pin, pose) for text, stamp, pin, pose in items]
        for _, stamp, _, _ in items:
            check_stamp(stamp, "text")
        self._ensure_started()
        clock, turns = self.marker_clock, []
        for text, stamp, _, _ in items:
            day = clock.date_of(stamp) if stamp is not None and self.config.resolve_dates else None
            said = with_dates(text, day) if day is not None else text
            turns.append(self.adapter.tokenize_turn(self.adapter.chat.user_parts(stamped(said, stamp, clock))))
            clock = clock.after(stamp)
        pinned = torch.cat([torch.full((len(t),), pin) for t, (_, _, pin, _) in zip(turns, items)])
        yield from self.push_steps(
            self.adapter.text_prompt(torch.cat(turns)), pinned=pinned if bool(pinned.any()) else False, stoppable=True,
            turns=[Turn(len(t), stamp, pose) for t, (_, stamp, _, pose) in zip(turns, items)])
        self.texts_ingested += len(items)
        self.newest_stamp = clock.previous
        return [int(t.numel()) for t in turns]

    def push_frame(self, rgb: np.ndarray, stamp: float | None = None, *, pose: Pose | None = None,
                   camera: str = "") -> int:
        """Push one camera frame (H x W x 3 uint8 RGB) as a user turn; returns its token count. `pose`: where the
        robot was at `stamp`; `camera`: which of the robot's cameras took it, said in its marker and its evidence
        ("": a robot's one camera, unnamed). ValueError for a name `value_rules.camera_problem` refuses."""
        return self.run_steps(self.frame_steps(rgb, stamp, pose=pose, camera=camera))

    def frame_steps(self, rgb: np.ndarray, stamp: float | None = None, *, pose: Pose | None = None,
                    camera: str = "") -> Steps:
        """`push_frame` a block at a time (`push_steps`); its value is what `push_frame` returns."""
        problem = camera_problem(camera)
        if problem:
            raise ValueError(problem)
        prompt = self.adapter.frame_prompt(rgb, stamp, max_pixels=self.config.max_frame_pixels,
                                           clock=self.marker_clock, camera=camera)
        self._ensure_started()
        n = yield from self.push_steps(prompt, turns=[Turn(len(prompt), stamp, pose, camera)])
        self.frames_ingested += 1
        if stamp is not None:
            self.newest_frame_stamp = self.newest_stamp = stamp
        return n

    def push_tokens(self, token_ids: Tensor | list[int], *, return_logits: bool = False,
                    pinned: bool = False) -> Tensor | None:
        """Push raw token ids (no chat formatting), chunk by chunk; optionally return their logits. `pinned`: kept
        ahead of what attention chooses, as a pinned text is."""
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        if ids.numel() == 0:
            raise ValueError("no tokens to push")
        return self.push_prompt(self.adapter.text_prompt(ids), return_logits=return_logits, pinned=pinned)

    def push_prompt(self, prompt: Prompt, *, return_logits: bool = False, pinned: bool = False) -> Tensor | None:
        """Push a prompt made by the adapter (`text_prompt`, `frame_prompt`) as it is: no turn of its own, no time
        marker, no system turn before it; optionally return every token's logits."""
        if len(prompt) == 0:
            raise ValueError("empty prompt")
        logits = self._push(prompt, return_logits=return_logits, pinned=pinned)
        return logits if return_logits else None

    # --- pushing -------------------------------------------------------------------------------------
    def _ensure_started(self) -> None:
        """Open the memory with the system turn before its first input. If pushing it fails (out of memory, a
        stop), nothing of it stays and the next input tries again: a memory without its system turn would
        answer differently for as long as it lives."""
        if self._started:
            return
        if self.config.system_prompt:
            try:
                self._push(self.adapter.text_prompt(self._system_turn()), stoppable=True)
            except BaseException:
                self.cache.reset()  # it held nothing before: the system turn comes first
                self.archive.reset()
                self.tokens_seen = 0
                raise
        self.inputs_from = self.tokens_seen
        self._started = True

    def _system_turn(self) -> list[int]:
        # Tokenized as the characters it is, like every text (ModelAdapter.tokenize_turn).
        return self.adapter.tokenize_turn(self.adapter.chat.system_parts(self.config.system_prompt))

    def _push(self, prompt: Prompt, *, return_logits: bool = False, last_logits: bool = False,
              pinned: bool | Tensor = False, stoppable: bool = False, turns: list[Turn] | None = None):
        """Push a prompt in blocks of at most chunk_size tokens, evicting after each block (`push_steps`). Returns its
        token count, or every token's logits (`return_logits`), or the last token's (`last_logits`)."""
        outputs = []

        def run(staged: StagedForward) -> Tensor:
            outputs.append(self.run_staged(staged))
            return outputs[-1]

        total = run_steps(self.push_steps(prompt, pinned=pinned, stoppable=stoppable, turns=turns,
                                          all_logits=return_logits), run)
        if return_logits:
            return torch.cat(outputs)
        return outputs[-1][-1:] if last_logits else total

    def push_steps(self, prompt: Prompt, *, pinned: bool | Tensor = False, stoppable: bool = False,
                   turns: list[Turn] | None = None, all_logits: bool = False) -> Steps:
        """A prompt's blocks of at most chunk_size tokens as steps: each staged on the cache and yielded for the caller
        to run (`run_staged`, or in one batch with other streams' blocks: engine/runtime/pool.py) before the next is
        staged; each block is evicted after. Its value: the prompt's token count. A caller that stops part-way closes
        it: the block staged is taken back, and the blocks that went in stay (as when a push fails part-way).

        Text is contiguous in 1-D, so each block is a prompt of its own (positions re-based, packed after
        each). A frame keeps one base position for all its blocks so its 2-D layout stays intact, and its
        positions are packed once it is complete. `pinned`: for the whole prompt, or a mask of its tokens.
        `turns`: each message in the prompt, for the archive's blocks.

        What went through the model is archived once the prompt ends, also when it ends early.
        """
        total = len(prompt)
        if total == 0:
            raise ValueError("empty prompt")
        chunk = self.config.chunk_size
        base = self.cache.next_position
        try:
            for start in range(0, total, chunk):
                if start and stoppable and self.stop_requested:
                    raise StreamStoppedError(
                        f"stopped while taking in a text: its first {start} of {total} tokens went in")
                block = prompt.slice(start, min(start + chunk, total))
                if prompt.token_ids is not None:
                    # Text positions count from 0 (`text_prompt`): the block's first is `start`.
                    offset, pack = self.cache.next_position - start, True
                else:
                    offset, pack = base, start + chunk >= total
                yield from self._forward_steps(
                    block, offset, evict=True, pack=pack, observe=True, record=True, static=True,
                    all_logits=all_logits,
                    pinned=pinned if isinstance(pinned, bool) else pinned[start : start + len(block)])
        finally:
            self.archive.end_prompt(frame=prompt.token_ids is None, turns=turns or [Turn(total)],
                                    token_ids=prompt.token_ids)
        if any(step is not None and not step.ready for step in (self.static_decoder, self.static_ingester)):
            self._warm_up_steps()
        return total

    def run_steps(self, steps: Steps):
        """Run a stream's own steps (`text_steps`, `frame_steps`, `answer_steps`...) one forward after another on this
        stream alone; their value."""
        return run_steps(steps, self.run_staged)

    def _warm_up_steps(self) -> None:
        """Make the static steps ready with the memory's first input, not at its first question. A model whose step
        cannot be made (a compiler that fails on it) decodes (or takes input) eagerly, with the reason logged: the
        input that went in stays, and the memory and answers are the same either way."""
        try:
            if self.static_decoder is not None and not self.static_decoder.ready:
                self.static_decoder.warm_up()
        except Exception as exc:
            logging.getLogger(__name__).warning("decode_step %r not available (%s: %s); answers decode eagerly",
                                                self.static_decoder.mode, type(exc).__name__, exc)
            self.static_decoder = None
        if self.static_ingester is None or self.static_ingester.ready:
            return
        try:
            self.static_ingester.warm_up()
        except Exception as exc:
            logging.getLogger(__name__).warning("ingest_step %r not available (%s: %s); inputs go in eagerly",
                                                self.static_ingester.mode, type(exc).__name__, exc)
            self.static_ingester = None

    def _forward(self, prompt: Prompt, offset: int, *, evict: bool, pack: bool, observe: bool,
                 all_logits: bool = False, pinned: bool | Tensor = False, record: bool = False,
                 static: bool = False, capture: dict[int, Tensor] | None = None) -> Tensor:
        """One forward of the model over `prompt` at `offset`, run here (`_forward_steps`)."""
        return self.run_steps(self._forward_steps(prompt, offset, evict=evict, pack=pack, observe=observe,
                                                  all_logits=all_logits, pinned=pinned, record=record, static=static,
                                                  capture=capture))

    def _forward_steps(self, prompt: Prompt, offset: int, *, evict: bool, pack: bool, observe: bool,
                       all_logits: bool = False, pinned: bool | Tensor = False, record: bool = False,
                       static: bool = False, capture: dict[int, Tensor] | None = None, logits: bool = True) -> Steps:
        """One forward of the model over `prompt` at `offset` as a step; its value: the logits sent back. `record`:
        the archive copies its keys and values; `static`: alone, through the stream's static ingest step where the
        block fits it; `capture`: filled with each layer's queries; `logits`: whether any are wanted."""
        device = prompt.embeds.device
        start = prompt.position_ids if prompt.position_ids.dim() == 1 else prompt.position_ids.min(0).values
        positions = PromptPositions(
            start=(start + offset).to(device=device, dtype=torch.long),
            end=(prompt.extent + offset).to(device=device, dtype=torch.long),
            first_seq=self.tokens_seen,
            frame=prompt.token_ids is None,  # text prompts carry their token ids; a frame's are embeddings
            pinned=pinned if isinstance(pinned, bool) else pinned.to(device),
        )
        recording = self.archive.recording(len(self.cache.layers)) if record else None
        plan = ForwardPlan(positions, evict=evict, pack=pack, observe=observe, recorder=recording, capture=capture)
        self.cache.stage(plan)
        staged = StagedForward(prompt.embeds, self.adapter.model_position_ids(prompt.position_ids, offset), plan,
                               recording, static=static, all_logits=all_logits, logits=logits)
        try:
            out = yield staged
        finally:
            self._unstage(staged)
        self.tokens_seen += len(prompt)
        return out

    def run_staged(self, staged: StagedForward) -> Tensor | None:
        """Run a staged forward on this stream alone: through its static ingest step (where the staged forward asks
        for it and the block fits it) or the cache's layers. Returns the last token's logits (every token's with
        `all_logits`; None where none are wanted)."""
        ingester = self.static_ingester if staged.static else None
        if ingester is not None and ingester.fits(staged.plan, all_logits=staged.all_logits):
            return ingester.run(staged.embeds, staged.position_ids, staged.plan)
        with torch.inference_mode():
            return self.adapter.forward(staged.embeds, staged.position_ids, self.cache, all_logits=staged.all_logits,
                                        logits=staged.logits, **{CACHE_ARGUMENT: self.cache})

    def _unstage(self, staged: StagedForward) -> None:
        """A staged forward is over (run, or failed): the cache drops its plan, the archive takes its recording."""
        self.cache.unstage()
        if staged.recording is not None:
            positions = staged.plan.positions
            self.archive.end_forward(staged.recording, positions.start, positions.end, positions.first_seq)


    # --- questions -----------------------------------------------------------------------------------
    def ask(self, question: str, *, max_new_tokens: int | None = None, keep_in_memory: bool = False,
            on_token: TokenCallback | None = None, cancel: threading.Event | None = None,
            asked_at: float | None = None) -> Answer:
        """Answer greedily from what is in memory. Without keep_in_memory the cache is left as it was.

        on_token gets the answer so far after each token. Setting `cancel` stops the answer at the next token
        with AnswerCancelledError and leaves the memory as it was, also with keep_in_memory (the question
        and answer are kept only once the answer is complete), unless the question is too long for the
        headroom and has to be pushed into the memory before the answer: it then stays, with the answer so
        far and its turn closed. `asked_at`: the stream time the question was asked at, for "how long ago" (None: the
        newest input's).
        """
        question = self.check_text(question, "question")
        return self._exchange(self.question_parts(question), max_new_tokens, keep_in_memory,
                              AnswerTurn(on_token, cancel, self._stopped, self._answer_text),
                              asked=Question(question, asked_at=asked_at))

    def open_answer(self, question: str, *, max_new_tokens: int | None = None, keep_in_memory: bool = False,
                    on_token: TokenCallback | None = None, cancel: threading.Event | None = None,
                    asked_at: float | None = None) -> OpenAnswer | None:
        """`ask` up to its decoding: the question (with what it retrieves) in the headroom and its last logits, for a
        decoding done elsewhere (several streams' answers in one batch) and `close_answer` after it; the same answer
        as `ask`. None where the answer cannot be decoded apart from the memory (kept, and the headroom has no room
        for the question and the whole answer: it goes into the memory as it decodes): `ask` it then."""
        return self.run_steps(self.answer_steps(question, max_new_tokens=max_new_tokens, keep_in_memory=keep_in_memory,
                                                on_token=on_token, cancel=cancel, asked_at=asked_at))

    def answer_steps(self, question: str, *, max_new_tokens: int | None = None, keep_in_memory: bool = False,
                     on_token: TokenCallback | None = None, cancel: threading.Event | None = None,
                     asked_at: float | None = None) -> Steps:
        """`open_answer` as steps (its two forwards: the question's queries for retrieval, the question placed), for
        several streams' questions to go through the model together (engine/runtime/pool.py)."""
        question = self.check_text(question, "question")
        self._ensure_started()
        started = time.monotonic()
        asked = max_new_tokens or self.config.max_new_tokens
        ids, content = self.question_ids(self.question_parts(question))
        if keep_in_memory and self.cache.slots - self.cache.fill - ids.numel() < asked:
            return None
        logits, max_new, snapshot, retrieval = yield from self._open_unkept_steps(
            ids, asked, content, Question(question, asked_at=asked_at))
        return OpenAnswer(ids, logits, max_new, asked, keep_in_memory,
                          AnswerTurn(on_token, cancel, self._stopped, self._answer_text), retrieval, snapshot, started)

    def close_answer(self, answer: OpenAnswer, tokens: list[int]) -> Answer:
        """End an opened answer with its tokens: the cache back to where it was, slot for slot, then the question and
        answer kept as one prompt where asked (as `ask` keeps them)."""
        self._restore(answer.snapshot)
        if answer.keep:
            self._keep_exchange(answer.ids, tokens)
        return self._answer(tokens, answer.retrieval, answer.asked, answer.keep, answer.started)

    def decode_answer(self, answer: OpenAnswer) -> list[int]:
        """An opened answer's tokens decoded on this stream's own step, as `ask` decodes them (for an answer that has
        no other to be batched with); `close_answer` or `abandon_answer` after it."""
        return self._generate(answer.logits, answer.max_new, answer.turn, keep=False)

    def abandon_answer(self, answer: OpenAnswer) -> None:
        """End an opened answer without tokens (cancelled, stopped, failed): the cache back to where it was."""
        self._restore(answer.snapshot)

    def progress(self, turn: AnswerTurn) -> Callable[[list[int]], None]:
        """What a decoding that reads its tokens back in groups calls with the tokens so far: each new one checked
        for a stop or a cancel and reported, as the eager path does token by token."""
        reported = 0

        def on_read(tokens: list[int]) -> None:
            nonlocal reported
            for n in range(reported + 1, len(tokens) + 1):
                turn.check()
                turn.report(tokens[:n])
            reported = len(tokens)

        return on_read

    def check_text(self, text: object, what: str = "text") -> CheckedText:
        """A text, question or recall text by the one text rule (engine/text_rules.py), with this stream's bound."""
        return checked_text(text, what, self.config.max_text_chars)

    def question_parts(self, question: str) -> tuple[str, str, str]:
        """A question's turn as (template before, its words, the rest): the answer prompt (the when prompt after a
        question that asks when) follows its words, outside them, so that retrieval reads the question alone."""
        head, words, tail = self.adapter.chat.question_parts(question)
        config = self.config
        prompt = config.when_prompt if config.when_prompt and asks_when(question) else config.answer_prompt
        return (head, words, f" {prompt}{tail}") if prompt else (head, words, tail)

    def describe(self, prompt: str | None = None, *, max_new_tokens: int | None = None) -> Answer:
        """A description of the scene so far; never stays in memory."""
        return self._exchange(self.adapter.chat.question_parts(prompt or DEFAULT_DESCRIPTION_PROMPT), max_new_tokens,
                              False, AnswerTurn(None, None, self._stopped, self._answer_text))

    def recall(self, text: str, *, limit: int = 5, since: float | None = None, until: float | None = None,
               near: tuple[float, float, float] | None = None, camera: str = "") -> list[Evidence]:
        """The moments that `text` points to most, best first, without an answer: the archive's blocks (held by
        the cache or not) scored as a question scores them, those stamped between `since` and `until` (stream
        time), with `near` (x, y, radius) those whose pose lies within the radius, and with `camera` only that
        camera's frames. ValueError for an unusable argument."""
        text = self.check_text(text, "recall text")
        problem = recall_problem(limit, since, until, near, camera)
        if problem:
            raise ValueError(problem)
        if not self.archive.enabled or not self.archive.blocks:
            return []
        ids, content = self.question_ids(self.adapter.chat.question_parts(text))
        if self.cache.slots - self.cache.fill - ids.numel() < 1:
            raise ValueError(f"recall text of {ids.numel()} tokens does not fit in the cache headroom")
        return self.retriever.recall(ids, content, limit, since, until, near, camera,
                                     inputs_from=self.inputs_from)

    def retrieval_heads(self) -> Tensor | None:
        """The model's retrieval heads (engine/archive/retrieval_heads.py), found on a stream of this kind at first
        use."""
        return retrieval_heads(self.adapter, lambda **settings: type(self)(self.adapter, type(self.config)(**settings)))

    def question_ids(self, parts: tuple[str, str, str]) -> tuple[Tensor, slice]:
        """A question turn's ids, and where its own words are among them (all of it where the template's
        pieces do not tokenize apart)."""
        ids = self.adapter.tokenize_turn(parts)
        head, tail = (len(self.adapter.tokenize(p)) if p else 0 for p in (parts[0], parts[2]))
        return ids, slice(head, len(ids) - tail) if 0 < len(ids) - head - tail else slice(0, len(ids))

    def content_queries(self, ids: Tensor, content: slice) -> tuple[Tensor, Tensor]:
        """The queries of every layer for a question's own words (`ids` at `content`), asked of the cache as it is
        (the question is taken away again), and the positions they were rotated with."""
        return self.run_steps(self.content_query_steps(ids, content))

    def content_query_steps(self, ids: Tensor, content: slice) -> Steps:
        """`content_queries` as a step. Only the question up to its own words goes through the model (the words
        after them change none of their queries), and no logits are made."""
        fill, frontier, frontiers = self.cache.fill, self.cache.next_position, self.cache.frontiers()
        captured: dict[int, Tensor] = {}
        asked = ids[: content.stop]
        try:
            yield from self._forward_steps(self.adapter.text_prompt(asked), frontier, evict=False, pack=False,
                                           observe=False, capture=captured, logits=False)
            self.tokens_seen -= len(asked)
        finally:
            self.cache.truncate(fill, frontiers)
        queries = torch.stack([captured[i][:, content] for i in range(len(self.cache.layers))])
        return queries, torch.arange(frontier, frontier + ids.numel())[content]  # text: as _forward placed them

    def turn_tokens(self, text: str) -> int:
        """How many tokens `text` takes as a user turn."""
        return len(self.adapter.tokenize_turn(self.adapter.chat.user_parts(text)))

    def place_turn(self, text: str) -> None:
        """Put `text` as a user turn after the cache's own, in the headroom, unkept: for one answer (the caller
        truncates the cache back afterwards, as for the blocks the retriever places)."""
        self.place_unkept(self.adapter.text_prompt(self.adapter.tokenize_turn(self.adapter.chat.user_parts(text))))

    def place_unkept(self, prompt: Prompt) -> Tensor:
        """Put `prompt` after the cache's own tokens, in the headroom, as an answer not kept puts its question and
        its tokens: no eviction, no re-pack, its attention not observed, nothing archived. Returns its logits. The
        caller truncates the cache back (`BoundedKVCache.truncate`) and sets `tokens_seen` back afterwards."""
        return self.run_steps(self.place_steps(prompt))

    def place_steps(self, prompt: Prompt) -> Steps:
        """`place_unkept` as a step; its value: the prompt's last logits."""
        return self._forward_steps(prompt, self.cache.next_position, evict=False, pack=False, observe=False)

    @functools.cached_property
    def closing_ids(self) -> Tensor | None:
        """The template's end of an assistant turn, which closes a kept answer (tokenized once, when needed)."""
        suffix = self.adapter.chat.assistant_suffix
        return self.adapter.tokenize(suffix) if suffix else None

    def _stopped(self) -> bool:
        return self.stop_requested

    def _answer_text(self, tokens: list[int]) -> str:
        return self.adapter.decode([t for t in tokens if t not in self._stop_ids]).strip()

    def _exchange(self, question_parts: tuple[str, str, str], max_new_tokens: int | None, keep: bool,
                  turn: AnswerTurn, *, asked: Question | None = None) -> Answer:
        """An answer; `asked`: the question's words and time, to retrieve from the archive with (None: the cache
        alone)."""
        start = time.monotonic()
        self._ensure_started()
        max_new = max_new_tokens or self.config.max_new_tokens
        ids, content = self.question_ids(question_parts)
        tokens, retrieval = self._answer_tokens(ids, max_new, keep, turn, content if asked else None, asked)
        return self._answer(tokens, retrieval, max_new, keep, start)

    def _checked(self, retrieval: Retrieval) -> str:
        """The answer a check gives in the model's place, or "": not mentioned where the memory holds what is asked
        of someone else (`check_speaker`), not seen where nothing in memory is like what a did-you-see asks about
        (`check_seen`)."""
        if self.config.check_speaker and retrieval.unattributed:
            return not_mentioned(retrieval.unattributed)
        if self.config.check_seen and retrieval.unseen:
            return NOT_SEEN
        return ""

    def _answer(self, tokens: list[int], retrieval: Retrieval, max_new: int, keep: bool, start: float) -> Answer:
        # Only the headroom ends an answer before max_new without its stop token (a cancel or stop raises).
        cut = not keep and len(tokens) < max_new and bool(tokens) and tokens[-1] not in self._stop_ids
        return Answer(
            text=self._checked(retrieval) or self._answer_text(tokens),
            tokens_generated=len(tokens),
            latency=time.monotonic() - start,
            tokens_seen=self.tokens_seen,
            cache_fill=self.cache.fill,
            newest_frame_stamp=self.newest_frame_stamp,
            kept_in_memory=keep,
            cut_by_headroom=cut,
            retrieved_tokens=sum(b.length for b in retrieval.placed),
            retrieved_stamps=[b.stamp for b in retrieval.placed],
            evidence=retrieval.evidence,
            time_note=retrieval.time_note,
        )

    def _answer_tokens(self, ids: Tensor, max_new: int, keep: bool, turn: AnswerTurn,
                       retrieve: slice | None = None, asked: Question | None = None) -> tuple[list[int], Retrieval]:
        """The answer's tokens and what was retrieved for it; `retrieve`: where the question's own words are, to
        retrieve from the archive with (None: the cache alone); `asked`: its words and time, for its time note."""
        # Room in the headroom for the question and the whole answer.
        fits = self.cache.slots - self.cache.fill - ids.numel() >= max_new
        closing = self.closing_ids
        retrieval = Retrieval()
        if keep and fits:
            # Answer as if not kept, then keep question and answer as one prompt: a cancelled answer
            # leaves the memory as it was. What was retrieved for it is not kept: it is in the archive already.
            tokens, retrieval = self._answer_tokens(ids, max_new, False, turn, retrieve, asked)
            self._keep_exchange(ids, tokens)
            return tokens, retrieval
        if keep:
            logits = self._push(self.adapter.text_prompt(ids), last_logits=True)
            try:
                tokens = self._generate(logits, max_new, turn, keep=True)
            except (StreamStoppedError, AnswerCancelledError):
                # The question and the answer so far are in the memory: end the turn, so that it stays whole.
                if closing is not None:
                    self._push(self.adapter.text_prompt(closing))
                raise
            tail = [tokens[-1]] if tokens and tokens[-1] not in self._stop_ids else []
            tail_ids = torch.tensor(tail, dtype=torch.long, device=ids.device)
            if closing is not None:
                tail_ids = torch.cat([tail_ids, closing])
            if tail_ids.numel():
                self._push(self.adapter.text_prompt(tail_ids))
            return tokens, retrieval
        logits, max_new, snapshot, retrieval = self._open_unkept(ids, max_new, retrieve, asked)
        try:
            tokens = self._generate(logits, max_new, turn, keep=False)
        finally:
            self._restore(snapshot)
        return tokens, retrieval

    def _open_unkept(self, ids: Tensor, max_new: int, retrieve: slice | None,
                     asked: Question | None = None) -> tuple[Tensor, int, tuple, Retrieval]:
        """An answer not kept, up to its decoding (`_open_unkept_steps`), run here."""
        return self.run_steps(self._open_unkept_steps(ids, max_new, retrieve, asked))

    def _open_unkept_steps(self, ids: Tensor, max_new: int, retrieve: slice | None,
                           asked: Question | None = None) -> Steps:
        """An answer not kept, up to its decoding: what it retrieves and the question in the headroom. Its value: the
        question's last logits, the most tokens the headroom leaves room for, the snapshot to go back to and the
        retrieval. ValueError where the question does not fit; on any failure the cache is as it was."""
        room = self.cache.slots - self.cache.fill - ids.numel()
        if room < 1:
            raise ValueError(
                f"question of {ids.numel()} tokens does not fit in the cache headroom "
                f"({self.cache.slots - self.cache.fill} free slots); ask a shorter question or keep it in memory"
            )
        max_new = min(max_new, room)
        snapshot = (self.cache.fill, self.cache.frontiers(), self.tokens_seen)
        retrieval = Retrieval()
        try:
            if retrieve is not None:
                budget = min(self.config.retrieve_tokens, room - max_new)
                retrieval = yield from self.retriever.retrieve_steps(
                    ids, retrieve, budget, self.config.evidence, spare=room - max_new - budget,
                    inputs_from=self.inputs_from)
                if self._checked(retrieval):
                    max_new = 0  # answered by a check (`_answer`): nothing to decode
                ids = self._with_time_note(ids, retrieve, asked, retrieval, max_new)
            logits = yield from self.place_steps(self.adapter.text_prompt(ids))
        except BaseException:
            self._restore(snapshot)
            raise
        return logits, max_new, snapshot, retrieval

    def _with_time_note(self, ids: Tensor, words: slice, asked: Question | None, retrieval: Retrieval,
                        max_new: int) -> Tensor:
        """The question's ids with its time note (`time_note`) after its words, where the config has it and the
        headroom has room for it beside the retrieved blocks and the whole answer."""
        if not self.config.time_note or asked is None or max_new < 1:
            return ids
        at = asked.asked_at if asked.asked_at is not None else self.newest_stamp
        note = time_note(asked.text, retrieval.evidence, self.marker_clock, at)
        if not note:
            return ids
        note_ids = self.adapter.tokenize(note).to(ids.device)
        if self.cache.slots - self.cache.fill - ids.numel() - note_ids.numel() < max(max_new, 1):
            return ids
        retrieval.time_note = note
        return torch.cat([ids[: words.stop], note_ids, ids[words.stop:]])

    def _restore(self, snapshot: tuple) -> None:
        self.cache.truncate(snapshot[0], snapshot[1])
        self.tokens_seen = snapshot[2]

    def _keep_exchange(self, ids: Tensor, tokens: list[int]) -> None:
        """A question and its answer into the memory as one prompt, the turn closed."""
        kept = [t for t in tokens if t not in self._stop_ids]
        closing = self.closing_ids
        prompt = torch.cat([ids, torch.tensor(kept, dtype=torch.long, device=ids.device)]
                           + ([closing.to(ids.device)] if closing is not None else []))
        self._push(self.adapter.text_prompt(prompt))

    def _generate(self, logits: Tensor, max_new: int, turn: AnswerTurn, *, keep: bool) -> list[int]:
        """Greedy decoding; the last token is returned but not pushed. An answer not kept in memory takes the
        stream's static step where it has one (engine/memory/decode_step.py): the same tokens, read back in groups."""
        if max_new < 1:
            return []
        if not keep and self.static_decoder is not None:
            turn.check()
            return self.static_decoder.generate(logits, max_new, self._stop_ids, self.progress(turn))
        tokens: list[int] = []
        for step in range(max_new):
            turn.check()
            token = int(logits[-1].argmax())
            tokens.append(token)
            turn.report(tokens)
            if token in self._stop_ids or step == max_new - 1:
                break
            prompt = self.adapter.text_prompt(torch.tensor([token], dtype=torch.long))
            # A kept answer may outgrow the headroom: evict once the storage is about to fill up.
            evict = keep and self.cache.fill + 2 > self.cache.slots
            logits = self._forward(prompt, self.cache.next_position, evict=evict, pack=evict, observe=keep,
                                   record=keep)
        return tokens

    def prepare_first_answer(self, *, tokens: int = 2) -> dict[str, float]:
        """Do now (while the model loads) what the first answer would otherwise do on first use, and forget it, so
        that the first answer takes the time of any other: the question template and the retriever's reference
        question tokenized; that question through the model after the cache's own with every layer's queries
        taken, as retrieval takes a question's; the static steps made (compiled) over the cache's storage; a scratch
        retrieval index of the question's own keys, scored with its queries; the sentence encoder loaded and run once;
        `tokens` tokens decoded. Then the
        cache is truncated back and the clock set back: no token added, nothing archived, no policy statistic
        touched, every later answer the same. Only the cache's storage stays made (a stream makes it once, at
        its first input otherwise: `StreamStats.kv_bytes` shows it from now on).

        What the first retrieval builds from the memory as it is then stays the first retrieval's: the archive's
        index, whose reference question is asked of that memory (one forward of a few tokens, `Retriever.index`).

        Returns the seconds each part took; {} where the cache's headroom has no room for the question."""
        from types import SimpleNamespace

        from ..archive.retrieval_index import RetrievalIndex, middle_layers
        from ..archive.retriever import REFERENCE_QUESTION

        times: dict[str, float] = {}
        start = time.monotonic()
        ids, content = self.retriever.reference_question
        _ = self.closing_ids  # a kept answer's end of turn, tokenized once
        times["tokenize"] = time.monotonic() - start
        cache = self.cache
        fill, frontiers, seen = cache.fill, cache.frontiers(), self.tokens_seen
        if cache.slots - fill - ids.numel() - tokens < 1:
            return times
        try:
            start = time.monotonic()
            frontier, captured = cache.next_position, {}
            logits = self._forward(self.adapter.text_prompt(ids), frontier, evict=False, pack=False, observe=False,
                                   capture=captured)  # as `content_queries` asks, but kept for the decoding below
            queries = (torch.stack([captured[i][:, content] for i in range(len(cache.layers))]),
                       torch.arange(frontier, frontier + ids.numel())[content])
            times["question"] = time.monotonic() - start
            if any(step is not None and not step.ready for step in (self.static_decoder, self.static_ingester)):
                start = time.monotonic()
                self._warm_up_steps()  # into the slots after the question's, which nothing reads
                times["steps"] = time.monotonic() - start
            if self.archive.enabled:
                start = time.monotonic()
                keys = torch.stack([layer.keys[0, :, fill : fill + ids.numel()] for layer in cache.layers])
                heads = self.retrieval_heads()
                index = RetrievalIndex(middle_layers(*queries[0].shape[:2]) if heads is None else heads,
                                       kv_heads=keys.shape[1], head_dim=keys.shape[-1], size=keys.shape[2],
                                       block_tokens=self.archive.block_tokens, inv_freq=self.archive.inv_freq,
                                       device=queries[0].device)
                index.set_reference(*queries)
                index.write(0, keys)
                index.scores(queries, [SimpleNamespace(slot=0, length=keys.shape[2])])
                times["index"] = time.monotonic() - start
                start = time.monotonic()
                if (encoder := self.retriever.load_encoder()) is not None:  # loaded once per process, then shared
                    encoder.embed([REFERENCE_QUESTION])
                times["sentence_encoder"] = time.monotonic() - start
            start = time.monotonic()
            self._generate(logits, tokens, AnswerTurn(None, None, self._stopped, self._answer_text), keep=False)
            times["decode"] = time.monotonic() - start
        finally:
            cache.truncate(fill, frontiers)
            self.tokens_seen = seen
        return times

__all__ = ["KVStream", "OpenAnswer", "StreamStats"]
