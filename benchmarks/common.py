"""Shared pieces of the text benchmarks: the text, the runs, the result files.

The benchmarks import the installed package (`bash scripts/setup.sh`, then `source scripts/env.sh`).
"""

from __future__ import annotations

import json
import os
import platform
import re
import resource
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_TEXT = ROOT.parent / "shared" / "data" / "texts" / "jack_sheppard_pg16215.txt"


def policy_names() -> list[str]:
    """Every registered eviction policy, the full cache (the ceiling) first."""
    from inf_mllm_ros.engine.policies import POLICIES

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


def machine() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def write_records(name: str, records: list[dict]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(records, indent=1) + "\n")
    return path


def load_records(name: str) -> list[dict]:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else []
