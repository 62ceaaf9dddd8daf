# shellcheck shell=bash
# Source me (bash): `source scripts/env.sh` after scripts/setup.sh.
# Activates .venv (ROS 2 from PyPI wheels) and the colcon workspace in install/,
# and keeps ROS traffic on this machine in a domain of its own.

_inf_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ ! -x "$_inf_root/.venv/bin/python" || ! -f "$_inf_root/install/setup.bash" ]]; then
    echo "scripts/env.sh: run scripts/setup.sh first" >&2
    unset _inf_root
    # shellcheck disable=SC2317  # exit only when run instead of sourced
    return 1 2>/dev/null || exit 1
fi

# colcon's and venv's scripts read unset variables; relax -u while sourcing them.
_inf_had_u=0
[[ $- == *u* ]] && _inf_had_u=1
set +u

# shellcheck disable=SC1091
source "$_inf_root/.venv/bin/activate"
# The wheels make the virtualenv a ROS prefix; the workspace is layered on top of it.
export AMENT_PREFIX_PATH="$_inf_root/.venv${AMENT_PREFIX_PATH:+:$AMENT_PREFIX_PATH}"
export CMAKE_PREFIX_PATH="$_inf_root/.venv${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
# shellcheck disable=SC1091
source "$_inf_root/install/setup.bash"

((_inf_had_u)) && set -u
unset _inf_had_u

export RMW_IMPLEMENTATION=rmw_fastrtps_cpp
export ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST
# A domain per shell, so parallel runs and leftover nodes do not see each other.
if [[ -z "${ROS_DOMAIN_ID:-}" ]]; then
    export ROS_DOMAIN_ID=$((RANDOM % 100 + 1))
fi
# Python started from .venv re-executes itself once through the wheels' .pth hook
# (ros_wheels_bootstrapper) to set LD_LIBRARY_PATH; it keeps the entries set here.
# Raw camera frames above about 600 KB between processes: Fast DDS with large shared-memory segments
# (config/fastdds_large_frames.xml; see docs/deployment.md, "Large frames"), unless a profile is chosen already.
if [[ -z "${FASTDDS_DEFAULT_PROFILES_FILE:-}" && -z "${FASTDDS_BUILTIN_TRANSPORTS:-}" ]]; then
    export FASTDDS_DEFAULT_PROFILES_FILE="$_inf_root/install/inf_mllm_ros/share/inf_mllm_ros/config/fastdds_large_frames.xml"
fi
export INF_MLLM_ROS_ROOT="$_inf_root"
unset _inf_root
