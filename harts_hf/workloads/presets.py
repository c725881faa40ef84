"""Named workload presets (``swe``, ``tau``, ``grpo``, ``search``, ``coding_agent``, ``distinct``) and
:func:`make_workload`.

``scale`` multiplies every token length of a preset (counts and shapes stay), so a full-size shape fits a CPU
test. ``R_tok`` depends on length ratios, so it stays in each preset's range down to ``scale ~ 0.02``; below,
short spans round up to 1 token and it drifts down (tau: ~8.5 at 0.01, ~7.3 at 0.005; swe: ~5.4 at 0.005).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

from .agentic import agentic_rollouts
from .generators import grpo_groups
from .workload import Workload

__all__ = ["PRESETS", "Preset", "make_workload"]


@dataclass(frozen=True)
class Preset:
    """A named workload: ``generator(**params)`` with the parameters in ``length_params`` multiplied by ``scale``.

    ``r_tok_range``: the documented ``(low, high)`` of ``forest().stats()["R_tok"]`` for scale 1 down to ~0.02.
    ``doc``: what the preset models and where its numbers come from.
    """

    generator: Callable[..., Workload]
    params: dict
    length_params: tuple[str, ...]
    r_tok_range: tuple[float, float]
    doc: str


_AGENTIC_LENGTHS = ("system_prompt_len", "issue_len", "think_len", "action_len", "observation_len",
                    "subagent_task_len", "summary_len", "compaction_threshold")

PRESETS: dict[str, Preset] = {
    "swe": Preset(
        agentic_rollouts,
        dict(num_tasks=1, rollouts_per_task=8, turns=30, system_prompt_len=19000, issue_len=1000, think_len=1150,
             action_len=200, observation_len=420, length_sigma=0.8, divergence_prob=0.2,
             divergence_sampling="stratified"),
        _AGENTIC_LENGTHS,
        (5.0, 6.2),
        """SWE-bench agentic RL batch: the workload of HARTS (arXiv 2608.28158), R_tok ~ 5.6.

        One task, 8 rollouts of 30 turns. A ~19k-token system prompt + tool schemas and a ~1k-token issue
        (SWE-bench, Jimenez et al., arXiv 2310.06770) are shared; turns are ~1.15k thinking, ~200 action and ~420
        observation tokens (lognormal, sigma 0.8). One turn in five (q = 0.2, stratified) ends a sequence and has
        its thinking dropped later. About 450k unique tokens per task at scale 1. With
        ``num_tasks=4..8`` (tasks share the system prompt) R_tok rises to ~5.8.""",
    ),
    "tau": Preset(
        agentic_rollouts,
        dict(num_tasks=1, rollouts_per_task=8, turns=25, system_prompt_len=4800, issue_len=150, think_len=250,
             action_len=60, observation_len=150, length_sigma=0.8, divergence_prob=0.45,
             divergence_sampling="stratified"),
        _AGENTIC_LENGTHS,
        (8.0, 10.5),
        """tau-bench-like customer-service agent (Yao et al., tau-bench, arXiv 2406.12045), R_tok ~ 9.

        A ~4.8k-token domain policy + tool schemas is shared, the user's first message (~150 tokens) starts the
        task; 8 rollouts of 25 short turns (~250 thinking, ~60 action, ~150 user/tool tokens). Thinking is dropped
        at every new user message, modelled as q = 0.45 of the turns.""",
    ),
    "grpo": Preset(
        grpo_groups,
        dict(num_prompts=8, group_size=8, prompt_len=512, completion_len=2048, system_prompt_len=1024,
             prompt_len_sigma=0.3, completion_len_sigma=0.5),
        ("prompt_len", "completion_len", "system_prompt_len"),
        (1.3, 1.9),
        """Single-turn GRPO (Shao et al., DeepSeekMath, arXiv 2402.03300): 8 prompts x 8 completions, R_tok ~ 1.6.

        A 1k-token system prompt shared by all, ~512-token prompts, ~2k-token reasoning completions (lognormal,
        sigma 0.5). With ~1k completions R_tok would be ~2.3; longer completions put it in 1.3-1.9.""",
    ),
    "distinct": Preset(
        grpo_groups,
        dict(num_prompts=64, group_size=1, prompt_len=512, completion_len=2048, system_prompt_len=0,
             prompt_len_sigma=0.3, completion_len_sigma=0.5),
        ("prompt_len", "completion_len"),
        (1.0, 1.001),
        """The no-sharing control: 64 unrelated prompts with one completion each (the `grpo` preset's lengths from
        DeepSeekMath's GRPO, arXiv 2402.03300, with no system prompt and groups of one), R_tok 1.0. The tree has nothing to share, so it measures the tree path's own
        overhead against the packed per-trajectory path and TRL's GRPOTrainer on the same rows.""",
    ),
    "search": Preset(
        agentic_rollouts,
        dict(num_tasks=1, rollouts_per_task=4, turns=10, system_prompt_len=2000, issue_len=500, think_len=600,
             action_len=150, observation_len=300, length_sigma=0.8, divergence_prob=0.0, fork_prob=0.15,
             fork_token_prob=0.15, max_branches=16),
        _AGENTIC_LENGTHS,
        (2.0, 5.0),
        """Tree search over agent turns (in the spirit of Tree of Thoughts, Yao et al., arXiv 2305.10601).

        4 rollouts of 10 turns; after a turn (p = 0.15) or at a random token inside one (p = 0.15) the
        trajectory forks into two continuations, up to 16 branches per rollout. No thinking is dropped, so
        sharing comes only from the forks; most branch points fall off 64-token chunk boundaries.""",
    ),
    "coding_agent": Preset(
        agentic_rollouts,
        dict(num_tasks=1, rollouts_per_task=4, turns=40, system_prompt_len=12000, issue_len=500, think_len=500,
             action_len=250, observation_len=1500, length_sigma=1.0, divergence_prob=0.1,
             divergence_sampling="stratified", subagent_prob=0.05, subagent_turns=5, subagent_task_len=400,
             compaction_threshold=48000, summary_len=2000),
        _AGENTIC_LENGTHS,
        (1.9, 3.2),
        """Long-horizon coding agent with sub-agents and auto-compaction (the mechanisms of Claude Code's Task
        sub-agents and auto-compact, docs.anthropic.com/en/docs/claude-code; lengths are our choice).

        4 rollouts of 40 turns with a 12k-token system prompt; 5% of turns spawn a 5-turn sub-agent that shares
        only the system prompt; contexts past 48k tokens are compacted into a 2k-token summary.""",
    ),
}


def make_workload(name: str, *, scale: float = 1.0, seed: int = 0, **overrides) -> Workload:
    """The preset ``name`` (see :data:`PRESETS`) with token lengths times ``scale`` and the given ``seed``.

    Every scaled length is rounded and kept >= 1 (a length of 0, i.e. "none", stays 0). ``overrides`` replace
    generator parameters before scaling (lengths in full-size tokens), e.g. ``num_tasks=4``.
    """
    if name not in PRESETS:
        raise ValueError(f"name = {name!r} is not a workload preset; known presets: {', '.join(sorted(PRESETS))}.")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale = {scale!r}; expected a finite number > 0 (1.0 = full-size token lengths).")
    preset = PRESETS[name]
    accepted = set(inspect.signature(preset.generator).parameters) - {"seed"}
    unknown = sorted(set(overrides) - accepted)
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not parameters of preset {name!r} "
                         f"({preset.generator.__name__} takes {', '.join(sorted(accepted))}).")
    params = {**preset.params, **overrides}
    for key in preset.length_params:
        value = params.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:  # bad values: generator says
            params[key] = max(1, round(value * scale))
    workload = preset.generator(**params, seed=seed)
    return dataclasses.replace(workload, name=name, params={"preset": name, "scale": scale, **workload.params})
