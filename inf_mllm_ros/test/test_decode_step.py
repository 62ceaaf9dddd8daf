"""The static decode step (engine/memory/decode_step.py) on tiny models of every family: the eager path's tokens and
logits, no graph break under torch.compile(fullgraph=True, dynamic=False), one compile for a whole stream with
evictions and answers that retrieve, and an answer's stop, cancel and progress as on the eager path."""

from __future__ import annotations

import threading

import pytest
import torch
import torch._dynamo.testing

from inf_mllm_ros.engine.answering import AnswerCancelledError
from inf_mllm_ros.engine.memory.decode_step import StaticDecoder, resolve_decode_step
from inf_mllm_ros.engine.models.loading import load_model
from inf_mllm_ros.engine.runtime.stream import KVStream
from inf_mllm_ros.engine.stream_config import StreamConfig
from inf_mllm_ros.testing.random_models import FAMILIES, build_model_folder

from test_archive import assert_same_state, cache_state, frame, sentence, small_cache_long_past

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ALL_FAMILIES = FAMILIES + ("llama",)
# Compiled for real (inductor) where a family's step differs most: M-RoPE, and the default model's shape. The
# others are traced by dynamo alone, which is what finds a graph break.
INDUCTOR = ("qwen2_vl", "llava_onevision")
QUESTIONS = ["Where is the pallet?", "What did the forklift do at the dock?", "Which door light changed?"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_models")
    return {family: load_model(build_model_folder(family, root / family, seed=3), device="cpu", dtype="float32")
            for family in ALL_FAMILIES}


def question_logits(stream, question: str) -> torch.Tensor:
    """The question pushed after the cache (as an answer not kept does): its last logits."""
    ids, _ = stream.question_ids(stream.adapter.chat.question_parts(question))
    return stream.place_unkept(stream.adapter.text_prompt(ids))


def eager_steps(stream, logits: torch.Tensor, n: int) -> tuple[list[int], list[torch.Tensor]]:
    """n greedy tokens through the eager path, and the logits each fed token gave."""
    tokens, steps = [], []
    for _ in range(n):
        tokens.append(int(logits[-1].argmax()))
        logits = stream.place_unkept(stream.adapter.text_prompt(torch.tensor([tokens[-1]])))
        steps.append(logits[-1].clone())
    return tokens, steps


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_the_static_step_gives_the_eager_paths_tokens_and_logits(family, adapters):
    stream = small_cache_long_past(adapters[family])
    assert stream.cache.evictions > 0
    for question in QUESTIONS[:2]:
        fill, frontier, seen = stream.cache.fill, stream.cache.next_position, stream.tokens_seen
        logits = question_logits(stream, question)
        asked = (stream.cache.fill, stream.cache.next_position)
        want_tokens, want_logits = eager_steps(stream, logits, 10)
        stream.cache.truncate(*asked)
        decoder = StaticDecoder(stream.adapter, stream.cache, "static")
        decoder.start(logits)
        for want_token, want in zip(want_tokens, want_logits):
            assert int(decoder.token) == want_token
            torch.testing.assert_close(decoder.step()[-1], want, atol=1e-5, rtol=1e-5)
        stream.cache.truncate(fill, frontier)
        stream.tokens_seen = seen


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_the_compiled_step_has_no_graph_break_and_one_graph_serves_a_whole_stream(family, adapters):
    """fullgraph=True fails on any graph break; the counter sees every (re)compile. Over the stream, evictions
    re-pack the cache and answers retrieve from the archive: the same answers as the eager path, one graph."""
    adapter = adapters[family]
    stream = small_cache_long_past(adapter)
    assert stream.static_decoder is None  # "auto" stays eager on the CPU
    counter = (torch._dynamo.testing.CompileCounterWithBackend("inductor") if family in INDUCTOR
               else torch._dynamo.testing.CompileCounter())
    compiled = StaticDecoder(adapter, stream.cache, "compiled", compile_options={"backend": counter})
    retrieved, evictions = 0, stream.cache.evictions
    for round_ in range(3):
        for question in QUESTIONS:
            before = cache_state(stream)
            stream.static_decoder = None
            eager = stream.ask(question, max_new_tokens=12)
            stream.static_decoder = compiled
            got = stream.ask(question, max_new_tokens=12)
            assert (got.text, got.tokens_generated, got.retrieved_tokens) == \
                (eager.text, eager.tokens_generated, eager.retrieved_tokens), question
            assert_same_state(before, cache_state(stream))
            retrieved += got.retrieved_tokens > 0
        for i in range(6):  # about a hundred tokens more: the cache evicts and re-packs again
            stream.push_text(sentence(20 + 6 * round_ + i), stamp=30.0 + i)
        if adapter.supports_frames:
            stream.push_frame(frame(round_), stamp=40.0 + round_)
    assert stream.cache.evictions > evictions + 3
    assert retrieved >= 3, "answers that retrieve are among those decoded"
    assert counter.frame_count == 1, f"{counter.frame_count} graphs compiled: the step recompiled"


def test_a_static_answer_stops_at_a_stop_token_and_reports_each_token_as_the_eager_path(adapters):
    stream = small_cache_long_past(adapters["qwen2_vl"])
    eager_reports, static_reports = [], []
    stream.static_decoder = None
    eager = stream.ask(QUESTIONS[0], max_new_tokens=20, on_token=lambda text, n: eager_reports.append((text, n)))
    stream.static_decoder = StaticDecoder(stream.adapter, stream.cache, "static", sync_every=8)
    got = stream.ask(QUESTIONS[0], max_new_tokens=20, on_token=lambda text, n: static_reports.append((text, n)))
    assert got.text == eager.text and static_reports == eager_reports and len(eager_reports) == 20
    # A stop token in the middle of a group of eight ends the answer there, as it ends the eager one.
    logits = question_logits(stream, QUESTIONS[0])
    fill, frontier = stream.cache.fill, stream.cache.next_position
    tokens, _ = eager_steps(stream, logits, 12)
    stream.cache.truncate(fill, frontier)
    for at in (0, 2, 7, 10):
        reads = []
        got_tokens = stream.static_decoder.generate(logits, 20, {tokens[at]}, lambda t: reads.append(list(t)))
        first = tokens.index(tokens[at])
        assert got_tokens == tokens[: first + 1]
        assert reads[-1] == got_tokens and all(len(r) % 8 == 0 for r in reads[:-1])


def test_a_cancel_ends_a_static_answer_within_a_group_and_leaves_the_memory_as_it_was(adapters):
    stream = small_cache_long_past(adapters["llama"])
    stream.static_decoder = StaticDecoder(stream.adapter, stream.cache, "static", sync_every=8)
    before = cache_state(stream)
    cancel, reports = threading.Event(), []

    def on_token(text, n):
        reports.append(n)
        if n == 3:
            cancel.set()

    with pytest.raises(AnswerCancelledError):
        stream.ask(QUESTIONS[1], max_new_tokens=20, on_token=on_token, cancel=cancel)
    assert reports == [1, 2, 3]
    assert_same_state(before, cache_state(stream))


def test_the_decode_step_setting():
    assert resolve_decode_step("auto", torch.device("cpu")) == "eager"
    assert resolve_decode_step("auto", torch.device("cuda", 0)) == "compiled"
    assert resolve_decode_step("static", torch.device("cpu")) == "static"
    with pytest.raises(ValueError, match="decode_step"):
        StreamConfig(decode_step="graph")
    with pytest.raises(ValueError, match="decode_step"):
        resolve_decode_step("fast", torch.device("cpu"))


def test_a_stream_that_decodes_in_static_steps_binds_them_with_its_first_input_and_answers_as_eager(adapters):
    """The step is made ready (compiled, on a GPU) while the first input goes in, not when the first question
    waits; its step into the slot after the filled ones changes nothing of the memory."""
    config = dict(capacity=48, chunk_size=16, archive_size=4096, retrieve_tokens=64, archive_block=16)
    eager = KVStream(adapters["qwen2_vl"], StreamConfig(**config, decode_step="eager"))
    static = KVStream(adapters["qwen2_vl"], StreamConfig(**config, decode_step="static"))
    assert eager.static_decoder is None and not static.static_decoder.ready
    for i in range(10):
        for stream in (eager, static):
            stream.push_text(sentence(i), stamp=float(i))
        assert static.static_decoder.ready
        assert_same_state(cache_state(eager), cache_state(static))
    for question in QUESTIONS:
        assert static.ask(question, max_new_tokens=10).text == eager.ask(question, max_new_tokens=10).text


def test_a_step_that_cannot_be_made_leaves_the_stream_decoding_eagerly_and_its_input_in(adapters, caplog):
    stream = KVStream(adapters["llama"], StreamConfig(capacity=48, chunk_size=16, decode_step="static"))

    def fails(*args):  # a torch.compile backend that fails on the step
        raise RuntimeError("the compiler gave up")

    stream.static_decoder = StaticDecoder(stream.adapter, stream.cache, "compiled", compile_options={"backend": fails})
    taken = stream.push_text(sentence(1), stamp=1.0)
    assert taken > 0 and stream.texts_ingested == 1 and stream.static_decoder is None
    assert "answers decode eagerly" in caplog.text and "the compiler gave up" in caplog.text
    assert stream.ask(QUESTIONS[0], max_new_tokens=4).tokens_generated >= 1
