"""The CUDA path: the Triton scoring kernel on a GPU, and the engine in half precision on a GPU.

Skipped where no CUDA device is visible (the CPU suite checks the kernel under Triton's interpreter).
On a GPU machine: `python -m pytest inf_mllm_ros/test/test_cuda.py` (SmolLM2 prepared, see README).
"""

from __future__ import annotations

import pytest
import torch

from inf_mllm_ros.engine.archive import retrieval_heads as retrieval_heads_module
from inf_mllm_ros.engine.ops import scoring, triton_scoring
from inf_mllm_ros.engine.models.loading import load_model
from inf_mllm_ros.engine.runtime.stream import KVStream
from inf_mllm_ros.engine.stream_config import StreamConfig
from inf_mllm_ros.testing.random_models import build_model_folder

import test_archive
import test_decode_step
import test_retrieval_index
from conftest import LIGHTHOUSE, load_prepared
from test_scoring import make_inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")

# (label, num_heads, num_kv_heads, head_dim): the head layouts of the models the package runs.
LAYOUTS = [
    ("smollm2_135m", 9, 3, 64),
    ("qwen2.5_0.5b", 14, 2, 64),
    ("qwen2_vl_2b", 12, 2, 128),
    ("no_gqa_128", 8, 8, 128),
    ("gqa8", 8, 1, 64),
]
WINDOWS = [1, 16, 64, 512, 1024]  # decode steps, short prompts, frames, long prefill chunks
CACHES = [0, 1024, 4096]


def inputs(num_heads, num_kv, head_dim, n_past, q, dtype, seed=0):
    query, key = make_inputs(num_heads, num_kv, head_dim, n_past, q, dtype, seed)
    return query.cuda(), key.cuda()


@pytest.fixture(scope="module", autouse=True)
def no_tf32():
    # The PyTorch reference must multiply fp32 exactly (TF32 would round the logits to 10 bits).
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.skipif(not triton_scoring.available(), reason="triton cannot be imported")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("n_past", CACHES)
@pytest.mark.parametrize("q", WINDOWS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_triton_kernel_matches_the_pytorch_path(layout, q, n_past, dtype):
    _, num_heads, num_kv, head_dim = layout
    query, key = inputs(num_heads, num_kv, head_dim, n_past, q, dtype)
    scaling = head_dim**-0.5
    got = scoring.window_scores(query, key, n_past, scaling, backend="triton")
    want = scoring.window_scores(query, key, n_past, scaling, backend="torch")  # float32 on the same inputs
    assert got.dtype == torch.float32 and got.shape == (num_kv, n_past + q)
    # Both take the same rounded inputs and multiply them exactly (bf16/fp16 products fit in fp32; fp32 goes
    # through IEEE dots), so they differ only in the order of fp32 sums: a millionth of a query's unit of
    # attention per key, far below any score gap that decides an eviction.
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    group = num_heads // num_kv
    torch.testing.assert_close(got.sum(dim=1), torch.full_like(got[:, 0], group * q), rtol=1e-5, atol=0)


@pytest.mark.skipif(not triton_scoring.available(), reason="triton cannot be imported")
def test_auto_backend_on_cuda_is_triton():
    query, key = inputs(14, 2, 64, 300, 64, torch.bfloat16)
    auto = scoring.window_scores(query, key, 300, 0.125)
    assert torch.equal(auto, scoring.window_scores(query, key, 300, 0.125, backend="triton"))


@pytest.fixture(scope="module")
def smollm2_bf16():
    return load_prepared("smollm2", device="cuda", dtype="bfloat16")


TEXT = LIGHTHOUSE


@pytest.mark.parametrize("policy", ["inf_mllm", "streaming_llm", "h2o", "full"])
def test_while_the_stream_fits_the_engine_matches_the_plain_model_in_bf16(smollm2_bf16, policy):
    """The plain model gets the same 64-token chunks through its own cache, so both run the same kernels
    on the same shapes: any difference is the engine's (its cache layout, its positions)."""
    from transformers import DynamicCache

    adapter = smollm2_bf16
    ids = adapter.tokenize(TEXT)
    stream = KVStream(adapter, StreamConfig(capacity=1024, policy=policy, chunk_size=64, system_prompt=""))
    logits = stream.push_tokens(ids, return_logits=True).float()
    past, expected = DynamicCache(), []
    with torch.inference_mode():
        for start in range(0, len(ids), 64):
            chunk = ids[start : start + 64].to("cuda")[None]
            out = adapter.model(input_ids=chunk, past_key_values=past, use_cache=True)
            expected.append(out.logits[0].float())
    expected = torch.cat(expected)
    assert logits.shape == expected.shape
    # bf16 logits carry 8 bits: 0.0625 is two units in the last place at the logits' scale (|logit| < 32).
    torch.testing.assert_close(logits, expected, atol=0.0625, rtol=0)
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.99


def test_triton_and_pytorch_scores_keep_the_same_tokens_on_the_gpu(smollm2_bf16):
    """Past many evictions the two scoring paths keep (almost) the same tokens in the real engine loop."""
    ids = smollm2_bf16.tokenize(TEXT * 8)
    kept = {}
    for backend in ("triton", "torch"):
        stream = KVStream(smollm2_bf16, StreamConfig(capacity=256, policy="inf_mllm", chunk_size=64, system_prompt="",
                                                     scoring_backend=backend))
        for start in range(0, len(ids), 64):
            stream.push_tokens(ids[start : start + 64])
        kept[backend] = [stream.cache.cached_seq(i).sort(-1).values for i in range(len(stream.cache.layers))]
    same = torch.stack([(a == b).float().mean() for a, b in zip(kept["triton"], kept["torch"])])
    # Near-ties between candidates can fall either way at the last bit: allow a few in a hundred.
    assert same.mean() >= 0.97, same


def test_gpu_memory_stays_flat_as_the_stream_grows(smollm2_bf16):
    ids = smollm2_bf16.tokenize(TEXT * 40)
    stream = KVStream(smollm2_bf16, StreamConfig(capacity=512, policy="inf_mllm", chunk_size=64, system_prompt=""))
    peaks = []
    for start in range(0, len(ids), 64):
        stream.push_tokens(ids[start : start + 64])
        if start == 2048:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if start > 2048:
            peaks.append(torch.cuda.max_memory_allocated())
    assert stream.tokens_seen > 4 * 2048
    assert max(peaks) - min(peaks) < 1 << 20, f"peak GPU memory grew by {(max(peaks) - min(peaks)) >> 10} KiB"


@pytest.fixture(scope="module")
def tiny_on_the_gpu(tmp_path_factory):
    """Tiny random models of a text family and a frame family, float32 on the GPU."""
    root = tmp_path_factory.mktemp("tiny_models_gpu")
    return {family: load_model(build_model_folder(family, root / family), device="cuda", dtype="float32")
            for family in ("llama", "qwen2_vl")}


@pytest.mark.parametrize("family", ["llama", "qwen2_vl"])
def test_the_archive_keeps_blocks_on_the_host_and_puts_them_back_into_a_gpu_cache(family, tiny_on_the_gpu,
                                                                                 monkeypatch):
    """The CPU suite's checks of retrieval's mechanics, with the cache on the GPU and the archive in host
    memory: blocks put back where they were give the same logits, an answer that retrieved (its retrieval
    heads found on the GPU) leaves the cache as it was, slot for slot, and nothing is placed where the cache
    holds an answer as good."""
    test_archive.test_placing_archived_blocks_where_they_were_gives_the_same_logits(family, tiny_on_the_gpu)
    test_archive.test_an_answer_that_retrieved_leaves_the_cache_as_it_was_slot_for_slot(family, tiny_on_the_gpu)
    for cache_answers in (True, False):
        test_archive.test_nothing_is_retrieved_where_the_cache_holds_an_answer_as_good_as_the_archives(
            family, cache_answers, tiny_on_the_gpu, monkeypatch)
        monkeypatch.undo()
    heads = KVStream(tiny_on_the_gpu[family], StreamConfig()).retrieval_heads()
    assert heads is not None and heads.device.type == "cpu"
    assert int(heads.sum()) == max(retrieval_heads_module.MIN_HEADS,
                                   round(retrieval_heads_module.SHARE * heads.numel()))


@pytest.mark.parametrize("seed, sentences", [(0, 40), (1, 57)])
def test_the_retrieval_index_lives_on_the_gpu_and_scores_as_the_plain_computation(seed, sentences, tiny_on_the_gpu):
    """Blocks recorded from the GPU (copied to pinned host memory without a wait per forward), indexed on the
    GPU, scored as the plain computation over the host archive."""
    test_retrieval_index.test_the_index_scores_blocks_as_the_plain_computation_over_the_archive(
        tiny_on_the_gpu["qwen2_vl"], seed, sentences)


@pytest.mark.parametrize("family", ["llama", "qwen2_vl"])
def test_the_compiled_step_under_cuda_graphs_gives_the_eager_answers(family, tiny_on_the_gpu):
    """On CUDA the decode step "auto" is the compiled one, under CUDA graphs (mode="reduce-overhead"): its answers
    are the eager path's, over a stream that evicts and retrieves, and leave the memory as it was."""
    test_decode_step.test_the_static_step_gives_the_eager_paths_tokens_and_logits(family, tiny_on_the_gpu)
    adapter = tiny_on_the_gpu[family]
    stream = test_archive.small_cache_long_past(adapter)
    compiled = stream.static_decoder
    assert compiled is not None and compiled.mode == "compiled"
    for i, question in enumerate(test_decode_step.QUESTIONS * 2):
        before = test_archive.cache_state(stream)
        stream.static_decoder = None
        eager = stream.ask(question, max_new_tokens=12)
        stream.static_decoder = compiled
        got = stream.ask(question, max_new_tokens=12)
        assert (got.text, got.tokens_generated, got.retrieved_tokens) == \
            (eager.text, eager.tokens_generated, eager.retrieved_tokens)
        test_archive.assert_same_state(before, test_archive.cache_state(stream))
        stream.push_text(test_archive.sentence(30 + i), stamp=50.0 + i)


@pytest.mark.parametrize("family", ["llama", "qwen2_vl"])
def test_the_compiled_ingest_step_under_cuda_graphs_leaves_the_eager_memory(family, tiny_on_the_gpu):
    """On CUDA the ingest step "auto" is the compiled one, under CUDA graphs: after each input the memory is the
    eager path's (the same slots kept), over a stream that evicts, and the answers are the same."""
    import test_ingest_step

    adapter = tiny_on_the_gpu[family]
    eager = KVStream(adapter, StreamConfig(**test_ingest_step.CONFIG, ingest_step="eager"))
    compiled = KVStream(adapter, StreamConfig(**test_ingest_step.CONFIG))
    assert compiled.static_ingester is not None and compiled.static_ingester.mode == "compiled"
    for _ in test_ingest_step.feed((eager, compiled), adapter, 5, 12):
        test_ingest_step.assert_same_memory(test_archive.cache_state(eager), test_archive.cache_state(compiled))
    assert compiled.static_ingester.blocks > 10 and eager.cache.evictions > 10
    for question in test_ingest_step.QUESTIONS:
        assert compiled.ask(question, max_new_tokens=8).text == eager.ask(question, max_new_tokens=8).text
