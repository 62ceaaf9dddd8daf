"""The streaming engine on the real SmolLM2-135M-Instruct (the small embedded language model)."""

from __future__ import annotations

import concurrent.futures
import math
import random
import threading
import time

import pytest
import torch

from inf_mllm_ros.engine.runtime.engine import EngineBusyError, EngineNotReadyError, StreamingEngine
from inf_mllm_ros.engine.models.loading import ModelLoadError, load_model
from inf_mllm_ros.engine.answering import AnswerCancelledError, StreamStoppedError, asks_when
from inf_mllm_ros.engine.runtime.stream import KVStream
from inf_mllm_ros.settings import BY_NAME
from inf_mllm_ros.engine.stream_config import StreamConfig
from inf_mllm_ros.engine.runtime.work_queue import FRAME_PERIOD_SHARE, Job, WorkQueue

from conftest import LIGHTHOUSE

POLICIES = ["inf_mllm", "streaming_llm", "h2o", "window", "full"]
TEXT = LIGHTHOUSE


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def reference(smollm2):
    """The plain transformers model with its own full cache, loaded from the same folder."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2.folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("policy", POLICIES)
def test_while_the_stream_fits_every_policy_matches_the_full_model(smollm2, reference, policy):
    ids = smollm2.tokenize(TEXT)
    stream = KVStream(smollm2, StreamConfig(capacity=1024, policy=policy, chunk_size=64, system_prompt=""))
    logits = stream.push_tokens(ids, return_logits=True)
    with torch.inference_mode():
        expected = reference(ids[None]).logits[0].float()
    assert logits.shape == expected.shape
    # The stream's linears multiply through packed weights (engine/ops/few_rows.py), the plain model's through torch's
    # own: float32 sums in another order, about 1e-4 apart on logits about 10 in size on this text.
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=0)


@pytest.mark.parametrize("policy", ["inf_mllm", "window"])
def test_greedy_answer_matches_the_full_model(smollm2, reference, policy):
    config = StreamConfig(capacity=1024, policy=policy, chunk_size=32)
    stream = KVStream(smollm2, config)
    stream.push_text("Forklift F2 parked at dock 3.", 5.0)
    answer = stream.ask("Where did forklift F2 park?", max_new_tokens=24)
    chat = smollm2.chat
    prompt = chat.system(config.system_prompt) + chat.user("Forklift F2 parked at dock 3. [0:00:05.0]")
    question = "".join(stream.question_parts("Where did forklift F2 park?"))  # with the shipped answer prompt
    ids = torch.cat([smollm2.tokenize(prompt), smollm2.tokenize(question)])
    with torch.inference_mode():
        out = reference.generate(ids[None], max_new_tokens=24, do_sample=False)[0, ids.numel():]
    expected = smollm2.decode([t for t in out.tolist() if t not in smollm2.stop_token_ids]).strip()
    assert answer.text == expected
    assert "dock 3" in answer.text.lower()


@pytest.mark.parametrize("question, when", [
    ("When did forklift F2 park?", True),
    ("when was the door of dock 3 opened", True),
    ("At what time did the light of door D1 turn red?", True),
    ("What time is the delivery due?", True),
    ("On which day did Gina open her store?", True),
    ("  In what year did Nate get his turtles?", True),
    ("Where did forklift F2 park?", False),
    ("What did Maria say about the time she went hiking?", False),
    ("How long ago did you see the ladder?", False),
    ("Whenever the door opens, who comes in?", False),
    ("Who parked when the alarm rang?", False),
])
def test_a_question_that_asks_when_is_told_the_when_prompt_and_only_then(smollm2, question, when):
    stream = KVStream(smollm2, StreamConfig(capacity=256))
    config = stream.config
    head, words, rest = stream.question_parts(question)
    assert words.strip() == question.strip()  # retrieval reads the question alone either way
    assert (config.when_prompt in rest, config.answer_prompt in rest) == (when, not when)
    stream.reconfigure(when_prompt="")  # none: the answer prompt after every question
    assert config.answer_prompt in stream.question_parts(question)[2]
    assert asks_when(question) == when


def test_a_system_turn_that_fails_leaves_nothing_and_is_pushed_again(smollm2, monkeypatch):
    # A system turn longer than a block, whose second block fails (as an out-of-memory error would): the
    # first block must not stay, and the next input opens the memory with the whole turn.
    config = StreamConfig(capacity=1024, chunk_size=16)
    stream = KVStream(smollm2, config)
    forward, calls = smollm2.forward, []

    def second_block_fails(*args, **kwargs):  # the model's forward, as the stream calls it once a block
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return forward(*args, **kwargs)

    monkeypatch.setattr(smollm2, "forward", second_block_fails)
    with pytest.raises(RuntimeError, match="out of memory"):
        stream.push_text("Forklift F2 parked at dock 3.", 5.0)
    assert (stream.cache.fill, stream.cache.next_position, stream.tokens_seen) == (0, 0, 0)
    stream.push_text("Forklift F2 parked at dock 3.", 5.0)
    monkeypatch.undo()
    fresh = KVStream(smollm2, config)
    fresh.push_text("Forklift F2 parked at dock 3.", 5.0)
    assert stream.stats() == fresh.stats()
    torch.testing.assert_close(stream.cache.layers[0].keys[..., : stream.cache.fill, :],
                               fresh.cache.layers[0].keys[..., : fresh.cache.fill, :])


def test_a_stop_ends_a_long_text_at_its_block_and_keeps_what_went_in(smollm2, monkeypatch):
    # A shutdown must not wait for a long text: it stops at the end of the block being pushed.
    stream = KVStream(smollm2, StreamConfig(capacity=1024, chunk_size=32, system_prompt=""))
    forward = smollm2.forward

    def stop_during_the_first_block(*args, **kwargs):
        stream.request_stop()  # as close() does, from another thread, while the model runs
        return forward(*args, **kwargs)

    monkeypatch.setattr(smollm2, "forward", stop_during_the_first_block)
    with pytest.raises(StreamStoppedError, match="its first 32 of"):
        stream.push_text(TEXT)
    assert stream.tokens_seen == stream.cache.fill == 32 and stream.texts_ingested == 0


def test_an_answer_cut_by_the_headroom_says_so(smollm2):
    stream = KVStream(smollm2, StreamConfig(capacity=64, chunk_size=16, headroom=36, system_prompt=""))
    stream.push_text(TEXT)  # the cache full: what is left for a question and its answer is the headroom
    question = "Tell a long story about the lighthouse keeper."
    cut = stream.ask(question, max_new_tokens=200)
    assert cut.cut_by_headroom and 0 < cut.tokens_generated < 36, cut
    whole = stream.ask(question, max_new_tokens=4)
    assert not whole.cut_by_headroom and whole.tokens_generated == 4
    kept = stream.ask(question, max_new_tokens=60, keep_in_memory=True)  # a kept answer is not bounded so
    assert not kept.cut_by_headroom and kept.tokens_generated > cut.tokens_generated


def test_a_stop_never_cuts_a_kept_question_short(smollm2, monkeypatch):
    # A question kept in memory and too long for the headroom goes in, in blocks, before its answer; a stop
    # then ends the answer, never the question, and the turn is closed: a dialogue turn stays whole.
    stream = KVStream(smollm2, StreamConfig(capacity=64, chunk_size=16, headroom=32, system_prompt=""))
    stream.push_text("Forklift F2 parked at dock 3.")
    question = " ".join(["Where did forklift F2 park, and when?"] * 6)
    turn = smollm2.tokenize_turn(stream.question_parts(question)).numel()
    assert turn > 32
    before, forward = stream.tokens_seen, smollm2.forward

    def stop_during_the_first_block(*args, **kwargs):
        stream.request_stop()
        return forward(*args, **kwargs)

    monkeypatch.setattr(smollm2, "forward", stop_during_the_first_block)
    with pytest.raises(StreamStoppedError, match="answering"):
        stream.ask(question, keep_in_memory=True)
    assert stream.tokens_seen == before + turn + stream.closing_ids.numel()


def test_a_question_not_kept_leaves_memory_exactly_as_it_was(smollm2):
    stream = KVStream(smollm2, StreamConfig(capacity=128, policy="inf_mllm", chunk_size=32))
    stream.push_text(TEXT)
    layer = stream.cache.layers[3]
    before = (stream.cache.fill, stream.cache.next_position, stream.tokens_seen, layer.keys[:, :, : layer.fill].clone())
    stream.ask("What does the keeper do at dusk?", max_new_tokens=8)
    assert (stream.cache.fill, stream.cache.next_position, stream.tokens_seen) == before[:3]
    assert torch.equal(layer.keys[:, :, : layer.fill], before[3])


def test_a_kept_exchange_stays_in_memory_for_the_next_round(smollm2):
    stream = KVStream(smollm2, StreamConfig(capacity=256, policy="inf_mllm", chunk_size=32))
    stream.push_text("The visitor's name is Margaret.")
    seen = stream.tokens_seen
    first = stream.ask("Remember this: the password is tulip. Reply OK.", max_new_tokens=6, keep_in_memory=True)
    assert first.kept_in_memory and stream.tokens_seen > seen
    assert "tulip" in stream.ask("What is the password?", max_new_tokens=12).text.lower()


@pytest.mark.parametrize("keep", [False, True])
def test_an_answer_streams_token_by_token_and_a_cancel_leaves_memory_as_it_was(smollm2, keep):
    import threading

    stream = KVStream(smollm2, StreamConfig(capacity=128, policy="inf_mllm", chunk_size=32))
    stream.push_text(TEXT)
    partial = []
    whole = stream.ask("What does the keeper do at dusk?", max_new_tokens=8,
                       on_token=lambda text, n: partial.append((text, n)))
    assert [n for _, n in partial] == list(range(1, whole.tokens_generated + 1))
    assert partial[-1][0] == whole.text and all(whole.text.startswith(t) for t, _ in partial)

    layer = stream.cache.layers[3]
    before = (stream.cache.fill, stream.cache.next_position, stream.tokens_seen, stream.cache.evictions,
              layer.keys[:, :, : layer.fill].clone())
    cancel = threading.Event()
    seen = []

    def cancel_after_three(text, n):
        seen.append(n)
        if n == 3:
            cancel.set()

    with pytest.raises(AnswerCancelledError):
        stream.ask("Tell me everything about the keeper.", max_new_tokens=40, keep_in_memory=keep,
                   on_token=cancel_after_three, cancel=cancel)
    assert seen == [1, 2, 3], "stopped at the next token"
    assert (stream.cache.fill, stream.cache.next_position, stream.tokens_seen, stream.cache.evictions) == before[:4]
    assert torch.equal(layer.keys[:, :, : layer.fill], before[4])


def test_a_cancel_after_a_long_kept_question_went_in_closes_its_turn(smollm2, monkeypatch):
    # Question and answer do not fit the headroom together (max_new_tokens above it), so the question goes
    # into the memory first and the answer follows it there; a cancel then ends the turn, as a complete
    # answer would have.
    stream = KVStream(smollm2, StreamConfig(capacity=128, policy="inf_mllm", chunk_size=32))
    stream.push_text(TEXT)
    assert stream.cache.slots - stream.cache.fill < 1000
    pushed = []
    original = smollm2.text_prompt
    monkeypatch.setattr(smollm2, "text_prompt", lambda ids: pushed.append(ids.tolist()) or original(ids))
    cancel = threading.Event()
    with pytest.raises(AnswerCancelledError):
        stream.ask("Tell me everything about the keeper.", max_new_tokens=1000, keep_in_memory=True,
                   on_token=lambda text, n: n == 3 and cancel.set(), cancel=cancel)
    assert pushed[-1] == stream.closing_ids.tolist(), "the turn is closed"
    assert len(pushed) == 1 + 3 + 1, "the question, the three answer tokens before the cancel, the closing"


def test_stream_far_past_the_context_stays_bounded_and_answers(smollm2):
    stream = KVStream(smollm2, StreamConfig(capacity=128, policy="inf_mllm", chunk_size=64))
    ids = smollm2.tokenize(TEXT * 4)
    for _ in range(3):
        stream.push_tokens(ids)
    assert stream.cache.fill == 128 and stream.cache.next_position <= 128 + 64
    assert stream.ask("Who climbs the stairs?", max_new_tokens=10).text


def test_missing_and_broken_model_folders_name_the_path_and_problem(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=f"{tmp_path}.*not valid JSON"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ModelLoadError, match="no weights"):
        load_model(tmp_path)



def test_a_copied_model_file_is_joined_in_order_and_checked_and_a_wrong_one_leaves_nothing(tmp_path):
    """What a robot with no network gets its models from (`--qwen-gguf`): the file or its pieces."""
    import hashlib

    from inf_mllm_ros.engine.models.embedded_models import join_verified, prepare_qwen

    first, second = tmp_path / "piece0", tmp_path / "piece1"
    first.write_bytes(b"GGUF-head")
    second.write_bytes(b"-tail")
    sha = hashlib.sha256(b"GGUF-head-tail").hexdigest()
    assert join_verified([first, second], tmp_path / "joined", size=14, sha256=sha).read_bytes() == b"GGUF-head-tail"
    with pytest.raises(ModelLoadError, match="nothing was kept"):
        join_verified([second, first], tmp_path / "swapped", size=14, sha256=sha)
    assert not list(tmp_path.glob("swapped*"))
    with pytest.raises(ModelLoadError, match="expected 491400064 bytes"):
        prepare_qwen(tmp_path / "qwen", parts=[first, second])
    assert not (tmp_path / "qwen").exists()

def test_engine_answers_from_several_threads_and_refuses_when_busy(smollm2):
    engine = StreamingEngine(adapter=smollm2, config=StreamConfig(capacity=256, chunk_size=64),
                             max_pending_queries=2)
    assert engine.wait_ready(60)
    engine.push_text("Door D1 light turned red.", 31.0)
    answers, errors = [], []

    def ask():
        try:
            answers.append(engine.ask("What colour is the light of door D1?", max_new_tokens=8, timeout=120))
        except EngineBusyError as exc:
            errors.append(exc)

    hold = _hold_worker(engine)  # the six come while the model is busy: two may wait, the rest are refused
    threads = [threading.Thread(target=ask) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert hold.result(timeout=120).text
    assert len(answers) + len(errors) == 6 and answers
    assert len(errors) >= 4 and all("full" in str(e) for e in errors)
    assert engine.stats().texts_ingested == 1
    engine.close()
    with pytest.raises(EngineNotReadyError):
        engine.submit_text("after close")


def test_engine_reports_a_failed_load(tmp_path):
    engine = StreamingEngine(str(tmp_path / "missing"))
    with pytest.raises(EngineNotReadyError, match="does not exist"):
        engine.wait_ready(30)
    with pytest.raises(EngineNotReadyError, match="failed to load"):
        engine.ask("anyone?")


def test_close_stops_a_long_answer_at_the_next_token(smollm2):
    import time

    engine = StreamingEngine(adapter=smollm2, config=StreamConfig(capacity=256, chunk_size=64))
    engine.wait_ready(60)
    future = engine.submit_ask("Write a long story about a lighthouse.", max_new_tokens=2000)
    while not future.running():
        time.sleep(0.01)
    start = time.monotonic()
    engine.close(timeout=30)
    assert time.monotonic() - start < 10 and not engine.worker.thread.is_alive()
    with pytest.raises(Exception, match="stopped"):
        future.result(0)


def test_close_after_callers_gave_up_on_queued_questions(smollm2):
    """A caller that timed out cancels its waiting question; closing the engine must still go cleanly."""
    engine = StreamingEngine(adapter=smollm2, config=StreamConfig(capacity=256, chunk_size=64))
    engine.wait_ready(60)
    hold = _hold_worker(engine)
    waiting = [engine.submit_ask(f"Question {i}?", max_new_tokens=2) for i in range(3)]
    assert waiting[0].cancel() and waiting[1].cancel()
    assert engine.pending["queries"] == 1, "a question given up frees its place in the queue at once"
    engine.close(timeout=30)
    assert waiting[0].cancelled() and isinstance(waiting[2].exception(0), EngineNotReadyError)
    assert hold.done() and not engine.worker.thread.is_alive()


def _hold_worker(engine):
    """Queue a long answer and wait until the worker runs it, so that what is submitted next waits."""
    import time

    hold = engine.submit_ask("Write a long story about a lighthouse.", max_new_tokens=40)
    while not hold.running():
        time.sleep(0.005)
    return hold


def test_queued_texts_go_in_one_model_call_each_with_its_own_count(smollm2):
    engine = StreamingEngine(adapter=smollm2, config=StreamConfig(capacity=1024, chunk_size=128, system_prompt=""),
                             max_pending_texts=64)
    engine.wait_ready(60)
    stream = engine.worker.stream
    calls = []
    push_texts = stream.push_texts
    stream.push_texts = lambda items: calls.append(len(items)) or push_texts(items)
    hold = _hold_worker(engine)
    futures = [engine.submit_text(f"Pallet {i} moved to rack {i % 7}.", stamp=float(i)) for i in range(40)]
    # A text with a stamp that is no time is refused at once and spoils none of the batch.
    with pytest.raises(ValueError, match="text stamp"):
        engine.submit_text("Pallet 40 moved.", stamp=float("nan")).result(0)
    counts = [f.result(120) for f in futures]
    hold.result(120)
    assert calls == [40]  # was 40 calls, one per text
    assert engine.stats().texts_ingested == 40
    assert all(isinstance(n, int) and n > 5 for n in counts)
    # each text is its own turn: the counts add up to what the stream took in
    assert sum(counts) == engine.stats().tokens_seen
    single = KVStream(smollm2, StreamConfig(capacity=1024, system_prompt=""))
    assert single.push_text("Pallet 3 moved to rack 3.", stamp=3.0) == counts[3]
    engine.close()


def test_a_question_sees_the_texts_before_it_and_not_those_after(smollm2):
    engine = StreamingEngine(adapter=smollm2, config=StreamConfig(capacity=1024, chunk_size=128, system_prompt=""))
    engine.wait_ready(60)
    stream = engine.worker.stream
    seen_at_question = []
    ask = stream.ask
    stream.ask = lambda q, **kw: seen_at_question.append(stream.texts_ingested) or ask(q, **kw)
    hold = _hold_worker(engine)
    seen_at_question.clear()
    before = [engine.submit_text(f"Note {i}: all quiet in aisle {i}.") for i in range(9)]
    before.append(engine.submit_text("The code of the red locker is 4817."))
    question = engine.submit_ask("What is the code of the red locker?", max_new_tokens=16)
    after = [engine.submit_text(f"Late note {i}.") for i in range(5)]
    answer = question.result(120)
    hold.result(120)
    assert all(f.done() for f in before)
    assert seen_at_question == [10]
    assert "4817" in answer.text
    for f in after:
        f.result(120)
    assert engine.stats().texts_ingested == 15
    engine.close()


@pytest.mark.parametrize("measured", [False, True])
@pytest.mark.parametrize("texts", [3, 40])
def test_a_waiting_question_takes_the_texts_ahead_of_it_in_one_call_then_goes_before_the_frame(texts, measured):
    """Under a flood a question waits for the job in progress and one call of the texts ahead of it, not for a
    backlog taken a quarter period at a time between frames; without a question the frame goes first."""
    def queue(question: bool) -> WorkQueue:
        work = WorkQueue()
        if measured:
            work.took_texts(100, 25, 1.0, 128)  # a second a block: a period holds one block
        work.offer_frame(Job("frame"))
        for i in range(texts):
            work.add(Job("text", text=(f"Conveyor {i} moved crate {i} past the scanner.", None, False)))
        if question:
            work.add(Job("query"))
            work.add(Job("text", text=("A late note.", None, False)))
        return work

    work = queue(question=True)
    order = [[job.kind for job in work.next_jobs(256, 128, 1.0)] for _ in range(4)]
    assert order == [["text"] * texts, ["query"], ["frame"], ["text"]]
    assert work.queries == 0 and work.texts == 0 and not work
    work = queue(question=False)
    assert [job.kind for job in work.next_jobs(256, 128, 1.0)] == ["frame"]
    batch = work.next_jobs(256, 128, 1.0)
    assert 1 <= len(batch) < texts or texts * 48 <= 4 * 128  # a quarter period's worth, or one block at first


def test_waiting_texts_are_bounded_in_number_and_a_question_waits_for_a_bounded_batch_of_them():
    text = "Conveyor 4 carried another box past the scanner."  # 49 characters
    block = 16  # 64 characters (4 a token until measured)
    for seed in range(5):
        rng = random.Random(seed)
        work = WorkQueue()

        def add(n, kind="text"):
            for _ in range(n):
                work.add(Job(kind, text=(text, None, False)) if kind == "text" else Job(kind))

        ahead = rng.randint(20, 40)
        add(ahead)
        assert work.text_room(64) is None
        add(1, "query")
        # Before the pace is measured the question waits for one block of the texts ahead of it (a call is bounded in
        # tokens from the first), then goes ahead of the rest.
        first = work.next_jobs(1024, block, 0.0, 1.0)
        assert [job.kind for job in first] == ["text"] and len(first[0].text[0]) <= work.block_chars(block)
        assert [job.kind for job in work.next_jobs(1024, block, 0.0, 1.0)] == ["query"]
        assert len(work.next_jobs(1024, block, 0.0, 1.0)) == ahead - 1 and work.texts == 0
        per_block = rng.uniform(0.1, 0.4)
        work.took_texts(490, 140, 9 * per_block, block)  # 3.5 characters a token: 9 blocks
        assert work.block_chars(block) == 56  # the measured characters a token; the 4 assumed before is dropped
        add(ahead)
        add(1, "query")
        add(3)
        max_delay = rng.uniform(0.5, 1.5)
        batch = work.next_jobs(1024, block, 0.0, max_delay)
        blocks = math.ceil(sum(len(job.text[0]) for job in batch[:-1]) / work.block_chars(block))
        assert 1 <= len(batch) < ahead and blocks * per_block <= max_delay, (seed, len(batch))
        # The question overtakes the rest, which go in after it, with the texts that came after it.
        assert [job.kind for job in work.next_jobs(1024, block, 0.0, max_delay)] == ["query"]
        rest = work.next_jobs(1024, block, 0.0, max_delay)
        assert len(batch) + len(rest) == ahead + 3 and work.texts == work.text_chars == 0
        # A very slow model still takes one block of text before the question; none is refused for it.
        add(ahead)
        add(1, "query")
        work.took_texts(490, 140, 90.0, block)
        assert all(work.text_room(64) is None for _ in range(3))
        assert 1 <= len(work.next_jobs(1024, block, 0.0, max_delay)) <= 2
        assert [job.kind for job in work.next_jobs(1024, block, 0.0, max_delay)] == ["query"]
        add(64 - work.texts)
        assert work.text_room(64) == "64 waiting"


def test_while_a_camera_is_live_a_text_call_ends_before_the_next_frame_is_due():
    """A text call takes what the model takes, at its measured pace, in 90 % of the time left until the next frame
    is due, by the clock: right after a frame nearly a period's worth, later less, past the due time one block."""
    block = 16
    for seed in range(4):
        rng = random.Random(seed)
        work = WorkQueue()
        seconds_per_block = rng.uniform(0.05, 0.2)
        work.took_texts(224, 64, 4 * seconds_per_block, block)  # four blocks, 3.5 characters a token
        period = rng.uniform(1.0, 3.0)
        per_block = work.block_chars(block)

        def blocks(elapsed: float) -> int:  # the frame came `elapsed` seconds ago
            work.frame_offered[""] = time.monotonic() - elapsed
            return work.text_call_chars(1024, block, period) // per_block

        for elapsed in (0.0, rng.uniform(0.2, 0.8) * period):
            left = FRAME_PERIOD_SHARE * (period - elapsed) / seconds_per_block
            assert int(left) - 1 <= blocks(elapsed) <= int(left), (seed, elapsed)
        assert blocks(1.5 * period) == 1  # the next frame is due: one block, the least a call takes


def test_on_a_shared_model_a_text_call_is_bounded_as_while_a_question_waits():
    """On a model shared with other memories (engine/runtime/model_bench.py) a flooded memory's text call is bounded
    by `max_text_delay` of the model's measured time, as while one of its own questions waits: another memory's
    question may come during the call and waits for it. Alone it takes up to a cache's worth; with no delay bound the
    shared model does not bound it."""
    block = 16
    for seed in range(4):
        rng = random.Random(seed)
        work = WorkQueue()
        seconds_per_block = rng.uniform(0.05, 0.2)
        work.took_texts(224, 64, 4 * seconds_per_block, block)
        per_block = work.block_chars(block)
        max_delay = rng.uniform(0.3, 1.0)
        bounded = max(int(max_delay / work.seconds_per_block), 1) * per_block
        assert work.text_call_chars(1024, block, 0.0, max_delay, shared_model=True) == bounded
        assert work.text_call_chars(1024, block, 0.0, max_delay) == 4 * 1024
        assert work.text_call_chars(1024, block, 0.0, 0.0, shared_model=True) == 4 * 1024
        for _ in range(200):
            work.add(Job("text", text=("Conveyor 3 moved crate 12 past the scanner.", None, False, None)))
        taken = work.next_jobs(1024, block, 0.0, max_delay, shared_model=True)
        assert 1 <= sum(len(job.text[0]) for job in taken) <= bounded


@pytest.mark.serial
def test_under_a_flood_of_texts_a_frame_goes_in_every_frame_period(smollm2):
    import time

    from inf_mllm_ros.engine.runtime.engine import EngineBusyError as Busy

    # Frames come at 10 Hz, ungated (the node's frame_rate gate decides which frames come): the queue takes a waiting
    # frame after one other job, and the period bounds how long a text call is; the node's bound on waiting texts.
    period = 0.5
    engine = StreamingEngine(adapter=smollm2, config=StreamConfig(capacity=512, chunk_size=128),
                             max_pending_texts=64, frame_period=period,
                             max_text_delay=BY_NAME["max_text_delay"].default)
    engine.wait_ready(60)
    stream = engine.worker.stream
    frames_taken, text_calls = [], []
    # smollm2 is text only: the frame job is recorded where the model would encode it
    stream.push_frame = lambda rgb, stamp=None, **_: frames_taken.append(time.monotonic()) or 1
    push_texts = stream.push_texts

    def timed(items):
        start = time.monotonic()
        try:
            return push_texts(items)
        finally:
            text_calls.append(time.monotonic() - start)

    stream.push_texts = timed
    frame = torch.zeros(4, 4, 3, dtype=torch.uint8).numpy()
    start = time.monotonic()
    futures = []
    next_frame = start
    # until a few text calls and frames went in (the model's speed depends on the machine)
    while (len(text_calls) < 4 or len(frames_taken) < 8) and time.monotonic() - start < 300:
        for _ in range(64):  # keep the text queue full
            future = engine.submit_text("Conveyor 4 carried another box past the scanner.")
            if future.done() and isinstance(future.exception(), Busy):
                break
            futures.append(future)
        if time.monotonic() >= next_frame:  # a 10 Hz camera
            engine.submit_frame(frame, stamp=time.monotonic() - start)
            next_frame += 0.1
        time.sleep(0.01)
    engine.close()
    assert engine.counters.texts_refused > 0  # it was a flood
    assert sum(1 for f in futures if f.done() and not f.exception()) >= 16  # texts progressed
    assert len(frames_taken) >= 4  # was 0: no frame while texts waited
    # a frame waits at most the rest of the period and the text call under way (plus the camera's 0.1 s)
    gaps = [b - a for a, b in zip(frames_taken, frames_taken[1:])]
    assert max(gaps) <= period + max(text_calls) + 0.5, (gaps, text_calls)
    # Once the model's speed is known, a text call lasts about half a period while the camera is live, so
    # frames go in at the period's rate within half of it: not after a cache's worth of text (seconds).
    steady = gaps[2:] or gaps
    assert sum(steady) / len(steady) <= 1.5 * period + 0.1, (gaps, text_calls)
    assert sorted(text_calls)[len(text_calls) // 2] <= 2 * period, text_calls  # about half a period, measured
    # The longest any text waited is known, and bounded by the queue ahead of it.
    assert 0 < engine.counters.longest_text_wait_s < 60


def test_a_query_given_up_is_counted_failed_once_never_answered(smollm2):
    """The caller told its client the query failed: running or waiting, it counts once, as failed."""
    engine = StreamingEngine(adapter=smollm2, config=StreamConfig(capacity=256, chunk_size=64))
    try:
        engine.wait_ready(60)
        running = _hold_worker(engine)
        waiting = engine.submit_ask("Where is the dock?", max_new_tokens=2)
        assert engine.abandon(waiting) is False  # never started: the caller counts its own failure
        assert engine.abandon(running) is True  # running: it ends as it would, counted failed by the engine
        running.result(120)
        answered_later = engine.submit_ask("Where is the dock?", max_new_tokens=2)
        answered_later.result(120)
        assert engine.abandon(answered_later) is True  # ended just before the caller gave up: recounted
        assert (engine.counters.queries_answered, engine.counters.queries_failed) == (0, 2)
    finally:
        engine.close(timeout=30)


def test_only_an_input_that_went_in_is_reported_as_ingested(smollm2):
    """A failed input leaves the memory as it was: nothing reports a change (no description follows it)."""
    import time

    import numpy as np

    ingested = []
    engine = StreamingEngine(adapter=smollm2, config=StreamConfig(capacity=256, chunk_size=64),
                             on_ingested=ingested.append)
    try:
        engine.wait_ready(60)
        frame = engine.submit_frame(np.zeros((8, 8, 3), np.uint8), 0.0)
        with pytest.raises(Exception, match="frame"):  # a text-only model takes no frames
            frame.result(60)
        engine.submit_text("Forklift F2 parked at dock 3.", 1.0).result(60)
        deadline = time.monotonic() + 10
        while not ingested and time.monotonic() < deadline:  # reported right after the job
            time.sleep(0.01)
        assert ingested == ["text"]
    finally:
        engine.close(timeout=30)


def test_a_policy_setting_changed_while_the_model_loads_reaches_the_policy(smollm2, monkeypatch):
    from inf_mllm_ros.engine.runtime import engine as engine_module

    release = threading.Event()

    def slow_load(*_args, **_kwargs):
        release.wait(60)
        return smollm2

    monkeypatch.setattr(engine_module, "load_model", slow_load)
    engine = StreamingEngine("smollm2", StreamConfig(capacity=256, chunk_size=64))
    try:
        engine.update_settings(policy_settings={"attention_bias": 2.5})
        with pytest.raises(ValueError, match="attention_bias must be in"):
            engine.update_settings(policy_settings={"attention_bias": -1.0})  # refused: the settings keep 2.5
        with pytest.raises(ValueError, match="fixed when the stream starts"):
            engine.update_settings(policy_settings={"score_pool": 5})
        with pytest.raises(ValueError, match="max_new_tokens"):  # refused whole: the knob does not change either
            engine.update_settings(max_new_tokens=0, policy_settings={"attention_bias": 1.0})
        assert dict(engine.settings.policy_settings) == {"attention_bias": 2.5}
        assert engine.config.policy_settings == {}  # the caller's configuration is never written to
        release.set()
        engine.wait_ready(60)
        assert engine.worker.stream.policy.attention_bias == 2.5
        assert engine.stats().policy_settings["attention_bias"] == 2.5
    finally:
        release.set()
        engine.close(timeout=30)


def test_settings_changed_while_the_worker_runs_reach_every_job_whole(smollm2):
    """A hammer: one thread changes three live settings together, over and over, while the worker takes texts.
    Every job sees one snapshot whole (never a prompt of one change with the answer length of another), the
    caller's configuration is never written to, and the last change is what the stream ends with."""
    seen = []
    engine = StreamingEngine(adapter=smollm2, config=StreamConfig(capacity=256, chunk_size=64),
                             max_pending_texts=1000, on_ingested=lambda kind: seen.append(applied()))

    def applied():
        s = engine.worker.stream
        return s.config.max_new_tokens, s.config.system_prompt, s.policy.attention_bias

    stop = threading.Event()

    def hammer():
        n = 0
        while not stop.is_set():
            n = n % 200 + 1
            engine.update_settings(max_new_tokens=n, system_prompt=f"prompt {n}",
                                   policy_settings={"attention_bias": n / 100})
            time.sleep(0.001)  # leave the worker the interpreter now and then
        return n

    try:
        engine.wait_ready(60)
        before = applied()
        hammering = concurrent.futures.ThreadPoolExecutor(1).submit(hammer)
        for i in range(30):  # one job each (texts waiting together would go in as one)
            engine.push_text(f"Pallet {i} moved to bay {i % 7}.", timeout=120)
        stop.set()
        last = hammering.result(10)
        engine.push_text("The shift ended.", timeout=60)
    finally:
        stop.set()
        engine.close(timeout=30)
    whole = [(n, f"prompt {n}", n / 100) for n in range(1, 201)]
    assert all(s in whole or s == before for s in seen), [s for s in seen if s not in whole and s != before]
    assert len({s for s in seen}) >= 3, "the settings changed while the worker ran"
    assert seen[-1] == (last, f"prompt {last}", last / 100)
    assert engine.config.max_new_tokens == StreamConfig().max_new_tokens and engine.config.policy_settings == {}


def test_a_caller_told_that_a_job_ended_reads_the_memory_after_it(smollm2):
    """The figures `stats()` gives change before a job's caller hears of its end: the node publishes them
    as soon as a reset returns, and must never publish the memory as it was before the reset."""
    engine = StreamingEngine(adapter=smollm2, config=StreamConfig(capacity=256, chunk_size=64))
    try:
        engine.wait_ready(60)
        seen = {}
        # A done-callback runs the moment the result is set, on the engine's thread: the earliest any caller
        # can react.
        text = engine.submit_text("Forklift F2 parked at dock 3.", 1.0)
        text.add_done_callback(lambda _: seen.setdefault("text", engine.stats().texts_ingested))
        text.result(60)
        reset = engine.submit_reset()
        reset.add_done_callback(lambda _: seen.setdefault("reset", engine.stats().tokens_seen))
        reset.result(60)
        assert seen == {"text": 1, "reset": 0}
    finally:
        engine.close(timeout=30)


def test_an_error_in_the_workers_own_bookkeeping_leaves_the_worker_taking_work(smollm2, caplog):
    """A failure outside a job (here the caller's on_ingested callback) is logged; the worker goes on, the job's
    own result stands, and the next jobs run."""
    calls = []

    def on_ingested(kind: str) -> None:
        calls.append(kind)
        if len(calls) == 1:
            raise RuntimeError("the callback broke")

    engine = StreamingEngine(adapter=smollm2, config=StreamConfig(capacity=128, chunk_size=32),
                             on_ingested=on_ingested)
    try:
        assert engine.wait_ready(60)
        assert engine.push_text("The pallet is at dock 3.", stamp=1.0, timeout=60) > 0
        assert engine.push_text("The door light is green.", stamp=2.0, timeout=60) > 0
        assert engine.ask("Where is the pallet?", max_new_tokens=4, timeout=60).tokens_generated >= 1
        assert calls == ["text", "text"] and engine.worker.thread.is_alive()
        assert "recovered from an error between jobs" in caplog.text and "the callback broke" in caplog.text
    finally:
        engine.close()
