#!/usr/bin/env bash
# Builds the workspace (scripts/setup.sh) and runs the tests against the installed packages.
# Extra arguments go to pytest, e.g. scripts/test.sh -k interfaces -x
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/setup.sh

set +u
# shellcheck source=scripts/env.sh
source scripts/env.sh
set -u

echo "[test] ROS_DOMAIN_ID=$ROS_DOMAIN_ID RMW_IMPLEMENTATION=$RMW_IMPLEMENTATION"
# -P: the current directory is not put on sys.path, so the source folders in it cannot
# stand in for the packages colcon installed.
python -P -c 'import inf_mllm_ros; print("[test] inf_mllm_ros from", inf_mllm_ros.__file__)'

rc=0
python -P -m pytest inf_mllm_ros/test -q "$@" || rc=$?
if ((rc == 5)); then
    echo "[test] error: pytest collected no tests" >&2
    exit 1
fi
exit "$rc"
