"""A real 2-process data-parallel run on CPU (Accelerate over gloo): ranks stay in lock-step."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.models import build

SCRIPT = Path(__file__).parent / "scripts" / "two_process_tree_grpo.py"


@pytest.mark.parametrize("shuffle", ["groups"])
def test_two_processes_end_with_identical_parameters(tmp_path, shuffle):
    env = dict(os.environ, ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29517",
               str(SCRIPT), str(tmp_path), shuffle]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{k}.pt", weights_only=False) for k in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2], "accelerate ran fewer than 2 processes"
    initial = dict(build("qwen3_next_moe", seed=0).named_parameters())
    changed = 0
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), f"{name} differs between ranks"
        changed += not torch.equal(value, initial[name].detach())
    assert changed > len(initial) // 2, "training did not move the parameters"
    assert len(ranks[0]["logged"]) == 2 and ranks[0]["logged"][0]["tree/R_tok"] > 1
