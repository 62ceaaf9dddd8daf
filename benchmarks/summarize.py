"""Markdown tables of the recorded results, for docs/benchmarks.md.

    python benchmarks/summarize.py
"""

from __future__ import annotations

from collections import defaultdict

from common import load_records
from inf_mllm_ros.engine.memory.policies import policy_defaults

SHIPPED_BIAS = policy_defaults("inf_mllm")["attention_bias"]


def perplexity_table() -> str:
    records = load_records("long_text_ppl.json")
    runs = defaultdict(list)
    for r in records:
        runs[(r["policy"], str(r["cache_size"]), r["position_mode"], r.get("attention_bias"))].append(r)
    lines = ["| policy | cache | positions | tokens | first 4K bin | last bin | mean over bins | ms/token | KV bytes constant |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (policy, cache, mode, bias), rs in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        name = policy if policy != "inf_mllm" or bias in (None, SHIPPED_BIAS) else f"inf_mllm (bias {bias:g})"
        ppl = [r["ppl"] for r in rs]
        lines.append(f"| {name} | {cache} | {mode} | {rs[-1]['tokens']} | {ppl[0]:.1f} | {ppl[-1]:.1f} | "
                     f"{sum(ppl) / len(ppl):.1f} | {rs[-1]['ms_per_token']:.1f} | {rs[0]['kv_bytes_constant']} |")
    return "\n".join(lines)


def recall_table() -> str:
    records = load_records("recall.json")
    runs = defaultdict(list)
    for r in records:
        runs[(r["setting"], str(r["cache_size"]), r["policy"])].append(r)
    distances = sorted({r["distance"] for r in records})
    head = "| setting | cache | policy | " + " | ".join(f"{d // 1024}K" for d in distances) + " | all |"
    lines = [head, "|" + "---|" * (4 + len(distances))]
    for (setting, cache, policy), rs in sorted(runs.items()):
        cells = []
        for d in distances:
            hits = [r["recalled"] for r in rs if r["distance"] == d]
            cells.append(f"{sum(hits)}/{len(hits)}" if hits else "-")
        lines.append(f"| {setting} | {cache} | {policy} | " + " | ".join(cells)
                     + f" | {sum(r['recalled'] for r in rs)}/{len(rs)} |")
    return "\n".join(lines)


# The options of a few seconds' run on the small models (run.py --smoke).
SMOKE = []


def main(argv: list[str] | None = None) -> None:
    print(perplexity_table())
    print()
    print(recall_table())


if __name__ == "__main__":
    main()
