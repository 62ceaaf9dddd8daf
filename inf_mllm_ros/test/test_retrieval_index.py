"""The retrieval index (engine/archive/retrieval_index.py): what a question scores the archive's blocks with.

Its scores are checked against a plain computation over the archive's own keys (every block, every scoring
head, one question token at a time), on streams that wrap the archive round at several lengths; the reference
question is asked of the memory once, and its logits for a block come when the block is written."""

from __future__ import annotations

import math
import random

import pytest
import torch

from inf_mllm_ros.engine.models.loading import load_model
from inf_mllm_ros.engine.archive.retrieval_index import REFERENCE_WEIGHT, RetrievalIndex
from inf_mllm_ros.engine.ops.rotary import shift_rotary
from inf_mllm_ros.engine.runtime.stream import KVStream
from inf_mllm_ros.engine.stream_config import StreamConfig
from inf_mllm_ros.testing.random_models import build_model_folder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WORDS = "pallet forklift aisle dock shelf crate door light scanner badge ramp conveyor".split()


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return load_model(build_model_folder("qwen2_vl", tmp_path_factory.mktemp("tiny") / "m"), device="cpu",
                      dtype="float32")


def wrapped_stream(adapter, seed: int, sentences: int) -> KVStream:
    """A stream whose small archive has gone round (its oldest blocks dropped)."""
    rng = random.Random(seed)
    stream = KVStream(adapter, StreamConfig(capacity=48, chunk_size=16, archive_size=400, archive_block=16))
    for i in range(sentences):
        stream.push_text(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 30))) + ".", stamp=float(i))
    assert stream.archive.blocks_dropped > 0
    return stream


def plain_scores(stream: KVStream, heads: torch.Tensor, question, reference, blocks) -> torch.Tensor:
    """The scoring as the index's docstring states it, block by block and head by head."""
    archive = stream.archive
    per_question = []
    for queries, positions in (question, reference):
        queries, positions = queries.cpu(), positions.cpu()
        layers, q_heads, q, dim = queries.shape
        group = q_heads // archive.keys.shape[1]
        rows = []
        for layer, head in heads.nonzero().tolist():
            query = queries[layer, head]  # [q, dim]
            aligned = shift_rotary(query[None], (archive.block_tokens - positions)[None], archive.inv_freq)[0]
            row = []
            for block in blocks:
                keys = archive.keys[layer, head // group, block.slot : block.slot + block.length]
                row.append(float((aligned @ keys.T).max()) / math.sqrt(dim))
            rows.append(row)
        scores = torch.tensor(rows)
        per_question.append(((scores - scores.mean(1, keepdim=True)) / scores.std(1, keepdim=True)).sum(0))
    return per_question[0] - REFERENCE_WEIGHT * per_question[1]


@pytest.mark.parametrize("seed, sentences", [(0, 40), (1, 57), (2, 73)])
def test_the_index_scores_blocks_as_the_plain_computation_over_the_archive(adapter, seed, sentences):
    stream = wrapped_stream(adapter, seed, sentences)
    reference = stream.content_queries(*stream.retriever.reference_question)
    layers, q_heads = reference[0].shape[:2]
    heads = torch.zeros(layers, q_heads, dtype=torch.bool)
    heads.view(-1)[torch.randperm(layers * q_heads, generator=torch.Generator().manual_seed(seed))[:5]] = True
    device = reference[0].device  # the model's
    stream.archive.build_index(heads, reference, device)
    assert stream.archive.index.keys.device == device
    question = stream.content_queries(*stream.question_ids(adapter.chat.question_parts("Where is the ramp?")))
    blocks = list(stream.archive.blocks)
    expected = plain_scores(stream, heads, question, reference, blocks)
    assert torch.allclose(stream.archive.index.scores(question, blocks), expected, atol=1e-4)
    # Blocks written after the index was made get the reference's logits as they are written.
    for i in range(8):
        stream.push_text(f"The {WORDS[i]} was moved to bay {seed * 10 + i}.")
    blocks = list(stream.archive.blocks)
    expected = plain_scores(stream, heads, question, reference, blocks)
    assert torch.allclose(stream.archive.index.scores(question, blocks), expected, atol=1e-4)
    rebuilt = RetrievalIndex(heads, kv_heads=stream.archive.keys.shape[1], head_dim=stream.archive.keys.shape[-1],
                             size=stream.archive.size, block_tokens=stream.archive.block_tokens,
                             inv_freq=stream.archive.inv_freq, device=device)
    rebuilt.set_reference(*reference)
    for block in blocks:
        rebuilt.write(block.slot, stream.archive.keys[:, :, block.slot : block.slot + block.length])
    assert torch.allclose(rebuilt.scores(question, blocks), stream.archive.index.scores(question, blocks), atol=1e-5)


def test_the_reference_question_is_asked_once_per_memory(adapter, monkeypatch):
    stream = wrapped_stream(adapter, 3, 50)
    asked = []
    content_query_steps = stream.content_query_steps  # every way to a question's queries goes through it

    def counted(ids, content):
        asked.append(ids.numel())
        return content_query_steps(ids, content)

    monkeypatch.setattr(stream, "content_query_steps", counted)
    for n, question in enumerate(["Where is the ramp?", "What is on the shelf?", "Where is the dock?"]):
        stream.ask(question, max_new_tokens=2)
        # The first retrieval asks the question and the reference question; later ones the question alone.
        assert len(asked) == n + 2
    assert stream.archive.index is not None
    # A new memory (a reset) asks it again.
    stream.reset()
    for i in range(50):
        stream.push_text(" ".join(WORDS[(i + k) % len(WORDS)] for k in range(12)) + ".")
    asked.clear()
    stream.ask("Where is the ramp?", max_new_tokens=2)
    assert len(asked) == 2


def test_the_index_goes_with_a_resize_and_a_restore_and_comes_back_at_the_next_question(adapter):
    stream = wrapped_stream(adapter, 4, 50)
    stream.ask("Where is the ramp?", max_new_tokens=2)
    assert stream.archive.index is not None
    saved = stream.archive.export_state()
    stream.archive.resize(200)
    assert stream.archive.index is None
    stream.archive.import_state(saved, dtype=torch.float32)
    assert stream.archive.index is None
    stream.ask("Where is the ramp?", max_new_tokens=2)
    assert stream.archive.index is not None and stream.archive.index.keys.shape[1] == 200
