"""Shared pieces of the text benchmarks: the text, the runs, the result files.

The benchmarks import the installed package (`bash scripts/setup.sh`, then `source scripts/env.sh`).
"""

from __future__ import annotations

import json
import os
import platform
import random
import re
import resource
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Where results are written and read: benchmarks/results, or BENCHMARK_RESULTS (a smoke run writes to a scratch folder,
# never over the recorded results).
RESULTS = Path(os.environ.get("BENCHMARK_RESULTS") or ROOT / "benchmarks" / "results")
DEFAULT_TEXT = ROOT.parent / "shared" / "data" / "texts" / "jack_sheppard_pg16215.txt"


def policy_names() -> list[str]:
    """Every registered eviction policy, the full cache (the ceiling) first."""
    from inf_mllm_ros.engine.memory.policies import POLICIES

    return ["full"] + sorted(name for name in POLICIES if name != "full")


def gutenberg_body(text: str) -> str:
    """The book without Project Gutenberg's header and footer."""
    start = re.search(r"\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG[^\n]*\n", text)
    end = re.search(r"\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG", text)
    return text[start.end() if start else 0 : end.start() if end else len(text)].strip()


def read_text(path: str | os.PathLike | None) -> str:
    path = Path(path) if path else DEFAULT_TEXT
    if not path.exists():
        raise SystemExit(f"text file {path} not found (pass --text)")
    return gutenberg_body(path.read_text(encoding="utf-8", errors="replace"))


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def synchronize() -> None:
    """Wait for the GPU's queued work, so that a wall-clock timer measures it (a no-op on CPU)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_gpu_bytes() -> int | None:
    """Peak GPU memory allocated by this process so far, or None on CPU."""
    import torch

    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


def machine() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def shown(path: Path) -> Path:
    """A written file's path as printed: from the checkout where it is inside it (a smoke run's scratch folder is not)."""
    return path.relative_to(ROOT) if ROOT in path.parents else path


def write_records(name: str, records: list[dict]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(records, indent=1) + "\n")
    return path


def load_records(name: str) -> list[dict]:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else []


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson score interval of a rate of `hits` in `n` trials (sound near 0 and 1, unlike the normal
    approximation)."""
    if n == 0:
        return 0.0, 1.0
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def trial_interval(per_trial: list[tuple[int, int]], resamples: int = 4000, seed: int = 0) -> tuple[float, float]:
    """The 95 % interval of a rate whose questions come in trials, (hits, questions) per trial, resampling trials
    rather than questions (a percentile bootstrap). Twelve facts asked of one stream are not twelve independent
    draws: a sibling confused once is confused at every distance. Where misses cluster in trials this interval is
    wider than Wilson's over the questions; where they do not, it is as narrow as Wilson's or narrower."""
    rng = random.Random(seed)
    rates = []
    for _ in range(resamples):
        drawn = [per_trial[rng.randrange(len(per_trial))] for _ in per_trial]
        rates.append(sum(h for h, _ in drawn) / sum(n for _, n in drawn))
    rates.sort()
    return rates[int(0.025 * resamples)], rates[int(0.975 * resamples) - 1]


def add_matrix_options(parser, *, out: str, setting: str) -> None:
    """The options every matrix benchmark shares: its result file, resuming, plotting only, threads and
    seed, and the hidden ones by which it runs one of its streams in a child process."""
    import argparse

    parser.add_argument("--threads", type=int, default=2, help="torch threads per run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=out)
    parser.add_argument("--resume", action="store_true", help="keep the records already in --out, run the rest")
    parser.add_argument("--plot-only", action="store_true")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--policy", default="inf_mllm", help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=int, default=512, help=argparse.SUPPRESS)
    parser.add_argument("--setting", default=setting, help=argparse.SUPPRESS)


def run_child(cmd: list[str], records: list[dict], out: str) -> list[dict]:
    """Run one stream of a matrix benchmark in its own process (`--one`: its peak memory is its own), add
    the records it prints to `records` and write them all to `out`, so that an interrupted benchmark
    resumes after the last finished stream. Returns the new records."""
    printed = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    new = json.loads(printed.strip().splitlines()[-1])
    records += new
    write_records(out, records)
    return new


def matrix(settings: list[str], caches: list[int], policies: list[str]):
    """(setting, cache, policy) for every stream of a matrix benchmark; the full cache, which has no size,
    once per setting."""
    for setting in settings:
        for cache in caches:
            for policy in policies:
                if policy != "full" or cache == caches[0]:
                    yield setting, cache, policy


def tile_archive(stream, tokens: int) -> None:
    """Write the stream's archived blocks again, as newer blocks, until the archive holds `tokens` (scoring costs
    the same whatever the blocks hold): an archive of any size without streaming that many tokens."""
    archive, seq = stream.archive, stream.tokens_seen
    copies = list(archive.blocks)
    while copies:
        for block in copies:
            if archive.tokens + block.length > tokens:
                return
            seq += archive.append_copy(block, seq).length
