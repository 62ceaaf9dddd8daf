"""Eviction policies, generic: the registry, a new policy as one class or one file of its own, and the
settings' validation and live knobs. Each policy's own tests are in test_policy_<name>.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from inf_mllm_ros.engine.memory.policies import POLICIES, make_policy

from policy_helpers import FILL, KEEP, kept, view


def test_settings_are_validated_and_live_ones_changeable():
    policy = make_policy("inf_mllm", capacity=KEEP)
    policy.set_knob("attention_bias", 5e-3)
    assert policy.describe()["attention_bias"] == 5e-3
    for name, value, reason in (("attention_bias", -1.0, r"attention_bias must be in \[0, 100\]"),
                                ("attention_bias", "high", "must be of type float"),
                                ("score_pool", 5, "fixed when the stream starts"),
                                ("recency", 1.0, "has no setting 'recency'")):
        with pytest.raises(ValueError, match=reason):
            policy.set_knob(name, value)
    assert policy.describe()["attention_bias"] == 5e-3 and policy.score_pool == 13  # unchanged
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("lru", capacity=KEEP)
    with pytest.raises(ValueError, match="larger than the cache"):
        make_policy("h2o", capacity=8, recent_size=9)
    with pytest.raises(ValueError, match="score_pool must be 1 plus a multiple of 2"):
        make_policy("inf_mllm", capacity=KEEP, score_pool=4)
    with pytest.raises(ValueError, match="has no setting attention_bias"):
        make_policy("streaming_llm", capacity=KEEP, attention_bias=1.0)


def test_registry_lists_all_policies():
    assert set(POLICIES) == {"inf_mllm", "streaming_llm", "h2o", "window", "full"}


def test_a_new_policy_with_one_knob_is_one_class(monkeypatch):
    """Registered by name, built with its setting, and its setting is a node parameter, checked like the others."""
    import inf_mllm_ros.engine.memory.policies as policies
    from inf_mllm_ros import settings

    monkeypatch.setitem(policies.POLICIES, "every_other", None)  # taken out of the registry after the test

    @policies.register
    @dataclass
    class EveryOther(policies.EvictionPolicy):
        """Keeps every `stride`-th slot from the newest back."""

        name: ClassVar[str] = "every_other"
        stride: int = policies.knob(2, "Keep one slot in this many.", low=1, high=8, live=True)

        def select(self, view, keep):
            idx = torch.arange(view.fill - 1, -1, -self.stride)[:keep].flip(0)
            return idx.expand(view.num_heads, -1).contiguous()

    policy = policies.make_policy("every_other", capacity=KEEP, stride=3)
    assert policy.describe() == {"policy": "every_other", "stride": 3}
    params = {p.name: p for p in settings.knob_params(live=True)}
    assert params["stride"].description.startswith("every_other:") and not params["stride"].read_only
    assert params["stride"].default == 2 and (params["stride"].low, params["stride"].high) == (1, 8)
    with pytest.raises(ValueError, match="stride must be in"):
        policy.set_knob("stride", 9)


NEW_POLICY_FILE = '''
"""Keep every n-th: a policy in a file of its own, as a new policy is added to engine/memory/policies/."""

from dataclasses import dataclass
from typing import ClassVar

import torch

from inf_mllm_ros.engine.memory.policies import EvictionPolicy, knob, register


@register
@dataclass
class KeepEveryPolicy(EvictionPolicy):
    """Keeps the newest slots (the setting is there to be found, not used)."""

    name: ClassVar[str] = "keep_every"
    keep_every: int = knob(2, "Keep one slot in this many.", low=1, high=64)

    def select(self, view, keep):
        return torch.arange(view.fill - keep, view.fill).expand(view.num_heads, keep).contiguous()
'''


def test_a_new_policy_with_one_setting_is_one_new_file_and_nothing_else(tmp_path, monkeypatch):
    """A policy module written on its own registers when imported: selectable by name, its setting a node
    parameter (fixed at start) and a flag of the offline runner, with no other file changed."""
    import importlib.util
    import sys

    from inf_mllm_ros import settings
    from inf_mllm_ros.bags import offline

    path = tmp_path / "keep_every_policy.py"
    path.write_text(NEW_POLICY_FILE)
    module_name = "keep_every_policy"
    try:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses look the module up while building the class
        spec.loader.exec_module(module)

        assert POLICIES["keep_every"] is module.KeepEveryPolicy
        policy = make_policy("keep_every", capacity=KEEP, keep_every=3)
        assert policy.describe() == {"policy": "keep_every", "keep_every": 3}
        assert kept(policy, view(), keep=KEEP) == set(range(FILL - KEEP, FILL))

        # The node builds its parameter table when it starts (settings.PARAMETERS was built when the settings
        # module was first imported, before this policy existed): build the policy parameters again.
        params = {p.name: p for p in settings.knob_params(live=False)}
        param = params["keep_every"]
        assert param.description == "keep_every: Keep one slot in this many." and param.read_only
        assert (param.default, param.low, param.high) == (2, 1, 64)
        assert "keep_every" not in {p.name for p in settings.knob_params(live=True)}

        # The offline runner makes a flag of each policy parameter in the table when it builds its parser.
        new = [p for p in params.values() if p.name not in settings.BY_NAME]
        assert [p.name for p in new] == ["keep_every"]
        monkeypatch.setattr(offline, "PARAMETERS", (*settings.PARAMETERS, *new))
        args = offline.build_parser().parse_args(["bag", "--keep-every", "3"])
        assert args.keep_every == 3
    finally:
        POLICIES.pop("keep_every", None)
        sys.modules.pop(module_name, None)
    assert "keep_every" not in {p.name for p in settings.knob_params(live=False)}
