"""The streaming_llm eviction policy: the attention sinks and the recent window."""

from __future__ import annotations

from inf_mllm_ros.engine.memory.policies import make_policy

from policy_helpers import FILL, KEEP, kept, view


def test_streaming_llm_keeps_sinks_and_recent_window():
    policy = make_policy("streaming_llm", capacity=KEEP, sink_size=4)
    assert kept(policy, view()) == set(range(4)) | set(range(FILL - (KEEP - 4), FILL))
