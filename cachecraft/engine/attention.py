"""Attention primitives the engine and its hooks share.

:class:`_AttentionPlan` runs attention from a sorted subset of positions over the
whole prompt; the others measure attention mass (per segment, per key token) with
the same kernels, without ever holding an ``n x N`` matrix of probabilities.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F


def _attention_blocks(q: torch.Tensor, keys: torch.Tensor, q_pos: torch.Tensor, scaling: float,
                      block: int = 256):
    """Yield ``(first_query, probs [b, end])``: causal attention probabilities averaged
    over heads, one block of queries at a time, so no ``n x N`` matrix is materialised.
    q ``[H, n, D]`` and keys ``[H_kv, N, D]`` are rotated."""
    groups = q.shape[0] // keys.shape[0]
    keys = keys.repeat_interleave(groups, dim=0).float()
    for lo in range(0, q.shape[1], block):
        qb, pb = q[:, lo:lo + block].float(), q_pos[lo:lo + block]
        end = int(pb.max()) + 1
        scores = torch.einsum("hqd,hkd->hqk", qb, keys[:, :end]) * scaling
        scores.masked_fill_(torch.arange(end, device=q.device)[None] > pb[:, None], float("-inf"))
        yield lo, scores.softmax(dim=-1).mean(dim=0)


def _mass_per_segment(q: torch.Tensor, keys: torch.Tensor, q_pos: torch.Tensor,
                      starts: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention mass of each query on each segment (``starts``: segment offsets): ``[n, S]``.
    Explicit probabilities: for the few question queries; :class:`_SegmentMass` does many."""
    out = []
    for _, probs in _attention_blocks(q, keys, q_pos, scaling):
        end = probs.shape[1]
        csum = F.pad(probs.cumsum(dim=-1), (1, 0))  # csum[:, j] = mass on keys < j
        edges = torch.cat([starts.clamp(max=end), torch.tensor([end], device=q.device)])
        out.append(csum[:, edges[1:]] - csum[:, edges[:-1]])
    return torch.cat(out)


class _SegmentMass:
    """Attention mass of many queries on each segment, through the fused attention kernel.

    With the values replaced by segment indicators (one column per segment),
    ``softmax(QK^T) @ indicators`` is each query's mass on each segment, averaged over
    heads afterwards. The kernel never materialises the probabilities, so this costs
    one more attention pass, about half of what explicit probabilities cost. Columns
    are padded to the head size: the fused kernels want values as wide as the keys.
    """

    def __init__(self, bounds: Sequence[tuple[int, int]], num_kv_heads: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype):
        self.n_segments = len(bounds)
        segment_of = torch.cat([torch.full((hi - lo,), i, dtype=torch.long, device=device)
                                for i, (lo, hi) in enumerate(bounds)])
        indicators = F.one_hot(segment_of, self.n_segments).to(dtype)  # [N, S]
        self.values = []
        for lo in range(0, self.n_segments, head_dim):
            cols = indicators[:, lo:lo + head_dim]
            cols = F.pad(cols, (0, head_dim - cols.shape[1]))
            self.values.append(cols[None].expand(num_kv_heads, -1, -1).contiguous())

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, plan: "_AttentionPlan", scale: float,
                 gqa: bool) -> torch.Tensor:
        """Mass of q ``[H, n, D]`` (rotated; positions as in ``plan``) on each segment: ``[n, S]``."""
        parts = [plan.attend(q, keys, values, scale, gqa).float().mean(dim=0) for values in self.values]
        return torch.cat(parts, dim=-1)[:, :self.n_segments]


def _mass_per_key(q: torch.Tensor, keys: torch.Tensor, q_pos: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention mass all queries put on each key token, summed over queries: ``[N]``."""
    total = torch.zeros(keys.shape[1], device=q.device)
    for _, probs in _attention_blocks(q, keys, q_pos, scaling):
        total[:probs.shape[1]] += probs.sum(dim=0)
    return total


# Queries per masked attention call. On the CPU, small blocks follow the causal triangle
# closely. On a GPU few large calls beat many small ones (measured on an H200 at 32k tokens:
# 457 calls cost the host 0.78 s of a 1.68 s request), far more than the part of the
# triangle that large blocks compute for nothing.
CPU_QUERY_BLOCK = 128
CUDA_QUERY_BLOCK = 4096
# On a GPU, round each attention call's query and key counts up to a few sizes. cuDNN builds
# a graph for every new shape and keeps it: measured on an H100 at 4k tokens, 40-90 ms for a
# new (queries, keys) shape against 0.2 ms for one it has seen. Without rounding, every
# request has its own prompt length, so it paid the builds again (most of a 4k request).
CUDA_SHAPE_BUCKETS = True


def shape_bucket(n: int, smallest: int = 64) -> int:
    """``n`` rounded up to a multiple of ``max(smallest, 2**(floor(log2 n) - 3))``: a few sizes
    per power of two, so padding costs at most an eighth more (or up to ``smallest``)."""
    step = max(smallest, 1 << max(n.bit_length() - 4, 0))
    return -(-n // step) * step


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x [H, n, D]`` with zero rows appended up to ``rows``."""
    return x if x.shape[1] >= rows else F.pad(x, (0, 0, 0, rows - x.shape[1]))


class _AttentionPlan:
    """Query blocks for attention over the whole prompt from a sorted subset of positions.

    Each block sees keys only up to its last query's position, so the cost follows the
    causal triangle instead of every query scanning every key; block masks are built
    once per active set and reused by every layer that has the same set. When nearly
    every position is active, one causal call over all positions (the missing queries
    left at zero, their rows dropped) beats masked blocks, so that is used instead.
    With ``bucket`` (on a GPU by default) every call's queries and keys are padded to
    :func:`shape_bucket` sizes; the padded keys are masked out and the padded rows dropped.
    """

    DENSE_SHARE = 0.85  # measured: at 6k tokens on CPU, masked blocks lose above about this share

    def __init__(self, active: torch.Tensor, n_total: int, block: int | None = None,
                 bucket: bool | None = None):
        on_gpu = active.device.type == "cuda"
        if block is None:
            block = CUDA_QUERY_BLOCK if on_gpu else CPU_QUERY_BLOCK
        self.bucket = (CUDA_SHAPE_BUCKETS and on_gpu) if bucket is None else bucket
        self.full = active.numel() == n_total
        self.dense = not self.full and active.numel() >= self.DENSE_SHARE * n_total
        self.active, self.n_total = active, n_total
        # (first query, end query, padded query count, keys seen (padded), mask or None)
        self.blocks: list[tuple[int, int, int, int, torch.Tensor | None]] = []
        if self.full or self.dense:
            self.key_rows = shape_bucket(n_total) if self.bucket else n_total
            return
        arange = torch.arange(n_total, device=active.device)
        for lo in range(0, active.numel(), block):
            pos = active[lo:lo + block]
            real = rows = pos.numel()
            end = int(pos[-1]) + 1
            if self.bucket:  # padded rows see what the last real one sees; padded keys nobody
                rows, end = shape_bucket(rows), shape_bucket(end)
                pos = torch.cat([pos, pos[-1:].expand(rows - pos.numel())])
                arange = torch.arange(end, device=active.device) if end > arange.numel() else arange
            mask = arange[None, :end] <= pos[:, None]
            self.blocks.append((lo, lo + real, rows, end,
                                None if bool(mask.all()) else mask))
        self.key_rows = max(end for _, _, _, end, _ in self.blocks)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
               gqa: bool) -> torch.Tensor:
        """Attention of q ``[H, n, D]`` over keys/values ``[H_kv, N, D]``: ``[H, n, D]``."""
        keys, values = _pad_rows(keys, self.key_rows), _pad_rows(values, self.key_rows)
        if self.full or self.dense:
            if self.dense:  # each row's result depends on its own query only: pad, then drop
                padded = q.new_zeros(q.shape[0], self.key_rows, q.shape[2])
                padded[:, self.active] = q
                q = padded
            out = F.scaled_dot_product_attention(_pad_rows(q, self.key_rows)[None], keys[None], values[None],
                                                 is_causal=True, scale=scale, enable_gqa=gqa)[0]
            return out[:, self.active] if self.dense else out[:, :self.n_total]
        out = torch.empty_like(q)
        for lo, hi, rows, end, mask in self.blocks:
            out[:, lo:hi] = F.scaled_dot_product_attention(
                _pad_rows(q[:, lo:hi], rows)[None], keys[None, :, :end], values[None, :, :end], attn_mask=mask,
                scale=scale, enable_gqa=gqa)[0, :, :hi - lo]
        return out
