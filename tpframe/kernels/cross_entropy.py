"""Row kernels of the vocab-parallel head + cross entropy (tpframe/layers/cross_entropy.py).

    row_stats(logits [N, V], local_target [N], n_valid) -> [4, N] fp32:
        max, sum(exp(logit - max)), the target's logit (0 where the target is not in this shard: -1),
        and the sum of the logits (for label smoothing); columns >= n_valid (vocab padding) are left out.
    logits_grad_(logits, local_target, log_z, scale, n_valid, smoothing, vocab) -> logits, overwritten with
        scale * (softmax - (1 - smoothing) onehot(target) - smoothing / vocab), zero on padding columns.

The logits stay in their own dtype (bf16 in training); fp32 exists only in registers (Triton, one row per
program, one pass each way) or, in the torch twin, for `chunk` rows at a time. So the head never holds
an fp32 copy of the logits for the whole batch.
"""

from __future__ import annotations

import torch

from tpframe.kernels import HAVE_TRITON, use_triton

DEFAULT_CHUNK_ELEMENTS = 1 << 24  # torch path: fp32 rows per chunk ~ 64 MiB


def _chunk_rows(chunk: int | None, n_cols: int) -> int:
    return chunk if chunk else max(1, DEFAULT_CHUNK_ELEMENTS // max(1, n_cols))


def row_stats(
    logits: torch.Tensor, local_target: torch.Tensor, n_valid: int, chunk: int | None = None, triton: bool | None = None
) -> torch.Tensor:
    n = logits.shape[0]
    stats = torch.empty((4, n), dtype=torch.float32, device=logits.device)
    if n == 0:
        return stats
    if use_triton(logits) if triton is None else triton:
        block = min(4096, _next_pow2(max(n_valid, 16)))
        _row_stats_kernel[(n,)](logits, logits.stride(0), local_target, stats, n, n_valid, BLOCK=block, num_warps=8)
        return stats
    if n_valid == 0:
        stats[0].fill_(float("-inf")), stats[1:].zero_()
        return stats
    step = _chunk_rows(chunk, n_valid)
    for i in range(0, n, step):
        rows = logits[i : i + step, :n_valid].float()
        m = rows.max(dim=-1).values
        stats[0, i : i + step] = m
        stats[1, i : i + step] = (rows - m.unsqueeze(-1)).exp_().sum(dim=-1)
        t = local_target[i : i + step]
        picked = rows.gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        stats[2, i : i + step] = picked.masked_fill(t < 0, 0.0)
        stats[3, i : i + step] = rows.sum(dim=-1)
    return stats


def logits_grad_(
    logits: torch.Tensor,
    local_target: torch.Tensor,
    log_z: torch.Tensor,
    scale: torch.Tensor,
    n_valid: int,
    smoothing: float,
    vocab: int,
    chunk: int | None = None,
    triton: bool | None = None,
) -> torch.Tensor:
    n, v = logits.shape
    if n == 0:
        return logits
    if use_triton(logits) if triton is None else triton:
        block = min(4096, _next_pow2(max(v, 16)))
        _logits_grad_kernel[(n,)](
            logits,
            logits.stride(0),
            local_target,
            log_z,
            scale,
            v,
            n_valid,
            1.0 - smoothing,
            smoothing / vocab,
            BLOCK=block,
            num_warps=8,
        )
        return logits
    step = _chunk_rows(chunk, v)
    for i in range(0, n, step):
        rows = logits[i : i + step]
        p = (rows.float() - log_z[i : i + step].unsqueeze(-1)).exp_()
        t = local_target[i : i + step]
        hit = (t >= 0).float() * (1.0 - smoothing)
        p.scatter_add_(-1, t.clamp(min=0).unsqueeze(-1), -hit.unsqueeze(-1))
        if smoothing > 0:
            p[:, :n_valid] -= smoothing / vocab
        p[:, n_valid:] = 0.0
        p.mul_(scale[i : i + step].unsqueeze(-1))
        rows.copy_(p)
    return logits


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _row_stats_kernel(logits, stride, target, stats, N, n_valid, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = logits + row.to(tl.int64) * stride
        t = tl.load(target + row)
        cols = tl.arange(0, BLOCK)
        m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
        s = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
        picked = tl.zeros([BLOCK], tl.float32)
        total = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n_valid, BLOCK):
            c = start + cols
            valid = c < n_valid
            x = tl.load(base + c, mask=valid, other=float("-inf")).to(tl.float32)
            new_m = tl.maximum(m, tl.max(x, axis=0))  # finite: every block holds a valid column
            s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
            m = new_m
            picked += tl.where(c == t, x, 0.0)
            total += tl.where(valid, x, 0.0)
        tl.store(stats + row, m)
        tl.store(stats + N + row, s)
        tl.store(stats + 2 * N + row, tl.sum(picked, axis=0))
        tl.store(stats + 3 * N + row, tl.sum(total, axis=0))

    @triton.jit
    def _logits_grad_kernel(
        logits, stride, target, log_z, scale, n_cols, n_valid, hit_weight, smooth, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0)
        base = logits + row.to(tl.int64) * stride
        t = tl.load(target + row)
        lz = tl.load(log_z + row)
        g = tl.load(scale + row)
        cols = tl.arange(0, BLOCK)
        for start in range(0, n_cols, BLOCK):
            c = start + cols
            inside = c < n_cols
            x = tl.load(base + c, mask=inside, other=0.0).to(tl.float32)
            grad = tl.exp(x - lz) - tl.where(c == t, hit_weight, 0.0) - smooth
            grad = tl.where(c < n_valid, grad * g, 0.0)
            tl.store(base + c, grad.to(logits.dtype.element_ty), mask=inside)
