"""Tree forward for Mamba-2 mixers (Nemotron-H, Bamba, Granite-4 hybrid, Falcon-H1 with its multipliers and its
optional gated norm): the input projection once per unique token, the depthwise causal conv over each token's
ancestors, the state-space-duality scan over the prefix forest on a chunk grid (:data:`CHUNK_SIZE`: 64 unless set,
or the mixer's own), then its gated RMSNorm and output projection.

Mamba-2's scan is the gated delta rule's chunk machinery without the delta correction: the state ``h [heads, N, P]``
follows ``h = exp(dt A) h + B (dt x)^T`` and ``y = h^T C + D x``, i.e. gated linear attention with ``q = C``,
``k = B`` (``n_groups`` key heads), ``v = dt x``, log decay ``g = dt A`` (``tree_gated_delta_rule(delta=False)``).
``dt`` is ``softplus(dt + dt_bias)`` clamped to the mixer's ``time_step_limit``, in the projection's dtype, and the
rest in fp32, as transformers' own scan computes them. Planner pieces take their root's conv rows, state and replay
rows (on the scan's chunk grid) from the hand-off, as the gated-delta-rule mixers do.

:data:`SCAN_INPUTS` picks the dtype of the scan's ``C``, ``B`` and ``dt x``: on CUDA the half precision the model
runs in (the default), as transformers' CUDA path hands them to ``mamba_ssm``'s kernels (their states and sums stay
fp32; so do fla's here), on the CPU fp32, as transformers' PyTorch scan; or fp32 / half everywhere.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..kernels import TreeMetadata
from .core import PatchedForward, layer_key
from .gated_deltanet import executed_layout, tree_conv_with_handoffs, tree_mixer_call, tree_recurrence_with_handoffs

__all__ = ["CHUNK_SIZE", "SCAN_INPUTS", "is_scan_chunk_size", "scan_chunk_size", "tree_mamba2_factory",
           "tree_mamba2_forward"]

CHUNK_SIZE: int | None = 64
"""The chunk grid of the scan on forests (the tree, and the per-trajectory paths that run through harts_hf's
patches): 64 (the default, fla's own chunk), None for each mixer's own ``chunk_size`` (Nemotron-H's 128, as
transformers' scan runs it), or another power of two of at least 16 (fla's chunk kernels' tiles). Any grid gives the
same scan in exact arithmetic (only the order of the sums changes), and the planner cuts on it
(:func:`~.core.chunk_grid`). A finer grid replays fewer ancestors where a unit starts off it (at most ``chunk - 1`` rows
per unit) for more state passes. Measured on an H100 (BENCHMARKS.md, Nemotron-H full-size ``tau``, 2026-12-07): 64
against the mixer's 128 took the tree from 2.74 to 2.58 s and the packed path from 23.57 to 22.51 s, with the tree's
bf16 error against fp32 the per-trajectory paths'."""


def is_scan_chunk_size(value) -> bool:
    """Whether ``value`` can be the scan's chunk grid: an int that is a power of two of at least 16."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 16 and not value & (value - 1)


def scan_chunk_size(module) -> int:
    """The chunk grid of ``module``'s scan on forests: :data:`CHUNK_SIZE`, else the mixer's own ``chunk_size``."""
    if CHUNK_SIZE is None:
        return module.chunk_size
    if not is_scan_chunk_size(CHUNK_SIZE):
        raise ValueError(f"mamba2.CHUNK_SIZE must be None or a power of two of at least 16, got {CHUNK_SIZE!r}; "
                         "64 is the default, None runs each mixer's own chunk_size")
    return CHUNK_SIZE


SCAN_INPUTS = "cuda"
"""The dtype of the scan's inputs ``C``, ``B`` and ``dt x``: ``"cuda"`` (the default: ``"half"`` for CUDA inputs,
``"fp32"`` for the others), ``"fp32"`` (transformers' PyTorch scan) or ``"half"`` (the half precision the layer runs
in: the autocast dtype under autocast, else bf16 / fp16 weights' dtype; what transformers' CUDA path gives
``mamba_ssm``'s ``mamba_chunk_scan_combined``: half the bytes through the scan node and its gathers; the decay
``dt A``, the states and the ``D x`` skip stay fp32; an fp32 model without autocast computes as with ``"fp32"``).
Applies to every Mamba-2 family and to the per-trajectory paths that run through harts_hf's patches (the packed path
of the benchmarks). Measured on an H100 (BENCHMARKS.md, Nemotron-H): the half inputs' bf16 error against fp32 is the
per-trajectory paths', and full-size ``tau`` ran 6.5% faster on the tree, 5.4% on the packed path, than with fp32."""
_SCAN_INPUTS = ("fp32", "half", "cuda")


def tree_mamba2_factory(module: torch.nn.Module) -> dict:
    """``{"forward": ...}`` for one Mamba-2 mixer (a :class:`~.core.PatchedForward`)."""
    return {"forward": PatchedForward(module, module.forward, functools.partial(tree_mixer_call, tree_mamba2_forward))}


def tree_mamba2_forward(module, hidden_states: torch.Tensor, tree: TreeMetadata) -> torch.Tensor:
    """``hidden_states [1, U, hidden]`` -> ``[1, U, hidden]`` over the forest in ``tree``."""
    dtype = hidden_states.dtype
    H, P, G, N = module.num_heads, module.head_dim, module.n_groups, module.ssm_state_size
    backend = tree.gdn_backend_for(hidden_states)
    plan = tree.gdn_plan(backend, chunk_size=scan_chunk_size(module))
    rows = executed_layout(tree, plan)
    if rows is not None:
        hidden_states = rows.to_executed(hidden_states[0]).unsqueeze(0)
    U = hidden_states.shape[1]  # the forest's rows, or the executed positions' with ``rows``
    # Falcon-H1's multipliers: on the mixer's input and per section of the projection (its mup_vector buffer)
    if getattr(module, "ssm_in_multiplier", None) is not None:
        hidden_states = hidden_states * module.ssm_in_multiplier
    projected = module.in_proj(hidden_states)
    if getattr(module, "mup_vector", None) is not None:
        projected = projected * module.mup_vector
    gate, xbc, dt = projected[0].split([module.intermediate_size, module.conv_dim, H], dim=-1)
    layer = layer_key(module) if tree.context is not None or tree.exports else None
    xbc = tree_conv_with_handoffs(module, tree, layer, xbc, rows)
    x, B, C = torch.split(xbc, [module.intermediate_size, G * N, G * N], dim=-1)
    low, high = module.time_step_limit
    compute = torch.promote_types(dtype, torch.float32)  # the scan in fp32 as transformers runs it; fp64 stays fp64
    dt = torch.clamp(F.softplus(dt + module.dt_bias.to(dt.dtype)), min=low, max=high).to(compute)  # [U, H]
    x = x.to(compute).reshape(U, H, P)
    g = -torch.exp(module.A_log.float()).to(compute) * dt  # A as transformers' forward makes it (in fp32)
    scan = _scan_dtype(x, dtype, compute)
    inputs = (C.to(scan).reshape(U, G, N), B.to(scan).reshape(U, G, N), (x * dt[..., None]).to(scan), g,
              torch.ones_like(dt))
    y = tree_recurrence_with_handoffs(tree, layer, inputs, plan if rows is None else plan.executed_view(), rows,
                                      scale=1.0, backend=backend, delta=False)
    y = (y + module.D.to(compute)[:, None] * x).reshape(1, U, -1)
    if getattr(module, "mamba_rms_norm", True):
        y = module.norm(y, gate.unsqueeze(0))
    else:  # Falcon-H1 without the gated norm: the gate alone
        y = y * F.silu(gate.unsqueeze(0))
    out = module.out_proj(y.to(dtype))
    return out if rows is None else rows.to_rows(out[0]).unsqueeze(0)


def _scan_dtype(x: torch.Tensor, dtype: torch.dtype, compute: torch.dtype) -> torch.dtype:
    """The dtype of the scan's ``C``, ``B`` and ``dt x`` (:data:`SCAN_INPUTS`) for a layer whose hidden states are in
    ``dtype`` and whose scan computes in ``compute``."""
    if SCAN_INPUTS not in _SCAN_INPUTS:
        raise ValueError(f"mamba2.SCAN_INPUTS must be one of {_SCAN_INPUTS}, got {SCAN_INPUTS!r}")
    device = x.device.type
    if SCAN_INPUTS == "fp32" or (SCAN_INPUTS == "cuda" and device != "cuda"):
        return compute
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return dtype if dtype in (torch.bfloat16, torch.float16) else compute


def _register() -> None:
    from .core import TreeFamily, register_family

    # (model type, attention class, Mamba-2 mixer class, load-balancing loss to weight)
    for model_type, attention, mixer, moe in (("nemotron_h", "NemotronHAttention", "NemotronHMamba2Mixer", False),
                                              ("bamba", "BambaAttention", "BambaMixer", False),
                                              ("granitemoehybrid", "GraniteMoeHybridAttention",
                                               "GraniteMoeHybridMambaLayer", True),
                                              ("falcon_h1", "FalconH1Attention", "FalconH1Mixer", False)):
        register_family(TreeFamily(model_types=(model_type,), attention_classes=(attention,),
                                   linear_classes={mixer: tree_mamba2_factory}, moe=moe))


_register()
