#!/usr/bin/env bash
# The GPU measurement, as one command for a machine with a CUDA GPU and a Python that has PyTorch and
# transformers (no ROS, no weights needed): the CUDA tests of the decode step and the archive, then
# benchmarks/gpu_speed.py on random weights of real shapes (at most 9 minutes in all; the results are written after
# each shape, so a run cut short keeps what it measured). Results go to $OUT when it is set,
# else to benchmarks/results/.
#   bash scripts/gpu_check.sh [python]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${1:-python3}"
export PYTHONPATH="$PWD/inf_mllm_ros${PYTHONPATH:+:$PYTHONPATH}"
export INF_MLLM_CACHE_DIR="${TMPDIR:-/tmp}/inf_mllm_gpu_check"
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
nvidia-smi -L || true
"$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
timeout 200 "$PY" -m pytest inf_mllm_ros/test/test_cuda.py -q -k "compiled or archive" -p no:cacheprovider \
    2>&1 | tail -15 | tee "$out/gpu_check_tests.txt"
timeout 330 "$PY" benchmarks/gpu_speed.py --device cuda --out "$out/gpu_speed_cuda.json" 2>&1 \
    | grep -v -i warn | tail -60
