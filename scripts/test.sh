#!/usr/bin/env bash
# Builds the workspace (scripts/setup.sh) and runs the tests against the installed packages.
#   scripts/test.sh           the suite, less the tests marked slow or serial
#   scripts/test.sh --slow    the tests marked slow or serial only: recall on the 0.5B evaluation model over long
#                             streams, the soak of the node, the default model among frames, and the tests that
#                             measure time, memory or load (alone, after the others)
#   scripts/test.sh --all     both (what CI runs)
# Extra arguments go to pytest, e.g. scripts/test.sh -k interfaces -x
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

fast=1
slow=0
case "${1:-}" in
    --slow) fast=0; slow=1; shift ;;
    --all) slow=1; shift ;;
esac
# Up to four passes. The tests not marked slow run on two workers side by side (pytest-xdist), a file to a worker,
# as the tests of a file share its node or model and keep their order, with one torch thread a process: most of
# them wait on processes and DDS, and two processes with a thread a core keep both cores busy where more threads
# than cores would spin against each other. Files go to the workers longest first (conftest.py, LONGEST_FIRST).
# The benchmarks' smoke runs go two side by side; the other slow tests (long runs of the models, bound by the cores)
# run in one process with every thread: side by side they took no less time, and the last long file left one idle.
# Then the tests marked serial, which measure time, memory or load, run alone: with the slow ones (--slow, --all),
# as they wait on floods and bursts for minutes, which the quick suite leaves out.
WORKERS="${INF_MLLM_TEST_WORKERS:-2}"

bash scripts/setup.sh

set +u
# shellcheck source=scripts/env.sh
source scripts/env.sh
set -u

echo "[test] ROS_DOMAIN_ID=$ROS_DOMAIN_ID RMW_IMPLEMENTATION=$RMW_IMPLEMENTATION"
# -P: the current directory is not put on sys.path, so the source folders in it cannot
# stand in for the packages colcon installed.
python -P -c 'import inf_mllm_ros; print("[test] inf_mllm_ros from", inf_mllm_ros.__file__)'

# One folder for what the package keeps between runs (a model's retrieval heads), shared by every pass, worker and
# node process of this run (conftest.py), removed at its end: each model's heads are found once a suite.
INF_MLLM_TEST_CACHE_DIR="$(mktemp -d "${TMPDIR:-/tmp}/inf_mllm_test_cache_XXXXXX")"
export INF_MLLM_TEST_CACHE_DIR
trap 'rm -rf "$INF_MLLM_TEST_CACHE_DIR"' EXIT

# The whole test folder unless a test file or test is named.
targets=(inf_mllm_ros/test)
for arg in "$@"; do
    if [[ -e "$arg" || "$arg" == *::* ]]; then targets=(); fi
done

# Files holding tests with a mark: a pass collects only those (collecting every file again costs seconds).
files_with() { if ((${#targets[@]})); then grep -l "pytest.mark.$1" inf_mllm_ros/test/test_*.py; fi; }

# pytest's code 5: a pass collected no test (a selection may leave a pass empty, not all of them).
codes=()
if ((fast)); then
    rc=0
    OMP_NUM_THREADS=1 python -P -m pytest "${targets[@]}" -q --durations=15 -n "$WORKERS" --dist loadfile \
        --no-loadscope-reorder -m "not slow and not serial" "$@" || rc=$?
    codes+=("$rc")
fi
SMOKES=inf_mllm_ros/test/test_benchmarks_smoke.py
if ((slow)); then
    if ((${#targets[@]})); then
        # The benchmarks' smoke runs are a process each, mostly starting and loading a model on one core: two side
        # by side, a thread each (on this 2-core machine, under the same other load, seven took 515 s against
        # 1,066 s one after the other).
        rc=0
        OMP_NUM_THREADS=1 python -P -m pytest "$SMOKES" -q --durations=15 -n "$WORKERS" --dist load \
            -m "slow and not serial" "$@" || rc=$?
        codes+=("$rc")
    fi
    mapfile -t slow_targets < <(files_with slow | grep -vx "$SMOKES")
    rc=0
    python -P -m pytest "${slow_targets[@]}" -q --durations=15 -m "slow and not serial" "$@" || rc=$?
    codes+=("$rc")
fi
if ((slow)); then
    mapfile -t serial_targets < <(files_with serial)
    rc=0
    python -P -m pytest "${serial_targets[@]}" -q --durations=15 -m serial "$@" || rc=$?
    codes+=("$rc")
fi
collected=0
for rc in "${codes[@]}"; do
    if ((rc != 0 && rc != 5)); then exit "$rc"; fi
    if ((rc == 0)); then collected=1; fi
done
if ((collected == 0)); then
    echo "[test] error: pytest collected no tests" >&2
    exit 1
fi
