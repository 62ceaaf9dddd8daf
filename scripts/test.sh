#!/usr/bin/env bash
# Builds the workspace (scripts/setup.sh) and runs the tests against the installed packages.
#   scripts/test.sh           the suite, less the tests marked slow (about 11 minutes on 2 CPU cores)
#   scripts/test.sh --slow    the tests marked slow only: recall on the 0.5B evaluation model over long
#                             streams, the soak of the node, the default model among frames
#   scripts/test.sh --all     both (what CI runs)
# Extra arguments go to pytest, e.g. scripts/test.sh -k interfaces -x
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

marks=(-m "not slow")
case "${1:-}" in
    --slow) marks=(-m slow); shift ;;
    --all) marks=(); shift ;;
esac

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

rc=0
python -P -m pytest "${targets[@]}" -q --durations=15 "${marks[@]}" "$@" || rc=$?
if ((rc == 5)); then
    echo "[test] error: pytest collected no tests" >&2
    exit 1
fi
exit "$rc"
