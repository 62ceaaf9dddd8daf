"""The archive of the stream's KV (engine/archive/archive.py): its bound, its bytes, its blocks, and retrieval's
mechanics on tiny models of every family: what is placed before a question is the model's own keys and
values, re-rotated right (frames too), and an answer that retrieved leaves the cache as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inf_mllm_ros.engine.archive import retrieval_heads as retrieval_heads_module
from inf_mllm_ros.engine.archive import retriever as retriever_module
from inf_mllm_ros.engine.archive.retriever import best_last
from inf_mllm_ros.engine.archive.archive import BOOKKEEPING_BYTES, ArchivedBlock, KVArchive, Turn
from inf_mllm_ros.engine.archive.archive_blocks import cut_turns
from inf_mllm_ros.engine.ops.rotary import shift_rotary
from inf_mllm_ros.engine.models.loading import load_model
from inf_mllm_ros.engine.archive.retrieval_index import RetrievalIndex
from inf_mllm_ros.testing.random_models import FAMILIES, build_model_folder
from inf_mllm_ros.engine.runtime.stream import KVStream
from inf_mllm_ros.engine.stream_config import StreamConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WORDS = "pallet forklift aisle dock shelf crate door light scanner badge ramp conveyor".split()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_models")
    return {family: load_model(build_model_folder(family, root / family), device="cpu", dtype="float32")
            for family in FAMILIES + ("llama",)}


def sentence(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(6 + i % 5)) + "."


def frame(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (84, 112, 3), dtype=np.uint8)


def cache_state(stream: KVStream) -> dict:
    """Every held slot of every layer, its bookkeeping and the cache's counters."""
    state = {name: t.clone() for name, t in stream.cache.export_state().items()}
    state["next_position"] = stream.cache.next_position
    state["tokens_seen"] = stream.tokens_seen
    return state


def assert_same_state(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for name in before:
        if isinstance(before[name], torch.Tensor):
            assert torch.equal(before[name], after[name]), name
        else:
            assert before[name] == after[name], name


@pytest.mark.parametrize("turns, block, expected", [
    ([5, 6, 7], 32, [(18, -1)]),  # short messages share a block
    ([20, 20], 32, [(20, -1), (20, -1)]),  # two that do not fit together stay apart
    ([70], 32, [(24, 0), (23, 0), (23, 0)]),  # a long one in near-equal pieces, which know their message
    ([10, 70, 3, 4], 32, [(10, -1), (24, 1), (23, 1), (23, 1), (7, -1)]),  # not merged with whole messages
])
def test_blocks_follow_messages(turns, block, expected):
    assert cut_turns(turns, block) == expected
    assert sum(n for n, _ in cut_turns(turns, block)) == sum(turns)


def test_the_archive_drops_its_oldest_blocks_at_its_bound_and_its_bytes_match_the_formula(adapters):
    adapter = adapters["llama"]
    size = 300
    stream = KVStream(adapter, StreamConfig(capacity=64, chunk_size=16, archive_size=size, archive_block=16))
    seen_first = []
    for i in range(60):
        stream.push_text(sentence(i), stamp=float(i))
        archive = stream.archive
        assert archive.tokens <= size
        seen_first.append(archive.blocks[0].first_seq)
        # Blocks are contiguous runs of the stream, oldest first, and the newest is always there.
        blocks = list(archive.blocks)
        assert all(a.seq_end <= b.first_seq for a, b in zip(blocks, blocks[1:]))
        assert blocks[-1].seq_end == stream.tokens_seen
    assert seen_first == sorted(seen_first) and seen_first[-1] > 0, "the oldest blocks went first"
    assert stream.archive.blocks_dropped > 0
    # Nearly full: at most one block's room is left unused where writing wrapped round.
    assert archive.tokens > size - 2 * 16
    config = adapter.text_config
    kv_heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = config.num_hidden_layers * kv_heads * 2 * head_dim * 4 + BOOKKEEPING_BYTES
    assert archive.bytes_per_token() == per_token
    assert stream.stats().archive_bytes == size * per_token
    assert stream.stats().archive_tokens == archive.tokens
    # The GPU cache is the same with the archive on or off.
    off = KVStream(adapter, StreamConfig(capacity=64, chunk_size=16, archive_size=0))
    off.push_text(sentence(0))
    assert off.cache.kv_nbytes() == stream.cache.kv_nbytes() and off.cache.nbytes() == stream.cache.nbytes()
    assert off.stats().archive_tokens == 0 and off.stats().archive_bytes == 0


def test_every_token_of_the_stream_is_archived_once_with_its_kind_and_time(adapters):
    adapter = adapters["qwen2_vl"]
    stream = KVStream(adapter, StreamConfig(capacity=48, chunk_size=16, archive_size=4096, archive_block=16))
    stream.push_text(sentence(1), stamp=1.0)
    stream.push_frame(frame(0), stamp=2.0)
    stream.push_texts([(sentence(2), 3.0), (sentence(3), 4.0)])
    stream.ask("What was seen?", max_new_tokens=3)  # not kept: nothing archived
    blocks = list(stream.archive.blocks)
    assert blocks[0].first_seq == 0 and blocks[-1].seq_end == stream.tokens_seen
    assert all(a.seq_end == b.first_seq for a, b in zip(blocks, blocks[1:])), "no gap, no overlap"
    frames = [b for b in blocks if b.frame]
    assert len(frames) == 1 and frames[0].stamp == 2.0, "a frame is one block, with its time"
    assert {b.stamp for b in blocks if not b.frame} >= {1.0, 3.0, 4.0}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_retrieved_frame_block_is_the_models_own_keys_at_their_new_positions(family, adapters):
    """A frame's keys in the first layer depend on its tokens and their positions only: archived from a
    frame pushed after other input, re-rotated to any base, they must equal what the model makes of the
    same frame fed at that base."""
    adapter = adapters[family]
    rgb = frame(3)
    archived = KVStream(adapter, StreamConfig(capacity=512, chunk_size=16, archive_size=4096))
    archived.push_text(sentence(4), stamp=0.0)
    archived.push_frame(rgb, stamp=1.0)
    block = next(b for b in archived.archive.blocks if b.frame)
    keys, values, rel_start, rel_end = archived.archive.block_tensors(block)

    for base in (0, 37):
        fresh = KVStream(adapter, StreamConfig(capacity=512, chunk_size=16, system_prompt="", archive_size=0))
        if base:
            fresh.push_tokens(torch.arange(10, 10 + base))
        fill = fresh.cache.fill
        fresh.push_frame(rgb, stamp=1.0)
        layer = fresh.cache.layers[0]
        expected_keys = layer.keys[0, :, fill : layer.fill]
        assert expected_keys.shape[1] == block.length
        torch.testing.assert_close(layer.pos_start[0, fill : layer.fill], rel_start + base)
        torch.testing.assert_close(layer.pos_end[0, fill : layer.fill], rel_end + base)
        placed = shift_rotary(keys[0], torch.full((keys.shape[1], block.length), base), archived.archive.inv_freq)
        torch.testing.assert_close(placed, expected_keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(values[0], layer.values[0, :, fill : layer.fill], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES + ("llama",))
def test_placing_archived_blocks_where_they_were_gives_the_same_logits(family, adapters):
    """Take the frame and the text after it out of a full cache and put them back from the archive, at the
    positions they had: the next tokens' logits are those of the untouched cache."""
    adapter = adapters[family]
    config = StreamConfig(capacity=1024, chunk_size=16, policy="full", position_mode="original", archive_size=4096)
    stream = KVStream(adapter, config)
    stream.push_text(sentence(5), stamp=0.0)
    fill, position = stream.cache.fill, stream.cache.next_position
    if adapter.supports_frames:
        stream.push_frame(frame(1), stamp=1.0)
    stream.push_text(sentence(6), stamp=2.0)
    probe = adapter.tokenize(" the pallet is on the ramp")
    tokens_seen = stream.tokens_seen
    expected = stream.push_tokens(probe, return_logits=True)

    stream.cache.truncate(stream.cache.fill - len(probe), stream.cache.next_position)  # the probe
    stream.tokens_seen = tokens_seen
    stream.cache.truncate(fill, position)  # the frame and the text after it
    later = [b for b in stream.archive.blocks if b.first_seq >= fill and b.seq_end <= tokens_seen]  # not the probe
    assert [b.frame for b in later][:1] == [adapter.supports_frames]
    base = position
    for block in later:
        keys, values, rel_start, rel_end = stream.archive.block_tensors(block)
        heads = keys.shape[0] * keys.shape[1]
        placed = shift_rotary(keys.flatten(0, 1), torch.full((heads, block.length), base), stream.archive.inv_freq)
        stream.cache.splice(placed.view_as(keys), values, rel_start + base, rel_end + base,
                            torch.arange(block.first_seq, block.seq_end), torch.full((block.length,), block.frame))
        base += block.extent
    again = stream.push_tokens(probe, return_logits=True)
    torch.testing.assert_close(again, expected, atol=1e-4, rtol=1e-4)


def small_cache_long_past(adapter) -> KVStream:
    """A 48-token cache after twelve sentences (and frames, for a VLM): most of the stream is archived only."""
    stream = KVStream(adapter, StreamConfig(capacity=48, chunk_size=16, archive_size=4096, retrieve_tokens=64,
                                            archive_block=16))
    for i in range(12):
        stream.push_text(sentence(i), stamp=float(i))
        if adapter.supports_frames and i % 4 == 1:
            stream.push_frame(frame(i), stamp=i + 0.5)
    return stream


@pytest.mark.parametrize("family", ["llama", "qwen2_vl"])
def test_an_answer_that_retrieved_leaves_the_cache_as_it_was_slot_for_slot(family, adapters):
    adapter = adapters[family]
    stream = small_cache_long_past(adapter)
    before = cache_state(stream)
    answer = stream.ask("Where is the pallet?", max_new_tokens=8)
    assert answer.retrieved_tokens > 0 and not answer.kept_in_memory
    assert_same_state(before, cache_state(stream))
    # With the archive's budget at 0 the answer retrieves nothing.
    stream.reconfigure(retrieve_tokens=0)
    assert stream.ask("Where is the pallet?", max_new_tokens=8).retrieved_tokens == 0


@pytest.mark.parametrize("cache_answers", [True, False])
@pytest.mark.parametrize("family", ["llama", "qwen2_vl"])
def test_a_held_block_that_scores_as_high_as_the_archives_best_is_placed_again_nearest_the_question(
        family, cache_answers, adapters, monkeypatch):
    """Where blocks the cache holds score as high as the best archived one (one may hold a newer value, or only
    name the subject), the retrieved blocks are placed and copies of those held blocks after them, in stream order,
    within half the budget; held blocks that score low are not placed again. Retrieved blocks go after every held
    token. (The scores are set here: a tiny model's mean nothing.)"""
    adapter = adapters[family]
    stream = small_cache_long_past(adapter)
    blocks = list(stream.archive.blocks)
    held = stream.cache.holds(torch.tensor([b.first_seq for b in blocks]), torch.tensor([b.seq_end for b in blocks]))
    assert held.any() and not held.all(), "the cache holds some blocks and not others"
    held_seq = {s for b, h in zip(blocks, held.tolist()) if h for s in range(b.first_seq, b.seq_end)}

    def scores(index, question, scored):
        held = stream.cache.holds(torch.tensor([b.first_seq for b in scored]), torch.tensor([b.seq_end for b in scored]))
        assert held.any() and not held.all(), "the cache's blocks are scored beside the candidates"
        score = torch.arange(len(scored), dtype=torch.float32)
        score[held] = len(scored) if cache_answers else -len(scored)
        return score

    monkeypatch.setattr(RetrievalIndex, "scores", scores)
    for weight in ("WORD_MATCH_WEIGHT", "LEXICAL_WEIGHT", "REPLY_SHARE", "SEMANTIC_WEIGHT"):
        monkeypatch.setattr(retriever_module, weight, 0.0)  # the scores are these alone
    placed, splice = {}, stream.cache.splice

    def recording(keys, values, start, end, seq, frame):
        placed.update(start=start.clone(), seq=seq.tolist(), next_position=stream.cache.next_position)
        splice(keys, values, start, end, seq, frame)

    stream.cache.splice = recording
    before = cache_state(stream)
    answer = stream.ask("Where is the pallet?", max_new_tokens=4)
    assert answer.retrieved_tokens == len(placed["start"]) > 0
    assert int(placed["start"].min()) >= placed["next_position"], "after every held token"
    again = [s in held_seq for s in placed["seq"]]
    if cache_answers:
        first = again.index(True)
        assert first > 0 and all(again[first:]), "the held copies come last, nearest the question"
        assert placed["seq"][first:] == sorted(placed["seq"][first:]), "in stream order"
        assert len(again) - first <= stream.config.retrieve_tokens // 2
    else:
        assert not any(again)
    assert_same_state(before, cache_state(stream))


def test_blocks_the_cache_still_holds_are_not_retrieved(adapters):
    adapter = adapters["llama"]
    stream = KVStream(adapter, StreamConfig(capacity=1024, chunk_size=16, archive_size=4096))
    for i in range(6):
        stream.push_text(sentence(i))
    assert stream.cache.fill == stream.tokens_seen  # nothing evicted yet
    assert stream.ask("Where is the pallet?", max_new_tokens=4).retrieved_tokens == 0


def test_a_reset_empties_the_archive_and_a_resize_keeps_the_newest_blocks():
    archive = KVArchive(100, 8, torch.ones(4))
    keys = torch.randn(2, 1, 30, 8)
    for i in range(3):
        recording = archive.recording(2)
        recording.take(0, keys[0][None], keys[0][None])
        recording.take(1, keys[1][None], keys[1][None])
        archive.end_forward(recording, torch.arange(30), torch.arange(1, 31), 30 * i)
        archive.end_prompt(frame=False, turns=[Turn(30, float(i))])
    assert archive.tokens == 90
    newest = archive.blocks[-1].first_seq
    archive.resize(40)
    assert archive.tokens <= 40 and archive.blocks[-1].first_seq == newest
    assert archive.nbytes() == 40 * archive.bytes_per_token()
    archive.reset()
    assert archive.tokens == 0 and not archive.blocks


@pytest.mark.parametrize("family", ["llama", "qwen2_vl"])
def test_taking_input_is_the_same_with_the_archive_on_or_off(family, adapters):
    """The archive copies what goes through the model and changes nothing of it: the same evictions, the same
    slots, the same logits (so perplexity over any stream is the archive's to leave alone)."""
    adapter = adapters[family]
    streams = [KVStream(adapter, StreamConfig(capacity=48, chunk_size=16, archive_size=size)) for size in (0, 4096)]
    logits = []
    for stream in streams:
        for i in range(10):
            stream.push_text(sentence(i), stamp=float(i))
            if adapter.supports_frames and i % 3 == 0:
                stream.push_frame(frame(i), stamp=i + 0.5)
        logits.append(stream.push_tokens(adapter.tokenize(sentence(11)), return_logits=True))
    off, on = streams
    assert on.archive.tokens == on.tokens_seen and off.archive.tokens == 0
    assert on.cache.evictions == off.cache.evictions > 0
    for i in range(len(on.cache.layers)):
        assert torch.equal(on.cache.cached_seq(i), off.cache.cached_seq(i))
    assert torch.equal(logits[0], logits[1])


def test_chosen_blocks_are_placed_best_last_with_a_messages_pieces_together_in_order():
    def block(index: int, first_seq: int, message: int) -> ArchivedBlock:
        return ArchivedBlock(index, 0, 4, first_seq, 4, False, None, message)

    # As chosen: the best block, the other pieces of its long message (nearest first), then the next best.
    best, before_best, after_best, second = block(5, 40, 7), block(4, 36, 7), block(6, 44, 7), block(1, 8, 1)
    third = block(9, 60, 9)
    assert best_last([best, before_best, after_best, second, third]) == [
        third, second, before_best, best, after_best]


def test_retrieval_heads_are_a_tenth_of_the_layer_heads_found_alike_and_kept_in_a_file(adapters, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.setenv("INF_MLLM_CACHE_DIR", str(tmp_path))
    adapter = adapters["qwen2_vl"]
    new_stream = lambda **settings: KVStream(adapter, StreamConfig(**settings))  # noqa: E731
    heads = retrieval_heads_module.kept_or_found(adapter, new_stream)
    assert heads.dtype == torch.bool and heads.shape[0] == adapter.num_layers
    assert int(heads.sum()) == max(retrieval_heads_module.MIN_HEADS, round(retrieval_heads_module.SHARE * heads.numel()))
    assert torch.equal(retrieval_heads_module.find_retrieval_heads(adapter, new_stream), heads), \
        "the same model, the same heads"
    assert len(list(tmp_path.glob("retrieval_heads-*.json"))) == 1

    def not_again(_adapter, _new_stream):
        raise AssertionError("found again although kept")

    monkeypatch.setattr(retrieval_heads_module, "find_retrieval_heads", not_again)
    assert torch.equal(retrieval_heads_module.kept_or_found(adapter, new_stream), heads)
    # A file that cannot be read costs only finding them again.
    next(tmp_path.glob("retrieval_heads-*.json")).write_bytes(b"not a tensor")
    monkeypatch.setattr(retrieval_heads_module, "find_retrieval_heads", lambda a, n: heads)
    assert torch.equal(retrieval_heads_module.kept_or_found(adapter, new_stream), heads)


def test_a_model_whose_retrieval_heads_cannot_be_found_scores_on_the_middle_layers():
    class Model:  # stands for an adapter the synthetic stream does not suit
        pass

    def fails(_adapter, _new_stream):
        raise RuntimeError("no chat template")

    # retrieval then scores on the middle half
    assert retrieval_heads_module.retrieval_heads(Model(), lambda **settings: None, find=fails) is None


def placed_messages(stream: KVStream, question: str) -> list[str]:
    """The messages placed before `question` when it is asked, in placing order, each once."""
    placed = []
    splice = stream.cache.splice

    def recording(keys, values, start, end, seq, frame):
        placed.extend(seq.tolist())
        splice(keys, values, start, end, seq, frame)

    stream.cache.splice = recording
    stream.ask(question, max_new_tokens=2)
    quoted = []
    for s in placed:
        block = next(b for b in stream.archive.blocks if b.first_seq <= s < b.seq_end)
        text = stream.retriever.quote(block)
        if not quoted or quoted[-1] != text:
            quoted.append(text)
    return quoted


@pytest.mark.parametrize("seed", range(3))
def test_the_statements_that_name_the_question_go_nearest_it_the_newest_last(adapters, monkeypatch, seed):
    """Of blocks that score alike, the ones that name what the question names (its rarer words) are placed
    nearest the question, in stream order: a value told again since (held by the cache, copied) comes last, a
    sibling of the same form further back, and the old value not at all (told again since, it is left out: the
    model gives the old value too when both are there). (Scores are set here, the statements' blocks best in a
    random order and the held ones below every archived one, as a tiny model's scores mean nothing.)"""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    colours = rng.permutation(["red", "blue", "green", "white"])[:2]
    old, new, other = rng.choice(range(1000, 10000), 3, replace=False)
    stream = KVStream(adapters["llama"], StreamConfig(capacity=48, chunk_size=16, archive_size=4096,
                                                      retrieve_tokens=96, archive_block=16))
    told = [f"The code of the {colours[0]} locker is {old}.", f"The code of the {colours[1]} locker is {other}."]
    rng.shuffle(told)
    for i, text in enumerate(told + [sentence(i) for i in range(int(rng.integers(8, 12)))]):
        stream.push_text(text, stamp=float(i))
    stream.push_text(f"The code of the {colours[0]} locker is {new}.", stamp=100.0)

    def scores(index, question, scored):
        held = stream.cache.holds(torch.tensor([b.first_seq for b in scored]), torch.tensor([b.seq_end for b in scored]))
        told = torch.tensor(["locker" in stream.retriever.quote(b) for b in scored])
        return torch.where(held, -100.0, torch.where(told, 50.0, 0.0) + torch.rand(len(scored)))

    monkeypatch.setattr(RetrievalIndex, "scores", scores)
    quoted = placed_messages(stream, f"What is the code of the {colours[0]} locker?")
    assert str(new) in quoted[-1], quoted
    assert all(str(old) not in q for q in quoted), quoted
    assert any(str(other) in q for q in quoted[:-1]), quoted


@pytest.mark.parametrize("seed, naming_again", [(0, "came up in the morning meeting"), (1, "came up again"),
                                                 (2, "came up in the morning meeting"), (3, "was checked")])
def test_a_subject_named_again_is_not_placed_where_its_fact_is(adapters, monkeypatch, seed, naming_again):
    """Of the messages that name the question, those that only name its subject again (a mention, said over and
    over) are not placed where the fact is there to place: the model answered with the mention word for word.
    Where no message holds the value, a mention is placed as before. A short mention, as few words from its fact
    as a new value, is not taken for the fact told again. (Scores set as above: the subject's messages best, in
    a random order.)"""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    colour = str(rng.choice(["red", "blue", "green", "white"]))
    code = int(rng.integers(1000, 10000))
    fact, mention = (f"The code of the {colour} locker is {code}.",
                     f"The code of the {colour} locker {naming_again}.")
    stream = KVStream(adapters["llama"], StreamConfig(capacity=48, chunk_size=16, archive_size=4096,
                                                      retrieve_tokens=96, archive_block=16))
    filler = [sentence(i) for i in range(int(rng.integers(10, 14)))]
    at = sorted(rng.choice(range(1, len(filler)), 4, replace=False))
    texts = [fact] + [mention if i in at else text for i, text in enumerate(filler)]

    def scores(index, question, scored):
        told = torch.tensor(["locker" in stream.retriever.quote(b) for b in scored])
        return torch.where(told, 50.0, 0.0) + torch.rand(len(scored))

    monkeypatch.setattr(RetrievalIndex, "scores", scores)
    for with_fact in (True, False):
        stream = KVStream(adapters["llama"], stream.config)
        for i, text in enumerate(texts if with_fact else texts[1:]):
            stream.push_text(text, stamp=float(i))
        placed = placed_messages(stream, f"What is the code of the {colour} locker?")
        assert (any(fact in p for p in placed), any(mention in p for p in placed)) == (with_fact, not with_fact), placed
