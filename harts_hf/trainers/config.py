"""TreeGRPOConfig: GRPOConfig plus the switches of tree execution."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from trl import GRPOConfig

from .._checks import check_bool, check_int, check_number
from ..model_patches import gated_deltanet, mamba2, token_modules

__all__ = ["TreeGRPOConfig"]

_GDN_BACKENDS = ("auto", "torch", "fla")
_ATTENTION_BACKENDS = ("auto", "sdpa", "runs", "varlen", "cudnn")
_VARLEN_KERNELS = (None, "torch", "fa4", "flex", "auto")
_AUTOCAST_EXPERTS = (None, *token_modules._AUTOCAST_EXPERTS)
_MAMBA_SCAN_INPUTS = (None, *mamba2._SCAN_INPUTS)
VARLEN_KERNEL_HELP = ("The tree attention's varlen kernel on CUDA: 'auto' (fa4 where installed on Hopper / "
                      "Blackwell, else torch), 'torch' (torch's flash varlen), 'fa4' (FlashAttention-4, pip install "
                      "harts_hf[fa4]; the fastest measured, BENCHMARKS.md), 'flex' (torch's FlexAttention on the "
                      "packed rows where runs share keys: nothing gathered per run); process-wide "
                      "(harts_hf.kernels.tree_attention.varlen.KERNEL). None leaves that setting as it is "
                      "('auto' unless changed).")
AUTOCAST_EXPERTS_HELP = ("Under autocast, where MoE routed experts on transformers' grouped_mm run in the autocast "
                         "dtype (transformers runs them in the weights' dtype: fp32 with fp32 master weights): 'cuda' "
                         "(CUDA inputs), 'always' or 'never'; process-wide "
                         "(harts_hf.model_patches.token_modules.AUTOCAST_EXPERTS). None leaves that setting as it is "
                         "('cuda' unless changed).")
MAMBA_SCAN_INPUTS_HELP = ("Mamba-2 mixers (Nemotron-H, Falcon-H1, Granite-4 hybrid, Bamba): the dtype of the scan's "
                          "C, B and dt*x: 'fp32' (transformers' PyTorch scan), 'half' (the model's half precision, as "
                          "transformers' CUDA path hands them to mamba_ssm; states and sums stay fp32) or 'cuda' "
                          "('half' for CUDA inputs); process-wide (harts_hf.model_patches.mamba2.SCAN_INPUTS). None "
                          "leaves that setting as it is ('cuda' unless changed).")
MAMBA_CHUNK_SIZE_HELP = ("Mamba-2 mixers: the chunk grid of the scan on trees and on harts_hf's per-trajectory path: "
                         "a power of two of at least 16 (64, fla's chunk, is harts_hf's default: on an H100 Nemotron-H "
                         "ran 5.8% faster on the tree and 4.5% on the packed path than on its own 128) or 'own' (each "
                         "mixer's chunk_size, as transformers runs it); process-wide "
                         "(harts_hf.model_patches.mamba2.CHUNK_SIZE, None there for 'own'). None leaves that setting "
                         "as it is (64 unless changed).")
EXECUTED_MIXERS_HELP = ("Recurrent mixers (Gated DeltaNet, Kimi Delta Attention, Mamba-2) on trees: run each whole "
                        "in its kernel's executed layout (the layer's hidden rows gathered in and its output rows out "
                        "once) instead of gathering the kernel's q, k, v and gates in and its outputs and gradients "
                        "out; exact, fewer bytes moved for a few percent more rows through the projections. Not "
                        "faster on an H100 (full-size tau: Kimi-Linear 4.63 s either way with a 2.4 GiB lower peak, "
                        "Nemotron-H 2.5% slower, the 2.3B Qwen3-Next 0.7% slower; BENCHMARKS.md), so off by default; "
                        "a memory option at best; process-wide "
                        "(harts_hf.model_patches.gated_deltanet.EXECUTED_LAYOUT). None leaves that setting as it is.")
SHARED_KEYS_HELP = ("Tree attention on the varlen kernels (torch's, FlashAttention-4): attend key segments shared by "
                    "many trajectories (a group's prompt) in place, one extra unmasked call each merged through the "
                    "log-sum-exp, instead of gathering a copy of them for every trajectory below; exact, fewer "
                    "bytes moved (most for MLA's wide heads: its attention alone 0.87x the time on full-size tau, "
                    "H100), no whole step measured faster yet, so off by default; "
                    "process-wide (harts_hf.kernels.tree_attention.varlen.SHARED_KEYS_IN_PLACE). None leaves that "
                    "setting as it is.")
STORED_LAYERS_HELP = ("With gradient_checkpointing: how many decoder layers keep their activations for the "
                      "backward instead of recomputing their forward (softmax-attention layers first, then the others "
                      "spread evenly). Less compute, more memory; the gradients are the same. 0: every layer is "
                      "checkpointed (transformers' default).")
MATMUL_LAYERS_HELP = ("With gradient_checkpointing (non-reentrant, transformers' default): in how many checkpointed "
                      "decoder layers the forward's matrix-product outputs (every projection's GEMM, and the "
                      "attention) are kept, so that the backward's rerun of those layers recomputes only the "
                      "per-element work between them (softmax-attention layers first, then the others spread "
                      "evenly). Each such layer keeps its projections' outputs for the step: about 2 bytes per token "
                      "per output feature under bf16 (matmul_output_bytes_per_token(model) in "
                      "harts_hf.model_patches says how many per layer). Less compute, more memory; the gradients are "
                      "the same. Not under DeepSpeed ZeRO-3. 0: none.")
KEEP_MIXER_GIB_HELP = ("Instead of tree_keep_mixer_outputs=True: GiB of GPU memory to spend on kept linear-attention / "
                       "Mamba-2 node outputs; they are kept in as many checkpointed layers as fit at tree_token_budget "
                       "tokens per piece (needs tree_token_budget; counted by mixer_output_bytes_per_token in "
                       "autocast's dtype). The chosen layers are logged. None: off.")
KEEP_MIXER_OUTPUTS_HELP = ("With gradient_checkpointing (non-reentrant, transformers' default) and use_tree: keep each "
                           "linear-attention and Mamba-2 node's state pass and output stage from the forward (Gated "
                           "DeltaNet, Kimi Delta Attention, Mamba-2 on fla's kernels, CUDA), so the backward's rerun "
                           "of a checkpointed layer skips them. Memory: each such mixer's output per token of a "
                           "forward, about 2 x value heads x value head dim bytes under bf16 per layer "
                           "(mixer_output_bytes_per_token(model) in harts_hf.model_patches). The gradients are the "
                           "same. Not under DeepSpeed ZeRO-3. False: rerun them, as transformers does.")
MATMUL_GIB_HELP = ("Instead of tree_keep_matmul_layers: GiB of GPU memory to spend on kept matrix-product outputs; "
                   "they are kept in as many checkpointed layers as fit at tree_token_budget tokens per piece (needs "
                   "tree_token_budget; counted by matmul_output_bytes_per_token in autocast's dtype, worked out again "
                   "when the checkpointed layers change). The chosen layers are logged. None: off.")

KEEP_SOURCE_GRAPHS_HELP = ("With planner pieces (tree_token_budget) on one process: a piece that hands states to pieces "
                           "below it runs ONE forward with gradient and keeps its autograd graph while they run, "
                           "instead of a forward without gradient for the hand-off (over its tokens on their root "
                           "paths) and another with gradient after them. Saves that forward, for the memory of the kept "
                           "graphs (those of the pieces on the current chain; with gradient checkpointing, each "
                           "checkpointed layer's input and what the layer keeps). The gradients are the same. Not "
                           "with several processes or DeepSpeed (their gradient synchronisation needs each piece's "
                           "backward right after its forward). False: the second forward (one piece's activations "
                           "at a time).")


def check_source_graphs(trainer, owner: str) -> None:
    """``tree_keep_source_graphs`` runs on one process without DeepSpeed; elsewhere it fails, naming the fix."""
    processes = trainer.accelerator.num_processes
    if trainer.args.tree_keep_source_graphs and (processes > 1 or trainer.is_deepspeed_enabled):
        where = "DeepSpeed" if trainer.is_deepspeed_enabled else f"{processes} processes"
        raise ValueError(f"{owner}: tree_keep_source_graphs=True runs on one process without DeepSpeed (DDP and "
                         "DeepSpeed reduce the gradients in a piece's backward, which must then follow its forward "
                         f"directly), and this run has {where}; set tree_keep_source_graphs=False.")


def check_planner_supported(trainer, owner: str, config_name: str) -> None:
    """Options that cannot run a microbatch as planner pieces, each with its own backward, fail here, naming the fix
    (``owner``: the trainer's name; ``config_name``: its config class)."""
    budget = f"tree_token_budget={trainer.args.tree_token_budget}"
    fix = ("or set tree_token_budget=None (one tree forward per microbatch; lower per_device_train_batch_size if it "
           "does not fit)")
    if trainer.aux_loss_enabled:
        raise ValueError(f"{owner}: the MoE load-balancing loss (router_aux_loss_coef={trainer.router_aux_loss_coef}) "
                         f"depends on the whole microbatch's routing, so it cannot be split over planner pieces "
                         f"({budget}); set router_aux_loss_coef=0.0 in the {config_name}, {fix}.")
    if trainer.is_fsdp_enabled:
        raise ValueError(f"{owner}: FSDP runs backward through its own wrapper, which planner pieces ({budget}, one "
                         f"backward each) do not drive yet; train with DDP or DeepSpeed (ZeRO-2 or ZeRO-3), {fix}.")
    if trainer.is_deepspeed_enabled and trainer.accelerator.mixed_precision == "fp16":
        raise ValueError(f"{owner}: planner pieces ({budget}) under DeepSpeed with fp16: the dynamic loss scale would "
                         f"apply twice to the gradients handed between pieces; use bf16 ({config_name}(bf16=True)), "
                         f"{fix}.")
    if trainer.args.optim in ("lomo", "adalomo"):
        raise ValueError(f"{owner}: optim={trainer.args.optim!r} updates parameters inside backward, but planner "
                         f"pieces ({budget}) run one backward each; choose another optimizer, {fix}.")
    check_source_graphs(trainer, owner)


def matmul_setting(config) -> str:
    """The kept-products field in force, as ``name=value`` for messages (the count where set, else the GiB)."""
    if config.tree_keep_matmul_layers:
        return f"tree_keep_matmul_layers={config.tree_keep_matmul_layers}"
    return f"tree_keep_matmul_gib={config.tree_keep_matmul_gib}"


def mixer_setting(config) -> str | None:
    """The kept-mixer-outputs field in force, as ``name=value`` for messages (None where neither is set)."""
    if config.tree_keep_mixer_outputs:
        return "tree_keep_mixer_outputs=True"
    return None if config.tree_keep_mixer_gib is None else f"tree_keep_mixer_gib={config.tree_keep_mixer_gib}"


def _kept_budget(config, field: str, other: str | None, what: str, instead: str) -> float | None:
    """``config.<field>``: None, or GiB >= 0 (stored back as a float) with ``tree_token_budget`` set and ``other`` (the
    competing setting in force, as ``name=value``) not; ``what`` is kept, ``instead`` the setting without a budget."""
    gib = getattr(config, field)
    if gib is None:
        return None
    gib = check_number(gib, field, allow_zero=True)
    setattr(config, field, gib)
    if other:
        raise ValueError(f"{other} and {field}={gib} both say where {what} are kept; set one.")
    if config.tree_token_budget is None:
        raise ValueError(f"{field}={gib} sizes the kept {what} for pieces of at most tree_token_budget tokens, which is "
                         f"None; set tree_token_budget, or use {instead} instead.")
    return gib


def _needs_non_reentrant_checkpointing(config, setting: str, what: str) -> None:
    """``setting`` (``name=value``) keeps ``what`` of checkpointed layers through a selective-checkpointing policy:
    refused without gradient checkpointing or with its reentrant kind."""
    if not config.gradient_checkpointing:
        raise ValueError(f"{setting} keeps {what} of checkpointed layers, and gradient checkpointing is off (every one "
                         "is kept already); set gradient_checkpointing=True or turn the setting off.")
    if (config.gradient_checkpointing_kwargs or {}).get("use_reentrant"):
        raise ValueError(f"{setting} needs non-reentrant checkpointing (a selective-checkpointing policy), and "
                         "gradient_checkpointing_kwargs sets use_reentrant=True; drop it (transformers' default is "
                         "non-reentrant) or turn the setting off.")


def check_layer_counts(config) -> None:
    """``config.tree_stored_layers`` and ``config.tree_keep_matmul_layers`` are counts >= 0, ``tree_keep_matmul_gib``
    None or GiB >= 0 (with ``tree_token_budget``, and not beside a count), ``tree_keep_mixer_outputs`` a bool and
    ``tree_keep_mixer_gib`` None or GiB (the same way, not beside ``tree_keep_mixer_outputs=True``); each needs
    gradient checkpointing when set, and kept node outputs and matrix products need its non-reentrant kind."""
    config.tree_stored_layers = check_int(config.tree_stored_layers, "tree_stored_layers", minimum=0)
    if config.tree_stored_layers and not config.gradient_checkpointing:
        raise ValueError(f"tree_stored_layers={config.tree_stored_layers} picks layers to leave out of gradient "
                         "checkpointing, which is off; set gradient_checkpointing=True or tree_stored_layers=0.")
    keep = check_bool(config.tree_keep_mixer_outputs, "tree_keep_mixer_outputs")
    _kept_budget(config, "tree_keep_mixer_gib", "tree_keep_mixer_outputs=True" if keep else None, "mixer outputs",
                 "tree_keep_mixer_outputs=True")
    setting = mixer_setting(config)
    if setting:
        _needs_non_reentrant_checkpointing(config, setting, "node outputs")
    count = config.tree_keep_matmul_layers = check_int(config.tree_keep_matmul_layers, "tree_keep_matmul_layers",
                                                       minimum=0)
    gib = _kept_budget(config, "tree_keep_matmul_gib", f"tree_keep_matmul_layers={count}" if count else None,
                       "products", "tree_keep_matmul_layers")
    if count or gib:
        _needs_non_reentrant_checkpointing(config, matmul_setting(config), "products")


_BOOL_FIELDS = ("use_tree", "tree_share_across_groups", "tree_keep_groups_together", "tree_balance_replicas",
                "tree_cross_replica_handoffs", "tree_keep_attention_outputs", "tree_keep_mixer_outputs",
                "tree_keep_source_graphs")


@dataclass
class TreeGRPOConfig(GRPOConfig):
    r"""Configuration of [`TreeGRPOTrainer`]: every [`~trl.GRPOConfig`] field, plus the fields below.

    With `use_tree=True` the policy, old and reference log-probs of each microbatch come from one forward over
    the prefix forest of its sequences: shared prompt and history tokens are computed once, and the loss and
    gradient equal per-trajectory training.
    """

    use_tree: bool = field(
        default=True,
        metadata={"help": "Compute log-probs over prefix trees (shared tokens once). False trains exactly like "
                          "GRPOTrainer, e.g. for a model family without tree support."},
    )
    tree_token_budget: int | None = field(
        default=None,
        metadata={"help": "Most unique tokens in one tree forward. A microbatch whose forest is larger runs as "
                          "planner pieces cut at branch points, each its own forward and backward, with exact "
                          "hand-offs (every token computed once; the same loss and gradient). Not with the MoE "
                          "load-balancing loss (router_aux_loss_coef), DeepSpeed, FSDP or LOMO. A stretch without a "
                          "branch point longer than the budget is cut inside, at chunk boundaries (its parts hand "
                          "over as at a branch point). None: one forward per microbatch."},
    )
    tree_share_across_groups: bool = field(
        default=True,
        metadata={"help": "Let sequences of different prompts share tokens (e.g. a common system prompt is "
                          "computed once for the whole microbatch). False builds one tree per prompt."},
    )
    tree_keep_groups_together: bool = field(
        default=True,
        metadata={"help": "Shuffle the generation batch by prompt group instead of by row, so each microbatch "
                          "holds whole groups and siblings share their prefix. With several optimizer steps per "
                          "generation batch (steps_per_generation > gradient_accumulation_steps) each step then "
                          "trains on whole groups where GRPOTrainer trains on randomly drawn rows: the same "
                          "rows over the generation batch, other rows per step, so the per-step losses differ "
                          "from GRPOTrainer's (logged once). False keeps TRL's row shuffle and GRPOTrainer's "
                          "steps exactly, with less sharing per microbatch."},
    )
    tree_balance_replicas: bool = field(
        default=True,
        metadata={"help": "With several processes (and use_tree, tree_keep_groups_together), gather each generation "
                          "batch from every process and give each process whole prompt groups: the same number of "
                          "rows as TRL gives it, and about the same estimated tree cost (planner cost model on each "
                          "group's prefix forest; longest first, then improving swaps). Logs "
                          "tree/replica_imbalance (largest over mean estimated cost, after) and "
                          "tree/replica_imbalance_before (TRL's split). With equal rows per process the "
                          "'grpo', 'sapo', 'luspo', 'dr_grpo', 'dapo', 'cispo' and 'vespo' losses are the same "
                          "objective wherever rows go. TRL's split is kept, with a warning once that says why, "
                          "when moving rows would change the objective (loss_type='bnpo', the entropy bonus, the "
                          "MoE load-balancing loss, top_entropy_quantile < 1: all normalised or thresholded per "
                          "microbatch or step), for multimodal batches, and for a batch whose groups cannot be "
                          "split into equal row counts. False keeps TRL's split always."},
    )
    tree_cross_replica_handoffs: bool = field(
        default=False,
        metadata={"help": "With several processes (DDP) and tree_token_budget: plan each training microbatch over "
                          "the rows of ALL processes as one forest and let a tree's pieces run on different "
                          "processes, the shared prefix once on one of them, its states and keys handed to the "
                          "others point to point (harts_hf.planner.execute_plan(replica=rank)). Balances trees "
                          "larger than one process's share. Token-level losses only; not with DeepSpeed or FSDP. "
                          "Costlier than whole trees per process where those fit (2 x H200, 2B model, swe scale "
                          "0.1, budget 16384: 10.6 s per step for ~82k unique tokens; plain DDP with whole groups "
                          "and no pieces, on swe scale 0.05 x 4 tasks: ~4.6 s for ~88k; BENCHMARKS.md)."},
    )
    tree_cost_model: str | None = field(
        default=None,
        metadata={"help": "Path to a JSON cost model (harts_hf.planner.CostModel.save; "
                          "benchmarks/calibrate_cost_model.py fits one from timings on your GPU) used to cut "
                          "microbatches into pieces and to place groups on processes. None: the built-in H200 "
                          "guesses."},
    )
    tree_gdn_backend: str = field(
        default="auto",
        metadata={"help": "Gated-delta-rule kernel for tree execution: 'auto' (fla on CUDA when installed, "
                          "else PyTorch), 'torch' or 'fla'.", "choices": list(_GDN_BACKENDS)},
    )
    tree_attention_backend: str = field(
        default="auto",
        metadata={"help": "Softmax-attention kernel for tree execution: 'auto' (on CUDA flash varlen, or cuDNN per "
                          "run when runs are long), 'sdpa' (dense mask), 'runs' (SDPA per run), 'varlen' or 'cudnn'.",
                  "choices": list(_ATTENTION_BACKENDS)},
    )
    tree_varlen_kernel: str | None = field(
        default=None, metadata={"help": VARLEN_KERNEL_HELP, "choices": list(_VARLEN_KERNELS)})
    tree_autocast_experts: str | None = field(
        default=None, metadata={"help": AUTOCAST_EXPERTS_HELP, "choices": list(_AUTOCAST_EXPERTS)})
    tree_mamba_scan_inputs: str | None = field(
        default=None, metadata={"help": MAMBA_SCAN_INPUTS_HELP, "choices": list(_MAMBA_SCAN_INPUTS)})
    tree_mamba_chunk_size: str | None = field(default=None, metadata={"help": MAMBA_CHUNK_SIZE_HELP})
    tree_shared_keys_in_place: bool | None = field(default=None, metadata={"help": SHARED_KEYS_HELP})
    tree_executed_mixers: bool | None = field(default=None, metadata={"help": EXECUTED_MIXERS_HELP})
    tree_head_chunk_size: int = field(
        default=4096,
        metadata={"help": "Rows of the LM head computed at once in tree mode (bounds the logits' memory)."},
    )
    tree_keep_attention_outputs: bool = field(
        default=True,
        metadata={"help": "With gradient_checkpointing (non-reentrant, transformers' default) and use_tree: keep each "
                          "softmax-attention kernel's output and softmax statistics from the forward, so the "
                          "backward's rerun of a checkpointed layer skips the attention (memory: one attention "
                          "output per attention layer). The gradients are the same. False reruns it, as "
                          "transformers does."},
    )
    tree_keep_mixer_outputs: bool = field(default=False, metadata={"help": KEEP_MIXER_OUTPUTS_HELP})
    tree_keep_mixer_gib: float | None = field(default=None, metadata={"help": KEEP_MIXER_GIB_HELP})
    tree_keep_source_graphs: bool = field(default=False, metadata={"help": KEEP_SOURCE_GRAPHS_HELP})
    tree_stored_layers: int = field(default=0, metadata={"help": STORED_LAYERS_HELP})
    tree_keep_matmul_layers: int = field(default=0, metadata={"help": MATMUL_LAYERS_HELP})
    tree_keep_matmul_gib: float | None = field(default=None, metadata={"help": MATMUL_GIB_HELP})

    def __post_init__(self):
        self._check_tree_field_types()
        super().__post_init__()
        if self.tree_gdn_backend not in _GDN_BACKENDS:
            raise ValueError(f"tree_gdn_backend must be one of {_GDN_BACKENDS}, got {self.tree_gdn_backend!r}.")
        if self.tree_attention_backend not in _ATTENTION_BACKENDS:
            raise ValueError(f"tree_attention_backend must be one of {_ATTENTION_BACKENDS}, got "
                             f"{self.tree_attention_backend!r}.")
        check_process_settings(self)
        cuda_kernels = [f"tree_gdn_backend={self.tree_gdn_backend!r}"] if self.tree_gdn_backend == "fla" else []
        if self.tree_attention_backend in ("varlen", "cudnn"):
            cuda_kernels.append(f"tree_attention_backend={self.tree_attention_backend!r}")
        if cuda_kernels and self.use_tree:
            import torch

            if self.use_cpu or not torch.cuda.is_available():
                raise ValueError(f"{' and '.join(cuda_kernels)} run on CUDA only, and this run is on the CPU; use "
                                 "'auto' (it picks the CUDA kernels where they run).")
            if self.tree_attention_backend in ("varlen", "cudnn") and not (self.bf16 or self.fp16):
                raise ValueError(f"tree_attention_backend={self.tree_attention_backend!r} runs in half precision; "
                                 "set bf16=True (or fp16=True), or use tree_attention_backend='auto'.")
        if self.tree_cost_model is not None:
            from ..planner import CostModel

            try:
                CostModel.load(self.tree_cost_model)
            except (OSError, ValueError, TypeError) as error:
                raise ValueError(f"tree_cost_model={self.tree_cost_model!r} is not a readable cost model ({error}); "
                                 "give the JSON written by CostModel.save / benchmarks/calibrate_cost_model.py, or "
                                 "None for the built-in coefficients.") from error
        if self.tree_cross_replica_handoffs and self.tree_token_budget is None:
            raise ValueError("tree_cross_replica_handoffs=True plans microbatches into pieces: set tree_token_budget "
                             "(the most unique tokens of one piece), or tree_cross_replica_handoffs=False.")
        check_layer_counts(self)
        if self.use_tree and self.use_liger_kernel:
            raise ValueError("use_tree=True and use_liger_kernel=True both replace how log-probs are computed; set "
                             "use_liger_kernel=False to train on trees, or use_tree=False to keep Liger.")

    def _check_tree_field_types(self) -> None:
        """Each tree field has its type (numpy integers become ints, path-likes strings; the backends are checked
        against their choices below); an error names the field."""
        for name in _BOOL_FIELDS:
            check_bool(getattr(self, name), name)
        self.tree_token_budget = check_int(self.tree_token_budget, "tree_token_budget", allow_none=True)
        self.tree_head_chunk_size = check_int(self.tree_head_chunk_size, "tree_head_chunk_size")
        self.tree_stored_layers = check_int(self.tree_stored_layers, "tree_stored_layers", minimum=0)
        self.tree_keep_matmul_layers = check_int(self.tree_keep_matmul_layers, "tree_keep_matmul_layers", minimum=0)
        if isinstance(self.tree_cost_model, os.PathLike):
            self.tree_cost_model = os.fspath(self.tree_cost_model)
        if self.tree_cost_model is not None and not isinstance(self.tree_cost_model, str):
            raise TypeError(f"tree_cost_model must be a path to a JSON cost model or None, got "
                            f"{self.tree_cost_model!r} of type {type(self.tree_cost_model).__name__}")


def check_process_settings(config) -> None:
    """``tree_varlen_kernel``, ``tree_autocast_experts`` and ``tree_mamba_scan_inputs`` are each one of their
    choices, ``tree_mamba_chunk_size`` a power of two of at least 16 (an int, or its digits: the command line's),
    'own' or None, ``tree_shared_keys_in_place`` and ``tree_executed_mixers`` a bool or None (an error names the
    field, the value and the choices)."""
    chunk = config.tree_mamba_chunk_size
    if isinstance(chunk, str) and chunk.isdigit():  # from the command line (HfArgumentParser gives strings)
        config.tree_mamba_chunk_size = chunk = int(chunk)
    if chunk is not None and chunk != "own" and not mamba2.is_scan_chunk_size(chunk):
        raise ValueError(f"tree_mamba_chunk_size must be a power of two of at least 16 (64: fla's chunk, the "
                         f"default), 'own' (each Mamba-2 mixer's chunk_size) or None, got {chunk!r}.")
    for name, choices in (("tree_varlen_kernel", _VARLEN_KERNELS), ("tree_autocast_experts", _AUTOCAST_EXPERTS),
                          ("tree_mamba_scan_inputs", _MAMBA_SCAN_INPUTS)):
        if getattr(config, name) not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {getattr(config, name)!r}.")
    for name in ("tree_shared_keys_in_place", "tree_executed_mixers"):
        if getattr(config, name) is not None:
            check_bool(getattr(config, name), f"{name} (or None)")


def apply_process_settings(args) -> None:
    """Put ``tree_varlen_kernel`` (``varlen.KERNEL``), ``tree_autocast_experts`` (``token_modules.AUTOCAST_EXPERTS``),
    ``tree_mamba_scan_inputs`` (``mamba2.SCAN_INPUTS``), ``tree_mamba_chunk_size`` (``mamba2.CHUNK_SIZE``; 'own' is None
    there), ``tree_shared_keys_in_place`` (``varlen.SHARED_KEYS_IN_PLACE``) and ``tree_executed_mixers``
    (``gated_deltanet.EXECUTED_LAYOUT``) in force, process-wide; None leaves a setting as it is. 'fa4' without
    FlashAttention-4 installed fails here, naming the fix."""
    from ..kernels.tree_attention import varlen

    if args.tree_varlen_kernel == "fa4" and not varlen._fa4_importable():
        raise ImportError("tree_varlen_kernel='fa4' needs FlashAttention-4 (pip install harts_hf[fa4], i.e. "
                          "flash-attn-4); or set tree_varlen_kernel='auto' (FlashAttention-4 where it is installed) "
                          "or 'torch'.")
    if args.tree_varlen_kernel is not None:
        varlen.KERNEL = args.tree_varlen_kernel
    if args.tree_autocast_experts is not None:
        token_modules.AUTOCAST_EXPERTS = args.tree_autocast_experts
    if args.tree_mamba_scan_inputs is not None:
        mamba2.SCAN_INPUTS = args.tree_mamba_scan_inputs
    if args.tree_mamba_chunk_size is not None:
        mamba2.CHUNK_SIZE = None if args.tree_mamba_chunk_size == "own" else args.tree_mamba_chunk_size
    if args.tree_shared_keys_in_place is not None:
        varlen.SHARED_KEYS_IN_PLACE = args.tree_shared_keys_in_place
    if args.tree_executed_mixers is not None:
        gated_deltanet.EXECUTED_LAYOUT = args.tree_executed_mixers


def check_dropout(model, name: str, logger, switch: str) -> None:
    """Dropout under tree execution, checked when a tree trainer is built (after TRL's ``disable_dropout``). Attention
    dropout cannot run on a prefix forest: a rate the attention modules hold (a float ``attention_dropout``, or an
    ``attn_dropout`` / ``attention_dropout`` module) raises, naming the fix. Any other dropout runs once per unique
    token, so a token shared by several trajectories draws one mask for all of them where per-trajectory training
    draws one each (the same expected gradient, correlated noise): a warning names the modules. ``switch``: how
    this trainer's user turns dropout off."""
    import torch

    from ..model_patches.core import _PATCH_MARK

    handle = getattr(model, _PATCH_MARK, None)
    for module in [] if handle is None else handle.attention_modules:
        rate = getattr(module, "attention_dropout", None)
        if isinstance(rate, float) and rate > 0:
            raise ValueError(f"{name}: {type(module).__name__}.attention_dropout is {rate}; tree execution has no "
                             "attention dropout. Load the model with attention_dropout=0.0 "
                             "(from_pretrained(..., attention_dropout=0.0)), or train without trees (use_tree=False).")
        for attribute in ("attn_dropout", "attention_dropout"):
            child = getattr(module, attribute, None)
            if isinstance(child, torch.nn.Dropout) and child.p > 0:
                raise ValueError(f"{name}: {type(module).__name__}.{attribute} drops attention weights with p={child.p}; "
                                 f"tree execution has no attention dropout. {switch}, or train without trees "
                                 "(use_tree=False).")
    active = [path for path, module in model.named_modules() if isinstance(module, torch.nn.Dropout) and module.p > 0]
    if active:
        logger.warning(f"{name}: {len(active)} dropout modules are active ({', '.join(active[:3])}"
                       f"{', ...' if len(active) > 3 else ''}); on a prefix forest a token shared by several trajectories "
                       "draws one dropout mask for all of them (per-trajectory training draws one each): the same "
                       f"expected gradient, correlated noise. {switch}.")


def apply_layer_counts(model, args, logger) -> None:
    """Put ``tree_stored_layers``, ``tree_keep_mixer_outputs`` / ``tree_keep_mixer_gib`` and ``tree_keep_matmul_layers``
    / ``tree_keep_matmul_gib`` in force on ``model`` (a transformers model, as unwrapped for the trainer); kept outputs
    or products under DeepSpeed ZeRO-3 fail here, naming the fix."""
    import torch

    from ..model_patches import (
        keep_matmul_outputs,
        keep_matmul_outputs_within,
        keep_mixer_outputs,
        keep_mixer_outputs_within,
        store_layer_activations,
    )
    from ..model_patches.core import zero3_enabled

    if args.tree_stored_layers:
        store_layer_activations(model, args.tree_stored_layers)
    def dtype():  # autocast's, where the budgets are worked out
        return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else next(model.parameters()).dtype

    def refuse_under_zero3(setting: str, what: str) -> None:
        if zero3_enabled():
            raise ValueError(f"{setting} keeps {what} through a selective-checkpointing policy, which cannot run under "
                             "DeepSpeed ZeRO-3 (its parameter all-gathers inside the checkpointed layers); turn it "
                             "off, or use ZeRO-2 or DDP.")

    setting = mixer_setting(args)
    if setting:
        refuse_under_zero3(setting, "node outputs")
    if args.tree_keep_mixer_outputs:
        keep_mixer_outputs(model)
    elif args.tree_keep_mixer_gib is not None:
        layers = keep_mixer_outputs_within(model, args.tree_keep_mixer_gib, args.tree_token_budget, dtype())
        logger.info(f"{setting}: mixer outputs kept in {len(layers)} decoder layers {layers} at tree_token_budget="
                    f"{args.tree_token_budget}")
    gib = args.tree_keep_matmul_gib
    if not args.tree_keep_matmul_layers and gib is None:
        return
    setting = matmul_setting(args)
    refuse_under_zero3(setting, "products")
    if gib is None:
        keep_matmul_outputs(model, args.tree_keep_matmul_layers)
        return
    layers = keep_matmul_outputs_within(model, gib, args.tree_token_budget, dtype())
    logger.info(f"{setting}: matrix products kept in {len(layers)} decoder layers {layers} at tree_token_budget="
                f"{args.tree_token_budget}")
