"""Agentic multi-turn rollouts: shared system prompt, per-task issue, thinking dropped from later turns.

Also models sub-agents, auto-compaction and tree-search forks (at turn boundaries and inside a turn);
see :func:`agentic_rollouts`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .workload import (
    DEFAULT_VOCAB_SIZE,
    SequenceBuilder,
    SpanDrawer,
    Workload,
    check_count,
    check_length,
    check_nonnegative,
    check_probability,
    check_vocab_size,
)

__all__ = ["agentic_rollouts"]


def agentic_rollouts(
    num_tasks: int = 1,
    rollouts_per_task: int = 8,
    turns: int = 30,
    *,
    system_prompt_len: float = 19000,
    issue_len: float = 1000,
    think_len: float = 600,
    action_len: float = 200,
    observation_len: float = 900,
    length_sigma: float = 1.0,
    max_length_factor: float = 8.0,
    turns_sigma: float = 0.0,
    divergence_prob: float = 0.2,
    divergence_sampling: str = "independent",
    subagent_prob: float = 0.0,
    subagent_turns: int = 3,
    subagent_task_len: float = 300,
    compaction_threshold: float | None = None,
    summary_len: float = 2000,
    fork_prob: float = 0.0,
    fork_token_prob: float = 0.0,
    max_branches: int = 16,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
) -> Workload:
    """SWE-like agentic rollouts: ``num_tasks`` tasks, ``rollouts_per_task`` rollouts each, ``turns`` turns each.

    A rollout's context is ``system prompt + tools`` (one span shared by every sequence), the task's issue
    (shared by the task's rollouts), then turns of ``thinking, action`` (assistant, loss) and ``observation``
    (tool output, no loss); the last turn has no observation. Emitted sequences:

    * divergence: with probability ``divergence_prob`` a turn (not the last) ends a sequence of its own after its
      action, and later turns see that turn without its thinking, so they share the prefix only up to where
      that thinking started (the "thinking dropped from later turns" pattern);
    * the final trajectory of every rollout (and of every fork branch);
    * sub-agents: with probability ``subagent_prob`` a turn spawns a sub-agent sequence ``system prompt +
      sub-task + subagent_turns turns`` (sharing only the system prompt); its result is the turn's observation;
    * auto-compaction: once a context exceeds ``compaction_threshold`` tokens after an observation, it ends with a
      summary (assistant, loss) and the rollout continues from ``system prompt + summary`` (summary as prompt);
    * forks (tree search): after an observation with probability ``fork_prob``, and at a uniform token offset
      inside a turn's thinking + action with probability ``fork_token_prob``, a second continuation is started
      (it redraws the rest of that turn); at most ``max_branches`` branches per rollout.

    Args:
        num_tasks: tasks in the batch, >= 1 (they share the system prompt).
        rollouts_per_task: rollouts per task, >= 1 (they share the issue).
        turns: turns per rollout, >= 1 (the mean when ``turns_sigma > 0``).
        system_prompt_len: exact length of the system prompt + tool schemas, >= 0 (0 = none).
        issue_len, think_len, action_len, observation_len, subagent_task_len, summary_len: mean token lengths
            (>= 1) of the issue, a turn's thinking, action and observation, a sub-agent's task and a summary.
        length_sigma: log-space standard deviation of the lognormal span lengths (0 = exact lengths).
        max_length_factor: span lengths are clipped to this multiple of their mean (>= 1); every length is >= 1.
        turns_sigma: log-space standard deviation of the turn count per rollout (0 = exactly ``turns``).
        divergence_prob: probability ``q`` in [0, 1] that a turn is emitted as its own sequence.
        divergence_sampling: ``"independent"``: one coin per turn; ``"stratified"``: every turn still diverges
            with probability ``q``, but a rollout's divergent turns are ``1 / q`` turns apart from a uniform random
            phase (systematic sampling), so their number is ``q * (turns - 1)`` within 1 and batch statistics vary
            far less between seeds. Fork branches keep their rollout's schedule.
        subagent_prob: probability in [0, 1] that a turn spawns a sub-agent.
        subagent_turns: turns of a sub-agent, >= 1.
        compaction_threshold: context length (tokens) that triggers compaction; None = never.
        fork_prob: probability in [0, 1] of a fork after an observation.
        fork_token_prob: probability in [0, 1] of a fork inside a turn.
        max_branches: most branches (final trajectories) per rollout, >= 1.
        vocab_size: token ids are drawn from ``[0, vocab_size)``.
        seed: seed of ``np.random.default_rng``; the same arguments give the same workload.
    """
    params = dict(locals())
    for name in ("num_tasks", "rollouts_per_task", "turns", "subagent_turns", "max_branches"):
        check_count(name, params[name])
    check_nonnegative("system_prompt_len", system_prompt_len)
    for name in ("issue_len", "think_len", "action_len", "observation_len", "subagent_task_len", "summary_len",
                 "max_length_factor"):
        check_length(name, params[name])
    for name in ("length_sigma", "turns_sigma"):
        check_nonnegative(name, params[name])
    for name in ("divergence_prob", "subagent_prob", "fork_prob", "fork_token_prob"):
        check_probability(name, params[name])
    if divergence_sampling not in ("independent", "stratified"):
        raise ValueError(f"divergence_sampling = {divergence_sampling!r}; expected 'independent' or 'stratified'.")
    if compaction_threshold is not None:
        check_length("compaction_threshold", compaction_threshold)
    draw = SpanDrawer(np.random.default_rng(seed), check_vocab_size(vocab_size))

    generator = _AgenticGenerator(draw, params)
    for _ in range(num_tasks):
        task = generator.system.copy().add(generator.span(issue_len), loss=False)
        for _ in range(rollouts_per_task):
            generator.rollout(task)
    return Workload("agentic_rollouts", generator.sequences, generator.loss_masks, params)


@dataclass
class _Branch:
    """One continuation of a rollout: its context so far, the next turn, and that turn's content if pre-drawn."""

    context: SequenceBuilder
    turn: int
    pending: tuple[np.ndarray, np.ndarray] | None = None


class _AgenticGenerator:
    """Draws the rollouts of :func:`agentic_rollouts` and collects the emitted sequences."""

    def __init__(self, draw: SpanDrawer, params: dict):
        self.draw, self.rng, self.p = draw, draw.rng, params
        self.sequences: list[list[int]] = []
        self.loss_masks: list[list[bool]] = []
        self.system = SequenceBuilder()
        self.phase: float | None = None  # stratified divergence: the current rollout's phase
        self.branches_left = 0  # forks the current rollout may still make
        if round(params["system_prompt_len"]) > 0:
            self.system.add(draw.tokens(round(params["system_prompt_len"])), loss=False)

    def span(self, mean: float) -> np.ndarray:
        return self.draw.span(mean, self.p["length_sigma"], self.p["max_length_factor"])

    def rollout(self, task: SequenceBuilder) -> None:
        """All sequences of one rollout of ``task``: a stack of branches, run one after another."""
        turns, sigma = self.p["turns"], self.p["turns_sigma"]
        num_turns = turns if sigma == 0 else max(1, round(turns * self.rng.lognormal(-sigma * sigma / 2, sigma)))
        self.phase = self.rng.random() if self.p["divergence_sampling"] == "stratified" else None
        stack = [_Branch(task.copy(), 0)]
        self.branches_left = self.p["max_branches"] - 1
        while stack:
            self._run(stack.pop(), num_turns, stack)

    def _fork(self, probability: float) -> bool:
        if probability == 0 or self.branches_left == 0 or self.rng.random() >= probability:
            return False
        self.branches_left -= 1
        return True

    def _diverges(self, turn: int) -> bool:
        q = self.p["divergence_prob"]
        if self.phase is None:
            return self.rng.random() < q
        return math.floor(q * (turn + 1) + self.phase) > math.floor(q * turn + self.phase)

    def _run(self, branch: _Branch, num_turns: int, stack: list[_Branch]) -> None:
        p, context = self.p, branch.context
        for turn in range(branch.turn, num_turns):
            think, action = branch.pending or (self.span(p["think_len"]), self.span(p["action_len"]))
            branch.pending = None
            if self._fork(p["fork_token_prob"]):
                stack.append(_Branch(context.copy(), turn, self._redraw_tail(think, action)))
            if turn == num_turns - 1:
                context.emit(self.sequences, self.loss_masks, (think, True), (action, True))
                return
            if self._diverges(turn):
                context.emit(self.sequences, self.loss_masks, (think, True), (action, True))
                context.add(action, loss=True)
            else:
                context.add(think, loss=True).add(action, loss=True)
            if p["subagent_prob"] > 0 and self.rng.random() < p["subagent_prob"]:
                self._subagent()
            context.add(self.span(p["observation_len"]), loss=False)
            threshold = p["compaction_threshold"]
            if threshold is not None and context.num_tokens > threshold:
                summary = self.span(p["summary_len"])
                context.emit(self.sequences, self.loss_masks, (summary, True))
                context = self.system.copy().add(summary, loss=False)
            if self._fork(p["fork_prob"]):
                stack.append(_Branch(context.copy(), turn + 1))

    def _redraw_tail(self, think: np.ndarray, action: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A sibling of ``(think, action)`` equal up to a uniform offset in their concatenation, fresh after it."""
        offset = int(self.rng.integers(0, len(think) + len(action)))
        if offset < len(think):
            return np.concatenate([think[:offset], self.draw.tokens(len(think) - offset)]), \
                self.draw.tokens(len(action))
        offset -= len(think)
        return think, np.concatenate([action[:offset], self.draw.tokens(len(action) - offset)])

    def _subagent(self) -> None:
        p = self.p
        context = self.system.copy().add(self.span(p["subagent_task_len"]), loss=False)
        for turn in range(p["subagent_turns"]):
            context.add(self.span(p["think_len"]), loss=True).add(self.span(p["action_len"]), loss=True)
            if turn < p["subagent_turns"] - 1:
                context.add(self.span(p["observation_len"]), loss=False)
        context.emit(self.sequences, self.loss_masks)

