"""Eviction policies: which cached tokens survive when the cache is over capacity.

A policy sees one layer's slots (in stream order) and returns, per KV head, the indices of the slots
to keep. The cache does the gathering, so a policy is a few lines of scoring. A policy that needs
per-slot figures across evictions names them in `slot_stats`; the cache allocates, moves and resets
them with the slots, and the policy updates them in `select`.

One file per policy (full, window, streaming_llm, h2o, inf_mllm), each a dataclass subclass of
`EvictionPolicy` that joins `POLICIES` with `@register` when its module is imported; base.py holds what
they share. The shipped policies' settings (knobs) are declared in engine/policy_knobs.py, which imports
no torch, so that the node's parameter table and the launch file read them without the engine. A new policy
is a new file that declares its own knobs; imported here (or anywhere before the node builds its parameter
table), it is selectable by name and its knobs are node parameters and offline flags.
"""

from .base import (
    POLICIES,
    EvictionPolicy,
    SlotView,
    _keep_ends_and_best,
    make_policy,
    policy_defaults,
    register,
)
from ...policy_knobs import knob, policy_knobs
from .full import FullPolicy
from .h2o import H2OPolicy
from .inf_mllm import InfMLLMPolicy
from .streaming_llm import StreamingLLMPolicy
from .window import WindowPolicy

__all__ = [
    "EvictionPolicy",
    "FullPolicy",
    "H2OPolicy",
    "InfMLLMPolicy",
    "POLICIES",
    "SlotView",
    "StreamingLLMPolicy",
    "WindowPolicy",
    "_keep_ends_and_best",
    "knob",
    "make_policy",
    "policy_defaults",
    "policy_knobs",
    "register",
]
