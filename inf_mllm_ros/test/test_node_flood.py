"""Under a flood the node keeps its pace from the first message.

Another process (this one, through `testing.node_process.Driver`) publishes 50 texts a second and 320x240 frames at
5 Hz for 30 s into a fresh node (one torch thread, cache 256, frame_rate 1: the shipped settings otherwise) and asks a
question at 10 s. Counted from the first message, with no warm-up: frames go in at frame_rate in every 5-s window
after the first, texts at a pace near the one the same engine keeps in one process under the same traffic, and the
question is answered within its own time, one batch of the texts ahead of it and the job in progress. The small
model runs in the suite; the default model once, in the slow group.

The bounds are 40% of the pace in one process (frames and texts), where the aim is 50%: on this project's 2-core
machine the node's executor and the flood's own publisher share the cores with the model, and measured runs gave
the node 45% to 57% of the texts a second of one process, 22 to 24 frames in 30 s, and the question answered after
2.7 to 3.6 s (docs/node.md, "Order of work").
"""


from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from inf_mllm_ros.engine.engine import EngineBusyError, StreamingEngine
from inf_mllm_ros.engine.stream_config import StreamConfig
from inf_mllm_ros.input_rules import FrameGate
from inf_mllm_ros.settings import BY_NAME
from inf_mllm_ros.testing.node_process import Driver, NodeProcess, Scene

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
# The share of the pace in one process below which the test fails (see the docstring).
PACE_SHARE = 0.4


def text(n: int) -> str:
    return f"Conveyor {n % 9} moved crate {n} past the scanner."


def reference_pace(model: str) -> dict:
    """The engine in this process, one torch thread, under the same traffic through the node's frame gate: texts
    and frames a second, and the answer's own time with nothing waiting."""
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
            if elapsed >= next_frame:
                if gate.admit(elapsed):
                    engine.submit_frame(scene.frame(frames))
                frames, next_frame = frames + 1, next_frame + FRAME_EVERY
            while elapsed >= next_text:
                future = engine.submit_text(text(sent))
                sent, next_text = sent + 1, next_text + TEXT_EVERY
                assert not future.done() or isinstance(future.exception(), EngineBusyError) or future.exception() is None
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


def node_under_flood(model: str, tmp_path: Path) -> dict:
    """The flood into a fresh node from this process; the node's figures every half second from the first message."""
    domain_id = int(os.environ["ROS_DOMAIN_ID"])
    node = NodeProcess(domain_id, dict(NODE_PARAMS, model=model), tmp_path)
    driver = Driver(domain_id, name="flood_driver")
    try:
        deadline = time.monotonic() + 300
        while not ((stats := driver.latest_stats()[0]) is not None and stats.model_ready):
            assert node.alive and time.monotonic() < deadline, node.log()[-3000:]
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
        assert node.alive, node.log()[-3000:]
        return {"series": series, "texts_sent": sent, "answered_s": answered,
                "answer": question.result() if question.done() else None}
    finally:
        driver.close()
        node.stop(60)


def frames_per_window(series: list[tuple]) -> list[int]:
    """Frames taken in each whole 5-s window of the flood after the first."""
    def frames_at(t):
        return max(f for elapsed, f, _ in series if elapsed <= t)
    return [frames_at(start + WINDOW_S) - frames_at(start)
            for start in range(int(WINDOW_S), int(FLOOD_S - WINDOW_S) + 1, int(WINDOW_S))]


def check_flood(model: str, tmp_path: Path, *, frame_rate_held: bool) -> None:
    reference = reference_pace(model)
    flood = node_under_flood(model, tmp_path)
    windows = frames_per_window(flood["series"])
    texts_per_s = flood["series"][-1][2] / flood["series"][-1][0]
    print(f"{model}: in one process {reference['texts_per_s']:.1f} texts/s, {reference['frames_per_s']:.2f} "
          f"frames/s, an answer in {reference['answer_s']:.2f} s; the node under the flood: frames per 5 s {windows} "
          f"({flood['series'][-1][1]} in all), {texts_per_s:.1f} texts/s, the question answered after "
          f"{flood['answered_s']} s")
    answer = flood["answer"]
    assert answer is not None and answer.success, answer
    # Its own time, one batch of the texts ahead of it (max_text_delay) and the job in progress (a frame or a
    # text call, each about the answer's time on this model or less).
    assert flood["answered_s"] <= 2 * reference["answer_s"] + MAX_TEXT_DELAY + 1.0, (flood["answered_s"], reference)
    assert texts_per_s >= PACE_SHARE * reference["texts_per_s"], (texts_per_s, reference)
    # frame_rate where the model keeps it in one process, else the pace it keeps there.
    expected = FRAME_RATE * WINDOW_S if frame_rate_held else reference["frames_per_s"] * WINDOW_S
    assert all(PACE_SHARE * expected <= n <= (2 - PACE_SHARE) * expected for n in windows), (windows, expected)


def test_under_a_flood_the_node_keeps_its_pace_from_the_first_message(tmp_path):
    check_flood("smolvlm-smollm2", tmp_path, frame_rate_held=True)


@pytest.mark.slow
def test_under_a_flood_the_node_on_the_default_model_keeps_its_pace_from_the_first_message(tmp_path):
    check_flood("onevision-qwen2.5-0.5b", tmp_path, frame_rate_held=False)
