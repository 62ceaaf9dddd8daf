"""The bounded cache: fixed storage, exact fill, position re-packing, chunked pushes."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from inf_mllm_ros.engine.memory import cache as cache_module
from inf_mllm_ros.engine.models.adapters import CausalLMAdapter
from inf_mllm_ros.engine.memory.cache import CacheOverflowError
from inf_mllm_ros.engine.memory.cache_layer import BoundedLayer
from inf_mllm_ros.engine.ops.rotary import packed_positions, shift_rotary
from inf_mllm_ros.engine.runtime.stream import KVStream
from inf_mllm_ros.engine.stream_config import StreamConfig

BOUNDED = ["inf_mllm", "streaming_llm", "h2o", "window"]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    return CausalLMAdapter(LlamaForCausalLM(config), tokenizer=None)


def make_stream(adapter, **kw) -> KVStream:
    kw.setdefault("system_prompt", "")
    return KVStream(adapter, StreamConfig(**kw))


def test_shift_rotary_equals_rotation_at_the_shifted_position():
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16)
    rope = LlamaRotaryEmbedding(config)
    keys = torch.randn(1, 2, 5, 16)
    pos = torch.tensor([[3, 9, 10, 40, 41]])
    delta = torch.tensor([-3, -8, -8, -37, -37])
    cos, sin = rope(keys, pos)
    rotated, _ = apply_rotary_pos_emb(keys, keys, cos, sin)
    cos2, sin2 = rope(keys, pos + delta)
    expected, _ = apply_rotary_pos_emb(keys, keys, cos2, sin2)
    shifted = shift_rotary(rotated[0], delta.expand(2, 5), rope.inv_freq)
    torch.testing.assert_close(shifted, expected[0], atol=1e-5, rtol=1e-5)


def test_packed_positions_close_gaps_and_keep_runs_intact():
    # Tokens 0..2 of text, then (after evicted tokens) a 2x2 image run sharing base 20 (extent 2),
    # then text again after another gap.
    start = torch.tensor([[0, 1, 2, 20, 20, 20, 20, 30]])
    end = torch.tensor([[1, 2, 3, 22, 22, 22, 22, 31]])
    seq = torch.tensor([[0, 1, 2, 10, 11, 12, 13, 25]])
    new_start, new_end = packed_positions(start, end, seq)
    assert new_start.tolist() == [[0, 1, 2, 3, 3, 3, 3, 5]]
    assert new_end.tolist() == [[1, 2, 3, 5, 5, 5, 5, 6]]


@pytest.mark.parametrize("policy", BOUNDED)
def test_fill_is_min_of_capacity_and_tokens_seen_and_storage_is_never_reallocated(tiny, policy):
    stream = make_stream(tiny, capacity=48, policy=policy, chunk_size=16, headroom=16)
    generator = torch.Generator().manual_seed(1)
    pointers, kv_bytes, seen = None, None, 0
    for size in [5, 16, 40, 1, 33, 64, 7, 100]:
        ids = torch.randint(0, 300, (size,), generator=generator)
        stream.push_tokens(ids)
        seen += size
        assert stream.cache.fill == min(48, seen)
        assert all(layer.fill == stream.cache.fill for layer in stream.cache.layers)
        pointers = pointers or stream.cache.storage_pointers()
        kv_bytes = kv_bytes or stream.cache.kv_nbytes()
        assert stream.cache.storage_pointers() == pointers
        assert stream.cache.kv_nbytes() == kv_bytes
        # In-cache positions: the next position never runs past the storage.
        assert stream.cache.next_position <= 48 + 16
    assert stream.stats().tokens_evicted == seen - 48


def test_peak_fill_is_capacity_plus_one_chunk(tiny, monkeypatch):
    peak = {"fill": 0}
    original = BoundedLayer.append

    def recording(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        peak["fill"] = max(peak["fill"], self.fill)
        return out

    monkeypatch.setattr(BoundedLayer, "append", recording)
    stream = make_stream(tiny, capacity=32, policy="inf_mllm", chunk_size=8, headroom=8)
    stream.push_tokens(torch.randint(0, 300, (200,)))  # one long input, fed in blocks
    assert peak["fill"] == 32 + 8


def test_original_positions_keep_growing_cache_positions_stay_bounded(tiny):
    ids = torch.randint(0, 300, (300,))
    original = make_stream(tiny, capacity=32, policy="streaming_llm", chunk_size=16, position_mode="original")
    packed = make_stream(tiny, capacity=32, policy="streaming_llm", chunk_size=16)
    original.push_tokens(ids)
    packed.push_tokens(ids)
    assert original.cache.next_position == 300
    assert packed.cache.next_position == 32


def test_full_cache_refuses_overflow_and_keeps_its_memory(tiny):
    stream = make_stream(tiny, capacity=32, policy="full", chunk_size=8, headroom=8)
    stream.push_tokens(torch.randint(0, 300, (40,)))
    before = (stream.cache.fill, stream.tokens_seen, stream.cache.next_position)
    with pytest.raises(CacheOverflowError, match="do not fit"):
        stream.push_tokens(torch.randint(0, 300, (8,)))
    assert (stream.cache.fill, stream.tokens_seen, stream.cache.next_position) == before
    # Past its capacity, into its headroom, the full cache's memory is saved and restored like any other.
    restored = make_stream(tiny, capacity=32, policy="full", chunk_size=8, headroom=8)
    restored.cache.import_state(stream.cache.export_state(), dtype=torch.float32, device=torch.device("cpu"))
    assert restored.cache.fill == 40 and torch.equal(restored.cache.cached_seq(0), stream.cache.cached_seq(0))


def test_a_headroom_smaller_than_a_block_is_refused(tiny):
    """A full cache takes each block in its headroom before evicting: a smaller one would fail mid-input."""
    with pytest.raises(ValueError, match="headroom 8 is smaller than chunk_size 16"):
        make_stream(tiny, capacity=32, chunk_size=16, headroom=8)


def test_cache_mode_needs_rope_and_rejects_bad_sizes(tiny):
    with pytest.raises(ValueError, match="capacity"):
        make_stream(tiny, capacity=4)
    with pytest.raises(ValueError, match="context"):
        make_stream(tiny, capacity=4096)


def _rotate_exact(k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """RoPE rotation in float64: the reference a re-packed key must match."""
    angles = positions.double()[..., None] * inv_freq.double()
    angles = torch.cat((angles, angles), dim=-1)
    half = k.shape[-1] // 2
    return k * angles.cos() + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * angles.sin()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_repacked_keys_stay_exact_over_a_thousand_repacks(dtype):
    """Every key that survives is rotated to its new position from the key the model gave, so rounding
    never accumulates: after 1,000 re-packs the newest-at-start keys are within one rounding of exact."""
    from inf_mllm_ros.engine.memory.cache import BoundedKVCache, ForwardPlan, PromptPositions
    from inf_mllm_ros.engine.memory.policies import make_policy

    torch.manual_seed(0)
    dim, capacity, steps = 64, 1010, 1000
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    cache = BoundedKVCache(1, capacity, make_policy("streaming_llm", capacity=capacity), headroom=4,
                           rope_inv_freq=inv_freq.float())
    layer = cache.layers[0]
    raw = torch.randn(capacity + steps, dim, dtype=torch.float64)

    def push(first: int, n: int) -> None:
        pos = PromptPositions.contiguous(cache.next_position, first, n)
        keys = _rotate_exact(raw[first:first + n], pos.start, inv_freq).to(dtype)[None, None]
        cache.stage(ForwardPlan(pos, evict=True))
        cache.update(keys, keys, 0)
        cache.after_attention(0, None, None, 1.0)

    push(0, capacity)
    for i in range(steps):  # each step evicts the oldest non-sink token and shifts every newer key by one
        push(capacity + i, 1)
    seq = layer.seq[0, : layer.fill]
    survivors = seq >= capacity - 5  # keys that were shifted about 1,000 times
    moved = seq - layer.pos_start[0, : layer.fill]
    assert int(survivors.sum()) >= 5 and int(moved[survivors].min()) > 990, "every survivor was shifted ~1,000 times"
    exact = _rotate_exact(raw[seq], layer.pos_start[0, : layer.fill], inv_freq)
    got = layer.keys[0, 0, : layer.fill].double()
    error = ((got - exact).norm(dim=-1) / exact.norm(dim=-1))[survivors]
    # Half precision: within one rounding (the drift this guards against was 5 % after 200 re-packs).
    # float32 rotates the stored key in place: its drift stays far below anything attention can see.
    bound = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 1e-4}[dtype]
    assert float(error.max()) < bound, f"relative error {float(error.max()):.2e} after {steps} re-packs"


@pytest.mark.parametrize("policy", ["inf_mllm", "streaming_llm", "h2o"])
@pytest.mark.parametrize("pinned", [False, True])
def test_scoring_evicting_and_repacking_never_read_a_tensor_on_the_host(tiny, policy, pinned,
                                                                        host_reads_after_attention):
    stream = make_stream(tiny, capacity=48, policy=policy, chunk_size=16, headroom=16)
    stream.push_tokens(torch.randint(0, 300, (80,)))  # full, evicting after every block
    if pinned:
        stream.push_tokens(torch.randint(0, 300, (7,)), pinned=True)
    host_reads_after_attention.clear()
    evictions = stream.cache.evictions
    stream.push_tokens(torch.randint(0, 300, (64,)))
    assert stream.cache.evictions == evictions + 4  # scored, evicted and re-packed: the path was taken
    if pinned and policy == "inf_mllm":
        # While pins are held, Inf-MLLM asks whether any is still there and how many one layer-head holds
        # (so that the recent window leaves them room): two reads per eviction, for every layer at once.
        assert stream.cache.pinned_held() == 7
        assert host_reads_after_attention == ["__bool__", "__int__"] * 4
    else:
        assert host_reads_after_attention == []


@pytest.mark.parametrize("policy", BOUNDED)
@pytest.mark.parametrize("pinned", [False, True])
@pytest.mark.parametrize("one_row_at_a_time", [False, True])
def test_evicting_every_layer_at_once_keeps_what_one_layer_at_a_time_keeps(tiny, policy, pinned, one_row_at_a_time,
                                                                           monkeypatch):
    """Layers of one shape share storage and are evicted and re-packed in one pass; the slots kept, their
    keys and their positions are those of evicting layer by layer. Keys and values move in blocks of
    layer-heads whose temporaries fit a budget (one layer-head per block with a budget of one byte)."""
    generator = torch.Generator().manual_seed(3)
    pushes = [(torch.randint(0, 300, (size,), generator=generator), pinned and size == 7)
              for size in [40, 16, 7, 33, 64, 21]]
    streams = [make_stream(tiny, capacity=48, policy=policy, chunk_size=16, headroom=16) for _ in range(2)]
    streams[1].cache.stack_layers = False  # before the first token: the layers get storage of their own
    for ids, pin in pushes:  # layer by layer, whole layers in one block each
        streams[1].push_tokens(ids, pinned=pin)
    if one_row_at_a_time:
        monkeypatch.setattr(cache_module, "TEMPORARY_BYTES", 1)
    for ids, pin in pushes:
        streams[0].push_tokens(ids, pinned=pin)
    together, one_by_one = (stream.cache for stream in streams)
    assert together.stacked_layers() is not None and one_by_one.stacked_layers() is None
    assert together.evictions == one_by_one.evictions > 3
    assert together.next_position == one_by_one.next_position
    for a, b in zip(together.layers, one_by_one.layers):
        assert a.fill == b.fill == 48
        assert torch.equal(a.seq[:, :48], b.seq[:, :48])
        assert torch.equal(a.pos_start[:, :48], b.pos_start[:, :48])
        assert torch.equal(a.pinned[:, :48], b.pinned[:, :48])
        assert torch.allclose(a.keys[:, :, :48], b.keys[:, :, :48], atol=1e-6)
        assert torch.equal(a.values[:, :, :48], b.values[:, :, :48])
    if pinned and policy == "inf_mllm":
        assert together.pinned_held() == 7
