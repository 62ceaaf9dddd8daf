"""The static ingest step (engine/memory/ingest_step.py) on tiny models of every family: after each input the memory is the
eager path's (the same slots kept, keys, values and scores within float32 tolerance), with evictions, re-packs,
frames and pinned texts; no graph break under torch.compile(fullgraph=True, dynamic=False) and one graph per block
size over a whole stream whose answers retrieve; a block the step cannot take goes in eagerly."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

from inf_mllm_ros.engine.memory.cache import CacheOverflowError
from inf_mllm_ros.engine.memory.ingest_step import StaticIngester, block_sizes
from inf_mllm_ros.engine.models.loading import load_model
from inf_mllm_ros.engine.runtime.stream import KVStream
from inf_mllm_ros.engine.stream_config import StreamConfig
from inf_mllm_ros.testing.random_models import FAMILIES, build_model_folder

from test_archive import cache_state, frame, sentence

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ALL_FAMILIES = FAMILIES + ("llama",)
# Compiled for real (inductor) where a family's step differs most: M-RoPE, and the default model's shape. The
# others are traced by dynamo alone, which is what finds a graph break.
INDUCTOR = ("qwen2_vl", "llava_onevision")
QUESTIONS = ["Where is the pallet?", "What did the forklift do at the dock?", "Which door light changed?"]
CONFIG = dict(capacity=48, chunk_size=32, archive_size=4096, retrieve_tokens=64, archive_block=16)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_models")
    return {family: load_model(build_model_folder(family, root / family, seed=5), device="cpu", dtype="float32")
            for family in ALL_FAMILIES}


def assert_same_memory(want: dict, got: dict) -> None:
    """The same slots in the same order with the same bookkeeping; keys, values and scores within float32
    tolerance (the step's softmax runs over every slot, the eager one over the filled ones)."""
    assert want.keys() == got.keys()
    for name, value in want.items():
        if isinstance(value, torch.Tensor) and value.dtype.is_floating_point:
            torch.testing.assert_close(got[name], value, atol=1e-5, rtol=1e-4, msg=name)
        elif isinstance(value, torch.Tensor):
            assert torch.equal(got[name], value), name
        else:
            assert got[name] == value, name


def feed(streams, adapter, seed: int, count: int) -> None:
    """The same inputs into every stream, checked alike after each: texts of varying length (some pinned), and a
    frame now and then for a model that takes them."""
    for i in range(count):
        text = " ".join(sentence(seed + i + k) for k in range(1 + (seed + i) % 3))
        for stream in streams:
            stream.push_text(text, stamp=float(i), pin=(seed + i) % 7 == 3)
            if adapter.supports_frames and (seed + i) % 5 == 2:
                stream.push_frame(frame(seed + i), stamp=i + 0.5)
        yield i


def test_block_sizes():
    assert block_sizes(128) == (16, 32, 64, 128)
    assert block_sizes(100) == (16, 32, 64, 100)
    assert block_sizes(16) == (16,)
    assert block_sizes(8) == (8,)
    assert block_sizes(784, "cuda") == (128, 784) and block_sizes(128, "cuda") == (128,)


@pytest.mark.parametrize("seed", [0, 11])
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_the_static_step_leaves_the_memory_the_eager_path_leaves(family, seed, adapters):
    adapter = adapters[family]
    eager = KVStream(adapter, StreamConfig(**CONFIG, ingest_step="eager"))
    static = KVStream(adapter, StreamConfig(**CONFIG, ingest_step="static"))
    assert eager.static_ingester is None and static.static_ingester.mode == "static"
    for _ in feed((eager, static), adapter, seed, 12):
        assert_same_memory(cache_state(eager), cache_state(static))
    assert eager.cache.evictions > 10 and static.static_ingester.blocks > 10
    assert [(b.first_seq, b.length) for b in static.archive.blocks] == \
        [(b.first_seq, b.length) for b in eager.archive.blocks]
    for block in eager.archive.blocks:
        held = slice(block.slot, block.slot + block.length)
        for name in ("keys", "values"):
            torch.testing.assert_close(getattr(static.archive, name)[:, :, held], getattr(eager.archive, name)[:, :, held],
                                       atol=1e-5, rtol=1e-4)
    for question in QUESTIONS:
        got, want = static.ask(question, max_new_tokens=8), eager.ask(question, max_new_tokens=8)
        assert (got.text, got.retrieved_tokens) == (want.text, want.retrieved_tokens)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_the_compiled_step_has_no_graph_break_and_one_graph_per_block_size(family, adapters):
    """fullgraph=True fails on any graph break; the counter sees every (re)compile. Over a stream of several
    hundred tokens, with evictions, re-packs and answers that retrieve, the memory stays the eager one's."""
    adapter = adapters[family]
    eager = KVStream(adapter, StreamConfig(**CONFIG, ingest_step="eager"))
    compiled = KVStream(adapter, StreamConfig(**CONFIG, ingest_step="eager"))
    counter = (torch._dynamo.testing.CompileCounterWithBackend("inductor") if family in INDUCTOR
               else torch._dynamo.testing.CompileCounter())
    ingester = StaticIngester(adapter, compiled.cache, CONFIG["chunk_size"], "compiled",
                              compile_options={"backend": counter})
    compiled.static_ingester = ingester
    retrieved = 0
    for i in feed((eager, compiled), adapter, 3, 16):
        assert_same_memory(cache_state(eager), cache_state(compiled))
        if i % 5 == 4:
            got, want = compiled.ask(QUESTIONS[i % 3], max_new_tokens=6), eager.ask(QUESTIONS[i % 3], max_new_tokens=6)
            assert got.text == want.text
            retrieved += got.retrieved_tokens > 0
    assert compiled.tokens_seen > 300 and ingester.blocks > 15 and retrieved >= 2
    assert ingester.ready  # every block size made
    assert counter.frame_count == len(ingester.sizes) == 2, f"{counter.frame_count} graphs: the step recompiled"


def test_a_block_the_step_cannot_take_goes_in_eagerly(adapters):
    """A cache that never evicts fills its slots: a block whose padded size no longer fits goes through the
    layers; the memory is the eager one's all the same."""
    adapter = adapters["llama"]
    config = dict(capacity=64, chunk_size=64, headroom=206, policy="full", archive_size=0)
    eager = KVStream(adapter, StreamConfig(**config, ingest_step="eager"))
    static = KVStream(adapter, StreamConfig(**config, ingest_step="static"))
    ingester, went_eagerly = static.static_ingester, 0
    for i in range(40):
        fill, blocks, seen = static.cache.fill, ingester.blocks, static.tokens_seen
        try:
            eager.push_text(sentence(i), stamp=float(i))
        except CacheOverflowError:
            break  # the slots are full
        static.push_text(sentence(i), stamp=float(i))
        assert_same_memory(cache_state(eager), cache_state(static))
        if i == 0:
            continue  # the system turn and the first text: the first block makes the storage
        n = static.tokens_seen - seen
        fits = fill + ingester.padded_size(n) <= static.cache.slots
        assert ingester.blocks - blocks == fits, (i, fill, n)
        went_eagerly += not fits
    assert went_eagerly >= 1 and ingester.blocks >= 3


def test_the_ingest_step_setting_and_a_step_that_cannot_be_made(adapters, caplog):
    with pytest.raises(ValueError, match="ingest_step"):
        StreamConfig(ingest_step="graph")
    assert KVStream(adapters["llama"], StreamConfig(**CONFIG)).static_ingester is None  # "auto": eager on a CPU
    stream = KVStream(adapters["llama"], StreamConfig(**CONFIG, ingest_step="static"))

    def fails(*args):  # a torch.compile backend that fails on the step
        raise RuntimeError("the compiler gave up")

    stream.static_ingester = StaticIngester(stream.adapter, stream.cache, CONFIG["chunk_size"], "compiled",
                                            compile_options={"backend": fails})
    taken = stream.push_text(sentence(1), stamp=1.0)
    assert taken > 0 and stream.texts_ingested == 1 and stream.static_ingester is None
    assert "inputs go in eagerly" in caplog.text and "the compiler gave up" in caplog.text
    stream.push_text(sentence(2), stamp=2.0)
    assert stream.texts_ingested == 2
