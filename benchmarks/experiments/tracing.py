"""What the diagnostics share: the recall stream's default run, one fact's trace as it ages, and the hook
that hands policies the token ids of what they are told (for policies that read the words).

Nothing here changes the engine when imported: `tell_policies_token_ids` does, when a diagnostic calls it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: recall.py, common.py

from common import read_text, write_records  # noqa: E402
from recall import DISTANCES, make_facts, paragraphs, run_one, value_kept, value_positions  # noqa: E402

MENTIONED_CACHE = 512  # the cache of mentioned_run


def mentioned_run(policy: str, seed: int, policy_settings: dict, *, threads: int = 2) -> list[dict]:
    """`run_one` on the command line's default stream (twenty facts, subjects mentioned, cache 512, the 0.5B
    model in float32) for a policy and its settings: what the diagnostics and sweeps compare."""
    from types import SimpleNamespace

    return run_one(SimpleNamespace(
        policy=policy, cache=MENTIONED_CACHE, setting="mentioned", seed=seed, threads=threads, model="qwen2.5-0.5b",
        device="cpu", dtype="float32", text=None, facts=20, fact_every=400, distances=DISTANCES, bias=None,
        pool=None, first_mention=192, mention_gap=0, fact_alone=False, policy_settings=policy_settings))


MENTION_AGES = (192, 384, 768, 1536)  # the ages at which trace_fact mentions its fact


def trace_fact(stream, adapter, fact: dict, *, before: int = 10, until: int = 2100) -> list[dict]:
    """One fact told after `before` paragraphs of the novel (after 20 words of the next), mentioned at
    MENTION_AGES, followed until it is `until` tokens old: per message pushed, the fact's age, whether the
    message was a mention, and the share of layer-heads holding the value (the diagnostics' trace)."""
    filler = iter(paragraphs(read_text(None)))
    for _ in range(before):
        stream.push_text(next(filler))
    told = " ".join(next(filler).split()[:20] + [fact["statement"]])
    stream.push_text(told)
    planted = stream.tokens_seen
    where = value_positions(adapter, told, planted, fact["value"])
    mentions = [planted + age for age in MENTION_AGES]
    trace = []
    while stream.tokens_seen - planted < until:
        mention = bool(mentions) and stream.tokens_seen >= mentions[0]
        stream.push_text(fact["mention"] if mention else next(filler))
        if mention:
            mentions.pop(0)
        trace.append({"age": stream.tokens_seen - planted, "mention": mention,
                      "value_kept_in_layer_heads": round(value_kept(stream, where), 3)})
    return trace


def tell_policies_token_ids() -> None:
    """For the diagnostics whose policies read the words: a policy sees no token ids, so from now on a
    policy with a `told(prompt)` method is handed every prompt that stays in memory before it goes in."""
    from inf_mllm_ros.engine.stream import KVStream

    forward = KVStream._forward
    if getattr(forward, "tells_token_ids", False):
        return

    def forward_telling_ids(self, prompt, offset, *, evict, pack, observe, **kwargs):
        if observe and hasattr(self.policy, "told"):
            self.policy.told(prompt)
        return forward(self, prompt, offset, evict=evict, pack=pack, observe=observe, **kwargs)

    forward_telling_ids.tells_token_ids = True
    KVStream._forward = forward_telling_ids


def trace_variants(variants: list[tuple[str, dict]], out: str, *, seeds=(0,), threads: int = 2) -> None:
    """`trace_fact` for each (policy, settings) and seed's first fact (told after 10 + 5 x seed paragraphs),
    cache 512, on the 0.5B model, then the fact asked at the end; records written to results/`out` as they
    come (the diagnostics' shared loop)."""
    import torch

    from inf_mllm_ros.engine.loading import load_model
    from inf_mllm_ros.engine.stream import KVStream, StreamConfig

    torch.set_num_threads(threads)
    adapter = load_model("qwen2.5-0.5b", device="cpu", dtype="float32")
    records = []
    for policy, settings in variants:
        for seed in seeds:
            fact = make_facts(seed)[0]
            stream = KVStream(adapter, StreamConfig(capacity=512, policy=policy, chunk_size=64,
                                                    policy_settings=settings))
            run = [{"policy": policy, "cache_size": 512, "seed": seed, "policy_settings": settings, **r}
                   for r in trace_fact(stream, adapter, fact, before=10 + 5 * seed)]
            answer = stream.ask(fact["question"], max_new_tokens=12).text
            for r in run:
                r.update({"answer_at_end": answer, "recalled_at_end": fact["value"] in answer})
            records += run
            held = [r["age"] for r in run if r["value_kept_in_layer_heads"] > 0]
            print(policy, settings, seed, [(r["age"], r["value_kept_in_layer_heads"]) for r in run][::3],
                  "value held until age", max(held, default=0),
                  "recalled" if fact["value"] in answer else "not recalled", repr(answer), flush=True)
            write_records(out, records)
