"""Real 2-process data-parallel runs on CPU (Accelerate over gloo): ranks stay in lock-step."""

import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.models import build

SCRIPT = Path(__file__).parent / "scripts" / "two_process_tree_grpo.py"
ENV = dict(os.environ, ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1")


def launch(out_dir: Path, mode: str, port: int) -> list[dict]:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
               str(port), str(SCRIPT), str(out_dir), mode]
    result = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [torch.load(out_dir / f"rank{k}.pt", weights_only=False) for k in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2], "accelerate ran fewer than 2 processes"
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), f"{name} differs between ranks"
    return ranks


def test_two_processes_end_with_identical_parameters(tmp_path):
    ranks = launch(tmp_path, "groups", 29517)
    initial = dict(build("qwen3_next_moe", seed=0).named_parameters())
    changed = sum(not torch.equal(value, initial[name].detach()) for name, value in ranks[0]["params"].items())
    assert changed > len(initial) // 2, "training did not move the parameters"
    assert len(ranks[0]["logged"]) == 2 and ranks[0]["logged"][0]["tree/R_tok"] > 1


def test_two_processes_with_uneven_planner_pieces_match_one_process(tmp_path):
    """Budget 30 and forests of different sizes: per microbatch the ranks run different numbers of pieces (each
    a forward+backward), or one rank pieces and the other one tree forward; DDP still all-reduces once per
    optimizer step (in the last backward) and the result equals one process over the same global batch."""
    ranks = launch(tmp_path / "two", "planner", 29518)
    (tmp_path / "one").mkdir()
    result = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "one"), "planner"], env=ENV,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    single = torch.load(tmp_path / "one" / "rank0.pt", weights_only=False)
    assert single["world_size"] == 1
    pairs = list(zip(ranks[0]["pieces"], ranks[1]["pieces"]))  # per microbatch; 1: it fit, one tree forward
    assert len(pairs) == 4 and any(a != b and min(a, b) > 1 for a, b in pairs), f"trees not uneven: {pairs}"
    assert any((a == 1) != (b == 1) for a, b in pairs), f"no microbatch mixes pieces and one forward: {pairs}"
    initial = dict(build("qwen3_next_moe", seed=0).named_parameters())
    worst = 0.0
    for name, value in single["params"].items():
        step = value - initial[name].detach()
        difference = (ranks[0]["params"][name] - value).norm()
        assert difference <= 1e-5 * value.norm() + 1e-3 * step.norm(), name
        if step.norm() > 0:
            worst = max(worst, (difference / step.norm()).item())
    print(f"\n[2 processes, planner] pieces per microbatch {ranks[0]['pieces']} vs {ranks[1]['pieces']}; "
          f"worst |2-proc - 1-proc| / |step| = {worst:.2e}")
    assert ranks[0]["logged"][0]["tree/handoffs"] > 0
