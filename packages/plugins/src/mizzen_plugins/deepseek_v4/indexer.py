"""The top-k indexer: which compressed entries each query attends to, and replaying a record.

Score of query ``t`` for global group ``g`` (only ``lo[t] <= g < hi[t]``: complete groups of the
query's own segment)::

    score(t, g) = sum_h  w[t, h] * relu(q[t, h] . k[g] / sqrt(d))

Selection rule (shared by both implementations, so they pick identical entries from identical
scores): scores are ranked in float32 (``-0.0`` counts as ``+0.0``), higher first, ties broken by
the smaller group id; the top ``topk`` valid entries are kept in that order and the rest of the
row is ``-1``.  Selection is not differentiable; it runs under ``no_grad``.

Recorded/replayed choices are *segment-local* group numbers (``g - lo``), the form a rollout that
ran each sequence alone would record, so a record replays unchanged in THD, BSHD or under CP.

Implementations: ``reference`` loops over segments with a dense ``[Lq, G_s]`` score matrix;
``fast`` cuts the query rows into blocks of 64, gives each block the union of its rows' ranges,
and batches blocks with similar range sizes (bounded memory per batch).
"""

from __future__ import annotations

import torch

from mizzen_plugins.deepseek_v4.stream import StreamPlan

_BLOCK = 64
_MAX_SCORE_ELEMS = 1 << 26  # per fast batch: blocks * 64 * heads * range


def _rank_keys(scores: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """int64 keys whose descending order is the selection order (see module docstring)."""
    s = scores.to(torch.float32) + 0.0
    bits = s.view(torch.int32)
    mono = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    keys = mono * (1 << 32) + ((1 << 32) - 1 - ids)
    return torch.where(valid, keys, torch.iinfo(torch.int64).min)


def _select(scores, ids, valid, topk: int) -> torch.Tensor:
    """``[..., R]`` scores of global ids -> ``[..., topk]`` chosen ids (``-1`` where none)."""
    r = scores.shape[-1]
    keys = _rank_keys(scores, ids, valid)
    k = min(topk, r)
    top_keys, pos = torch.topk(keys, k, dim=-1)
    chosen = torch.gather(ids.expand_as(keys), -1, pos)
    chosen = torch.where(top_keys == torch.iinfo(torch.int64).min, -1, chosen)
    if k < topk:
        chosen = torch.cat([chosen, chosen.new_full((*chosen.shape[:-1], topk - k), -1)], -1)
    return chosen


def _scores(iq: torch.Tensor, iw: torch.Tensor, ik: torch.Tensor) -> torch.Tensor:
    """``iq [..., q, h, d]``, ``iw [..., q, h]``, ``ik [..., r, d]`` -> ``[..., q, r]``."""
    dot = torch.einsum("...qhd,...rd->...qhr", iq, ik) * iq.shape[-1] ** -0.5
    return (torch.relu(dot) * iw[..., None]).sum(dim=-2)


@torch.no_grad()
def select_reference(plan: StreamPlan, iq, iw, ik, topk: int) -> torch.Tensor:
    compute = torch.promote_types(iq.dtype, torch.float32)
    iq, iw, ik = iq.to(compute), iw.to(compute), ik.to(compute)
    out = torch.full((plan.num_queries, topk), -1, dtype=torch.long, device=iq.device)
    cu = plan.groups.cu_groups.tolist()
    for s, q0, q1, _e0, _e1 in plan.segment_runs:
        g0, g1 = cu[s], cu[s + 1]
        if g1 == g0:
            continue
        ids = torch.arange(g0, g1, device=iq.device)
        valid = ids[None, :] < plan.hi[q0:q1, None]
        sc = _scores(iq[q0:q1], iw[q0:q1], ik[g0:g1])
        out[q0:q1] = _select(sc, ids[None, :], valid, topk)
    return out


@torch.no_grad()
def select_fast(plan: StreamPlan, iq, iw, ik, topk: int) -> torch.Tensor:
    compute = torch.promote_types(iq.dtype, torch.float32)
    dev = iq.device
    tq = plan.num_queries
    out = torch.full((tq, topk), -1, dtype=torch.long, device=dev)
    g_total = ik.shape[0]
    if tq == 0 or g_total == 0:
        return out
    nb = (tq + _BLOCK - 1) // _BLOCK
    rows = torch.arange(nb * _BLOCK, device=dev).view(nb, _BLOCK)
    row_ok = rows < tq
    rows = rows.clamp(max=tq - 1)
    lo, hi = plan.lo[rows], plan.hi[rows]
    has = (hi > lo) & row_ok
    big = torch.iinfo(torch.long).max
    blk_lo = torch.where(has, lo, big).amin(dim=1)
    blk_hi = torch.where(has, hi, -1).amax(dim=1)
    width = (blk_hi - blk_lo).clamp(min=0)
    width_host = width.tolist()
    # bucket blocks by range width rounded up to a power of two (>= 8)
    buckets: dict[int, list[int]] = {}
    for b, w in enumerate(width_host):
        if w > 0:
            buckets.setdefault(max(8, 1 << (w - 1).bit_length()), []).append(b)
    heads = iq.shape[1]
    for r_pad, members in sorted(buckets.items()):
        per = max(1, _MAX_SCORE_ELEMS // (_BLOCK * heads * r_pad))
        for i in range(0, len(members), per):
            blk = torch.tensor(members[i : i + per], dtype=torch.long, device=dev)
            ids = blk_lo[blk][:, None] + torch.arange(r_pad, device=dev)[None, :]  # [n, R]
            rr = rows[blk]  # [n, B]
            valid = (
                (ids[:, None, :] >= plan.lo[rr][..., None])
                & (ids[:, None, :] < plan.hi[rr][..., None])
                & row_ok[blk][..., None]
            )
            sc = _scores(
                iq[rr].to(compute), iw[rr].to(compute), ik[ids.clamp(max=g_total - 1)].to(compute)
            )
            chosen = _select(sc, ids[:, None, :], valid, topk)  # [n, B, topk]
            keep = row_ok[blk].flatten()
            out[rr.flatten()[keep]] = chosen.reshape(-1, topk)[keep]
    return out


def to_local(plan: StreamPlan, selected: torch.Tensor) -> torch.Tensor:
    """Global group ids -> segment-local group numbers (``-1`` stays ``-1``)."""
    return torch.where(selected >= 0, selected - plan.lo[:, None], -1)


def from_record(plan: StreamPlan, record: torch.Tensor) -> torch.Tensor:
    """Validate a recorded ``[Tq, k]`` segment-local top-k and turn it into global group ids."""
    if record.dim() != 2 or record.shape[0] != plan.num_queries:
        raise ValueError(
            f"topk.shape = {tuple(record.shape)}: expected [{plan.num_queries}, k] (one row of "
            "segment-local group numbers per query token, -1 for unused slots)"
        )
    record = record.to(device=plan.lo.device, dtype=torch.long)
    limit = (plan.hi - plan.lo)[:, None]
    bad = (record < -1) | (record >= limit)
    if bool(bad.any()):
        t = int(bad.any(dim=1).nonzero()[0])
        raise ValueError(
            f"topk[{t}] = {record[t].tolist()}: token {t} (position {int(plan.q_pos[t])}) can "
            f"only select complete groups 0..{int(limit[t]) - 1} of its own segment (or -1); "
            "was the record taken with the same compress_ratio and sequence?"
        )
    srt = torch.sort(record, dim=1).values
    dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
    if bool(dup.any()):
        t = int(dup.any(dim=1).nonzero()[0])
        raise ValueError(f"topk[{t}] = {record[t].tolist()} selects a group twice")
    return torch.where(record >= 0, record + plan.lo[:, None], -1)
