"""A short soak of the installed node: the run of benchmarks/soak.py (inf_mllm_ros.testing.soak; an hour there) for
about 100 s.

A camera at 30 fps (640x480 rgb8, best effort), a text a second and a question every 15 s, into the
node with stats every second, a memory file checkpointed every 30 s and lighter model work than its
defaults (NODE_PARAMS, TORCH_THREADS). Every question gets a response, frames and every text go in,
resident memory stays flat once the model is loaded and frames are going in, and SIGINT ends the node
with exit code 0.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from inf_mllm_ros.testing import soak

# Resident memory and pace are measured: alone, not beside other tests.
pytestmark = pytest.mark.serial

REPO_ROOT = Path(__file__).resolve().parents[2]
DURATION = 100.0  # seconds from the node's start, model loading included
QUESTION_EVERY = 15.0
SAMPLE_EVERY = 2.0
# The node's defaults but lighter model work: config/cpu.yaml's small model, frames at the size and rate it gives them,
# short answers, no descriptions (test_node covers those). On a 2-core CPU shared with other work the
# defaults leave the model behind the inputs (texts refused with "text queue full", answers close to
# query_timeout); this test is about the node staying whole under a camera, texts and questions, and
# the benchmark keeps the defaults.
# The archive grows resident memory by design until it holds archive_size tokens (46 KB a token for this model in
# float32): a small one is full within the warm-up, so that flat memory afterwards covers a full archive too.
# Checkpoints every 30 s (the benchmark: 60 s) so that two or more fall after the warm-up.
NODE_PARAMS = {"model": "smolvlm-smollm2", "max_frame_pixels": 65536, "frame_rate": 0.2, "max_new_tokens": 16,
               "description_period": 0.0, "archive_size": 512, "checkpoint_period": 30.0}
# One torch thread in the node, as the in-process tests use (conftest's one_torch_thread): with one
# thread per core on a loaded 2-core machine the same matrix products take about 4 times longer.
TORCH_THREADS = 1
# Resident memory after warm-up (the model loaded, a frame and an answer through, the cache full, a checkpoint
# written), the median of the first half of the run phase's samples (camera, texts and questions going in) against the
# median of the second half. It swings by 30 to 70 MiB with checkpoints and steps up at what happens once within the
# first minutes (a step of 93 MiB at 66 s, flat to the end after it, in one run): the halves' medians of six runs on a
# 2-core CPU gave +2.3 % to +5.1 %, whichever half a step fell in. What this short run is for is a leak that grows
# with the inputs: the camera's frames kept (640x480 at 30 fps, 27 MB a second) would add over 40 % between the halves
# (their medians some 30 s apart), one frame in four about 11 %. Slow leaks are for the hour-long benchmark
# (results/soak.json: +1.1 % over the hour).
RSS_TOLERANCE = 0.10
# Peak memory (VmHWM) over the warm reference: a checkpoint save briefly holds about 2.5 times the
# memory file (measured +125 to +135 MiB for a 50 MB file at cache 1024, +11%).
PEAK_TOLERANCE = 0.25


def soak_benchmark():
    """benchmarks/soak.py (the results' writer and plot), with benchmarks/ on sys.path only while it loads."""
    benchmarks = str(REPO_ROOT / "benchmarks")
    spec = importlib.util.spec_from_file_location("soak_benchmark", REPO_ROOT / "benchmarks" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, benchmarks)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(benchmarks)
    return module


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    folder = tmp_path_factory.mktemp("soak")
    # conftest has put this run's ROS domain into os.environ; the node and this process meet there.
    out = soak.run_soak(DURATION, question_every=QUESTION_EVERY, sample_every=SAMPLE_EVERY,
                        partial=folder / "soak.partial.jsonl", domain_id=int(os.environ["ROS_DOMAIN_ID"]),
                        node_params=NODE_PARAMS, torch_threads=TORCH_THREADS, node_log=folder / "node.log")
    json_path, png = soak_benchmark().write_results(out, folder)
    assert json.loads(json_path.read_text()) == out
    assert png.stat().st_size > 0
    partial = [json.loads(line) for line in (folder / "soak.partial.jsonl").read_text().splitlines()]
    assert len(partial) == len(out)  # each record as it was taken, the summary last
    return out


def summary_of(records) -> dict:
    [summary] = [r for r in records if r["kind"] == "summary"]
    print(json.dumps(summary, indent=1))
    return summary


@pytest.mark.slow
def test_every_question_gets_a_response_within_the_timeout(records):
    summary = summary_of(records)
    questions = [r for r in records if r["kind"] == "question"]
    assert len(questions) >= int(DURATION // QUESTION_EVERY) - 1, questions
    limit = soak.QUERY_TIMEOUT + soak.RESPONSE_GRACE
    for q in questions:
        assert q["responded"], q
        assert q["latency_s"] <= limit, q
        assert q["success"] or q["message"].strip(), q
    assert summary["questions_answered"] >= 1, summary


@pytest.mark.slow
def test_frames_and_texts_go_in(records):
    summary = summary_of(records)
    assert summary["frames_ingested"] >= 1, summary
    assert summary["frames_ingested"] + summary["frames_dropped"] <= summary["frames_published"], summary
    assert summary["texts_published"] >= DURATION * 0.8 - 30, summary  # 1 Hz from subscription to the end
    assert summary["texts_ingested"] == summary["texts_published"], summary
    assert summary["inputs_rejected"] == 0, summary
    samples = [r for r in records if r["kind"] == "sample"]
    assert all(s["fill"] <= s["capacity"] for s in samples if s["capacity"]), "fill above capacity"


@pytest.mark.slow
def test_the_node_lives_and_exits_0_on_sigint(records):
    summary = summary_of(records)
    assert summary["node_alive_at_end"], summary
    assert summary["node_exit_code"] == 0 and not summary["node_killed"], summary
    assert summary["node_log_errors"] == 0, summary
    assert summary["memory_file_bytes_after_stop"], summary  # saved at shutdown, if not before


@pytest.mark.slow
def test_resident_memory_is_flat_after_warm_up(records):
    # The run phase only: inputs and questions going in at their rates.
    samples = [r for r in records if r["kind"] == "sample" and r["phase"] == "run" and r["rss_mb"] is not None]
    questions = [r for r in records if r["kind"] == "question"]
    first_answer = min((q["asked_at_s"] + q["latency_s"] for q in questions if q["success"]), default=None)
    assert first_answer is not None
    # Warm: the model answered, a frame went in, the cache is full (it has evicted) and a checkpoint was written:
    # until then the working set is still growing with what the memory holds and does.
    warm = [s for s in samples if s["model_ready"] and s["frames_ingested"] >= 1 and s["elapsed_s"] >= first_answer
            and (s["tokens_evicted"] or 0) > 0 and s["checkpoints_seen"] >= 1]
    assert len(warm) >= 15, f"too little of the run after warm-up: {len(warm)} samples"
    half = len(warm) // 2
    reference = soak.median([s["rss_mb"] for s in warm[:half]])
    end = soak.median([s["rss_mb"] for s in warm[half:]])
    peak = max(s["hwm_mb"] for s in warm)
    print(f"rss after warm-up {reference} MiB (first half, from {warm[0]['elapsed_s']} s), {end} MiB (second half) "
          f"({100 * (end - reference) / reference:+.1f}%), peak {peak} MiB; samples: "
          + " ".join(f"{s['elapsed_s']:.0f}:{s['rss_mb']:.0f}" for s in warm))
    assert abs(end - reference) <= RSS_TOLERANCE * reference, (reference, end)
    assert peak <= (1 + PEAK_TOLERANCE) * reference, (reference, peak)
