"""The engine's settings that may change while it runs, as one immutable snapshot: `LiveSettings`.

A change (a node parameter set, a caller's call) becomes a new snapshot, checked whole before anything
changes (`changed`), handed to the engine in one call (`StreamingEngine.update_settings`) and applied by
the worker between two jobs: a job never sees half of a change, and nothing shares a mutable configuration
with the worker.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from ..memory.policies import make_policy
from ..stream_config import StreamConfig


@dataclass(frozen=True)
class LiveSettings:
    """What may change at run time: the stream's system prompt, answer prompts, answer length and longest text, the
    policy's live knobs, the frame period (what a text call may take while a camera is live), the time bound on
    waiting texts and the checkpoint period."""

    system_prompt: str | None = StreamConfig.system_prompt
    max_new_tokens: int = StreamConfig.max_new_tokens
    policy_settings: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))
    frame_period: float = 0.0  # seconds between the frames that come (1 / the node's frame_rate); 0: no camera bound
    max_text_delay: float = 0.0  # the model's seconds of texts a question waits for (WorkQueue.next_jobs); 0: all
    checkpoint_period: float = 0.0  # seconds between saves of a changed memory; 0: on request and at close
    answer_prompt: str = StreamConfig.answer_prompt
    when_prompt: str = StreamConfig.when_prompt
    max_text_chars: int | None = StreamConfig.max_text_chars  # the one text rule's bound (engine/text_rules.py)

    @classmethod
    def of(cls, config: StreamConfig, *, frame_period: float = 0.0, max_text_delay: float = 0.0,
           checkpoint_period: float = 0.0) -> LiveSettings:
        """The live part of a stream configuration, with the engine's own settings."""
        return cls(config.system_prompt, config.max_new_tokens, MappingProxyType(dict(config.policy_settings)),
                   frame_period, max_text_delay, checkpoint_period, config.answer_prompt, config.when_prompt,
                   config.max_text_chars)

    def changed(self, config: StreamConfig, **changes) -> LiveSettings:
        """A new snapshot with `changes` (`policy_settings`: the knobs that change, others kept), checked as the
        stream and the policy of `config` would take it. Raises ValueError, naming the setting, for an unknown
        setting or a bad value: the caller's snapshot is then unchanged."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"not a live engine setting: {', '.join(unknown)}")
        knob_changes = dict(changes.pop("policy_settings", {}))
        current = {**config.policy_settings, **self.policy_settings}
        policy = make_policy(config.policy, capacity=config.capacity, **current)
        for name, value in knob_changes.items():
            policy.set_knob(name, value)  # refuses a knob that cannot change at run time, or a bad value
            knob_changes[name] = getattr(policy, name)  # as the policy took it
        new = dataclasses.replace(self, policy_settings=MappingProxyType({**self.policy_settings, **knob_changes}),
                                  **changes)
        if new.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {new.max_new_tokens}")
        if new.max_text_chars is not None and new.max_text_chars < 1:
            raise ValueError(f"max_text_chars must be >= 1, got {new.max_text_chars}")
        for name in ("frame_period", "max_text_delay", "checkpoint_period"):
            if getattr(new, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(new, name)}")
        return new

    @property
    def stream_part(self) -> dict:
        """These settings' part that a stream takes as it runs (`KVStream.reconfigure`), the policy's knobs aside."""
        return dict(system_prompt=self.system_prompt, max_new_tokens=self.max_new_tokens,
                    answer_prompt=self.answer_prompt, when_prompt=self.when_prompt, max_text_chars=self.max_text_chars)

    def stream_config(self, config: StreamConfig) -> StreamConfig:
        """`config` (a new object) with these settings' stream part."""
        return dataclasses.replace(config, **self.stream_part,
                                   policy_settings={**config.policy_settings, **self.policy_settings})
