"""Fused GPU kernels (Triton) for the places where eager PyTorch makes several passes over memory.

    rotary.py         qkv [s, b, (nq + 2 nkv) d] -> q, k rotated and v, each [b, n, s, d], in one pass (and back)
    cross_entropy.py  per-row softmax statistics and the in-place logits gradient of the head + loss path
    decode_attention.py  generation's few new queries over the KV cache (flash-decoding), inference only
    gemv.py           one token's linear layer (batch-1 decode graphs), streaming the weight once, inference only
    kv_write.py       a decode step's keys and values into their cache slots in one launch (decode graphs)
    norm.py           LayerNorm / RMSNorm forward, and backward with the weight gradients in the same pass
    cast_transpose.py  rowwise float8 of a tensor's transpose for train.fp8's backward (tpframe::cast_transpose)

Every kernel has a plain-torch twin that computes the same function (the CPU path, and the tests' oracle);
callers pick the kernel only for CUDA tensors; the cross-entropy and norm kernels run outside torch.compile
tracing (the head stays eager; compiled blocks get Inductor's own norms), the rotary, decode-attention and
cast-transpose kernels also inside it, as custom ops.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; CPU-only installs may lack it
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    HAVE_TRITON = False


def use_triton(x: torch.Tensor) -> bool:
    """Whether a Triton kernel should run on `x`: a CUDA tensor, Triton importable, not under compile tracing."""
    return HAVE_TRITON and x.is_cuda and not torch.compiler.is_compiling()
