"""The flood: texts at 50 a second and 320x240 frames at 5 Hz for 30 s from another process into a fresh node (one
torch thread, cache 256, frame_rate 1, the shipped settings otherwise), a question at 10 s, counted from the first
message; and the same engine in one process under the same traffic, for reference. `test_node_flood.py` checks the
node against the reference; `benchmarks/node_flood.py` records runs of it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ..engine.engine import EngineBusyError, StreamingEngine
from ..engine.stream_config import StreamConfig
from ..input_rules import FrameGate
from ..settings import BY_NAME
from .node_process import Driver, NodeProcess, Scene

FLOOD_S = 30.0
TEXT_EVERY = 0.02  # 50 texts a second
FRAME_EVERY = 0.2  # a 5 Hz camera
QUESTION_AT = 10.0
QUESTION = "Which crate moved past the scanner last?"
FRAME_RATE = 1.0
WINDOW_S = 5.0
REFERENCE_S = 15.0  # the in-process run under the same traffic
NODE_PARAMS = {"cache_size": 256, "torch_threads": 1, "frame_rate": FRAME_RATE, "stats_period": 0.5,
               "description_period": 0.0}
MAX_TEXT_DELAY = BY_NAME["max_text_delay"].default


def text(n: int) -> str:
    return f"Conveyor {n % 9} moved crate {n} past the scanner."


def reference_pace(model: str, stamped: bool = True) -> dict:
    """The engine in this process, one torch thread, under the same traffic through the node's frame gate: texts
    and frames a second, and the answer's own time with nothing waiting. Each input is stamped with its time since
    the first, as the node stamps it: the model reads the time after every text and frame (about ten tokens more
    than a short text's own); `stamped` False leaves the time out."""
    import torch

    threads = torch.get_num_threads()
    engine = StreamingEngine(model, StreamConfig(capacity=NODE_PARAMS["cache_size"]), device="cpu", dtype="float32",
                             frame_period=1.0 / FRAME_RATE, max_text_delay=MAX_TEXT_DELAY, torch_threads=1)
    try:
        engine.wait_ready(300)
        scene, gate = Scene(240, 320), FrameGate(FRAME_RATE)
        start = time.monotonic()
        next_text = next_frame = 0.0
        sent = frames = 0
        while (elapsed := time.monotonic() - start) < REFERENCE_S:
            stamp = elapsed if stamped else None
            if elapsed >= next_frame:
                if gate.admit(elapsed):
                    engine.submit_frame(scene.frame(frames), stamp)
                frames, next_frame = frames + 1, next_frame + FRAME_EVERY
            while elapsed >= next_text:
                future = engine.submit_text(text(sent), stamp)
                sent, next_text = sent + 1, next_text + TEXT_EVERY
                if future.done() and future.exception() is not None and not isinstance(future.exception(),
                                                                                         EngineBusyError):
                    raise future.exception()
            time.sleep(0.004)
        stats = engine.stats()
        seconds = time.monotonic() - start
        while engine.pending["texts"] or engine.pending["frame"]:
            time.sleep(0.05)
        asked = time.monotonic()
        engine.ask(QUESTION, max_new_tokens=BY_NAME["max_new_tokens"].default, timeout=120)
        return {"texts_per_s": stats.texts_ingested / seconds, "frames_per_s": stats.frames_ingested / seconds,
                "answer_s": time.monotonic() - asked}
    finally:
        engine.close()
        torch.set_num_threads(threads)


def flood_figures(reference: dict, flood: dict) -> dict:
    """What a run shows: frames in each 5-s window after the first, texts a second, the question's wait, beside the
    reference."""
    elapsed, frames, texts = flood["series"][-1]
    return {"frames_per_window": [n for _, n in frames_per_window(flood["series"])], "frames": frames,
            "texts_per_s": texts / elapsed, "question_answered_s": flood["answered_s"],
            "reference_texts_per_s": reference["texts_per_s"], "reference_frames_per_s": reference["frames_per_s"],
            "reference_answer_s": reference["answer_s"]}


def node_under_flood(model: str, tmp_path: Path, domain_id: int | None = None) -> dict:
    """The flood into a fresh node from this process; the node's figures every half second from the first message."""
    domain_id = int(os.environ["ROS_DOMAIN_ID"]) if domain_id is None else domain_id
    node = NodeProcess(domain_id, dict(NODE_PARAMS, model=model), tmp_path)
    driver = Driver(domain_id, name="flood_driver")
    try:
        deadline = time.monotonic() + 300
        while not ((stats := driver.latest_stats()[0]) is not None and stats.model_ready):
            if not node.alive or time.monotonic() > deadline:
                raise RuntimeError(f"the node did not become ready: {node.log()[-3000:]}")
            time.sleep(0.1)
        scene = Scene(240, 320)
        series, question, asked, answered = [], None, None, None
        start = time.monotonic()
        next_text = next_frame = next_sample = 0.0
        sent = frames = 0
        while (elapsed := time.monotonic() - start) < FLOOD_S:
            if elapsed >= next_frame:
                driver.publish_frame(scene.frame(frames), time.time_ns())
                frames, next_frame = frames + 1, next_frame + FRAME_EVERY
            while elapsed >= next_text:
                driver.publish_text(text(sent))
                sent, next_text = sent + 1, next_text + TEXT_EVERY
            if question is None and elapsed >= QUESTION_AT:
                question, asked = driver.ask(QUESTION), time.monotonic()
            if question is not None and answered is None and question.done():
                answered = time.monotonic() - asked
            if elapsed >= next_sample:
                stats = driver.latest_stats()[0]
                series.append((elapsed, stats.frames_ingested, stats.texts_ingested))
                next_sample += 0.5
            time.sleep(0.004)
        while answered is None and time.monotonic() - asked < 120:
            if question.done():
                answered = time.monotonic() - asked
            time.sleep(0.02)
        if not node.alive:
            raise RuntimeError(f"the node ended under the flood: {node.log()[-3000:]}")
        # Frames the node held back (frame_rate) or replaced: about four of five if every frame reached it.
        dropped = driver.latest_stats()[0].frames_dropped
        return {"series": series, "texts_sent": sent, "answered_s": answered, "frames_dropped": dropped,
                "answer": question.result() if question.done() else None}
    finally:
        driver.close()
        node.stop(60)


def frames_per_window(series: list[tuple], window_s: float = WINDOW_S) -> list[tuple[float, int]]:
    """Frames taken in each whole window of `window_s` after the flood's first 5 s: (its start, the count)."""
    def frames_at(t):
        return max(f for elapsed, f, _ in series if elapsed <= t)
    starts = [WINDOW_S + i * window_s for i in range(int((FLOOD_S - WINDOW_S) // window_s))]
    return [(start, frames_at(start + window_s) - frames_at(start)) for start in starts]
