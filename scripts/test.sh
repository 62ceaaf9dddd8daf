#!/usr/bin/env bash
# Builds the workspace (scripts/setup.sh) and runs the tests against the installed packages.
#   scripts/test.sh           the suite, less the tests marked slow
#   scripts/test.sh --slow    the tests marked slow only: recall on the 0.5B evaluation model over long
#                             streams, the soak of the node, the default model among frames
#   scripts/test.sh --all     both (what CI runs)
# Extra arguments go to pytest, e.g. scripts/test.sh -k interfaces -x
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

selection="not slow"
case "${1:-}" in
    --slow) selection="slow"; shift ;;
    --all) selection=""; shift ;;
esac
# The tests run in two passes: most on two workers side by side (pytest-xdist), a file to a worker, as the
# tests of a file share its node or model and keep their order; then those marked serial, which measure time,
# memory or load, alone. One torch thread a process in the first pass: two processes with a thread a core keep
# both cores busy, where more threads than cores would spin against each other.
WORKERS="${INF_MLLM_TEST_WORKERS:-2}"
side_by_side="not serial"
alone="serial"
if [[ -n "$selection" ]]; then
    side_by_side="($selection) and not serial"
    alone="($selection) and serial"
fi

bash scripts/setup.sh

set +u
# shellcheck source=scripts/env.sh
source scripts/env.sh
set -u

echo "[test] ROS_DOMAIN_ID=$ROS_DOMAIN_ID RMW_IMPLEMENTATION=$RMW_IMPLEMENTATION"
# -P: the current directory is not put on sys.path, so the source folders in it cannot
# stand in for the packages colcon installed.
python -P -c 'import inf_mllm_ros; print("[test] inf_mllm_ros from", inf_mllm_ros.__file__)'

# The whole test folder unless a test file or test is named.
targets=(inf_mllm_ros/test)
for arg in "$@"; do
    if [[ -e "$arg" || "$arg" == *::* ]]; then targets=(); fi
done

side=0
OMP_NUM_THREADS=1 python -P -m pytest "${targets[@]}" -q --durations=15 -n "$WORKERS" --dist loadfile \
    -m "$side_by_side" "$@" || side=$?
# The serial pass collects only the files that hold serial tests: collecting every file again costs seconds.
serial_targets=("${targets[@]}")
if ((${#targets[@]})); then
    mapfile -t serial_targets < <(grep -l "pytest.mark.serial" inf_mllm_ros/test/test_*.py)
fi
serial=0
python -P -m pytest "${serial_targets[@]}" -q --durations=15 -m "$alone" "$@" || serial=$?
# pytest's code 5: a pass collected no test (a selection may leave one pass empty, not both).
if ((side == 5 && serial == 5)); then
    echo "[test] error: pytest collected no tests" >&2
    exit 1
fi
for rc in "$side" "$serial"; do
    if ((rc != 0 && rc != 5)); then exit "$rc"; fi
done
