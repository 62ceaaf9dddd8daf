"""Retrieval-window scores: blocked PyTorch path against a naive reference, Triton against PyTorch.

The Triton kernels are checked on CPU under TRITON_INTERPRET=1. That variable must be set before
triton is first imported, so those checks run in a child process (this file run as a script);
the pytest process itself never imports triton with the interpreter off by accident.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inf_mllm_ros.engine.ops import scoring, triton_scoring
from inf_mllm_ros.engine.ops.scoring import visible_counts, window_scores

PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def make_inputs(num_heads, num_kv, head_dim, n_past, q, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # Scale 2 gives peaked softmaxes, closer to real attention than unit-variance noise.
    query = (2 * torch.randn(num_heads, q, head_dim, generator=gen)).to(dtype)
    key = (2 * torch.randn(num_kv, n_past + q, head_dim, generator=gen)).to(dtype)
    return query, key


def naive_scores(query, key, n_past, scaling):
    """Materialises the whole [num_heads, q, keys] attention matrix, in float64."""
    num_heads, q, _ = query.shape
    num_kv, n_keys, _ = key.shape
    group = num_heads // num_kv
    k = key.double().repeat_interleave(group, dim=0)  # kv head of query head h is h // group
    logits = scaling * query.double() @ k.transpose(1, 2)
    t = torch.arange(q).unsqueeze(1)
    j = torch.arange(n_keys).unsqueeze(0)
    logits = logits.masked_fill(j > n_past + t, float("-inf"))
    probs = torch.softmax(logits, dim=-1).sum(dim=1)  # [num_heads, keys]
    return probs.view(num_kv, group, n_keys).sum(dim=1)


# (num_heads, num_kv_heads, head_dim, n_past, q, block_size)
TORCH_CASES = [
    (2, 2, 16, 0, 1, 64),  # first token of an empty cache
    (4, 2, 16, 30, 1, 64),  # decode step
    (4, 1, 16, 0, 9, 4),  # empty cache, window not a multiple of the block
    (6, 2, 32, 17, 10, 3),  # group 3
    (8, 1, 16, 40, 12, 5),  # group 8
    (4, 4, 64, 25, 7, 1),  # no grouping, one query per block
    (3, 3, 8, 5, 6, 100),  # block larger than the window
    (12, 2, 128, 64, 20, 8),  # Qwen2-VL-2B head layout
]


@pytest.mark.parametrize("num_heads,num_kv,head_dim,n_past,q,block", TORCH_CASES)
def test_torch_matches_naive(num_heads, num_kv, head_dim, n_past, q, block):
    query, key = make_inputs(num_heads, num_kv, head_dim, n_past, q)
    scaling = head_dim**-0.5
    got = window_scores(query, key, n_past, scaling, backend="torch", block_size=block)
    want = naive_scores(query, key, n_past, scaling)
    assert got.dtype == torch.float32
    assert got.shape == (num_kv, n_past + q)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv,head_dim,n_past,q,block", TORCH_CASES)
def test_scores_conserve_probability(num_heads, num_kv, head_dim, n_past, q, block):
    # Each query's probabilities sum to 1, so each kv head collects group * q in total.
    query, key = make_inputs(num_heads, num_kv, head_dim, n_past, q, seed=1)
    got = window_scores(query, key, n_past, 0.3, backend="torch", block_size=block)
    group = num_heads // num_kv
    torch.testing.assert_close(got.sum(dim=1), torch.full((num_kv,), float(group * q)))
    assert (got >= 0).all()


def test_window_keys_only_seen_by_later_queries():
    # The last window key is seen by the last query only: its score is at most group * 1.
    query, key = make_inputs(4, 2, 16, 10, 6)
    got = window_scores(query, key, 10, 0.25, backend="torch")
    assert (got[:, -1] <= 2 + 1e-5).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype):
    query, key = make_inputs(6, 2, 64, 33, 11, dtype=dtype)
    got = window_scores(query, key, 33, 64**-0.5, backend="torch", block_size=4)
    want = naive_scores(query, key, 33, 64**-0.5)  # on the same rounded values
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_torch_path_is_blocked(monkeypatch):
    # The attention rows in flight never exceed block_size per head.
    seen = []
    real_softmax = torch.softmax

    def spy(x, dim):
        seen.append(tuple(x.shape))
        return real_softmax(x, dim=dim)

    monkeypatch.setattr(torch, "softmax", spy)
    query, key = make_inputs(4, 2, 16, 20, 10)
    window_scores(query, key, 20, 0.25, backend="torch", block_size=4)
    assert seen == [(2, 2, 4, 30), (2, 2, 4, 30), (2, 2, 2, 30)]


def test_auto_backend_on_cpu_is_torch():
    query, key = make_inputs(4, 2, 16, 12, 5)
    auto = window_scores(query, key, 12, 0.25)
    torch_path = window_scores(query, key, 12, 0.25, backend="torch")
    assert torch.equal(auto, torch_path)


def test_visible_counts():
    counts = visible_counts(3, 4, "cpu")
    assert counts.dtype == torch.float32
    assert counts.tolist() == [4.0, 4.0, 4.0, 4.0, 3.0, 2.0, 1.0]
    assert visible_counts(0, 1, "cpu").tolist() == [1.0]


def test_visible_counts_match_causal_mask():
    # Scores of a uniform attention are 1/(visible keys) per pair; counting pairs must agree.
    n_past, q = 5, 4
    seen = torch.zeros(n_past + q)
    for t in range(q):
        seen[: n_past + t + 1] += 1
    assert torch.equal(visible_counts(n_past, q), seen)


@pytest.mark.parametrize(
    "q_shape,k_shape,n_past,match",
    [
        ((4, 3, 16), (2, 10, 16), 5, "must equal"),
        ((3, 3, 16), (2, 8, 16), 5, "not a multiple"),
        ((4, 3, 16), (2, 8, 32), 5, "head_dim"),
        ((4, 0, 16), (2, 5, 16), 5, "q >= 1"),
    ],
)
def test_rejects_bad_shapes(q_shape, k_shape, n_past, match):
    with pytest.raises(ValueError, match=match):
        window_scores(torch.zeros(q_shape), torch.zeros(k_shape), n_past, 1.0)


def test_rejects_unknown_backend():
    query, key = make_inputs(2, 1, 16, 3, 2)
    with pytest.raises(ValueError, match="backend"):
        window_scores(query, key, 3, 1.0, backend="cuda")


def test_triton_backend_without_triton_raises(monkeypatch):
    monkeypatch.setattr(triton_scoring, "triton", None)
    query, key = make_inputs(2, 1, 16, 3, 2)
    with pytest.raises(RuntimeError, match="triton"):
        window_scores(query, key, 3, 1.0, backend="triton")
    # "auto" falls back to PyTorch instead.
    assert window_scores(query, key, 3, 1.0).shape == (1, 5)


def test_triton_module_imports_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from inf_mllm_ros.engine.ops import triton_scoring\n"
        "assert not triton_scoring.available()\n"
        "print('ok')\n"
    )
    out = _run_child(["-c", code], interpret=False)
    assert out.strip().endswith("ok")


# ---- Triton, under the CPU interpreter ----------------------------------------------------

# (name, num_heads, num_kv, head_dim, n_past, q, dtype, transposed query)
TRITON_CASES = [
    ("empty_cache_q1", 2, 2, 64, 0, 1, "float32", False),
    ("gqa2", 4, 2, 64, 37, 5, "float32", False),
    ("gqa8_bf16", 8, 1, 64, 90, 8, "bfloat16", False),
    ("gqa3_fp16", 6, 2, 64, 20, 7, "float16", False),
    ("decode_bf16", 4, 2, 64, 70, 1, "bfloat16", False),
    ("empty_cache_q8", 2, 1, 64, 0, 8, "float32", False),
    ("head_dim_128", 2, 2, 128, 50, 3, "float32", False),
    ("head_dim_48", 2, 1, 48, 13, 4, "float32", False),
    ("strided_query", 4, 2, 64, 60, 6, "float32", True),
    # Windows longer than one query tile; later key blocks skip the queries that cannot see them.
    ("long_window_fp32", 2, 1, 64, 10, 90, "float32", False),
    ("long_window_bf16", 4, 2, 64, 20, 70, "bfloat16", False),
]


def _run_child(args, interpret):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), env.get("PYTHONPATH")]))
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.fixture(scope="module")
def triton_results():
    if not triton_scoring.available():
        pytest.skip(f"triton cannot be imported: {triton_scoring.import_error()}")
    out = _run_child([__file__, "--triton-cases"], interpret=True)
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("case", TRITON_CASES, ids=[c[0] for c in TRITON_CASES])
def test_triton_matches_torch(triton_results, case):
    result = triton_results[case[0]]
    assert result["shape"] == [case[2], case[4] + case[5]]
    assert result["max_err"] <= 1e-4, result
    assert result["sum_err"] <= 1e-5, result


def triton_case(name, num_heads, num_kv, head_dim, n_past, q, dtype, transposed):
    """Runs one case through both backends; called in the interpreter child process."""
    query, key = make_inputs(num_heads, num_kv, head_dim, n_past, q, getattr(torch, dtype))
    if transposed:  # attention modules hand over [q, heads, d] memory viewed as [heads, q, d]
        query = query.transpose(0, 1).contiguous().transpose(0, 1)
    scaling = head_dim**-0.5
    got = scoring.window_scores(query, key, n_past, scaling, backend="triton")
    want = scoring.window_scores(query, key, n_past, scaling, backend="torch", block_size=4)
    group = num_heads // num_kv
    return {
        "shape": list(got.shape),
        "max_err": (got - want).abs().max().item(),
        "sum_err": ((got.sum(dim=1) - group * q).abs().max() / (group * q)).item(),  # relative
    }


if __name__ == "__main__" and sys.argv[1:] == ["--triton-cases"]:
    assert triton_scoring.interpreting(), "run with TRITON_INTERPRET=1"
    results = {case[0]: triton_case(*case) for case in TRITON_CASES}
    print(json.dumps(results))


@pytest.mark.parametrize("n_past,q,block", [(0, 5, 128), (37, 9, 4), (100, 1, 128)])
def test_fused_attention_matches_sdpa_and_window_scores(n_past, q, block):
    from inf_mllm_ros.engine.ops.scoring import attention_with_window_scores

    torch.manual_seed(3)
    query, key, value = torch.randn(6, q, 16), torch.randn(2, n_past + q, 16), torch.randn(2, n_past + q, 16)
    output, scores = attention_with_window_scores(query, key, value, n_past, 0.25, block_size=block)
    mask = torch.ones(q, n_past + q, dtype=torch.bool).tril(n_past)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(3, 0), value.repeat_interleave(3, 0), attn_mask=mask, scale=0.25)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scores, window_scores(query, key, n_past, 0.25, backend="torch"), atol=1e-5, rtol=1e-5)
