"""A decode step's keys and values into their KV-cache slots in one launch (torch: two `index_copy_`, one each).

    cache_k[:, :, index[t]] = k[:, :, t];  cache_v[:, :, index[t]] = v[:, :, t]
    k, v [b, nkv, s, d];  caches [b, nkv, L, d];  index [s]

`index` [s] is a device tensor (the cache's write slots), so a CUDA graph of the step writes the right slots at
every position. One program per (row, head, token) copies its d values of k and of v. It runs only while a CUDA graph
is being captured (the decode step's graph), where it saves a launch per layer (benchmarks/RESULTS.md, 'Decode with
the KV-cache write kernel'); eagerly a Triton launch costs more host time than torch's two. Plain-torch twin: two
index_copy_.
"""

from __future__ import annotations

import torch

from tpframe.kernels import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _kv_write(k, v, cache_k, cache_v, index, S, L, D, BLOCK_D: tl.constexpr):
        row = tl.program_id(0)  # over b * nkv * s
        head, t = row // S, row % S
        slot = tl.load(index + t)
        cols = tl.arange(0, BLOCK_D)
        inside = cols < D
        src = row.to(tl.int64) * D + cols
        dst = (head.to(tl.int64) * L + slot) * D + cols
        tl.store(cache_k + dst, tl.load(k + src, mask=inside), mask=inside)
        tl.store(cache_v + dst, tl.load(v + src, mask=inside), mask=inside)


def takes(k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor) -> bool:
    """Whether `kv_write` serves this append: inside a CUDA-graph capture, contiguous inputs of the cache's dtype."""
    return (
        use_triton(k)
        and torch.cuda.is_current_stream_capturing()
        and k.dtype == v.dtype == cache_k.dtype
        and k.is_contiguous()
        and v.is_contiguous()
        and cache_k.is_contiguous()
    )


def kv_write(
    k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, index: torch.Tensor
) -> None:
    """Write k and v [b, nkv, s, d] into slots `index` [s] of cache_k and cache_v [b, nkv, L, d], in place."""
    if not HAVE_TRITON:
        raise RuntimeError("kv_write needs Triton")
    b, n, s, d = k.shape
    if (
        v.shape != k.shape
        or cache_k.shape != cache_v.shape
        or cache_k.shape[:2] != (b, n)
        or cache_k.shape[3] != d
        or index.shape != (s,)
        or not (k.is_contiguous() and v.is_contiguous() and cache_k.is_contiguous() and cache_v.is_contiguous())
    ):
        raise ValueError(
            f"kv_write: k {tuple(k.shape)}, v {tuple(v.shape)}, caches {tuple(cache_k.shape)} / "
            f"{tuple(cache_v.shape)}, index {tuple(index.shape)} do not fit contiguous [b, nkv, s, d], "
            "[b, nkv, L, d], [s]"
        )
    _kv_write[(b * n * s,)](
        k, v, cache_k, cache_v, index, s, cache_k.shape[2], d, BLOCK_D=triton.next_power_of_2(d), num_warps=1
    )
