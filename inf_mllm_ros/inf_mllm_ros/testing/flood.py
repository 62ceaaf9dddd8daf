"""The flood: texts at 50 a second and 320x240 frames at 5 Hz for 30 s from another process into a fresh node (one
torch thread, cache 256, frame_rate 1, the shipped settings otherwise), a question at 10 s, counted from the first
message; and the same engine in one process under the same traffic, for reference. `test_node_flood.py` checks the
node against the reference; `benchmarks/node_flood.py` records runs of it.

On a shared CPU (`busy` CPU-bound processes beside, testing/cpu_load.py), the publisher publishes from timers and
spins rclpy's MultiThreadedExecutor, as many robot nodes do (`publisher="timers"`), and the reference is the same
engine in one process beside the same load, under the same traffic with the same question at 10 s, for the whole
flood (`reference_flood`): what one process with that share of the CPU takes.
"""

from __future__ import annotations

import os
import statistics
from concurrent.futures import wait as wait_futures
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

from ..engine.runtime.engine import EngineBusyError, StreamingEngine
from ..engine.stream_config import StreamConfig
from ..input_rules import FrameGate
from ..settings import BY_NAME
from .cpu_load import busy_cores
from .node_process import Driver, NodeProcess, Scene, proc_cpu_seconds

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
# The question's answer is cut at this many tokens in the node and the reference alike: its time then measures the wait
# and the model's pace, not how long an answer the two memories happen to give (up to 64 tokens, 0.1 to 0.2 s each on
# one core: a 64-token answer against the reference's 12 put a run past its bound by the length alone).
QUESTION_TOKENS = 16


def text(n: int) -> str:
    return f"Conveyor {n % 9} moved crate {n} past the scanner."


def reference_pace(model: str, stamped: bool = True, question_tokens: int = QUESTION_TOKENS) -> dict:
    """The engine in this process, one torch thread, under the same traffic through the node's frame gate: texts
    and frames a second, the longest job (a frame or a call of texts: the longest time between two inputs taken while
    the flood lasts, the model being never idle under it), and the answer's own time (cut at `question_tokens`) once
    every input has gone in or been refused. Each input is stamped with its time since the first, as the node stamps
    it: the model reads the time after every text and frame (about ten tokens more than a short text's own);
    `stamped` False leaves the time out."""
    import torch

    threads = torch.get_num_threads()
    engine = StreamingEngine(model, StreamConfig(capacity=NODE_PARAMS["cache_size"]), device="cpu", dtype="float32",
                             frame_period=1.0 / FRAME_RATE, max_text_delay=MAX_TEXT_DELAY, torch_threads=1)
    taken: list[float] = []  # when each input went in, appended from the worker's thread
    futures: list = []

    def submitted(future) -> None:
        futures.append(future)
        future.add_done_callback(lambda f: taken.append(time.monotonic())
                                 if not f.cancelled() and f.exception() is None else None)

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
                    submitted(engine.submit_frame(scene.frame(frames), stamp))
                frames, next_frame = frames + 1, next_frame + FRAME_EVERY
            while elapsed >= next_text:
                submitted(future := engine.submit_text(text(sent), stamp))
                sent, next_text = sent + 1, next_text + TEXT_EVERY
                if future.done() and future.exception() is not None and not isinstance(future.exception(),
                                                                                         EngineBusyError):
                    raise future.exception()
            time.sleep(0.004)
        stats = engine.stats()
        seconds = time.monotonic() - start
        # Every input in (or refused): a job still running when the queue is empty would be waited for otherwise.
        wait_futures(futures, timeout=300)
        asked = time.monotonic()
        answer = engine.ask(QUESTION, max_new_tokens=question_tokens, timeout=120)
        # While the flood lasts: the texts left when it stops go in after it, in calls no frame bounds.
        ends = sorted(t for t in taken if t <= start + seconds)
        return {"texts_per_s": stats.texts_ingested / seconds, "frames_per_s": stats.frames_ingested / seconds,
                "longest_job_s": max((b - a for a, b in zip(ends, ends[1:])), default=0.0),
                "answer_s": time.monotonic() - asked, "answer": answer.text, "answer_tokens": answer.tokens_generated}
    finally:
        engine.close()
        torch.set_num_threads(threads)


def reference_flood(model: str, busy: int = 0, question_tokens: int = QUESTION_TOKENS,
                    questions_at: tuple[float, ...] = (QUESTION_AT,)) -> dict:
    """The engine in this process, one torch thread, under the flood's traffic for the whole flood (FLOOD_S) through
    the node's frame gate, its inputs stamped as the node stamps them, with the question at each of `questions_at`,
    beside `busy` CPU-bound processes: frames and texts taken, and each question's time from asked to answered (the
    first's as `answer_s`, all in `answers_s`)."""
    import torch

    threads = torch.get_num_threads()
    engine = StreamingEngine(model, StreamConfig(capacity=NODE_PARAMS["cache_size"]), device="cpu", dtype="float32",
                             frame_period=1.0 / FRAME_RATE, max_text_delay=MAX_TEXT_DELAY, torch_threads=1)
    try:
        engine.wait_ready(300)
        scene, gate = Scene(240, 320), FrameGate(FRAME_RATE)
        with busy_cores(busy, seconds=FLOOD_S + 180) if busy else nullcontext() as load:
            start = time.monotonic()
            next_text = next_frame = 0.0
            sent = frames = 0
            questions = Questions(questions_at, lambda: engine.submit_ask(QUESTION, max_new_tokens=question_tokens))
            while (elapsed := time.monotonic() - start) < FLOOD_S:
                if elapsed >= next_frame:
                    if gate.admit(elapsed):
                        engine.submit_frame(scene.frame(frames), elapsed)
                    frames, next_frame = frames + 1, next_frame + FRAME_EVERY
                while elapsed >= next_text:
                    engine.submit_text(text(sent), elapsed)
                    sent, next_text = sent + 1, next_text + TEXT_EVERY
                questions.poll(elapsed)
                time.sleep(0.004)
            stats = engine.stats()
            questions.finish(120)
            answers = [future.result(timeout=120) for future in questions.futures]
            cores = load.cores_taken() if load is not None else 0.0
        return {"frames": stats.frames_ingested, "texts": stats.texts_ingested, "texts_sent": sent,
                "answer_s": questions.answered[0], "answers_s": questions.answered,
                "answer_tokens": answers[0].tokens_generated, "answer": answers[0].text, "busy_cores": cores}
    finally:
        engine.close()
        torch.set_num_threads(threads)


class Questions:
    """The flood's questions: each asked (`ask()`, which gives a future) once the flood reaches its time, and its time
    from asked to answered."""

    def __init__(self, at: tuple[float, ...], ask: Callable[[], object]):
        self.at, self.ask = sorted(at), ask
        self.futures: list = []  # each with done() and result(): an engine's Future, an rclpy one
        self.asked: list[float] = []
        self.answered: list[float | None] = []

    def poll(self, elapsed: float) -> None:
        """Ask the next question where its time has come; note the answers that came."""
        if len(self.futures) < len(self.at) and elapsed >= self.at[len(self.futures)]:
            self.futures.append(self.ask())
            self.asked.append(time.monotonic())
            self.answered.append(None)
        for i, future in enumerate(self.futures):
            if self.answered[i] is None and future.done():
                self.answered[i] = time.monotonic() - self.asked[i]

    def finish(self, timeout: float) -> None:
        """Wait (up to `timeout` seconds from the last question asked) for the answers still out."""
        while None in self.answered and time.monotonic() - self.asked[-1] < timeout:
            self.poll(float("-inf"))
            time.sleep(0.02)


def median_s(times: list[float | None]) -> float | None:
    """The median of the questions' times, or None where one was not answered."""
    return statistics.median(times) if times and None not in times else None


def shared_cpu_figures(reference: dict, flood: dict) -> dict:
    """What a flood on a shared CPU shows beside its reference: frames over the whole flood and their share of the
    reference's, the question's time against the reference's, texts taken, and what was taken or refused."""
    elapsed, frames, texts = flood["series"][-1]
    return {"frames": frames, "reference_frames": reference["frames"],
            "frame_share": round(frames / max(reference["frames"], 1), 3),
            "frames_per_window": [n for _, n in frames_per_window(flood["series"])],
            "question_answered_s": flood["answered_s"], "reference_answer_s": reference["answer_s"],
            "questions_answered_s": flood["answered_all_s"], "reference_answers_s": reference["answers_s"],
            "question_answered_median_s": median_s(flood["answered_all_s"]),
            "reference_answer_median_s": median_s(reference["answers_s"]),
            "answer": flood["answer"].answer if flood["answer"] is not None else None,
            "node_answer_latency_s": flood["answer"].latency if flood["answer"] is not None else None,
            "reference_answer": reference["answer"], "reference_answer_tokens": reference["answer_tokens"],
            "texts_per_s": texts / elapsed, "reference_texts": reference["texts"], "texts_sent": flood["texts_sent"],
            "texts_taken": flood["texts_taken"], "texts_refused": flood["texts_refused"],
            "texts_unaccounted": flood["texts_sent"] - flood["texts_taken"] - flood["texts_refused"],
            "busy_cores": flood["busy_cores"], "reference_busy_cores": reference["busy_cores"],
            "node_cores": flood["node_cores"], "publisher_cores": flood["publisher_cores"]}


def flood_figures(reference: dict, flood: dict) -> dict:
    """What a run shows: frames in each 5-s window after the first, texts a second, the question's wait, beside the
    reference."""
    elapsed, frames, texts = flood["series"][-1]
    return {"frames_per_window": [n for _, n in frames_per_window(flood["series"])], "frames": frames,
            "texts_per_s": texts / elapsed, "question_answered_s": flood["answered_s"],
            "reference_texts_per_s": reference["texts_per_s"], "reference_frames_per_s": reference["frames_per_s"],
            "reference_answer_s": reference["answer_s"], "reference_longest_job_s": reference["longest_job_s"]}


class _TimerPublisher:
    """The flood published from timers on the driver's node (a text every TEXT_EVERY, a frame every FRAME_EVERY), as a
    robot node publishes, on whatever executor the driver spins."""

    def __init__(self, driver: Driver):
        self.driver, self.scene, self.texts, self.frames = driver, Scene(240, 320), 0, 0
        self.on = False
        # A callback runs on an executor thread while `stop` runs on the caller's: a text published as the flood
        # stops must be counted before `texts` is read, or the node is found to have taken one text more than sent.
        self._lock = threading.Lock()
        self._timers = [driver.node.create_timer(TEXT_EVERY, self._text), driver.node.create_timer(FRAME_EVERY,
                                                                                                    self._frame)]

    def _text(self) -> None:
        with self._lock:
            if self.on:
                self.driver.publish_text(text(self.texts))
                self.texts += 1

    def _frame(self) -> None:
        with self._lock:
            if self.on:
                self.driver.publish_frame(self.scene.frame(self.frames), time.time_ns())
                self.frames += 1

    def stop(self) -> None:
        """No timer publishes after this returns, and every text published is in `texts`."""
        with self._lock:
            self.on = False
        for t in self._timers:
            self.driver.node.destroy_timer(t)


def node_under_flood(model: str, tmp_path: Path, domain_id: int | None = None, *, publisher: str = "loop",
                     busy: int = 0, question_tokens: int = QUESTION_TOKENS,
                     questions_at: tuple[float, ...] = (QUESTION_AT,)) -> dict:
    """The flood into a fresh node from this process; the node's figures every half second from the first message.

    publisher "loop": published from this thread, the driver spinning the node's executor; "timers": published from
    timers, the driver spinning rclpy's MultiThreadedExecutor. busy: CPU-bound processes beside, from the first
    message to the end of the flood. question_tokens: the question's max_new_tokens (0: the node's). questions_at:
    when the question is asked (the first's time `answered_s` and answer `answer`; all in `answered_all_s`,
    `answers`)."""
    domain_id = int(os.environ["ROS_DOMAIN_ID"]) if domain_id is None else domain_id
    node = NodeProcess(domain_id, dict(NODE_PARAMS, model=model), tmp_path)
    driver = Driver(domain_id, name="flood_driver", executor="rclpy" if publisher == "timers" else "once_queued")
    timers = _TimerPublisher(driver) if publisher == "timers" else None
    try:
        deadline = time.monotonic() + 300
        while not ((stats := driver.latest_stats()[0]) is not None and stats.model_ready):
            if not node.alive or time.monotonic() > deadline:
                raise RuntimeError(f"the node did not become ready: {node.log()[-3000:]}")
            time.sleep(0.1)
        # The node subscribes as it activates: the flood starts once both topics are matched, so that every text
        # sent can be counted as taken or refused.
        while not (driver.text.get_subscription_count() and driver.camera.get_subscription_count()):
            if time.monotonic() > deadline:
                raise RuntimeError("the node's text and image subscriptions were not matched")
            time.sleep(0.05)
        time.sleep(0.5)
        # A publisher-side match is not yet a link: samples of a reliable, volatile topic written before the node's
        # side has matched the writer are lost by the middleware, not the node. One text through, end to end, before
        # the flood; what follows is counted from its figures on.
        base = _texts_accounted(_text_through(driver, deadline))
        scene = Scene(240, 320)
        series = []
        questions = Questions(questions_at, lambda: driver.ask(QUESTION, question_tokens))
        with busy_cores(busy, seconds=FLOOD_S + 180) if busy else nullcontext() as load:
            start = time.monotonic()
            cpu_at_start = (proc_cpu_seconds(node.pid), proc_cpu_seconds(os.getpid()))
            next_text = next_frame = next_sample = 0.0
            sent = frames = 0
            if timers is not None:
                timers.on = True
            while (elapsed := time.monotonic() - start) < FLOOD_S:
                if timers is None and elapsed >= next_frame:
                    driver.publish_frame(scene.frame(frames), time.time_ns())
                    frames, next_frame = frames + 1, next_frame + FRAME_EVERY
                while timers is None and elapsed >= next_text:
                    driver.publish_text(text(sent))
                    sent, next_text = sent + 1, next_text + TEXT_EVERY
                questions.poll(elapsed)
                if elapsed >= next_sample:
                    stats = driver.latest_stats()[0]
                    series.append((elapsed, stats.frames_ingested, stats.texts_ingested - base[0]))
                    next_sample += 0.5
                time.sleep(0.004)
            if timers is not None:
                timers.stop()
                sent = timers.texts
            cores = load.cores_taken() if load is not None else 0.0
            # Cores the node and this process (the publisher) took during the flood.
            node_cores, publisher_cores = ((proc_cpu_seconds(pid) - at_start) / FLOOD_S
                                           for pid, at_start in zip((node.pid, os.getpid()), cpu_at_start))
        questions.finish(120)
        if not node.alive:
            raise RuntimeError(f"the node ended under the flood: {node.log()[-3000:]}")
        # The texts the node took: in the model, refused with a count (a full queue), or still waiting; the figures
        # once none waits and the model's count has stood still for 2 s (the last call may hold texts taken from the
        # queue and not yet counted), or a minute has passed.
        ended = time.monotonic()
        seen, steady_since = None, None
        while time.monotonic() < ended + 60:
            last, at = driver.latest_stats()
            now = (last.texts_ingested, last.texts_waiting, last.inputs_rejected)
            if now != seen:
                seen, steady_since = now, at
            elif at > ended + 1.0 and not last.texts_waiting and at - steady_since >= 2.0:
                break
            time.sleep(0.1)
        # Frames the node held back (frame_rate) or replaced: about four of five if every frame reached it.
        answers = [future.result() if future.done() else None for future in questions.futures]
        return {"series": series, "texts_sent": sent, "answered_s": questions.answered[0],
                "answered_all_s": questions.answered, "frames_dropped": last.frames_dropped,
                "answer": answers[0], "answers": answers, "busy_cores": cores,
                "node_cores": node_cores, "publisher_cores": publisher_cores,
                "texts_taken": last.texts_ingested + last.texts_waiting - base[0] - base[1],
                "texts_refused": last.inputs_rejected - base[2]}
    finally:
        driver.close()
        node.stop(60)


def _texts_accounted(stats) -> tuple[int, int, int]:
    return stats.texts_ingested, stats.texts_waiting, stats.inputs_rejected


def _text_through(driver: Driver, deadline: float):
    """Publish a text (again every second) until the node's figures show it taken; returns those figures."""
    before = sum(_texts_accounted(driver.latest_stats()[0]))
    published = None
    while True:
        stats = driver.latest_stats()[0]
        if sum(_texts_accounted(stats)) > before:
            return stats
        if time.monotonic() > deadline:
            raise RuntimeError("no text reached the node before the flood")
        if published is None or time.monotonic() - published >= 1.0:
            driver.publish_text("The flood begins.")
            published = time.monotonic()
        time.sleep(0.05)


def frames_per_window(series: list[tuple], window_s: float = WINDOW_S) -> list[tuple[float, int]]:
    """Frames taken in each whole window of `window_s` after the flood's first 5 s: (its start, the count)."""
    def frames_at(t):
        return max(f for elapsed, f, _ in series if elapsed <= t)
    starts = [WINDOW_S + i * window_s for i in range(int((FLOOD_S - WINDOW_S) // window_s))]
    return [(start, frames_at(start + window_s) - frames_at(start)) for start in starts]
