"""What the model would build at its first answer, built while it loads (`KVStream.prepare_first_answer`, called by the
engine's worker after the model and the memory are loaded): on tiny random models, the memory is left as it was (the
same figures, slots, clock and archive) and every later answer, memory and figure is the one a stream without the
warm-up gives for the same inputs, eager or through the static steps, which the warm-up makes ready."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from inf_mllm_ros.engine.runtime.engine import StreamingEngine
from inf_mllm_ros.engine.runtime.stream import KVStream
from inf_mllm_ros.engine.stream_config import StreamConfig
from inf_mllm_ros.engine.models.loading import load_model
from inf_mllm_ros.engine.persistence.memory_file import load_memory, save_memory
from inf_mllm_ros.testing.random_models import build_model_folder

from test_archive import cache_state, sentence

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Small enough that the texts below are evicted into the archive and questions retrieve from it.
CONFIG = dict(capacity=48, chunk_size=32, archive_size=4096, retrieve_tokens=64, archive_block=16, max_new_tokens=6)
QUESTIONS = ["Where is the pallet?", "What did the forklift do at the dock?", "Which door light changed?"]
# Figures that the storage made by the warm-up of an empty memory changes (it is made once; by the first input else).
STORAGE_FIGURES = {"kv_bytes", "cache_bytes"}


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return load_model(build_model_folder("llava_onevision", tmp_path_factory.mktemp("tiny") / "m", seed=3),
                      device="cpu", dtype="float32")


def memory(stream: KVStream) -> dict:
    """The slots, clock and counters, the archive's blocks and the stream's figures."""
    state = cache_state(stream)
    state.update({f"archive.{k}": v.clone() for k, v in stream.archive.export_state().items()})
    state.update(stream.clock_state())
    state["stats"] = stream.stats().as_dict()
    state["index_built"] = stream.archive.index is not None
    return state


def assert_same(want: dict, got: dict, skip: set = frozenset()) -> None:
    assert want.keys() == got.keys()
    for name in want:
        if name == "stats":
            assert {k: v for k, v in want[name].items() if k not in skip} == \
                   {k: v for k, v in got[name].items() if k not in skip}
        elif isinstance(want[name], torch.Tensor):  # bit for bit (an unstamped input's stamp is NaN)
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, equal_nan=True, msg=name)
        else:
            assert want[name] == got[name], name


def told(stream: KVStream, first: int, count: int) -> None:
    for i in range(first, first + count):
        stream.push_text(" ".join(sentence(i + k) for k in range(1 + i % 3)), stamp=float(i))


def answer(stream: KVStream, question: str, **kwargs):
    """The answer but its latency."""
    return dataclasses.replace(stream.ask(question, **kwargs), latency=0.0)


def test_the_warm_up_leaves_a_memory_that_holds_tokens_as_it_was_and_its_answers_the_same(adapter):
    plain, warmed = KVStream(adapter, StreamConfig(**CONFIG)), KVStream(adapter, StreamConfig(**CONFIG))
    for stream in (plain, warmed):
        told(stream, 0, 8)
    assert plain.archive.blocks and plain.cache.evictions, "the texts reach the archive"
    before = memory(warmed)
    parts = warmed.prepare_first_answer()
    assert {"tokenize", "question", "index", "decode"} <= parts.keys()
    assert_same(before, memory(warmed))
    assert_same(memory(plain), memory(warmed))
    retrieved = 0
    for i, question in enumerate(QUESTIONS):
        want, got = answer(plain, question), answer(warmed, question)
        assert got == want
        assert_same(memory(plain), memory(warmed))
        retrieved += want.retrieved_tokens
        told(plain, 20 + i, 1)
        told(warmed, 20 + i, 1)
    assert retrieved > 0 and plain.archive.index is not None


@pytest.mark.parametrize("steps", ["eager", "static"])
def test_the_warm_up_of_an_empty_memory_changes_no_answer_and_makes_the_static_steps_ready(adapter, steps):
    config = dict(CONFIG, decode_step=steps, ingest_step=steps)
    plain, warmed = KVStream(adapter, StreamConfig(**config)), KVStream(adapter, StreamConfig(**config))
    before = memory(warmed)
    warmed.prepare_first_answer()
    # Nothing went in: only the cache's storage is made now rather than with the first input, so that its layers
    # export what a reset memory's export, no slot and every counter 0.
    after = memory(warmed)
    layers = {name: after.pop(name) for name in list(after) if name.startswith("layer.")}
    assert layers and all(not t.any() if name.endswith(".counters") else t.shape[-1] == 0 or t.shape[-2] == 0
                          for name, t in layers.items())
    assert_same(before, after, skip=STORAGE_FIGURES)
    assert warmed.stats().kv_bytes > 0 and warmed.tokens_seen == 0 and warmed.cache.fill == 0
    if steps == "static":
        assert warmed.static_decoder.ready and warmed.static_ingester.ready
        assert not plain.static_decoder.ready and not plain.static_ingester.ready
    for i, question in enumerate(QUESTIONS):
        told(plain, 4 * i, 4)
        told(warmed, 4 * i, 4)
        assert_same(memory(plain), memory(warmed))
        assert answer(warmed, question) == answer(plain, question)
        keep = answer(warmed, f"Remember {sentence(i)}", keep_in_memory=True)
        assert keep == answer(plain, f"Remember {sentence(i)}", keep_in_memory=True)
        assert_same(memory(plain), memory(warmed))
    assert plain.archive.blocks and plain.cache.evictions
    if steps == "static":  # and the steps were taken, not given up
        assert warmed.static_decoder is not None and warmed.static_ingester.blocks > 0


def test_a_memory_saved_after_the_warm_up_of_an_empty_one_loads_as_an_empty_one(adapter, tmp_path):
    warmed, plain, loaded = (KVStream(adapter, StreamConfig(**CONFIG)) for _ in range(3))
    warmed.prepare_first_answer()
    save_memory(warmed, tmp_path / "memory.safetensors")
    load_memory(loaded, tmp_path / "memory.safetensors")
    assert loaded.cache.fill == 0 and loaded.tokens_seen == 0
    for stream in (plain, loaded):
        told(stream, 0, 8)
    assert_same(memory(plain), memory(loaded))
    assert answer(loaded, QUESTIONS[0]) == answer(plain, QUESTIONS[0])


def test_the_engine_prepares_the_first_answer_while_it_loads(adapter):
    engine = StreamingEngine(adapter=adapter, config=StreamConfig(**CONFIG))
    try:
        assert engine.wait_ready(60)
        prepared = engine.worker.preparation
        assert {"retrieval_heads", "first_answer", "first_answer_question"} <= prepared.keys()
        assert all(seconds >= 0 for seconds in prepared.values())
        stats = engine.stats()
        assert stats.fill == 0 and stats.tokens_seen == 0 and stats.archive_blocks == 0
    finally:
        engine.close()
