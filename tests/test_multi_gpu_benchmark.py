"""CPU smoke run of benchmarks/multi_gpu_tree_grpo.py: 2 processes over gloo and the 1-process reference.
Times and the rates and imbalances made of them are checked for shape only (CI's machine is loaded); losses,
gradient norms, token counts and the planner's estimated-cost imbalances are checked for their values."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "multi_gpu_tree_grpo.py"
ENV = dict(os.environ, ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1")
ARGS = ["--preset", "tiny", "--scale", "0.002", "--steps", "2", "--tasks-per-step", "4"]


def is_finite_nonnegative(value) -> bool:
    """A measured time, or a rate or imbalance made of them: a finite float >= 0, whatever its size."""
    return isinstance(value, float) and math.isfinite(value) and value >= 0


def run(command: list[str]) -> None:
    result = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_two_processes_on_swe_trees_match_one_process(tmp_path):
    """Both runs train the same global batch per step (4 swe tasks; dataset order fixed), each process 2 whole
    groups. The default 'dapo' loss divides by the generation batch's token count over all processes, and DDP
    averages gradients, so the 2-process objective and gradient equal the 1-process ones (and the logged loss is
    the mean of the processes' losses, i.e. the same value); grad_norm is logged after the all-reduce. Unique
    tokens are not compared: each process computes the shared system prompt once, so 2 processes hold it twice."""
    one, two = tmp_path / "one", tmp_path / "two"
    run([sys.executable, str(SCRIPT), *ARGS, "--out", str(one)])
    run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
         "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29527", str(SCRIPT), *ARGS,
         "--out", str(two), "--compare", str(one / "summary.json")])
    ranks = [json.loads((two / f"rank{k}.json").read_text()) for k in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2], "accelerate ran fewer than 2 processes"
    assert [len(r["steps"]) for r in ranks] == [2, 2]
    partial = [json.loads((two / f"rank{k}.partial.json").read_text()) for k in range(2)]  # written after each step
    assert [p["steps"] for p in partial] == [r["steps"] for r in ranks]
    assert all(step["path_tokens"] > step["unique_tokens"] > 0 for r in ranks for step in r["steps"])
    reference, summary = (json.loads((path / "summary.json").read_text()) for path in (one, two))
    assert reference["world_size"] == 1 and summary["world_size"] == 2 and summary["same_steps_on_every_rank"]
    for key in ("mean_step_s", "step_imbalance", "forward_imbalance", "path_tokens_per_s_per_gpu",
                "unique_tokens_per_s_per_gpu"):
        assert is_finite_nonnegative(summary[key]), (key, summary[key])
    for row, single in zip(summary["steps"], reference["steps"]):
        assert len(row["step_s"]) == 2 and len(row["forward_s"]) == 2
        assert all(map(is_finite_nonnegative, row["step_s"] + row["forward_s"] + row["loss_s"] + row["outside_s"])), row
        assert all(loss >= forward for loss, forward in zip(row["loss_s"], row["forward_s"])), row  # + the backward
        assert sum(row["path_tokens"]) == sum(single["path_tokens"])  # the same global batch
        assert row["tree"]["tree/replica_imbalance_before"] >= row["tree"]["tree/replica_imbalance"] >= 1
    compared = summary["compare"]["steps"]
    assert [entry["step"] for entry in compared] == [1, 2]
    first, second = compared
    assert abs(first["reference_loss"]) > 1e-4 and first["reference_grad_norm"] > 1e-4  # non-trivial values
    assert first["loss_rel_diff"] < 1e-5 and first["grad_norm_rel_diff"] < 1e-5, first
    assert second["loss_rel_diff"] < 1e-4 and second["grad_norm_rel_diff"] < 1e-4, second  # after one update
    print(f"\n[swe trees, 2 processes vs 1] step 1: loss {first['loss']:.6g} vs {first['reference_loss']:.6g} "
          f"(rel {first['loss_rel_diff']:.1e}), grad_norm rel {first['grad_norm_rel_diff']:.1e}; step 2: loss rel "
          f"{second['loss_rel_diff']:.1e}, grad_norm rel {second['grad_norm_rel_diff']:.1e}; placement imbalance "
          f"{[r['tree']['tree/replica_imbalance_before'] for r in summary['steps']]} -> "
          f"{[r['tree']['tree/replica_imbalance'] for r in summary['steps']]}")


def test_cross_replica_handoffs_on_swe_trees_match_one_process(tmp_path):
    """--cross-replica (tree_cross_replica_handoffs): 2 swe tasks per step, one per process, planned as ONE forest
    over both processes (budget 200: the shared system prompt and each task's prefix on one process, pieces of both
    tasks on either); loss and grad norm equal the 1-process run over the same global batch."""
    one, two = tmp_path / "one", tmp_path / "two"
    args = ["--preset", "tiny", "--scale", "0.002", "--steps", "2", "--tasks-per-step", "2", "--tree-token-budget", "200"]
    run([sys.executable, str(SCRIPT), *args, "--out", str(one)])
    run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
         "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29528", str(SCRIPT), *args,
         "--cross-replica", "--out", str(two), "--compare", str(one / "summary.json")])
    summary = json.loads((two / "summary.json").read_text())
    assert summary["world_size"] == 2 and all(row["tree"]["tree/handoffs"] > 0 for row in summary["steps"])
    for entry in summary["compare"]["steps"]:
        assert entry["loss_rel_diff"] < 1e-5 and entry["grad_norm_rel_diff"] < 1e-5, entry


def test_trl_trainer_on_the_same_rollouts_matches_the_tree_trainer(tmp_path):
    """--trainer trl runs TRL's own GRPOTrainer (padded rows, micro-batches of 53 rows via --grad-accum 4) on the
    same swe rollouts: the same loss and grad_norm as TreeGRPOTrainer's one tree forward per step, and every
    path token is also a computed token (no sharing)."""
    tree, trl = tmp_path / "tree", tmp_path / "trl"
    run([sys.executable, str(SCRIPT), *ARGS, "--out", str(tree)])
    run([sys.executable, str(SCRIPT), *ARGS, "--trainer", "trl", "--grad-accum", "4", "--out", str(trl),
         "--compare", str(tree / "summary.json")])
    summary = json.loads((trl / "summary.json").read_text())
    assert summary["config"]["trainer"] == "trl" and summary["config"]["per_device_train_batch_size"] * 4 == 4 * 53
    assert all(r["path_tokens"] == r["unique_tokens"] for r in summary["steps"])
    first, second = summary["compare"]["steps"]
    assert first["loss_rel_diff"] < 1e-5 and first["grad_norm_rel_diff"] < 1e-5, first
    assert second["loss_rel_diff"] < 1e-4 and second["grad_norm_rel_diff"] < 1e-4, second


def test_grpo_and_distinct_rollouts_make_prompt_groups():
    """--workload grpo: one task per prompt group (the group's shared system prompt + prompt is TRL's prompt);
    --workload distinct: groups of 8 unrelated sequences after one shared token (the no-sharing control)."""
    sys.path.insert(0, str(SCRIPT.parent))
    import multi_gpu_tree_grpo as bench

    grpo = bench.WorkloadRollouts(2, 3, 0.01, 1000, workload="grpo")
    assert len(grpo.tasks) == 6 and grpo.rows_per_task == 8
    distinct = bench.WorkloadRollouts(2, 3, 0.01, 1000, workload="distinct")
    assert len(distinct.tasks) == 6 and distinct.rows_per_task == 8
    for prompt, completions, masks in distinct.tasks.values():
        assert prompt == [0] and len(completions) == 8 and all(map(len, completions))
        assert len({tuple(c[:3]) for c in completions}) == 8  # nothing shared past the one token
        assert all(len(m) == len(c) and any(m) for m, c in zip(masks, completions))


def both_trainers(tmp_path, args: list[str], grad_accum: int) -> dict:
    """TreeGRPOTrainer, then TRL's GRPOTrainer (``grad_accum`` padded micro-batches) on the same rollouts; asserts
    the same loss and grad_norm in every step, the same per-trajectory work (tokens and causal attention pairs) in
    both summaries, TRL's FLOP ratio 1 (it shares nothing) and the tree's the forest's; returns the tree run's
    summary."""
    tree, trl = tmp_path / "tree", tmp_path / "trl"
    run([sys.executable, str(SCRIPT), *args, "--out", str(tree)])
    run([sys.executable, str(SCRIPT), *args, "--trainer", "trl", "--grad-accum", str(grad_accum), "--out", str(trl),
         "--compare", str(tree / "summary.json")])
    theirs = json.loads((trl / "summary.json").read_text())
    for entry in theirs["compare"]["steps"]:
        assert entry["loss_rel_diff"] < 1e-4 and entry["grad_norm_rel_diff"] < 1e-4, entry
    ours = json.loads((tree / "summary.json").read_text())
    rates = json.loads((tree / "rank0.json").read_text())["flop_rates"]
    for mine, other in zip(ours["steps"], theirs["steps"]):
        assert mine["path_pairs"] == other["path_pairs"] == other["tree_pairs"] and mine["path_tokens"] == other["path_tokens"]
        assert other["flop_ratio"] == 1.0 and all(is_finite_nonnegative(row["mfu"]) for row in (mine, other))
        work = [rates["per_token"] * sum(mine[tokens]) + rates["per_pair"] * sum(mine[pairs])
                for tokens, pairs in (("path_tokens", "path_pairs"), ("unique_tokens", "tree_pairs"))]
        assert math.isclose(mine["flop_ratio"], work[0] / work[1], rel_tol=1e-12) and mine["flop_ratio"] >= 1.0
    assert is_finite_nonnegative(ours["mfu"]) and ours["flop_ratio"] >= 1.0
    return ours


def test_trl_trainer_on_distinct_rows_matches_the_tree_trainer(tmp_path):
    """The no-sharing control under both trainers: TRL's GRPOTrainer and TreeGRPOTrainer train the same distinct
    rows to the same loss and grad_norm."""
    reference = both_trainers(tmp_path, ["--preset", "tiny", "--workload", "distinct", "--scale", "0.004", "--steps",
                                         "2", "--tasks-per-step", "2"], grad_accum=2)
    # 2 groups of 8 rows per step; all 16 rows start with the same prompt token, the one token computed once
    assert all(sum(r["path_tokens"]) - sum(r["unique_tokens"]) == 2 * 8 - 1 for r in reference["steps"])


def test_trl_trainer_on_tau_trees_matches_the_tree_trainer(tmp_path):
    """--workload tau (a task's rollouts fork often and share a long policy): TRL's GRPOTrainer, every row padded
    and computed alone, and TreeGRPOTrainer's one forest per step give the same loss and grad_norm."""
    reference = both_trainers(tmp_path, ["--preset", "tiny", "--workload", "tau", "--scale", "0.02", "--steps", "2",
                                         "--tasks-per-step", "1"], grad_accum=5)
    assert reference["config"]["rows_per_task"] == 95  # one task, all its sequences
    assert all(sum(r["path_tokens"]) > 5 * sum(r["unique_tokens"]) for r in reference["steps"])  # R_tok > 5
    assert all(r["flop_ratio"] > 5 for r in reference["steps"])


def test_liger_is_the_trl_baselines_option(capsys):
    """--liger turns on TRL's use_liger_kernel for the TRL baselines only (GRPO and SFT benchmarks): without a TRL
    trainer it is refused, naming the flag and the fix (the tree configs refuse use_liger_kernel with use_tree)."""
    import pytest

    sys.path.insert(0, str(SCRIPT.parent))
    import multi_gpu_tree_grpo as bench
    import sft_step

    assert bench.parse_args(["--trainer", "trl", "--liger"]).liger
    assert not bench.parse_args(["--trainer", "trl"]).liger
    assert sft_step.parse_args(["--trainer", "tree", "trl", "--liger"]).liger
    for parse, argv, message in ((bench.parse_args, ["--liger"], "--liger is TRL's use_liger_kernel for --trainer trl"),
                                 (sft_step.parse_args, ["--trainer", "tree", "--liger"],
                                  "--liger is SFTConfig.use_liger_kernel for --trainer trl")):
        with pytest.raises(SystemExit):
            parse(argv)
        assert message in capsys.readouterr().err
