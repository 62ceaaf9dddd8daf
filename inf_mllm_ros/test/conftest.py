"""Fixtures shared by the tests: repository root, and an isolated ROS environment."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
# A Project Gutenberg novel kept beside the repository for the evaluation of eviction on real text.
SHARED_TEXT = REPO_ROOT.parent / "shared" / "data" / "texts" / "jack_sheppard_pg16215.txt"

# One ROS domain per pytest run, set before any test starts rclpy, so nodes made in this
# process and in its child processes meet each other and nothing else on the machine.
# Derived from the pid so that two runs at the same time differ (1..100 are safe ports); each
# pytest-xdist worker is a run of its own, numbered after its controller's pid, so that the
# workers of one run differ from each other.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1"... under xdist
RUN_DOMAIN_ID = str((os.getppid() * 8 + int(_WORKER[2:])) % 100 + 1 if _WORKER else os.getpid() % 100 + 1)
os.environ["ROS_DOMAIN_ID"] = RUN_DOMAIN_ID
os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
# Files the package keeps between runs (a model's retrieval heads) go to a folder of this run's, shared by
# its child processes: the one scripts/test.sh makes for all its passes and workers (INF_MLLM_TEST_CACHE_DIR,
# so that each model's heads are found once a suite, as a robot finds them once), else one of this process's,
# removed at its end.
if os.environ.get("INF_MLLM_TEST_CACHE_DIR"):
    os.environ["INF_MLLM_CACHE_DIR"] = os.environ["INF_MLLM_TEST_CACHE_DIR"]
else:
    os.environ["INF_MLLM_CACHE_DIR"] = tempfile.mkdtemp(prefix="inf_mllm_test_cache_")
    atexit.register(shutil.rmtree, os.environ["INF_MLLM_CACHE_DIR"], ignore_errors=True)

# A short passage for the engine's equivalence checks (about 250 tokens).
LIGHTHOUSE = (
    "The lighthouse keeper climbed the stairs every evening at dusk. He trimmed the wick, polished the lens "
    "and wrote the weather in his log. Ships passed far out at sea, and their lights answered his. "
) * 6


# The test files that take longest, longest first (the fast pass's time per file, measured on the 2-core machine):
# scripts/test.sh hands files to its two workers in this order (--no-loadscope-reorder), so that the long ones start
# first and the workers end together, rather than one waiting alone on a long file handed out last.
LONGEST_FIRST = ("test_node.py", "test_where_when.py", "test_engine.py", "test_replay_offline.py", "test_method.py",
                 "test_memory_file.py", "test_ingest_step.py", "test_streams.py", "test_node_cameras.py",
                 "test_decode_step.py", "test_node_tf.py", "test_gpu_speed_benchmark.py", "test_node_where_when.py",
                 "test_naming.py", "test_hub.py", "test_offline_tf.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than a few seconds (real model, long streams)")
    config.addinivalue_line("markers", "serial: measures time or load, so runs alone: after the tests that run side "
                                       "by side (scripts/test.sh)")


def load_prepared(model: str, device: str = "cpu", dtype: str = "float32"):
    """An embedded model (float32 on the CPU unless told), or the test skipped where the model cannot be had
    here (not prepared, not downloadable, no GPU). A model that is there and fails to load fails the test."""
    from inf_mllm_ros.engine.models.loading import ModelUnavailableError, load_model

    try:
        return load_model(model, device=device, dtype=dtype)
    except ModelUnavailableError as exc:
        pytest.skip(f"{model} is not available here: {exc}")


@pytest.fixture
def repo_root() -> Path:
    """The repository root (holds inf_mllm_interfaces/ and inf_mllm_ros/)."""
    return REPO_ROOT


@pytest.fixture
def ros_env() -> dict:
    """Environment for child processes: this one, on localhost, in this run's domain."""
    env = dict(os.environ)
    env["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    env["ROS_DOMAIN_ID"] = RUN_DOMAIN_ID
    return env


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models: thread start-up costs more than it saves, and on a busy machine far more."""
    import warnings

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*torchvision.*")
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def host_reads_after_attention(monkeypatch) -> list[str]:
    """The tensor values read on the host (a bool, an int, .item(), .tolist()...) while a layer scores, evicts
    and re-packs after attending, as they happen. On a GPU each read makes the host wait for the device, once
    per layer per prompt: that path must ask the device nothing."""
    import torch

    from inf_mllm_ros.engine.memory.cache import BoundedKVCache

    reads, inside = [], [False]
    after_attention = BoundedKVCache.after_attention

    def watched(self, *args, **kwargs):
        inside[0] = True
        try:
            return after_attention(self, *args, **kwargs)
        finally:
            inside[0] = False

    def spy(name):
        real = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if inside[0]:
                reads.append(name)
            return real(self, *args, **kwargs)
        return read

    monkeypatch.setattr(BoundedKVCache, "after_attention", watched)
    for name in ("__bool__", "__int__", "__float__", "__index__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, spy(name))
    return reads
