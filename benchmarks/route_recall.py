"""Which sighting a question in other words points to, for each weight of the sentence encoder's share of retrieval's
ranking: the route bags' narration (bags/route_scenario.py) pushed into one stream in-process, stamped at its times
on the wall clock, and every question but never-seen asked as a recall (no answer decoded). A question counts where
the recall's first moment is the asked sighting (its stamp within 2 s), and where it is any sighting of the asked
thing. Tuning data only (the route seeds through the node, `where_when.py`, are the report).

    python benchmarks/run.py route_recall --seeds 0,1,2,200007 --weights 0,5,8,12
"""

from __future__ import annotations

import argparse
import json
import time

from common import RESULTS, shown, wilson

SMOKE = ["--model", "smollm2", "--seeds", "0", "--duration", "60", "--weights", "0,8", "--out", "route_recall_smoke.json"]
STAMP_S = 2.0


def run_seed(adapter, seed: int, duration: float, cache: int, weights: list[float]) -> list[dict]:
    import torch

    from inf_mllm_ros.bags.route_scenario import build_route
    from inf_mllm_ros.engine.archive import retriever
    from inf_mllm_ros.engine.runtime.stream import KVStream
    from inf_mllm_ros.settings import DEFAULTS, stream_config

    scenario = build_route(seed, duration)
    stream = KVStream(adapter, stream_config(dict(DEFAULTS) | {"cache_size": cache, "clock": "wall"}))
    stream.time_origin = 8 * 3600.0
    shipped = retriever.SEMANTIC_WEIGHT
    records = []
    try:
        with torch.inference_mode():
            for line in scenario.narration:
                stream.push_text(line.text, line.time_s)
            for q in scenario.questions:
                if q.kind == "never_seen":
                    continue
                seen = [s.time_s for s in scenario.sightings_of(q.thing)]
                record = {"seed": seed, "kind": q.kind, "question": q.question, "thing": q.thing,
                          "sightings": len(seen), "weights": {}}
                for weight in weights:
                    retriever.SEMANTIC_WEIGHT = weight
                    top = stream.recall(q.question, limit=1)
                    stamp = top[0].stamp if top else None
                    record["weights"][str(weight)] = {
                        "asked": stamp is not None and abs(stamp - q.expected["time_s"]) <= STAMP_S,
                        "thing": stamp is not None and min(abs(stamp - t) for t in seen) <= STAMP_S,
                        "top": top[0].text if top else ""}
                records.append(record)
    finally:
        retriever.SEMANTIC_WEIGHT = shipped
    return records


def summary(records: list[dict], weights: list[str]) -> dict:
    out = {}
    for weight in weights:
        cells = {}
        for name in ("asked", "thing"):
            hits = sum(r["weights"][weight][name] for r in records)
            low, high = wilson(hits, len(records))
            cells[name] = {"hits": hits, "n": len(records), "rate": round(hits / max(len(records), 1), 3),
                           "interval": [round(low, 3), round(high, 3)]}
        out[weight] = cells
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2,200007")
    p.add_argument("--weights", default="0,5,8,12", help="SEMANTIC_WEIGHT values, separated by commas")
    p.add_argument("--duration", type=float, default=300.0)
    p.add_argument("--cache", type=int, default=512)
    p.add_argument("--model", default="onevision-qwen2.5-0.5b")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="route_recall.json")
    args = p.parse_args(argv)
    import torch

    from inf_mllm_ros.engine.models.loading import load_model

    torch.set_num_threads(args.threads)
    weights = [float(w) for w in args.weights.split(",")]
    adapter = load_model(args.model, device="cpu", dtype=args.dtype)
    records, started = [], time.monotonic()
    for seed in (int(s) for s in args.seeds.split(",")):
        records += run_seed(adapter, seed, args.duration, args.cache, weights)
        print(f"seed {seed}: {len(records)} questions so far, {time.monotonic() - started:.0f} s", flush=True)
    result = {"settings": vars(args), "records": records, "summary": summary(records, [str(w) for w in weights])}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / args.out
    path.write_text(json.dumps(result, indent=1) + "\n")
    for weight, cells in result["summary"].items():
        print(f"weight {weight}: asked sighting {cells['asked']['hits']}/{cells['asked']['n']} "
              f"{cells['asked']['interval']}, the thing {cells['thing']['hits']}/{cells['thing']['n']}")
    print(f"wrote {shown(path)}")


if __name__ == "__main__":
    main()
