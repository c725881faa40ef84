"""Cost model of one tree forward+backward: linear in the work a piece of a forest carries.

Features per piece: unique tokens, attention pairs (sum of depth + 1), replayed tokens, gated-delta-rule
rounds, leaves (sequence ends), and a constant per forward+backward call (the feature ``microbatches``: the planner
charges it once per piece, whole trees of one microbatch sharing one call). Coefficients are fitted by non-negative
least squares from measured timings (``CostModel.fit``; ``python -m benchmarks calibrate`` on a GPU, ``python -m
benchmarks refit`` from committed results). The defaults, in seconds, are the refit to full-size forests of 12k to
177k tokens on one H200 (the 2.3B Qwen3-Next preset, bf16 autocast, fused kernels, checkpointing with kept attention
outputs; the trees and packed calls of `tau`, `grpo` and `distinct`, 2026-12-01; BENCHMARKS.md, "Planner cost
model"). Calibrate on the GPU and model you train (``TreeGRPOConfig.tree_cost_model``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .._checks import check_number

__all__ = ["FEATURES", "CostModel", "nnls"]

FEATURES = ("unique_tokens", "attention_pairs", "replay_tokens", "rounds", "leaves", "microbatches")


@dataclass(frozen=True)
class CostModel:
    """``cost = sum(coefficient * feature)``; coefficients are seconds per unit of each feature."""

    unique_tokens: float = 4.20e-5
    attention_pairs: float = 1.11e-9
    replay_tokens: float = 7.47e-5
    rounds: float = 4.59e-3
    leaves: float = 0.0  # the fit gave leaves no cost of their own on the H200
    microbatches: float = 0.522  # fixed cost of one forward+backward call (host work, launches)

    def __post_init__(self):
        for name in FEATURES:
            check_number(getattr(self, name), f"CostModel: {name}", allow_zero=True)

    def cost(self, features: dict) -> float:
        return sum(getattr(self, name) * float(features.get(name, 0.0)) for name in FEATURES)

    @classmethod
    def fit(cls, features: list[dict], seconds: list[float]) -> CostModel:
        """Non-negative least squares over measured ``(features, seconds)`` pairs."""
        if len(features) != len(seconds) or not features:
            raise ValueError("fit needs one timing per feature dict, and at least one")
        matrix = np.array([[float(f.get(name, 0.0)) for name in FEATURES] for f in features])
        scale = np.maximum(np.abs(matrix).max(axis=0), 1e-12)
        coefficients = nnls(matrix / scale, np.asarray(seconds, dtype=float)) / scale
        return cls(**dict(zip(FEATURES, coefficients.tolist())))

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path) -> CostModel:
        coefficients = json.loads(Path(path).read_text())
        if not isinstance(coefficients, dict) or set(coefficients) - set(FEATURES):
            raise ValueError(f"CostModel.load: {path} must hold a JSON object with keys among {FEATURES}, got "
                             f"{sorted(coefficients) if isinstance(coefficients, dict) else coefficients!r:.200}")
        return cls(**coefficients)


def nnls(matrix: np.ndarray, target: np.ndarray, max_iterations: int = 500) -> np.ndarray:
    """Lawson-Hanson active-set solution of ``min ||A x - b||`` subject to ``x >= 0``."""
    rows, columns = matrix.shape
    x = np.zeros(columns)
    passive = np.zeros(columns, dtype=bool)
    for _ in range(max_iterations):
        gradient = matrix.T @ (target - matrix @ x)
        candidates = ~passive & (gradient > 1e-12)
        if not candidates.any():
            break
        passive[np.argmax(np.where(candidates, gradient, -np.inf))] = True
        while True:
            z = np.zeros(columns)
            z[passive] = np.linalg.lstsq(matrix[:, passive], target, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            blocked = passive & (z <= 0)
            step = np.min(x[blocked] / np.maximum(x[blocked] - z[blocked], 1e-300))
            x = x + step * (z - x)
            passive &= x > 1e-15
    return x
