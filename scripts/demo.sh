#!/usr/bin/env bash
# The whole system on the sample bag, from a fresh checkout:
#   1. scripts/setup.sh (virtualenv, ROS 2 wheels, colcon build, embedded model; quick when done);
#   2. starts the installed inf_mllm_node on the embedded default model (inf_mllm_bringup/config/demo.yaml):
#      Qwen2.5-0.5B's language weights in a LLaVA-OneVision shape whose untrained vision part gives
#      every frame the same neutral tokens, so answers come from the narration, never from the frames;
#   3. replays the sample bag through DDS in lockstep, on bag time, asking its questions at
#      their bag times through ~/query, and prints the answers, the latest description and the
#      memory figures;
#   4. meanwhile runs inf_mllm_offline over the same bag, without ROS (report and plot), and at the
#      end compares its answers with the node's. The two share the cores: each gets half of them.
# Output goes to out/demo/ (replaced on every run).
#   --small   the small embedded model (SmolLM2-135M, SmolVLM-shaped): faster, weaker answers, and its
#             untrained vision part's frame tokens are noise
# Other arguments go to inf_mllm_replay.
set -euo pipefail

MODEL_ARGS=()
if [[ "${1:-}" == "--small" ]]; then
    shift
    MODEL_ARGS=(--model smolvlm-smollm2)
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
START=$SECONDS
say() { printf '\n[demo %3ds] %s\n' "$((SECONDS - START))" "$*"; }

say "setting up (scripts/setup.sh)"
bash scripts/setup.sh

set +u
# shellcheck source=scripts/env.sh
source scripts/env.sh
set -u

PREFIX="$ROOT/install/inf_mllm_ros"
BIN="$PREFIX/lib/inf_mllm_ros"
SHARE="$PREFIX/share/inf_mllm_ros"
BAG="$SHARE/sample_bags/warehouse_shift"
PARAMS="$ROOT/install/inf_mllm_bringup/share/inf_mllm_bringup/config/demo.yaml"
OUT="$ROOT/out/demo"
rm -rf "$OUT"
mkdir -p "$OUT"

NODE_PID=""
stop_node() {
    if [[ -n "$NODE_PID" ]] && kill -0 "$NODE_PID" 2>/dev/null; then
        kill -INT "$NODE_PID"
        for _ in $(seq 150); do
            kill -0 "$NODE_PID" 2>/dev/null || break
            sleep 0.2
        done
        if kill -0 "$NODE_PID" 2>/dev/null; then
            echo "[demo] the node did not stop within 30 s of SIGINT; killing it" >&2
            kill -KILL "$NODE_PID" 2>/dev/null || true
        fi
        local rc=0
        wait "$NODE_PID" || rc=$?
        NODE_PID=""
        return "$rc"
    fi
}
OFFLINE_PID=""
trap 'stop_node || true; [[ -z "$OFFLINE_PID" ]] || kill "$OFFLINE_PID" 2>/dev/null || true' EXIT

# The node and the offline runner run side by side, each on half the cores: on a small CPU two
# single-threaded runs get through more work than one after the other with two threads each. The
# same thread count on both sides also keeps their float sums, and so their greedy answers, the same.
THREADS=$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))
export OMP_NUM_THREADS="$THREADS"

say "starting inf_mllm_offline over the same bag, without ROS, beside the node (output $OUT/offline.out)"
"$BIN/inf_mllm_offline" "$BAG" --params "$PARAMS" ${MODEL_ARGS[@]+"${MODEL_ARGS[@]}"} --no-progress \
    --questions "$BAG/questions.yaml" --out "$OUT/offline" >"$OUT/offline.out" 2>&1 &
OFFLINE_PID=$!

say "starting inf_mllm_node (ROS_DOMAIN_ID=$ROS_DOMAIN_ID, parameters $PARAMS, log $OUT/node.log)"
NODE_ARGS=(--ros-args --params-file "$PARAMS")
((${#MODEL_ARGS[@]})) && NODE_ARGS+=(-p "model:=${MODEL_ARGS[1]}")
"$BIN/inf_mllm_node" "${NODE_ARGS[@]}" >"$OUT/node.log" 2>&1 &
NODE_PID=$!

say "replaying $BAG in lockstep and asking its questions through /inf_mllm/query"
"$BIN/inf_mllm_replay" "$BAG" --lockstep --questions "$BAG/questions.yaml" \
    --answers-out "$OUT/node_answers.json" "$@"

say "stopping the node"
node_rc=0
stop_node || node_rc=$?
grep -E "model ready|WARN|ERROR" "$OUT/node.log" | head -5 || true
if ((node_rc == 0)); then
    echo "node stopped cleanly"
else
    # Reported at the end too; the offline part does not need the node.
    echo "[demo] warning: the node exited with status $node_rc (log: $OUT/node.log)" >&2
fi

say "waiting for inf_mllm_offline"
offline_rc=0
wait "$OFFLINE_PID" || offline_rc=$?
OFFLINE_PID=""
grep -v -E "^Loading weights|^\s*$" "$OUT/offline.out" || true
if ((offline_rc != 0)); then
    echo "[demo] error: inf_mllm_offline failed with status $offline_rc (output: $OUT/offline.out)" >&2
    exit 1
fi

python - "$OUT/node_answers.json" "$OUT/offline/log.jsonl" <<'EOF'
import json, sys
from inf_mllm_ros.bags.stream_inputs import tally
node = json.load(open(sys.argv[1]))
records = [json.loads(line) for line in open(sys.argv[2])]
offline = [r for r in records if r["type"] == "answer"]
same = sum(a["answer"] == b["answer"] for a, b in zip(node, offline))
print(f"\nanswers: {tally([(a['correct'], a.get('needs_vision', False)) for a in offline])}")
notice = next((r["model"].get("notice") for r in records if r["type"] == "settings"), None)
if notice:
    print(f"note: {notice}")
print(f"node and offline runner: {same} of {len(offline)} answers are the same (greedy decoding, same prompts)")
last = [r for r in map(json.loads, open(sys.argv[2])) if "fill" in r][-1]
print(f"memory: the cache holds {last['fill']} of the {last['tokens_seen']} tokens seen ({last['tokens_evicted']} "
      f"evicted); keys and values {last['kv_bytes'] / 2**20:.1f} MiB, allocated once; "
      f"process {last['rss_bytes'] / 2**20:.0f} MiB")
EOF

say "done in $((SECONDS - START)) s"
echo "report: $OUT/offline/report.md"
echo "plot:   $OUT/offline/plot.png"
if [[ -f "$OUT/offline/map.png" ]]; then echo "map:    $OUT/offline/map.png (the route and where each answer rests)"; fi
echo "log:    $OUT/offline/log.jsonl, node answers $OUT/node_answers.json, node log $OUT/node.log"
if ((node_rc != 0)); then
    echo "[demo] error: the node did not shut down cleanly (status $node_rc, log $OUT/node.log)" >&2
    exit 1
fi
