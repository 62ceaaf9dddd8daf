"""The demo's answers as a record: the offline runner over the shipped sample bag with the demo's parameters
(inf_mllm_bringup/config/demo.yaml: the embedded default, cache 512, the patrol robot's /odom as the pose topic),
its questions at their bag times. The same answers the demo prints (scripts/demo.sh), kept with each answer's
right or wrong, the answer from the cache alone where the archive was used, and the heaviest evidence with its
stamp, pose and its distance in time from the moment the question is about.

    python benchmarks/run.py demo_bag                 # results/demo_bag.json
    python benchmarks/run.py demo_bag --model smolvlm-smollm2 --out demo_bag_small.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common import ROOT, machine, write_records

BAG = ROOT / "inf_mllm_ros" / "sample_bags" / "warehouse_shift"
PARAMS = ROOT / "inf_mllm_bringup" / "config" / "demo.yaml"
OUT = "demo_bag.json"

# The options of a short run on the small models (run.py --smoke).
SMOKE = ["--model", "smollm2", "--out", "demo_bag.json"]  # text only: the frames are skipped, counted


def main(argv: list[str] | None = None) -> None:
    from inf_mllm_ros.bags.offline import read_params_file, run_offline
    from inf_mllm_ros.bags.stream_inputs import load_questions
    from inf_mllm_ros.engine.value_rules import as_declared
    from inf_mllm_ros.settings import BY_NAME, DEFAULTS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="instead of the parameters file's")
    p.add_argument("--out", default=OUT)
    args = p.parse_args(argv)
    given = {k: v for k, v in read_params_file(PARAMS).items() if k in BY_NAME}
    settings = dict(DEFAULTS) | {k: as_declared(v, BY_NAME[k].type) for k, v in given.items()}
    if args.model:
        settings["model"] = args.model
    started = time.monotonic()
    result = run_offline(BAG, load_questions(BAG / "questions.yaml"), settings)
    keep = ("time_s", "question", "expected", "kind", "needs_vision", "answer", "correct", "retrieved_tokens",
            "answer_without_archive", "correct_without_archive", "evidence_time_error_s", "evidence_distance_m",
            "seconds")
    records = [{k: a.get(k) for k in keep} | {"heaviest_evidence": (a.get("evidence") or [None])[0]}
               for a in result.answers]
    text = [r for r in records if r["correct"] is not None and not r["needs_vision"]]
    summary = {"kind": "summary", "model": settings["model"], "cache_size": settings["cache_size"],
               "narration_questions_right": sum(r["correct"] for r in text), "narration_questions": len(text),
               "vision_questions_right": sum(bool(r["correct"]) for r in records if r["needs_vision"]),
               "poses": result.counts.get("poses", 0), "seconds": round(time.monotonic() - started, 1),
               "machine": machine(), "bag": str(Path(BAG).relative_to(ROOT))}
    path = write_records(args.out, records + [summary])
    for r in records:
        print(f"[{r['time_s']:5.1f} s] {r['question']}  ->  {r['answer']}  ({'right' if r['correct'] else 'wrong'})")
    print(json.dumps(summary), f"\n{path}")


if __name__ == "__main__":
    main()
