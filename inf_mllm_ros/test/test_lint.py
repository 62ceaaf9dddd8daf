"""The code keeps to the lint rules in ruff.toml (pycodestyle, pyflakes, a docstring for every module and class
of the package), as ROS packages check theirs with ament's linters."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO_ROOT


def test_ruff_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
