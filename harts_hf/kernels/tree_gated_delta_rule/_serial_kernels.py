"""Triton kernels of :mod:`.serial_state_pass` (imported only when a CUDA run selects the serial state pass)."""

import triton
import triton.language as tl


@triton.jit
def _state_columns(i_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """This program's block of the ``[K, V]`` state: key offsets, value columns, their masks, flat offsets."""
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    return o_k, o_v, m_k, m_v, m_k[:, None] & m_v[None, :], o_k[:, None] * V + o_v[None, :]


@triton.jit
def _unit(unit_bos, unit_eos, unit_chunk, unit_initial, unit_save, i_u):
    """Unit ``i_u``: first executed token, length, first ``h`` chunk, bank row it starts from, row it saves to."""
    bos = tl.load(unit_bos + i_u).to(tl.int64)
    length = tl.load(unit_eos + i_u).to(tl.int64) - bos
    first = tl.load(unit_chunk + i_u).to(tl.int64)
    return bos, length, first, tl.load(unit_initial + i_u).to(tl.int64), tl.load(unit_save + i_u).to(tl.int64)


@triton.jit
def _lane(lane_start, first_lane):
    """The unit range ``[begin, end)`` of this program's lane (``first_lane`` + the grid's third index)."""
    lane = first_lane + tl.program_id(2)
    return tl.load(lane_start + lane).to(tl.int64), tl.load(lane_start + lane + 1).to(tl.int64)


@triton.jit
def forward_kernel(k, w, u, g, h, v_new, bank, unit_bos, unit_eos, unit_chunk, unit_initial, unit_save,
                   lane_start, first_lane, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PER_KEY: tl.constexpr):
    i_v, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (HV // H)
    o_k, o_v, m_k, m_v, m_kv, o_kv = _state_columns(i_v, K, V, BK, BV)
    begin, end = _lane(lane_start, first_lane)
    for i_u in range(begin, end):
        bos, length, first, row_in, row_out = _unit(unit_bos, unit_eos, unit_chunk, unit_initial, unit_save, i_u)
        b_h = tl.load(bank + (row_in * HV + i_h) * K * V + o_kv, mask=m_kv, other=0.0).to(tl.float32)
        for i_t in range(tl.cdiv(length, BT)):
            o_t = i_t * BT + tl.arange(0, BT)
            m_t = o_t < length
            token = bos + o_t
            m_tv = m_t[:, None] & m_v[None, :]
            tl.store(h + ((first + i_t) * HV + i_h) * K * V + o_kv, b_h.to(h.dtype.element_ty), mask=m_kv)
            b_w = tl.load(w + (token[:, None] * HV + i_h) * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                          other=0.0)
            b_v = tl.load(u + (token[:, None] * HV + i_h) * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
            b_v = b_v - tl.dot(b_w, b_h.to(b_w.dtype))
            tl.store(v_new + (token[:, None] * HV + i_h) * V + o_v[None, :], b_v.to(v_new.dtype.element_ty),
                     mask=m_tv)
            last = bos + tl.minimum((i_t + 1) * BT, length) - 1
            b_k = tl.load(k + (token[None, :] * H + i_hk) * K + o_k[:, None], mask=m_k[:, None] & m_t[None, :],
                          other=0.0)
            if PER_KEY:  # one gate per key channel (KDA): k arrives decayed to the chunk's end
                b_g_last = tl.load(g + (last * HV + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
                b_h = b_h * tl.exp2(b_g_last)[:, None] + tl.dot(b_k, b_v.to(b_k.dtype))
            else:
                b_g_last = tl.load(g + last * HV + i_h).to(tl.float32)
                b_g = tl.load(g + token * HV + i_h, mask=m_t, other=0.0).to(tl.float32)
                b_v = b_v * tl.where(m_t, tl.exp2(b_g_last - b_g), 0.0)[:, None]
                b_h = b_h * tl.exp2(b_g_last) + tl.dot(b_k, b_v.to(b_k.dtype))
        if row_out > 0:
            tl.store(bank + (row_out * HV + i_h) * K * V + o_kv, b_h, mask=m_kv)
            tl.debug_barrier()  # a later unit of this program reads the row back


@triton.jit
def backward_kernel(q, k, w, g, do, dv, dh, dv2, d_bank, unit_bos, unit_eos, unit_chunk, unit_initial,
                    unit_save, lane_start, first_lane, scale, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                    V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PER_KEY: tl.constexpr):
    i_v, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (HV // H)
    o_k, o_v, m_k, m_v, m_kv, o_kv = _state_columns(i_v, K, V, BK, BV)
    begin, end = _lane(lane_start, first_lane)
    for j_u in range(begin, end):
        i_u = begin + end - 1 - j_u
        bos, length, first, row_in, row_out = _unit(unit_bos, unit_eos, unit_chunk, unit_initial, unit_save, i_u)
        # rows other than a saved final state hold no gradient for this unit: row 0 is never added to; ".cg" reads
        # past L1, where lanes of an earlier launch added to the row
        b_dh = tl.load(d_bank + (tl.maximum(row_out, 0) * HV + i_h) * K * V + o_kv, mask=m_kv & (row_out > 0),
                       other=0.0, cache_modifier=".cg").to(tl.float32)
        num_chunks = tl.cdiv(length, BT)
        for j_t in range(num_chunks):
            i_t = num_chunks - 1 - j_t
            o_t = i_t * BT + tl.arange(0, BT)
            m_t = o_t < length
            token = bos + o_t
            m_tv = m_t[:, None] & m_v[None, :]
            tl.store(dh + ((first + i_t) * HV + i_h) * K * V + o_kv, b_dh.to(dh.dtype.element_ty), mask=m_kv)
            last = bos + tl.minimum((i_t + 1) * BT, length) - 1
            b_k = tl.load(k + (token[:, None] * H + i_hk) * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                          other=0.0)
            b_q = tl.load(q + (token[None, :] * H + i_hk) * K + o_k[:, None], mask=m_k[:, None] & m_t[None, :],
                          other=0.0).to(tl.float32)
            if PER_KEY:  # q and k arrive gated (KDA); the state decays per key channel
                b_decay = tl.exp2(tl.load(g + (last * HV + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32))
                b_dv = tl.dot(b_k, b_dh.to(b_k.dtype))
                b_decay = b_decay[:, None]
            else:
                b_g_last = tl.load(g + last * HV + i_h).to(tl.float32)
                b_g = tl.load(g + token * HV + i_h, mask=m_t, other=0.0).to(tl.float32)
                b_dv = tl.dot(b_k, b_dh.to(b_k.dtype)) * tl.where(m_t, tl.exp2(b_g_last - b_g), 0.0)[:, None]
                b_q = b_q * tl.exp2(b_g)[None, :]
                b_decay = tl.exp2(b_g_last)
            b_dv += tl.load(dv + (token[:, None] * HV + i_h) * V + o_v[None, :], mask=m_tv, other=0.0)
            tl.store(dv2 + (token[:, None] * HV + i_h) * V + o_v[None, :], b_dv.to(dv2.dtype.element_ty),
                     mask=m_tv)
            b_w = tl.load(w + (token[None, :] * HV + i_h) * K + o_k[:, None], mask=m_k[:, None] & m_t[None, :],
                          other=0.0)
            b_do = tl.load(do + (token[:, None] * HV + i_h) * V + o_v[None, :], mask=m_tv, other=0.0)
            b_dh = b_dh * b_decay + tl.dot(b_q, b_do.to(tl.float32)) * scale - tl.dot(b_w, b_dv.to(b_w.dtype))
        if row_in > 0:
            p_row = d_bank + (row_in * HV + i_h) * K * V + o_kv
            if i_u == begin:  # a lane's first unit: sibling lanes of this launch may add to the same row
                tl.atomic_add(p_row, b_dh, mask=m_kv)
            else:  # saved by an earlier unit of this lane (its parent, in lanes): no other program adds to it now
                tl.store(p_row, tl.load(p_row, mask=m_kv, other=0.0, cache_modifier=".cg") + b_dh, mask=m_kv)
                tl.debug_barrier()  # that unit, processed next, reads the row back
