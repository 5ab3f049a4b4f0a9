"""The Mamba-2 selective scan (state-space duality form), in pure torch.

Per head ``h`` (state ``S_t`` of shape ``[head_dim, state_size]``, group ``g = h // (H / G)``)::

    S_t = exp(dt_t[h] * A[h]) * S_{t-1} + dt_t[h] * outer(x_t[h], B_t[g])
    y_t[h] = S_t @ C_t[g]

and ``S`` restarts from zero at every sequence start (``seq_idx`` changes).  The ``D`` skip, the
gate and the projections live in the mixer, not here.

:func:`ssd_step_by_step` is this recurrence written literally (the definition, for tests).
:func:`ssd_chunked` computes the same thing in chunks of ``chunk_size`` tokens: exact quadratic
attention-like products inside a chunk, and the recurrence only across chunk boundaries.

Invariants:
- Inputs ``x [b, T, H, P]``, ``dt [b, T, H]`` (already softplus-ed and clamped, > 0),
  ``A [H]`` (< 0), ``B``/``C [b, T, G, N]``, optional ``seq_idx [b, T]`` (non-decreasing integers).
  Output ``y [b, T, H, P]`` in ``x``'s dtype; the arithmetic runs in
  :func:`~mizzen_plugins.nemotron_h.numerics.compute_dtype` (float32, or float64 for float64).
- No subtraction of cumulative sums: every decay ``exp(sum of dt*A over (s, l])`` is formed from a
  masked cumulative sum, so it is exactly 1 for an empty range and never overflows; pairs of
  positions in different sequences get decay 0 through a mask (no ``-inf`` arithmetic in the
  backward pass).
- ``T`` need not be a multiple of ``chunk_size`` (padded with ``dt = 0``, which carries state
  unchanged and adds nothing; padded outputs are cut off).
- Pure tensor code without data-dependent Python control flow, so ``torch.compile`` can trace it
  with dynamic shapes (the GPU fast path in :mod:`mizzen_plugins.nemotron_h.scan_backend`).
  Every ``einsum`` has two operands: with three or more, torch asks ``opt_einsum`` (where that
  package is installed, as on the GPU images) for a contraction order from the concrete sizes,
  which specialises a compiled graph to the number of chunks and the state size (a recompile for
  every packed length).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mizzen_plugins.nemotron_h.numerics import compute_dtype

__all__ = ["check_shapes", "ssd_chunked", "ssd_step_by_step"]


def check_shapes(x, dt, A, B, C, seq_idx) -> None:
    """The scan's shape contract (``x [b, T, H, P]``, ``dt [b, T, H]``, ``A [H]``, ``B``/``C``
    ``[b, T, G, N]`` with ``G | H``, ``seq_idx [b, T]``): a ValueError naming every mismatch."""
    b, T, H, _ = x.shape
    G = B.shape[2]
    problems = []
    if dt.shape != (b, T, H):
        problems.append(f"dt {tuple(dt.shape)} != {(b, T, H)}")
    if A.shape != (H,):
        problems.append(f"A {tuple(A.shape)} != {(H,)}")
    if B.shape != C.shape or B.shape[:2] != (b, T):
        problems.append(f"B {tuple(B.shape)} and C {tuple(C.shape)} must both be [{b}, {T}, G, N]")
    if H % G:
        problems.append(f"{G} groups must divide {H} heads")
    if seq_idx is not None and seq_idx.shape != (b, T):
        problems.append(f"seq_idx {tuple(seq_idx.shape)} != {(b, T)}")
    if problems:
        raise ValueError(f"ssd scan shapes (x is {tuple(x.shape)}): " + "; ".join(problems))


def _heads_of_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[..., G, N] -> [..., H, N]``: head ``h`` uses group ``h // (H / G)``."""
    return t.repeat_interleave(num_heads // t.shape[-2], dim=-2)


def ssd_step_by_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    seq_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """The recurrence, one token at a time (slow; the definition the chunked scan must equal)."""
    check_shapes(x, dt, A, B, C, seq_idx)
    b, T, H, P = x.shape
    f = compute_dtype(x)
    Bh = _heads_of_groups(B.to(f), H)
    Ch = _heads_of_groups(C.to(f), H)
    state = x.new_zeros(b, H, P, B.shape[-1], dtype=f)
    ys = []
    for t in range(T):
        if seq_idx is not None and t > 0:
            keep = (seq_idx[:, t] == seq_idx[:, t - 1]).to(f)
            state = state * keep[:, None, None, None]
        decay = torch.exp(dt[:, t].to(f) * A.to(f))  # [b, H]
        update = (dt[:, t].to(f)[..., None] * x[:, t].to(f))[..., None] * Bh[:, t, :, None, :]
        state = decay[..., None, None] * state + update
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]))
    return torch.stack(ys, dim=1).to(x.dtype)


def _log_decay_between(a: torch.Tensor) -> torch.Tensor:
    """``a [..., Q] -> [..., Q, Q]`` with ``[l, s] = sum(a[s+1 .. l])`` for ``l >= s``, else -inf.

    Built from a cumulative sum of a strictly-lower-triangular copy, never as a difference of
    cumulative sums.
    """
    Q = a.shape[-1]
    ones = torch.ones(Q, Q, dtype=torch.bool, device=a.device)
    # rows[..., k, s] = a[k] where k > s, else 0; cumsum over k gives sum(a[s+1 .. l]).
    rows = a.unsqueeze(-1).expand(*a.shape, Q).masked_fill(~torch.tril(ones, -1), 0.0)
    return rows.cumsum(dim=-2).masked_fill(~torch.tril(ones), float("-inf"))


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    chunk_size: int,
    seq_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """The chunked scan (same result as :func:`ssd_step_by_step`, up to float rounding)."""
    check_shapes(x, dt, A, B, C, seq_idx)
    b, T, H, P = x.shape
    Q = chunk_size
    pad = (-T) % Q
    n = (T + pad) // Q  # number of chunks
    if seq_idx is None:
        seq_idx = torch.zeros(b, T, dtype=torch.int64, device=x.device)
    seq_idx = seq_idx.to(torch.int64)

    # Pad the time axis to n * Q: dt = 0 there (decay 1, no input), same sequence as the last token.
    f = compute_dtype(x)
    xf = F.pad(x.to(f), (0, 0, 0, 0, 0, pad))
    dtf = F.pad(dt.to(f), (0, 0, 0, pad))
    Bh = F.pad(_heads_of_groups(B.to(f), H), (0, 0, 0, 0, 0, pad))
    Ch = F.pad(_heads_of_groups(C.to(f), H), (0, 0, 0, 0, 0, pad))
    seq = torch.cat([seq_idx, seq_idx[:, -1:].expand(b, pad)], dim=1)

    # Chunked views: time -> (chunk c, position l).
    xdt = (xf * dtf[..., None]).view(b, n, Q, H, P)  # the input term of each step
    a = (dtf * A.to(f)).view(b, n, Q, H).permute(0, 3, 1, 2)  # [b, H, c, l], log-decays <= 0
    Bc = Bh.view(b, n, Q, H, -1)
    Cc = Ch.view(b, n, Q, H, -1)
    seq = seq.view(b, n, Q)

    # 1. Inside each chunk: y[l] += sum_{s <= l, same sequence} (C_l . B_s) decay(s, l] xdt_s.
    same_seq = seq[:, :, :, None] == seq[:, :, None, :]  # [b, c, l, s]
    log_decay = _log_decay_between(a).masked_fill(~same_seq[:, None], float("-inf"))
    decay = torch.exp(log_decay)  # [b, H, c, l, s]
    scores = torch.einsum("bclhn,bcshn->bhcls", Cc, Bc) * decay
    y = torch.einsum("bhcls,bcshp->bclhp", scores, xdt)

    # 2. The state each chunk leaves behind (its own tokens only, those of its last sequence).
    decay_to_end = decay[..., -1, :]  # [b, H, c, s]: decay(s, Q-1], 0 for other sequences
    weighted_B = Bc * decay_to_end.permute(0, 2, 3, 1)[..., None]  # [b, c, s, H, N]
    chunk_states = torch.einsum("bcshn,bcshp->bchpn", weighted_B, xdt)

    # 3. Across chunks: the state entering chunk c sums chunk_states[z] for z < c, decayed over
    #    chunks z+1 .. c-1, if chunk z's last token and chunk c-1's last token share a sequence.
    #    Index i = 0 is "before the first chunk" (zero state), i = c + 1 is "after chunk c".
    totals = F.pad(a.sum(-1), (1, 0))  # [b, H, n + 1]
    owner = torch.cat([seq[:, :1, 0], seq[:, :, -1]], dim=1)  # [b, n + 1]
    same_owner = owner[:, :, None] == owner[:, None, :]
    carry = torch.exp(_log_decay_between(totals).masked_fill(~same_owner[:, None], float("-inf")))
    sources = F.pad(chunk_states, (0, 0, 0, 0, 0, 0, 1, 0))  # [b, n + 1, H, P, N], source 0 = 0
    entering = torch.einsum("bhiz,bzhpn->bihpn", carry[..., :n, :], sources)  # [b, n, H, P, N]

    # 4. Entering state -> outputs: decayed through positions 0..l, only for its own sequence.
    decay_from_start = torch.exp(a.cumsum(-1))  # [b, H, c, l]
    continues = (seq == owner[:, :n, None]).to(f)  # [b, c, l]
    reach = decay_from_start.permute(0, 2, 3, 1) * continues[..., None]  # [b, c, l, H]
    y = y + torch.einsum("bclhn,bchpn->bclhp", Cc * reach[..., None], entering)
    return y.reshape(b, n * Q, H, P)[:, :T].to(x.dtype)
