"""Real 2-process data-parallel runs on CPU (Accelerate over gloo): ranks stay in lock-step."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.models import build

SCRIPT = Path(__file__).parent / "scripts" / "two_process_tree_grpo.py"
ENV = dict(os.environ, ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1")


def launch(out_dir: Path, mode: str | None, port: int, script: Path = SCRIPT, timeout: float = 600,
           processes: int = 2) -> list[dict]:
    """``script`` on ``processes`` processes; a run still going after ``timeout`` seconds (a hang: ranks waiting in
    different collectives) is stopped with its workers and fails the test."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
               str(port), str(script), str(out_dir), *([mode] if mode else [])]
    with subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # torchrun's agent (this process) forwards SIGTERM to its workers, which run in sessions of their own
            process.terminate()
            try:
                stdout, stderr = process.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                stdout, stderr = process.communicate()
            pytest.fail(f"the {processes}-process run ({script.name} {mode}) did not finish in {timeout} s (hung "
                        f"in a collective?)\n{stdout[-3000:]}{stderr[-3000:]}")
    assert process.returncode == 0, stdout[-3000:] + stderr[-3000:]
    ranks = [torch.load(out_dir / f"rank{k}.pt", weights_only=False) for k in range(processes)]
    assert [r["world_size"] for r in ranks] == [processes] * processes, f"accelerate ran fewer than {processes}"
    for rank in ranks[1:]:
        for name, value in ranks[0]["params"].items():
            assert torch.equal(value, rank["params"][name]), f"{name} differs between ranks"
    return ranks


def run_one_process(out_dir: Path, mode: str | None, script: Path = SCRIPT) -> dict:
    """The same script as one plain process (the reference for the 2-process runs)."""
    out_dir.mkdir()
    result = subprocess.run([sys.executable, str(script), str(out_dir), *([mode] if mode else [])], env=ENV,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    single = torch.load(out_dir / "rank0.pt", weights_only=False)
    assert single["world_size"] == 1
    return single


def compare_final_parameters(rank: dict, single: dict, *, value_tol: float, step_tol: float) -> tuple[float, float]:
    """Parameters after training on 2 processes vs 1: every difference within ``value_tol`` of the value plus
    ``step_tol`` of the step the 1-process run took; returns the worst difference per step and per value."""
    initial = dict(build("qwen3_next_moe", seed=0).named_parameters())
    worst_step = worst_value = 0.0
    for name, value in single["params"].items():
        step = value - initial[name].detach()
        difference = (rank["params"][name] - value).norm()
        assert difference <= value_tol * value.norm() + step_tol * step.norm(), name
        if step.norm() > 0:
            worst_step = max(worst_step, (difference / step.norm()).item())
        worst_value = max(worst_value, (difference / value.norm()).item())
    return worst_step, worst_value


def compare_first_gradients(ranks: list[dict], single: dict) -> float:
    """The first optimizer step's gradients (after DDP's all-reduce): bit-identical on every rank and within 1e-5
    of the 1-process run's; returns the worst relative difference."""
    worst = 0.0
    assert ranks[0]["gradients"].keys() == single["gradients"].keys()
    for name, reference in single["gradients"].items():
        assert all(torch.equal(ranks[0]["gradients"][name], rank["gradients"][name]) for rank in ranks[1:]), name
        difference = (ranks[0]["gradients"][name] - reference).norm()
        assert difference <= 1e-5 * reference.norm() + 1e-8, f"{name}: {difference / reference.norm():.2e}"
        if reference.norm() > 0:
            worst = max(worst, (difference / reference.norm()).item())
    return worst


def test_two_processes_end_with_identical_parameters(tmp_path):
    ranks = launch(tmp_path, "groups", 29517)
    initial = dict(build("qwen3_next_moe", seed=0).named_parameters())
    changed = sum(not torch.equal(value, initial[name].detach()) for name, value in ranks[0]["params"].items())
    assert changed > len(initial) // 2, "training did not move the parameters"
    assert len(ranks[0]["logged"]) == 2 and ranks[0]["logged"][0]["tree/R_tok"] > 1
    # the MoE load-balancing loss is per microbatch: tree_balance_replicas keeps TRL's split (and logs no imbalance)
    assert "tree/replica_imbalance" not in ranks[0]["logged"][0]


def test_two_processes_with_uneven_planner_pieces_match_one_process(tmp_path):
    """Budget 30 and forests of different sizes: per microbatch the ranks run different numbers of pieces (each
    a forward+backward), or one rank pieces and the other one tree forward; DDP still all-reduces once per
    optimizer step (in the last backward) and the result equals one process over the same global batch."""
    ranks = launch(tmp_path / "two", "planner", 29518)
    single = run_one_process(tmp_path / "one", "planner")
    pairs = list(zip(ranks[0]["pieces"], ranks[1]["pieces"]))  # per microbatch; 1: it fit, one tree forward
    assert len(pairs) == 4 and any(a != b and min(a, b) > 1 for a, b in pairs), f"trees not uneven: {pairs}"
    assert any((a == 1) != (b == 1) for a, b in pairs), f"no microbatch mixes pieces and one forward: {pairs}"
    worst, _ = compare_final_parameters(ranks[0], single, value_tol=1e-5, step_tol=1e-3)
    print(f"\n[2 processes, planner] pieces per microbatch {ranks[0]['pieces']} vs {ranks[1]['pieces']}; "
          f"worst |2-proc - 1-proc| / |step| = {worst:.2e}")
    assert ranks[0]["logged"][0]["tree/handoffs"] > 0


@pytest.mark.parametrize("mode, port", [("mixed", 29554), ("mixed_no_checkpointing", 29555),
                                        ("mixed_sequence", 29556)])
def test_two_processes_with_pieces_on_one_and_one_forward_on_the_other_match_one_process(tmp_path, mode, port):
    """Process 0 runs every microbatch as planner pieces (a hand-off forward without gradient first), process 1 as
    one tree forward, over 3 optimizer steps of 2 accumulated microbatches. DDP's forward issues collectives (with
    gradient checkpointing, find_unused_parameters=False: a bucket rebuild in the first forward with gradient after
    the first synchronised backward; Qwen3-Next's RoPE buffers: a broadcast in the first forward after a
    synchronised one), which both processes must issue in the same order (else gloo fails on a size mismatch or
    hangs): each step's loss and gradient norm equal one process's over the same global batch."""
    ranks = launch(tmp_path / "two", mode, port, timeout=300)
    single = run_one_process(tmp_path / "one", mode)
    pairs = list(zip(ranks[0]["pieces"], ranks[1]["pieces"]))  # per microbatch; 1: it fit, one tree forward
    assert len(pairs) == 6 and all(a > 1 and b == 1 for a, b in pairs), pairs
    assert all(rank["find_unused_parameters"] is (mode == "mixed_no_checkpointing") for rank in ranks)
    logged = [[{k: v for k, v in entry.items() if "time" not in k} for entry in rank["logged"]] for rank in ranks]
    assert logged[0] == logged[1]  # the same steps, values and metrics on both processes (timings aside)
    steps = [[(entry["loss"], entry["grad_norm"]) for entry in run["logged"]] for run in (ranks[0], single)]
    assert len(steps[1]) == 3
    for two, one in zip(*steps):
        assert two == pytest.approx(one, rel=1e-4, abs=1e-6), steps
    worst, _ = compare_final_parameters(ranks[0], single, value_tol=1e-5, step_tol=1e-3)
    print(f"\n[2 processes, {mode}] pieces per microbatch {ranks[0]['pieces']} vs {ranks[1]['pieces']}; (loss, grad "
          f"norm) per step {steps[0]} vs one process {steps[1]}; worst |2-proc - 1-proc| / |step| = {worst:.2e}")


@pytest.mark.parametrize("mode, port", [("cross", 29520), ("cross_grpo", 29521)])
def test_two_processes_with_cross_replica_handoffs_match_one_process(tmp_path, mode, port):
    """tree_cross_replica_handoffs: each microbatch's rows of both processes form one forest, planned over the two
    processes; a tree's pieces run on either, the prefix's states and keys handed across point to point (gloo),
    TRL's per-token loss with each row's own process's normalisers. The parameters after 2 optimizer steps equal
    one process over the same global batch (the 1-process run plans its own microbatch as usual). 'dapo' (TRL's
    default) normalises by the global token count; 'grpo' by each process's own rows, which the weights must keep."""
    ranks = launch(tmp_path / "two", mode, port)
    single = run_one_process(tmp_path / "one", mode)
    assert ranks[0]["pieces"] and len(ranks[0]["pieces"]) == len(ranks[1]["pieces"])
    crossing = [c for _, c in ranks[0]["pieces"]]
    assert [c for _, c in ranks[1]["pieces"]] == crossing  # one plan, built the same on both processes
    assert sum(crossing) > 0, f"no hand-off crossed processes: {ranks[0]['pieces']}"
    worst_gradient = compare_first_gradients(ranks, single)
    worst, _ = compare_final_parameters(ranks[0], single, value_tol=1e-5, step_tol=1e-3)
    print(f"\n[2 processes, cross-replica hand-offs, {mode}] (pieces here, crossing hand-offs) per microbatch: rank 0 "
          f"{ranks[0]['pieces']}, rank 1 {ranks[1]['pieces']}; first-step gradient vs 1 process "
          f"{worst_gradient:.2e}; after 2 steps worst |2-proc - 1-proc| / |step| = {worst:.2e}")
    trees = [[{k: v for k, v in e.items() if k.startswith("tree/")} for e in rank["logged"]] for rank in ranks]
    assert trees[0] == trees[1] and ranks[0]["logged"][0]["tree/handoffs"] > 0


def test_three_processes_with_cross_replica_handoffs_match_one_process(tmp_path):
    """The cross-replica run on 3 processes, 6 rows each (a prefix's hand-offs may go to either of two other
    processes): one plan built alike on every process, hand-offs crossing processes, every process running pieces,
    and the first gradient and the parameters after 2 optimizer steps equal one process over the same 18 rows per
    microbatch."""
    ranks = launch(tmp_path / "three", "cross_three", 29522, processes=3)
    single = run_one_process(tmp_path / "one", "cross_three")
    crossing = [[c for _, c in rank["pieces"]] for rank in ranks]
    assert crossing[0] == crossing[1] == crossing[2] and sum(crossing[0]) > 0, [r["pieces"] for r in ranks]
    here = [sum(h for h, _ in rank["pieces"]) for rank in ranks]
    assert all(here), f"a process ran no piece: {[r['pieces'] for r in ranks]}"
    worst_gradient = compare_first_gradients(ranks, single)
    worst, _ = compare_final_parameters(ranks[0], single, value_tol=1e-5, step_tol=1e-3)
    print(f"\n[3 processes, cross-replica hand-offs] (pieces here, crossing hand-offs) per microbatch: "
          f"{[r['pieces'] for r in ranks]}; first-step gradient vs 1 process {worst_gradient:.2e}; after 2 steps "
          f"worst |3-proc - 1-proc| / |step| = {worst:.2e}")


def test_two_processes_balance_whole_groups_and_match_one_process(tmp_path):
    """TRL's split gives process 0 both big trees of every generation batch; tree_balance_replicas moves whole
    groups so each process holds one big and one small group (the same rows per process). Under DDP's average
    the 'grpo' loss of equal-row microbatches is (1 / all rows) x the sum of per-row terms wherever rows sit, so
    the first step's gradient and the final parameters equal one process over the same global batch."""
    ranks = launch(tmp_path / "two", "balance", 29519)
    single = run_one_process(tmp_path / "one", "balance")
    for rank in ranks:  # two generation batches; each process trains on one long ("!") and one short prompt
        assert len(rank["held"]) == 2
        for prompts in rank["held"]:
            assert len(prompts) == 2 and sum(p.startswith("!") for p in prompts) == 1, prompts
    trees = [[{k: v for k, v in entry.items() if k.startswith("tree/") or k == "step"} for entry in rank["logged"]]
             for rank in ranks]
    assert trees[0] == trees[1]  # lock-step: the same steps, tree totals and imbalance on both processes
    logged = ranks[0]["logged"]
    before = [entry["tree/replica_imbalance_before"] for entry in logged]
    after = [entry["tree/replica_imbalance"] for entry in logged]
    assert len(logged) == 2 and all(b > 1.3 for b in before) and all(a < 1.1 for a in after), (before, after)
    assert all(entry["tree/replica_moved_rows"] == 12 for entry in logged)
    worst_gradient = compare_first_gradients(ranks, single)
    worst_step, worst_value = compare_final_parameters(ranks[0], single, value_tol=1e-6, step_tol=1e-4)
    print(f"\n[2 processes, balanced] imbalance before {before} after {after}; worst first-step gradient error "
          f"{worst_gradient:.2e}; parameters after 2 steps: worst |2-proc - 1-proc| / |step| = {worst_step:.2e}, "
          f"/ |value| = {worst_value:.2e}")


def test_tree_sft_on_two_processes_matches_one_process(tmp_path):
    """TreeSFTTrainer under DDP (2 processes, 3 rows each) trains the same global batch as one process (6 rows):
    SFTTrainer's token count across processes and DDP's average give the same language-modelling objective; the
    MoE load-balancing loss is a per-process mean, as in SFTTrainer, so the parameters agree to ~1e-3 of the step
    they took; both ranks end bit-identical."""
    script = Path(__file__).parent / "scripts" / "two_process_tree_sft.py"
    ranks = launch(tmp_path / "two", None, 29549, script)
    single = run_one_process(tmp_path / "one", None, script)
    worst_step, _ = compare_final_parameters(ranks[0], single, value_tol=1e-5, step_tol=1e-3)
    losses = [[entry["loss"] for entry in run["logged"]] for run in (ranks[0], single)]
    assert len(losses[1]) == 2 and losses[0] == pytest.approx(losses[1], rel=1e-4)
    print(f"\n[TreeSFT, 2 processes vs 1] worst parameter difference {worst_step:.1e} of the step; losses {losses}")
