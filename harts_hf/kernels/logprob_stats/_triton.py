"""Triton kernels of :mod:`.ops` (imported only when a CUDA run takes the fused path).

Forward: one program per row walks the vocabulary in blocks with an online softmax, keeping the running maximum
``m``, ``s = sum exp(z - m)`` and ``t = sum exp(z - m) (z - m)`` (``z`` the tempered logits), so that
``lse = m + log s`` and the entropy ``log s - t / s`` come from bounded terms (no cancellation of two large
numbers when the entropy is small); with the largest logit left of the label, whether the label is the argmax. Backward: one program per (row, vocabulary block) writes
``dz = (g_lp (onehot - p) - g_H p (log p + H)) / T`` in the logits' dtype.
"""

import triton
import triton.language as tl


@triton.jit
def stats_kernel(logits, labels, lse, logprobs, entropies, top1, stride_row, V, inv_temperature,
                 BV: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride_row
    label = tl.load(labels + row).to(tl.int64)
    m = tl.full((), -1e30, tl.float32)
    before = tl.full((), float("-inf"), tl.float32)  # the largest logit left of the label
    s = tl.zeros((), tl.float32)
    t = tl.zeros((), tl.float32)
    for start in range(0, V, BV):
        columns = start + tl.arange(0, BV)
        inside = columns < V
        z = tl.load(base + columns, mask=inside, other=float("-inf")).to(tl.float32) * inv_temperature
        m_new = tl.maximum(m, tl.max(z, 0))
        before = tl.maximum(before, tl.max(tl.where(columns < label, z, float("-inf")), 0))
        scale = tl.exp(m - m_new)
        e = tl.exp(z - m_new)
        t = scale * (t + s * (m - m_new)) + tl.sum(tl.where(inside, e * (z - m_new), 0.0), 0)
        s = scale * s + tl.sum(e, 0)
        m = m_new
    log_s = tl.log(s)
    valid = (label >= 0) & (label < V)
    z_label = tl.load(base + label, mask=valid, other=float("nan")).to(tl.float32) * inv_temperature
    tl.store(lse + row, m + log_s)
    tl.store(logprobs + row, z_label - m - log_s)
    tl.store(entropies + row, log_s - t / s)
    # the label is the argmax (its first occurrence, as torch.argmax picks): no logit above it, none equal before it
    tl.store(top1 + row, ((z_label >= m) & (z_label > before)).to(tl.int8))


@triton.jit
def grad_kernel(logits, grad_logits, labels, lse, entropies, grad_logprobs, grad_entropies, stride_row,
                stride_grad_row, V, inv_temperature, HAS_ENTROPY: tl.constexpr, BV: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BV + tl.arange(0, BV)
    inside = columns < V
    z = tl.load(logits + row * stride_row + columns, mask=inside, other=0.0).to(tl.float32) * inv_temperature
    log_p = z - tl.load(lse + row)
    p = tl.exp(log_p)
    g = tl.load(grad_logprobs + row)
    label = tl.load(labels + row).to(tl.int64)
    dz = tl.where(columns == label, g, 0.0) - g * p
    if HAS_ENTROPY:
        dz -= tl.load(grad_entropies + row) * p * (log_p + tl.load(entropies + row))
    tl.store(grad_logits + row * stride_grad_row + columns, (dz * inv_temperature).to(grad_logits.dtype.element_ty),
             mask=inside)
