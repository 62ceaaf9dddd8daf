"""Every benchmark runs to the end on the small embedded models (`benchmarks/run.py --smoke`), so that none rots
between the runs whose figures the docs report. The soak's, the flood's and the GPU benchmark's smoke runs are their
own tests (test_soak.py, test_node_flood.py, test_gpu_speed_benchmark.py), which also check what they measure."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

OWN_TESTS = {"soak", "gpu_speed", "node_flood"}


def benchmark_names() -> list[str]:
    spec = importlib.util.spec_from_file_location("benchmark_runner", REPO_ROOT / "benchmarks" / "run.py")
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    return list(runner.BENCHMARKS)


def test_every_benchmark_module_is_listed_by_the_runner():
    modules = {p.stem for p in (REPO_ROOT / "benchmarks").glob("*.py")} - {"run", "common"}
    assert modules == set(benchmark_names())


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in benchmark_names() if n not in OWN_TESTS])
def test_the_benchmark_runs_to_the_end_and_writes_its_results(name):
    done = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "run.py"), "--smoke", name],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"[smoke] {name}: ok" in done.stdout, done.stdout[-3000:]
