"""Seeded synthetic RL workloads as token sequences with loss masks, for measuring prefix sharing.

Generators: :func:`grpo_groups`, :func:`agentic_rollouts`, :func:`fixed_branching`; named presets
(``swe``, ``tau``, ``grpo``, ``search``, ``coding_agent``, ``distinct``) through :func:`make_workload`.
"""

from .agentic import agentic_rollouts
from .generators import fixed_branching, grpo_groups
from .presets import PRESETS, Preset, make_workload
from .workload import DEFAULT_VOCAB_SIZE, Workload

__all__ = [
    "DEFAULT_VOCAB_SIZE",
    "PRESETS",
    "Preset",
    "Workload",
    "agentic_rollouts",
    "fixed_branching",
    "grpo_groups",
    "make_workload",
]
