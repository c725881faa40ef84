"""Pure-PyTorch chunkwise gated delta rule over a batch of equal-length (padded) sequences.

Returns the outputs and, on request, the recurrent state after any number of whole chunks, all in
the autograd graph (fp32). This is the ``"torch"`` backend of the tree gated delta rule: CPU-safe,
exact, and the numerical twin of per-sequence chunked execution.
"""

from __future__ import annotations

import torch

__all__ = ["chunk_gated_delta_rule_torch", "l2_normalize", "prepare_inputs"]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """States and recurrences run in fp32 (fp64 when given fp64, for tight tests)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (the normalisation fla and transformers apply to q, k)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel):
    """Per-token preparation shared by every torch path: key heads repeated onto value heads, fp32 (fp64 stays
    fp64), optional L2 norm of q and k, q scaled (default ``K ** -0.5``). Shapes ``[..., H, D]`` / ``[..., H]``."""
    HK, HV = k.shape[-2], v.shape[-2]
    if HV != HK:
        q, k = q.repeat_interleave(HV // HK, dim=-2), k.repeat_interleave(HV // HK, dim=-2)
    compute_dtype = _compute_dtype(q)
    q, k, v, g, beta = (x.to(compute_dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q), l2_normalize(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k, v, g, beta


def chunk_gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    chunk_size: int = 64,
    state_chunks: list[int] | None = None,
    delta: bool = True,
) -> tuple[torch.Tensor, dict]:
    """Gated delta rule, chunk by chunk, on fp32 inputs already normalised and scaled.

    Args:
        q, k: ``[N, H, T, K]``; v: ``[N, H, T, V]``; beta: ``[N, H, T]``; g (log decay, <= 0): ``[N, H, T]`` one per
            head (Gated DeltaNet) or ``[N, H, T, K]`` one per key channel (Kimi Delta Attention). ``T`` must be a
            multiple of ``chunk_size``; pad with zeros (zero k, v, beta and g leave the state unchanged).
        initial_state: ``[N, H, K, V]`` fp32.
        state_chunks: chunk counts ``c`` for which the state after ``c`` whole chunks is returned (0 = initial).
        delta: False drops the delta correction: ``S = exp(g) S + k (beta v)^T`` (gated linear attention; Mamba-2's
            state-space duality form with ``q = C``, ``k = B``, ``v = dt x``, ``g = dt A``, ``beta = 1``).

    Returns:
        ``o [N, H, T, V]`` and ``{c: state [N, H, K, V]}`` for every requested ``c`` plus ``"final"``.
    """
    N, H, T, K = k.shape
    if T % chunk_size:
        raise ValueError(f"sequence length {T} is not a multiple of chunk_size {chunk_size}; pad first.")
    n = T // chunk_size
    wanted = set(state_chunks or ())
    per_channel = g.dim() == 4

    def chunks(x):
        return x.reshape(N, H, n, chunk_size, *x.shape[3:])

    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    k_beta = k * beta.unsqueeze(-1)
    v_beta = v * beta.unsqueeze(-1)
    if per_channel:
        # log of the decay from the chunk start to each position, per key channel: [N, H, n, C, K]. The decay between
        # positions j <= i, exp(G_i - G_j) per channel, is formed pair by pair ([C, C, K]): a factored exp(G_i) *
        # exp(-G_j) overflows once a chunk's decay passes e^-88
        log_decay = g.cumsum(-2)
        pair_decay = (log_decay.unsqueeze(-2) - log_decay.unsqueeze(-3)).masked_fill(
            ~causal[..., None], float("-inf")).exp()  # [N, H, n, C (i), C (j), K]
        system = torch.einsum("...ik,...jk,...ijk->...ij", k_beta, k, pair_decay)
        intra = torch.einsum("...ik,...jk,...ijk->...ij", q, k, pair_decay)
        decay = log_decay.exp()  # [N, H, n, C, K]
        k_to_end = k * (log_decay[..., -1:, :] - log_decay).exp()
        chunk_decay = decay[..., -1, :, None]  # [N, H, n, K, 1]: each key row of the state
    else:
        log_decay = g.cumsum(-1)  # [N, H, n, C]
        pair_decay = (log_decay.unsqueeze(-1) - log_decay.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
        system = (k_beta @ k.transpose(-1, -2)) * pair_decay
        intra = (q @ k.transpose(-1, -2)) * pair_decay
        decay = log_decay.exp().unsqueeze(-1)  # [N, H, n, C, 1]
        k_to_end = k * (log_decay[..., -1:] - log_decay).exp().unsqueeze(-1)
        chunk_decay = log_decay[..., -1].exp()[..., None, None]
    if delta:  # WY form of the within-chunk delta updates: (I + strictly-lower(beta k k^T * decay)) u = beta v
        u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, k_beta * decay, upper=False, unitriangular=True)
    else:  # no correction: every write lands as it is
        u, w = v_beta, torch.zeros_like(k_beta)
    q_decayed = q * decay

    state = initial_state
    states = {0: state} if 0 in wanted else {}
    outputs = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state
        outputs.append(q_decayed[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ v_new
        if i + 1 in wanted:
            states[i + 1] = state
    states["final"] = state
    o = torch.stack(outputs, dim=2).reshape(N, H, T, -1)
    return o, states
