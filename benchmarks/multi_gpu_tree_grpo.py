"""Multi-GPU TreeGRPOTrainer on `swe` rollout trees: throughput per GPU, replica imbalance, loss/grad-norm parity.

No generation: a TRL ``rollout_func`` (:class:`WorkloadRollouts`) hands the trainer the trajectories of the `swe`
workload preset (harts_hf.workloads), one prompt group per task. Launch it with ``accelerate launch`` (DDP or
DeepSpeed ZeRO-2/3), or as plain ``python`` for the one-process reference over the same global batch.

On the 2-GPU machine, from the repository root (bf16 + gradient checkpointing on CUDA; add ``--tree-token-budget N``
to run big microbatches as planner pieces, DDP or DeepSpeed; on the lent machines, first unpack the package bundle as
../shared/device/README.md says, `python3` there):

    python benchmarks/multi_gpu_tree_grpo.py --preset 2b --scale 0.05 --tasks-per-step 4 --steps 6 --warmup 2 \
        --out results/mgpu/one
    accelerate launch --config_file examples/accelerate_ddp.yaml benchmarks/multi_gpu_tree_grpo.py --preset 2b \
        --scale 0.05 --tasks-per-step 4 --steps 6 --warmup 2 --out results/mgpu/ddp --compare results/mgpu/one/summary.json
    accelerate launch --config_file examples/accelerate_deepspeed_zero2.yaml benchmarks/multi_gpu_tree_grpo.py \
        --preset 2b --scale 0.05 --tasks-per-step 4 --steps 6 --warmup 2 --out results/mgpu/zero2 \
        --compare results/mgpu/one/summary.json          # needs `pip install deepspeed`
    accelerate launch --config_file examples/accelerate_deepspeed_zero3.yaml benchmarks/multi_gpu_tree_grpo.py \
        --preset 2b --scale 0.05 --tasks-per-step 4 --steps 6 --warmup 2 --out results/mgpu/zero3 \
        --compare results/mgpu/one/summary.json          # ZeRO-3 (also on CPU in tests/test_deepspeed.py)
    python benchmarks/multi_gpu_tree_grpo.py --preset 2b --scale 0.05 --tasks-per-step 4 --steps 6 --warmup 2 \
        --trainer trl --grad-accum 54 --out results/mgpu/trl --compare results/mgpu/one/summary.json
    accelerate launch --config_file examples/accelerate_ddp.yaml benchmarks/multi_gpu_tree_grpo.py --preset 2b \
        --scale 0.1 --tasks-per-step 2 --steps 2 --warmup 1 --tree-token-budget 16384 \
        --cross-replica --out results/mgpu/cross      # both tasks' trees planned as one forest over both GPUs

The last one is TRL's own GRPOTrainer on the same rollouts (right-padded micro-batches, every trajectory computed
alone): the end-to-end baseline, with the loss and grad norm to compare against the tree run.

At scale 0.05 a step is 4 tasks x 54 rows: ~510k path tokens, ~88.6k unique (R_tok ~5.7), completions up to 3,269
tokens; the 1-GPU reference holds all of it in one tree forward (fp32 weights and AdamW state ~35 GiB for 2.2B
parameters, plus activations). Measured on 2 x H200 (BENCHMARKS.md, "Multi-GPU training"): 9.03 s/step on one
GPU, 4.55 with DDP, 4.20 with ZeRO-2. The first steps include fla's Triton autotuning and compilation (~100 s per
process without a warm Triton cache), hence ``--warmup 2``.

The first command is the 1-GPU reference: it trains the whole global batch (all tasks of a step) in one process,
so its step time is the 1-GPU time of the work the 2-GPU runs split (add ``--grad-accum 2`` to it for the same
microbatch size as one of 2 GPUs; the objective is the same). ``--compare`` adds per-step loss / grad-norm
differences and the per-GPU throughput ratio (scaling efficiency) to the summary. The default loss is TRL's
'dapo' (normalised by the whole generation batch's tokens: with DDP's gradient average, N processes train the
same objective as one; 'grpo' is too, but its value, the mean advantage, is ~0). CPU smoke run (gloo, 2 processes,
fp32):

    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \
        --dynamo_backend no benchmarks/multi_gpu_tree_grpo.py --preset tiny --scale 0.002 --steps 2 --out /tmp/mgpu

NVLink multicast (NVLS) stays off: every process sets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 at the top of this file, before torch (and torch.distributed) is imported, because on the
shared H200 hosts a program using multicast can put the host's GPUs out of service; export them in the launching
shell as well. They are harmless on CPU.

Writes ``OUT/rank<k>.json`` (per step: wall time, generation / placement / forward time, this rank's path and unique
tokens, its local loss) and, on rank 0, ``OUT/summary.json`` (per step: step time per rank and its max/mean, the
same for forward time, logged loss, grad_norm and tree/* metrics; throughput per GPU over the steps after
``--warmup``; with ``--compare``, the per-step loss / grad-norm differences to a reference summary) and prints a
markdown table. Under DDP the ranks wait for each other in the gradient all-reduce, so their step times are
almost equal; the forward time (this rank's tree forward, no collective inside) shows the work imbalance.
"""

from __future__ import annotations

import os

# Before torch (and torch.distributed) is imported: no NVLink multicast (NVLS) in NCCL, symmetric memory or NVSHMEM.
os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_tree_vs_trajectory import MODELS, build_model  # noqa: E402

PRESETS = {"tiny": "tiny", "2b": "qwen3_next_2b"}  # --preset -> bench_tree_vs_trajectory.MODELS
WORKLOADS = ("swe", "tau", "grpo", "distinct")
AGENTIC = ("swe", "tau")  # agentic presets: tasks of forking multi-turn rollouts
SPECIAL = ("<pad>", "<eos>")  # the last two ids of the model's vocabulary; workload tokens stay below them


# ---------------------------------------------------------------------------------------------- rollouts
class WorkloadRollouts:
    """A TRL ``rollout_func`` that returns workload trajectories (`swe` by default) instead of generating.

    Step ``s`` of training is ``make_workload("swe", scale, seed=seed + s, num_tasks=tasks_per_step)``: its tasks
    share the system prompt, each task's rollouts share the task's issue, and within a rollout thinking is dropped
    from later turns (so its sequences fork where that thinking started). Dataset prompt ``"s:t"`` is task ``t`` of
    step ``s``; with ``shuffle_dataset=False`` the generation batch of step ``s`` holds exactly step ``s``'s tasks,
    whatever the number of processes, so a 1-process and an N-process run train on the same global batch.

    Mapping of one task to one prompt group (TRL needs ``num_generations`` rows per prompt): the group holds
    ``rows_per_task`` of the task's sequences (all of them when the task has exactly that many; otherwise a seeded
    random subset, in emission order; the default is the smallest task's count, so few are dropped). The prompt is
    the group's longest common prefix (system prompt + issue); the rest of each sequence is its completion, so
    siblings share their long agentic histories inside the completions, as multi-turn rollouts do. The workload's
    loss mask becomes TRL's ``env_mask``: observations (tool output) carry no loss, thinking and actions do.
    Token ids are drawn below ``vocab_size - 2``; the last two ids are the tokenizer's pad and EOS.

    ``workload="tau"``: the same for the `tau` preset (a ~4.8k-token policy shared by all tasks, short turns, thinking
    dropped at q = 0.45 of them: R_tok ~9 within a task). ``workload="grpo"``: a task is one prompt group of the `grpo`
    preset (shared system prompt, then the group's prompt). ``workload="distinct"``: the no-sharing control; each task
    is ``rows_per_task`` (default 8) unrelated sequences of the `distinct` preset after ONE shared token (TRL needs a
    prompt per group), so the forest shares one token per group and the tree has nothing else to share.
    """

    def __init__(self, steps: int, tasks_per_step: int, scale: float, vocab_size: int, seed: int = 0,
                 rows_per_task: int | None = None, overrides: dict | None = None, workload: str = "swe"):
        from harts_hf.workloads import make_workload

        if workload not in WORKLOADS:
            raise ValueError(f"workload={workload!r}: expected one of {', '.join(WORKLOADS)}")
        if workload == "distinct":
            rows_per_task = rows_per_task or 8
        self.tasks: dict[str, tuple[list[int], list[list[int]], list[list[int]]]] = {}
        per_step = []
        for step in range(steps):
            count = dict(num_tasks=tasks_per_step) if workload in AGENTIC else \
                dict(num_prompts=tasks_per_step * (rows_per_task if workload == "distinct" else 1))
            generated = make_workload(workload, scale=scale, seed=seed + step, vocab_size=vocab_size - len(SPECIAL),
                                      **{**count, **(overrides or {})})
            per_step.append(_split_by_task(generated) if workload != "distinct"
                            else _distinct_groups(generated, rows_per_task))
            if len(per_step[-1]) != tasks_per_step:
                raise ValueError(f"step {step}: found {len(per_step[-1])} tasks, expected {tasks_per_step}")
        counts = [len(rows) for tasks in per_step for rows in tasks]
        self.rows_per_task = rows_per_task or min(counts)
        if self.rows_per_task > min(counts) or self.rows_per_task < 2:
            raise ValueError(f"rows_per_task={rows_per_task}: tasks have {min(counts)}..{max(counts)} sequences; "
                             "choose 2..the smallest count (default: the smallest count)")
        rng = random.Random(seed)
        for step, tasks in enumerate(per_step):
            for task, rows in enumerate(tasks):
                keep = sorted(rng.sample(range(len(rows)), self.rows_per_task))
                self.tasks[f"{step}:{task}"] = _prompt_and_completions([rows[i] for i in keep])
        self.max_completion_length = max(len(c) for _, completions, _ in self.tasks.values() for c in completions)

    def prompts(self) -> list[str]:
        return list(self.tasks)

    def __call__(self, prompts: list[str], trainer) -> dict:
        """TRL passes each prompt ``num_generations`` times in a row; every run of a prompt gets its task's rows."""
        output = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": []}
        start = 0
        while start < len(prompts):
            prompt_ids, completions, masks = self.tasks[prompts[start]]
            if prompts[start:start + len(completions)] != [prompts[start]] * len(completions):
                raise ValueError(f"prompt {prompts[start]!r} does not come {len(completions)} times in a row; set "
                                 "num_generations to rows_per_task")
            for completion, mask in zip(completions, masks):
                output["prompt_ids"].append(list(prompt_ids))
                output["completion_ids"].append(list(completion))
                output["logprobs"].append([0.0] * len(completion))
                output["env_mask"].append(list(mask))
            start += len(completions)
        return output


def _split_by_task(workload) -> list[list[tuple[list[int], list[bool]]]]:
    """The workload's (sequence, loss mask) pairs per task, tasks in emission order. A task is known by the first
    token after the system prompt (its issue's first token, unique per span by construction of the generator)."""
    system = round(workload.params["system_prompt_len"])
    tasks: dict[int, list] = {}
    for sequence, mask in zip(workload.sequences, workload.loss_masks):
        tasks.setdefault(sequence[system], []).append((sequence, mask))
    return list(tasks.values())


def _distinct_groups(workload, size: int) -> list[list[tuple[list[int], list[bool]]]]:
    """Consecutive groups of ``size`` of the workload's sequences, each after one shared token (id 0, no loss)."""
    rows = [([0, *sequence], [False, *mask]) for sequence, mask in zip(workload.sequences, workload.loss_masks)]
    return [rows[start:start + size] for start in range(0, len(rows), size)]


def _prompt_and_completions(rows) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """Longest common prefix as the prompt (leaving every completion at least one token), the rest as completions,
    loss masks of the completions as 0/1 lists."""
    sequences = [np.asarray(sequence) for sequence, _ in rows]
    shortest = min(len(s) for s in sequences)
    differs = np.nonzero((np.stack([s[:shortest] for s in sequences]) != sequences[0][:shortest]).any(0))[0]
    cut = min(int(differs[0]) if len(differs) else shortest, shortest - 1)
    completions = [s[cut:].tolist() for s in sequences]
    masks = [[int(flag) for flag in mask[cut:]] for _, mask in rows]
    return sequences[0][:cut].tolist(), completions, masks


def hash_reward(completions, completion_ids, **kwargs) -> list[float]:
    """A deterministic reward in [0, 1) per completion: a CRC32 of its token ids (spread inside every group)."""
    return [zlib.crc32(np.asarray(ids, dtype=np.int64).tobytes()) / 2**32 for ids in completion_ids]


def id_tokenizer(vocab_size: int):
    """A word-level tokenizer whose token ``i`` is the text ``"i"``, with ``<pad>`` and ``<eos>`` as the last two
    ids (TRL decodes completions for the reward functions and pads with the pad id)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {str(i): i for i in range(vocab_size - len(SPECIAL))}
    vocab.update({token: vocab_size - len(SPECIAL) + k for k, token in enumerate(SPECIAL)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


# ---------------------------------------------------------------------------------------------- timing
def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_trainer_class(tree: bool = True):
    """TreeGRPOTrainer (or, ``tree=False``, TRL's own GRPOTrainer: padded rows, no sharing) that times, per
    optimizer step on this rank, TRL's generation + scoring, the placement of groups on processes, and the forward
    (tree: from ``compute_loss`` to the tree statistics, before their gather; TRL: ``compute_loss``), and keeps
    this rank's path / unique tokens and attention pairs (TRL: both its unpadded tokens and their causal pairs, sum
    L (L + 1) / 2 over rows) and local loss."""
    from trl import GRPOTrainer

    from harts_hf import TreeGRPOTrainer

    class TimedTreeGRPOTrainer(TreeGRPOTrainer if tree else GRPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.step_record = self._fresh_record()
            self._forward_start = None

        @staticmethod
        def _fresh_record() -> dict:
            return dict(generate_s=0.0, balance_s=0.0, forward_s=0.0, train_s=0.0, path_tokens=0, unique_tokens=0,
                        path_pairs=0.0, tree_pairs=0.0, local_loss=0.0, microbatches=0, plan_memory=[], piece_padding=0)

        def _timed(self, key, function, *args):
            _synchronize(self.accelerator.device)
            start = time.perf_counter()
            result = function(*args)
            _synchronize(self.accelerator.device)
            self.step_record[key] += time.perf_counter() - start
            return result

        def _generate_and_score_completions(self, inputs):
            return self._timed("generate_s", super()._generate_and_score_completions, inputs)

        def _balance_replicas(self, batch):
            return self._timed("balance_s", super()._balance_replicas, batch)

        def compute_loss(self, model, inputs, *args, **kwargs):
            _synchronize(self.accelerator.device)
            self._forward_start = time.perf_counter()
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            if not tree and self._forward_start is not None:  # TRL's padded forward: no tree statistics hook
                lengths = (inputs["prompt_mask"].sum(1) + inputs["completion_mask"].sum(1)).double()
                tokens, pairs = int(lengths.sum()), float((lengths * (lengths + 1) / 2).sum())
                self._record_tree_stats(dict(path_tokens=tokens, unique_tokens=tokens, path_attention_pairs=pairs,
                                             tree_attention_pairs=pairs))
            return loss

        def _record_tree_stats(self, stats):
            if self._forward_start is not None:  # the training forward of this microbatch (not TRL's old log-probs)
                _synchronize(self.accelerator.device)
                self.step_record["forward_s"] += time.perf_counter() - self._forward_start
                self.step_record["path_tokens"] += int(stats["path_tokens"])
                self.step_record["unique_tokens"] += int(stats["unique_tokens"])
                self.step_record["path_pairs"] += float(stats["path_attention_pairs"])
                self.step_record["tree_pairs"] += float(stats["tree_attention_pairs"])
                self._forward_start = None
            if tree:
                super()._record_tree_stats(stats)

        def training_step(self, model, inputs, num_items_in_batch=None):
            # the whole micro-step: TRL's generation and scoring when its buffer is empty, the loss, every backward
            loss = self._timed("train_s", super().training_step, model, inputs, num_items_in_batch)
            self.step_record["local_loss"] += loss.item()
            self.step_record["microbatches"] += 1
            # planner pieces (CUDA): allocated / peak GiB after each piece's phases, for the last microbatch
            self.step_record["plan_memory"] = getattr(self, "last_plan_memory", [])  # TRL's trainer: none
            self.last_plan_memory = []
            # DeepSpeed with planner pieces: filler passes this process ran to match the others' collectives
            self.step_record["piece_padding"] += getattr(self, "last_piece_padding", 0)
            self.last_piece_padding = 0
            return loss

    return TimedTreeGRPOTrainer


def step_recorder(trainer, records: list, partial: Path | None = None):
    """Callback: wall time of every optimizer step on this rank (CUDA-synchronised), with the trainer's counters;
    with ``partial``, the steps so far are written there after each step (a run stopped by a time limit keeps them)."""
    from transformers import TrainerCallback

    class StepRecorder(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            _synchronize(trainer.accelerator.device)
            if trainer.accelerator.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(trainer.accelerator.device)
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            device = trainer.accelerator.device
            _synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
            records.append(dict(step=state.global_step, step_s=time.perf_counter() - self.start, peak_gib=peak,
                                **trainer.step_record))
            trainer.step_record = trainer._fresh_record()
            if partial is not None:
                partial.parent.mkdir(parents=True, exist_ok=True)
                partial.write_text(json.dumps(dict(steps=records, logged=logged_steps(state.log_history)), indent=1))

    return StepRecorder()


def logged_steps(log_history: list[dict]) -> list[dict]:
    """The trainer's logged optimizer steps (entries with a loss and a grad norm), their numeric fields."""
    return [{k: v for k, v in entry.items() if isinstance(v, (int, float))} for entry in log_history
            if "loss" in entry and "grad_norm" in entry]


# ---------------------------------------------------------------------------------------------- summary
def _model_work(rates: dict | None, unique: float, tree_pairs: float, path: float, path_pairs: float, seconds: float,
                world: int) -> dict:
    """:func:`model_flops.throughput`'s model FLOPs, FLOP ratio and MFU of the computed work (the tree's unique
    tokens and pairs; for TRL, which shares nothing, the rows' own) over ``seconds`` on ``world`` GPUs. Empty
    without ``rates`` (a rank record written before they were recorded)."""
    if not rates:
        return {}
    from model_flops import throughput

    work = throughput(rates, seconds * world, unique, tree_pairs, path, path_pairs)  # GPU-seconds: MFU per GPU
    return {key: work[key] for key in ("model_flops", "flop_ratio", "mfu")}


def summarize(ranks: list[dict], warmup: int) -> dict:
    """Per step: each rank's times and tokens, max/mean imbalances, logged loss / grad_norm / tree metrics, and the
    step's model FLOPs, FLOP ratio and MFU over the slowest rank's time; over the steps after ``warmup``: global
    and per-GPU tokens/s (tokens of all ranks over the slowest rank's time) and the same FLOP figures."""
    world = len(ranks)
    by_step = [{r["step"]: r for r in rank["steps"]} for rank in ranks]
    steps = sorted(set.intersection(*(set(s) for s in by_step)))
    logged = {entry["step"]: entry for entry in ranks[0]["logged"]}
    rates = ranks[0].get("flop_rates")
    rows = []
    for step in steps:
        entries = [s[step] for s in by_step]
        step_s = [e["step_s"] for e in entries]
        forward_s = [e["forward_s"] for e in entries]
        log = logged.get(step, {})
        rows.append(dict(
            step=step, step_s=step_s, forward_s=forward_s,
            # fwd+bwd of every micro-step (forward_s stops where the loss is known: before the last piece's backward,
            # or before Trainer's backward without pieces) and what the step spends outside its micro-steps
            # (optimizer, gradient clipping, logging)
            loss_s=[e.get("train_s", 0.0) - e["generate_s"] - e["balance_s"] for e in entries],
            outside_s=[e["step_s"] - e.get("train_s", 0.0) for e in entries],
            step_imbalance=max(step_s) / (sum(step_s) / world),
            forward_imbalance=max(forward_s) / max(sum(forward_s) / world, 1e-12),
            generate_s=[e["generate_s"] for e in entries], balance_s=[e["balance_s"] for e in entries],
            peak_gib=[e.get("peak_gib", float("nan")) for e in entries], path_tokens=[e["path_tokens"] for e in entries], unique_tokens=[e["unique_tokens"] for e in entries],
            path_pairs=[e.get("path_pairs", 0.0) for e in entries], tree_pairs=[e.get("tree_pairs", 0.0) for e in entries],
            local_loss=[e["local_loss"] for e in entries], loss=log.get("loss"), grad_norm=log.get("grad_norm"),
            tree={k: v for k, v in log.items() if k.startswith("tree/")}))
        rows[-1].update(_model_work(rates, *(sum(rows[-1][key]) for key in ("unique_tokens", "tree_pairs", "path_tokens",
                                                                             "path_pairs")), max(step_s), world))
    measured = [row for row in rows if row["step"] > warmup] or rows  # a run cut short of its timed steps
    seconds = sum(max(row["step_s"]) for row in measured)
    path = sum(sum(row["path_tokens"]) for row in measured)
    unique = sum(sum(row["unique_tokens"]) for row in measured)
    work = _model_work(rates, unique, *(sum(sum(row[key]) for row in measured) for key in ("tree_pairs", "path_tokens",
                                                                                          "path_pairs")), seconds, world)
    return dict(
        world_size=world, device=ranks[0]["device"], config=ranks[0]["config"], steps=rows,
        measured_steps=[row["step"] for row in measured],
        mean_step_s=seconds / len(measured),
        path_tokens_per_s=path / seconds, unique_tokens_per_s=unique / seconds,
        path_tokens_per_s_per_gpu=path / seconds / world, unique_tokens_per_s_per_gpu=unique / seconds / world,
        step_imbalance=max(row["step_imbalance"] for row in measured),
        forward_imbalance=max(row["forward_imbalance"] for row in measured),
        same_steps_on_every_rank=all(len(rank["steps"]) == len(ranks[0]["steps"]) for rank in ranks), **work)


def compare(summary: dict, reference: dict) -> dict:
    """Per common step: logged loss and grad_norm against a reference run's summary (absolute and relative
    differences); per-GPU throughput as a fraction of the reference's (scaling efficiency)."""
    theirs = {row["step"]: row for row in reference["steps"]}
    steps = []
    for row in summary["steps"]:
        other = theirs.get(row["step"])
        if other is None or row["loss"] is None or other["loss"] is None:
            continue
        entry = dict(step=row["step"], loss=row["loss"], reference_loss=other["loss"],
                     loss_abs_diff=abs(row["loss"] - other["loss"]),
                     loss_rel_diff=abs(row["loss"] - other["loss"]) / max(abs(other["loss"]), 1e-12))
        if row["grad_norm"] is not None and other["grad_norm"] is not None:
            entry.update(grad_norm=row["grad_norm"], reference_grad_norm=other["grad_norm"],
                         grad_norm_rel_diff=abs(row["grad_norm"] - other["grad_norm"]) / max(other["grad_norm"], 1e-12))
        steps.append(entry)
    return dict(steps=steps, reference_world_size=reference["world_size"],
                path_throughput_per_gpu_vs_reference=summary["path_tokens_per_s_per_gpu"]
                / reference["path_tokens_per_s_per_gpu"],
                step_time_vs_reference=summary["mean_step_s"] / reference["mean_step_s"])


def print_table(summary: dict) -> None:
    print(f"\n{summary['world_size']} process(es) on {summary['device']}, preset {summary['config']['preset']}, "
          f"{summary['config'].get('workload', 'swe')} scale {summary['config']['scale']}, {summary['config']['tasks_per_step']} tasks x "
          f"{summary['config']['rows_per_task']} rows per step")
    print("| step | step s per rank | forward s per rank | max/mean step | max/mean fwd | path tok | unique tok | "
          "loss | grad_norm | imbalance before | after |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in summary["steps"]:
        fmt = lambda values: " / ".join(f"{v:.3f}" for v in values)  # noqa: E731
        tree = {key: f"{value:.3f}" for key, value in row["tree"].items()}
        print(f"| {row['step']} | {fmt(row['step_s'])} | {fmt(row['forward_s'])} | {row['step_imbalance']:.3f} | "
              f"{row['forward_imbalance']:.3f} | {sum(row['path_tokens'])} | {sum(row['unique_tokens'])} | "
              f"{row['loss']:.6g} | {row['grad_norm']:.6g} | {tree.get('tree/replica_imbalance_before', '-')} | "
              f"{tree.get('tree/replica_imbalance', '-')} |")
    measured = [row for row in summary["steps"] if row["step"] in summary["measured_steps"]]
    if measured and "loss_s" in measured[0]:
        mean = lambda key: sum(max(row[key]) for row in measured) / len(measured)  # noqa: E731
        print(f"\nper measured step (slowest rank): generation {mean('generate_s'):.3f} s, fwd+bwd "
              f"{mean('loss_s'):.3f} s, outside the micro-steps (optimizer, clipping, logging) {mean('outside_s'):.3f} s")
    print(f"\nsteps {summary['measured_steps']}: {summary['mean_step_s']:.3f} s/step, "
          f"{summary['path_tokens_per_s_per_gpu']:.0f} path / {summary['unique_tokens_per_s_per_gpu']:.0f} unique "
          f"tokens/s per GPU" + (f", FLOP ratio {summary['flop_ratio']:.2f}, MFU {summary['mfu']:.3f}"
                                 if summary.get("mfu") is not None else ""))
    if "compare" in summary:
        result = summary["compare"]
        for entry in result["steps"]:
            print(f"step {entry['step']}: |loss - ref| {entry['loss_abs_diff']:.3e} (rel {entry['loss_rel_diff']:.3e}), "
                  f"grad_norm rel diff {entry.get('grad_norm_rel_diff', float('nan')):.3e}")
        print(f"per-GPU path throughput vs the {result['reference_world_size']}-process reference: "
              f"{result['path_throughput_per_gpu_vs_reference']:.3f}; step time ratio "
              f"{result['step_time_vs_reference']:.3f}")


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", choices=list(PRESETS), help="model (default: %(default)s)")
    parser.add_argument("--workload", default="swe", choices=WORKLOADS,
                        help="rollout preset: swe or tau (agentic trees), grpo (prompt groups) or distinct (the "
                             "no-sharing control; --rows-per-task default 8) (default: %(default)s)")
    parser.add_argument("--scale", type=float, default=0.002, help="token-length scale (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--tasks-per-step", type=int, default=4,
                        help="tasks (prompt groups) per optimizer step, over all processes (default: %(default)s)")
    parser.add_argument("--rows-per-task", type=int, default=None,
                        help="sequences per task = num_generations (default: the smallest task's count)")
    parser.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps (default: %(default)s)")
    parser.add_argument("--tree-token-budget", type=int, default=None,
                        help="most unique tokens per tree forward; larger microbatches run as planner pieces")
    parser.add_argument("--keep-source-graphs", action="store_true",
                        help="tree_keep_source_graphs=True (one process, with --tree-token-budget): a hand-off "
                             "source's forward runs once, its graph kept while the pieces below it run")
    parser.add_argument("--gdn-state-pass", default="auto", choices=["auto", "rounds", "serial"],
                        help="the fla node's state pass (fla_backend.STATE_PASS): fla's per round, all units in one "
                             "launch, or chosen per plan (default: %(default)s)")
    parser.add_argument("--head-chunk-size", type=int, default=4096,
                        help="tree_head_chunk_size: LM-head rows per chunk (default: %(default)s)")
    parser.add_argument("--varlen-kernel", default=None, choices=["torch", "fa4", "auto"],
                        help="tree_varlen_kernel: the tree attention's varlen kernel (default: harts_hf's, torch)")
    parser.add_argument("--row-block-size", type=int, default=None,
                        help="rows per call of the row-wise fla kernels and the gated norm (default: the library's "
                             "FLA_ROW_BUCKET); small values give each process a different call count, as large "
                             "batches do")
    parser.add_argument("--gradient-checkpointing", choices=["auto", "on", "off"], default="auto",
                        help="auto: on with CUDA, off on CPU (default: %(default)s)")
    parser.add_argument("--gdn-backend", default="auto", choices=["auto", "torch", "fla"],
                        help="tree_gdn_backend: auto = fla on CUDA when installed (default: %(default)s)")
    parser.add_argument("--num-iterations", type=int, default=1,
                        help="TRL's num_iterations: > 1 reuses each generation batch and computes old log-probs in a "
                             "forward-only pass (default: %(default)s)")
    parser.add_argument("--loss-type", default="dapo", choices=["grpo", "dapo", "dr_grpo", "cispo", "sapo"],
                        help="TRL loss; all of these keep tree_balance_replicas on (default: %(default)s)")
    parser.add_argument("--trainer", default="tree", choices=["tree", "trl"],
                        help="tree: TreeGRPOTrainer; trl: TRL's own GRPOTrainer on the same rollouts (padded rows, "
                             "every trajectory computed alone; use --grad-accum to fit memory) (default: %(default)s)")
    parser.add_argument("--trl-conv", choices=["auto", "fla", "torch"], default="auto",
                        help="with --trainer trl: the short convolution transformers' Qwen3-Next runs, fla's Triton "
                             "kernel standing in for the causal-conv1d package a careful user installs (not on the "
                             "device), or transformers' PyTorch fallback; auto: fla on CUDA where causal-conv1d is "
                             "missing (default: %(default)s)")
    parser.add_argument("--liger", action="store_true",
                        help="with --trainer trl: TRL's use_liger_kernel=True (Liger's Triton RMSNorm / SwiGLU kernels "
                             "in the model's layers; TRL keeps its own chunked LM head), what a careful TRL user turns "
                             "on for speed; needs liger-kernel")
    parser.add_argument("--cross-replica", action="store_true",
                        help="tree_cross_replica_handoffs=True (DDP; needs --tree-token-budget): each microbatch "
                             "planned over every process's rows, a task's tree split over processes")
    parser.add_argument("--no-balance", dest="balance", action="store_false",
                        help="tree_balance_replicas=False: TRL's split of rows over processes")
    parser.add_argument("--workload-override", action="append", default=[], metavar="KEY=VALUE",
                        help="workload generator parameter, e.g. turns=6 (repeatable; lengths in full-size tokens)")
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of throughput (default: %(default)s)")
    parser.add_argument("--learning-rate", type=float, default=1e-5, help="(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument("--out", default="results/multi_gpu_tree_grpo", help="(default: %(default)s)")
    parser.add_argument("--dump-stacks-after", type=float, default=None, metavar="SECONDS",
                        help="write every thread's Python stack to OUT/stacks<rank>.txt every SECONDS (to locate a hang)")
    parser.add_argument("--compare", default=None, metavar="REFERENCE_JSON",
                        help="summary.json of a reference run (e.g. 1 process) to compare loss and grad_norm with")
    args = parser.parse_args(argv)
    if args.liger and args.trainer != "trl":
        parser.error("--liger is TRL's use_liger_kernel for --trainer trl; the tree trainer has fused kernels of its "
                     "own (leave --liger out, or pass --trainer trl)")
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} leaves none of --steps {args.steps} to time: pass more steps than "
                     "warm-up steps")
    if args.compare and not Path(args.compare).is_file():
        parser.error(f"--compare {args.compare}: no such file (a summary.json of a reference run)")
    return args


def bind_trl_conv(choice: str, model) -> str:
    """Give transformers' Qwen3-Next (the TRL side) fla's Triton short convolution in place of its PyTorch fallback
    when the causal-conv1d package is missing (``choice`` "auto") or always ("fla"); checked against the fallback on
    one random input first. Returns what runs: "causal_conv1d", "fla" or "torch"."""
    import importlib.util

    module = sys.modules[type(model).__module__]
    if choice == "torch":
        return "torch"
    if choice == "auto" and importlib.util.find_spec("causal_conv1d") is not None:
        return "causal_conv1d"
    from fla.modules.causal_conv1d import causal_conv1d

    fallback = module.causal_conv1d_fn

    def fla_causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        # transformers' contract: [B, C, T] in and out, weight [C, W]; fla's kernel takes [B, T, C] and computes in
        # fp32, rounding once to the input's dtype (as the fallback's conv in the weights' fp32 does)
        return causal_conv1d(hidden_states.transpose(1, 2), weight, bias, activation=activation)[0].transpose(1, 2)

    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 64, 300, device="cuda", generator=generator)
    weight, bias = torch.randn(64, 4, device="cuda", generator=generator), torch.randn(64, device="cuda", generator=generator)
    got, expected = fla_causal_conv1d_fn(x, weight, bias, "silu"), fallback(x, weight, bias, activation="silu")
    if not torch.allclose(got, expected, rtol=1e-4, atol=1e-4):
        raise RuntimeError(f"fla's causal_conv1d differs from transformers' fallback by {(got - expected).abs().max()}")
    module.causal_conv1d_fn = fla_causal_conv1d_fn
    return "fla"


def main(argv=None):
    """Train, write this rank's record (and rank 0 the summary); returns the trainer, so that nothing of it is freed
    before the caller exits (see the end of this file)."""
    args = parse_args(argv)
    from harts_hf import TreeGRPOConfig

    if args.dump_stacks_after:
        import faulthandler

        Path(args.out).mkdir(parents=True, exist_ok=True)
        stacks = open(Path(args.out) / f"stacks{os.environ.get('RANK', '0')}.txt", "w")  # noqa: SIM115 (process-long)
        faulthandler.dump_traceback_later(args.dump_stacks_after, repeat=True, file=stacks)

    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by accelerate launch; the trainer checks it below
    if args.trainer == "tree" and args.tasks_per_step % (world * args.grad_accum):
        raise ValueError(f"--tasks-per-step {args.tasks_per_step} must be a multiple of processes x --grad-accum "
                         f"({world} x {args.grad_accum}), so that every microbatch holds whole groups")
    cuda = torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true")
    from harts_hf.kernels.tree_gated_delta_rule import fla_backend

    fla_backend.STATE_PASS = args.gdn_state_pass  # used by the fla backend only (CUDA)
    if args.row_block_size:
        from harts_hf.kernels import _backend

        _backend.FLA_ROW_BUCKET = args.row_block_size
    spec = MODELS[PRESETS[args.preset]]
    overrides = {key: json.loads(value) for key, value in (item.split("=", 1) for item in args.workload_override)}
    rollouts = WorkloadRollouts(args.steps, args.tasks_per_step, args.scale, spec["vocab_size"], seed=args.seed,
                                rows_per_task=args.rows_per_task, overrides=overrides, workload=args.workload)
    torch.manual_seed(args.seed)  # the same initial weights in every run on the same kind of device
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    model = build_model(PRESETS[args.preset], "qwen3_next", device, torch.float32)  # fp32 weights, bf16 autocast
    checkpointing = cuda if args.gradient_checkpointing == "auto" else args.gradient_checkpointing == "on"
    if not checkpointing:
        model.gradient_checkpointing_disable()
    from model_flops import flop_rates

    rates = flop_rates(model)  # model FLOPs of a token and a pair (and their recompute), kept in the rank record
    rows = args.tasks_per_step * rollouts.rows_per_task
    if rows % (world * args.grad_accum):
        raise ValueError(f"{rows} rows per step must split evenly over processes x --grad-accum "
                         f"({world} x {args.grad_accum})")
    out = Path(args.out)
    config = TreeGRPOConfig(
        output_dir=str(out / "trainer"), max_steps=args.steps, learning_rate=args.learning_rate, seed=args.seed,
        num_generations=rollouts.rows_per_task, per_device_train_batch_size=rows // (world * args.grad_accum),
        gradient_accumulation_steps=args.grad_accum, max_completion_length=rollouts.max_completion_length,
        loss_type=args.loss_type, beta=0.0, num_iterations=args.num_iterations, shuffle_dataset=False,
        tree_token_budget=args.tree_token_budget, tree_cross_replica_handoffs=args.cross_replica,
        tree_keep_source_graphs=args.keep_source_graphs, tree_balance_replicas=args.balance,
        tree_gdn_backend=args.gdn_backend, bf16=cuda, use_cpu=not cuda,
        gradient_checkpointing=checkpointing, tree_head_chunk_size=args.head_chunk_size,
        tree_varlen_kernel=args.varlen_kernel, use_liger_kernel=args.liger, use_tree=not args.liger,
        gradient_checkpointing_kwargs={"use_reentrant": False} if checkpointing else None, logging_steps=1,
        report_to="none", save_strategy="no", disable_tqdm=True)
    from datasets import Dataset

    trainer_class = timed_trainer_class(tree=args.trainer == "tree")
    from harts_hf.model_patches import cpu_safe

    cpu_safe(model)  # TRL's trainer too: CPU forwards where transformers bound fla's Triton kernels
    args.trl_conv = bind_trl_conv(args.trl_conv, model) if args.trainer == "trl" and cuda else "torch"
    trainer = trainer_class(model, reward_funcs=hash_reward, args=config, processing_class=id_tokenizer(spec["vocab_size"]),
                            train_dataset=Dataset.from_dict({"prompt": rollouts.prompts()}), rollout_func=rollouts)
    records: list[dict] = []
    if trainer.accelerator.num_processes != world:
        raise RuntimeError(f"WORLD_SIZE={world} but Accelerate runs {trainer.accelerator.num_processes} processes")
    rank = trainer.accelerator.process_index
    trainer.add_callback(step_recorder(trainer, records, out / f"rank{rank}.partial.json"))
    trainer.train()

    device = str(trainer.accelerator.device)
    if cuda:
        device += f" ({torch.cuda.get_device_name()})"
    logged = logged_steps(trainer.state.log_history)
    run_config = dict(vars(args), rows_per_task=rollouts.rows_per_task, world_size=world,
                      per_device_train_batch_size=config.per_device_train_batch_size,
                      distributed_type=str(trainer.accelerator.distributed_type), torch=torch.__version__,
                      zero_stage=getattr(trainer.accelerator.state.deepspeed_plugin, "zero_stage", None))
    out.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        from run_record import write_run_record

        write_run_record(out)
    (out / f"rank{rank}.json").write_text(json.dumps(
        dict(rank=rank, world_size=world, device=device, config=run_config, steps=records, logged=logged,
             flop_rates=rates), indent=1))
    trainer.accelerator.wait_for_everyone()  # every rank's file is written; no collective follows
    # every rank destroys the process group before it exits: a gloo process left to the interpreter's teardown can
    # abort ("terminate called without an active exception", SIGABRT), which failed a CI run after training ended
    trainer.accelerator.end_training()
    if rank != 0:
        return trainer
    ranks = [json.loads((out / f"rank{k}.json").read_text()) for k in range(world)]
    summary = summarize(ranks, args.warmup)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))  # before the comparison, which may fail
    if args.compare:
        summary["compare"] = compare(summary, json.loads(Path(args.compare).read_text()))
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print_table(summary)
    return trainer


if __name__ == "__main__":
    trainer = main()
    # exit without freeing anything: freeing the DDP / DeepSpeed reducer (when main's frame or the interpreter lets go
    # of the trainer) destroys its gloo process group with the GIL held while a gloo worker thread waits for the GIL
    # to free a finished all-gather's tensors (a deadlock, seen in CI under load), or aborts at teardown
    # (pytorch/pytorch#190489); every file is written and the group destroyed by now
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
