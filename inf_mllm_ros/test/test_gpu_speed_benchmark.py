"""benchmarks/gpu_speed.py in its smoke mode (the tiny shape on the CPU, a few steps), so that the benchmark a GPU
runs in its few lent minutes cannot rot between GPUs: it runs to the end and writes every figure it promises."""

from __future__ import annotations

import json
import math
import subprocess
import sys


def test_the_gpu_speed_benchmark_runs_to_the_end_and_writes_every_figure(repo_root, tmp_path):
    out = tmp_path / "smoke.json"
    subprocess.run([sys.executable, str(repo_root / "benchmarks" / "run.py"), "gpu_speed", "--smoke", "--out", str(out)],
                   check=True, timeout=600, capture_output=True)
    record = json.loads(out.read_text())
    assert record["device"].startswith("cpu") and record["bandwidth_bytes_per_s"] > 0
    tiny = record["shapes"]["tiny"]
    # A token's time is the difference of two answers' times: on a busy CPU in a few steps it can come out at or
    # below 0, so only its presence is checked here.
    for mode in ("eager", "static", "compiled", "transformers_generate"):
        assert math.isfinite(tiny[f"decode_ms_{mode}"]) and f"tokens_per_s_{mode}" in tiny, mode
    assert tiny["floor_ms"] > 0 and tiny["decode_step_shipped"] == "eager"
    assert set(tiny["answer_s_by_archived_tokens"]) == {"0", "512", "2048"}
    assert set(tiny["chunk_ms"]) == {"h2o", "inf_mllm", "streaming_llm", "window"}
    assert tiny["frames_per_s"] > 0
