"""Plots of a training run's logs: reward, tree compression and throughput per step.

    python -m harts_hf.report RUN_DIR [--out DIR]

RUN_DIR is a Trainer output directory (``trainer_state.json`` in it or in its newest ``checkpoint-*``).
Writes ``report.png`` (and ``report.json`` with the series) to ``--out`` (default RUN_DIR).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

__all__ = ["load_history", "main", "make_report"]


def _state_file(run_dir: Path) -> Path:
    direct = run_dir / "trainer_state.json"
    if direct.is_file():
        return direct
    checkpoints = sorted(run_dir.glob("checkpoint-*/trainer_state.json"),
                         key=lambda p: int(re.sub(r"\D", "", p.parent.name) or 0))
    if not checkpoints:
        raise FileNotFoundError(f"no trainer_state.json in {run_dir} or its checkpoint-* folders; "
                                "pass a Trainer output_dir (save_strategy must not be 'no', or call trainer.save_state()).")
    return checkpoints[-1]


def load_history(run_dir) -> list[dict]:
    """The per-step training log entries (those with a reward) of ``run_dir``."""
    path = _state_file(Path(run_dir))
    try:
        state = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:  # e.g. cut short by a run killed while saving
        raise ValueError(f"{path} is not valid JSON ({error}); point the report at another checkpoint, or "
                         "write the file again with trainer.save_state()") from error
    if not isinstance(state, dict) or not isinstance(state.get("log_history", []), list):
        raise ValueError(f"{path} is not a Trainer state: expected an object with a 'log_history' list")
    return [entry for entry in state.get("log_history", []) if isinstance(entry, dict) and "reward" in entry]


def _points(steps: list, values: list) -> tuple[list, list]:
    """``(steps, values)`` without the steps whose value is missing (a null in the log)."""
    kept = [(step, value) for step, value in zip(steps, values) if value is not None]
    return [step for step, _ in kept], [value for _, value in kept]


def _format(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def make_report(run_dir, out=None) -> Path:
    """Draw reward, R_tok and tokens/s against the step; returns the PNG's path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError("harts_hf.report draws with matplotlib: pip install matplotlib") from error
    history = load_history(run_dir)
    if not history:
        raise ValueError(f"{run_dir} has no logged training steps with a reward")
    out = Path(out or run_dir)
    out.mkdir(parents=True, exist_ok=True)
    steps = [entry["step"] for entry in history]
    series = {
        "reward": [entry.get("reward") for entry in history],
        "reward_std": [entry.get("reward_std") for entry in history],
        "tree/R_tok": [entry.get("tree/R_tok") for entry in history],
        "tree/unique_tokens": [entry.get("tree/unique_tokens") for entry in history],
        "tokens_per_second": [(entry.get("tree/path_tokens") or 0) / entry["step_time"]
                              if entry.get("step_time") else None for entry in history],
    }
    figure, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    axes[0].plot(*_points(steps, series["reward"]), label="reward")
    with_std = [(step, reward, std) for step, reward, std in zip(steps, series["reward"], series["reward_std"])
                if reward is not None and std is not None]
    if with_std:
        axes[0].fill_between([step for step, _, _ in with_std], [r - s for _, r, s in with_std],
                             [r + s for _, r, s in with_std], alpha=0.2, label="± std")
    axes[0].set_ylabel("reward")
    axes[0].legend()
    axes[1].plot(*_points(steps, series["tree/R_tok"]), color="tab:green")
    axes[1].set_ylabel("R_tok (path / unique tokens)")
    axes[2].plot(*_points(steps, series["tokens_per_second"]), color="tab:red")
    axes[2].set_ylabel("trajectory tokens / s")
    axes[2].set_xlabel("step")
    figure.suptitle(f"harts_hf run: {Path(run_dir).name}")
    figure.tight_layout()
    path = out / "report.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    (out / "report.json").write_text(json.dumps({"step": steps, **series}, indent=1))
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m harts_hf.report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    path = make_report(args.run_dir, args.out)
    history = load_history(args.run_dir)
    last = history[-1]
    print(f"{len(history)} steps; last reward {_format(last.get('reward'), '.4f')}, "
          f"R_tok {_format(last.get('tree/R_tok'), '.2f')}; plot: {path}")


if __name__ == "__main__":
    main()
