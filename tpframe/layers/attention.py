"""Self-attention with heads split across TP, rotary positions, and grouped-query attention.

    x [s, b, h] --qkv (column)--> q [s, b, nq/tp, d], k, v [s, b, nkv/tp, d]
      --SDPA (causal, this rank's heads)--> [s, b, nq/tp * d] --proj (row)--> [s, b, h]

With sequence parallelism x and the output are [s/tp, b, h]: qkv all-gathers the sequence and
proj reduce-scatters it. The fused qkv weight keeps q, k and v as separate logical tensors.
With context parallelism (`cp_comm`, tpframe/layers/context.py) x holds this CP rank's tokens of the
sequence and attention runs over every rank's keys and values, all-gathered over the CP group, or (`mode.cp_comm`
"all_to_all", tpframe/layers/ulysses.py) over the whole sequence of 1/cp of the heads, exchanged all-to-all.
Generation passes a `cache` (tpframe.inference.kv_cache): this step's keys and values are appended
to it and the queries attend over the whole cache under its mask (causal, and correct when the
query is shorter than the keys); on CUDA a decode step's few queries use tpframe/kernels/decode_attention.py.
`window`: sliding-window attention (tpframe/layers/sliding_window.py), each query over itself and the window-1 tokens
before it, in training, with packed documents and in generation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tpframe.comm import Communicator
from tpframe.kernels import HAVE_TRITON
from tpframe.kernels.decode_attention import decode_attention
from tpframe.kernels.rotary import qkv_rotary
from tpframe.layers.context import context_parallel_attention
from tpframe.layers.documents import Documents, context_parallel_document_attention, document_attention, uses_varlen
from tpframe.layers.linear import ColumnParallelLinear, RowParallelLinear
from tpframe.layers.mode import DEFAULT_MODE, LayerMode
from tpframe.layers.norm import RMSNorm
from tpframe.layers.sliding_window import sliding_window_attention
from tpframe.layers.ulysses import ulysses_attention
from tpframe.layers.utils import InitMethod, divide
from tpframe.parallel.state import default_tp_comm

DECODE_TOKENS = 4  # queries per row up to which generation's attention runs the decode kernel, not SDPA


def llama3_inv_freq(
    inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float, original_max_seq_len: int
) -> torch.Tensor:
    """Llama 3.1's rotary scaling of the frequencies (transformers' rope_type "llama3"): wavelengths longer than
    original/low_freq_factor are stretched `factor` times, those shorter than original/high_freq_factor kept, and
    the band between blended linearly in original/wavelength."""
    wavelength = 2 * math.pi / inv_freq
    blend = (original_max_seq_len / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    scaled = torch.where(wavelength > original_max_seq_len / low_freq_factor, inv_freq / factor, inv_freq)
    between = (wavelength >= original_max_seq_len / high_freq_factor) & (
        wavelength <= original_max_seq_len / low_freq_factor
    )
    return torch.where(between, (1 - blend) * inv_freq / factor + blend * inv_freq, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotary positions (GPT-NeoX rotate-half convention), [s, 1, 1, d]. `scaling`: Llama 3.1's
    (factor, low_freq_factor, high_freq_factor, original context) or None (`tpframe.models.config.rope_scaling`)."""

    def __init__(
        self,
        head_dim: int,
        max_seq_len: int,
        theta: float = 10000.0,
        *,
        scaling: tuple[float, float, float, int] | None = None,
    ):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary positions need an even head dim, got {head_dim}")
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        if scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, *scaling)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)[:, None, None, :]
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)
        self.max_seq_len = max_seq_len

    def forward(self, seq_len: int, dtype: torch.dtype, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions offset..offset+seq_len-1: [s, 1, 1, d] each."""
        if offset + seq_len > self.max_seq_len:
            raise ValueError(
                f"positions up to {offset + seq_len - 1} exceed the rotary table's max_seq_len {self.max_seq_len}"
            )
        return self.cos[offset : offset + seq_len].to(dtype), self.sin[offset : offset + seq_len].to(dtype)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence at its own positions: positions [b, s] -> [s, b, 1, d] each (no bounds check:
        a device tensor, e.g. inside a CUDA graph; the caller keeps positions < max_seq_len)."""
        idx = positions.t()
        return self.cos.flatten(1)[idx].unsqueeze(2).to(dtype), self.sin.flatten(1)[idx].unsqueeze(2).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [s, b, n, d] by position: x*cos + rotate_half(x)*sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def split_heads(
    qkv: torch.Tensor,
    nq: int,
    nkv: int,
    d: int,
    rotary=None,
    fused: bool = True,
    *,
    token_major: bool = False,
    qk_norm: tuple[nn.Module, nn.Module] | None = None,
):
    """qkv [s, b, (nq + 2 nkv) d] -> SDPA's q [b, nq, s, d], k, v [b, nkv, s, d], rotary applied to q and k.
    `token_major`: the fused kernel writes them in [b, s, n, d] memory (what variable-length attention reads).

    On CUDA one Triton kernel does the split, the rotation and the layout change (tpframe/kernels/rotary.py;
    under torch.compile as a custom op, since Inductor's own code for it is slow); elsewhere, or with
    `fused=False`, plain torch ops compute the same. The kernel takes tables shared by the batch ([s, 1, 1, d])
    or one row per sequence ([s, b, 1, d]: generation's left-padded rows, where it replaces ten small kernels
    per layer of every decode step). `qk_norm`: the query and key RMSNorms, applied per head before the rotation
    (eagerly in the same kernel, unless a norm's `fused` is off; compiled, by Inductor)."""
    if (
        fused
        and rotary is not None
        and rotary[0].shape[1] in (1, qkv.shape[1])
        and HAVE_TRITON
        and qkv.is_cuda
        and (qk_norm is None or all(n.fused for n in qk_norm) and not torch.compiler.is_compiling())
    ):
        norm = None if qk_norm is None else (qk_norm[0].weight, qk_norm[1].weight, qk_norm[0].eps)
        return qkv_rotary(qkv, *rotary, nq, nkv, d, token_major=token_major, norm=norm)
    s, b = qkv.shape[:2]
    q, k, v = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
    q, k, v = q.view(s, b, -1, d), k.view(s, b, -1, d), v.view(s, b, -1, d)
    if qk_norm is not None:
        q, k = qk_norm[0](q), qk_norm[1](k)
    if rotary is not None:
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
    return tuple(t.permute(1, 2, 0, 3) for t in (q, k, v))


class ParallelAttention(nn.Module):
    def __init__(
        self,
        hidden: int,
        heads: int,
        *,
        kv_heads: int | None = None,
        head_dim: int | None = None,
        qk_norm: bool = False,
        norm_eps: float = 1e-5,
        bias: bool = True,
        qkv_bias: bool | None = None,
        attention_dropout: float = 0.0,
        sequence_parallel: bool = False,
        comm: Communicator | None = None,
        init_method: InitMethod | None = None,
        output_init_method: InitMethod | None = None,
        rng_tracker=None,
        cp_comm: Communicator | None = None,
        window: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        mode: LayerMode = DEFAULT_MODE,
    ):
        super().__init__()
        comm = comm or default_tp_comm()
        self.cp_comm = cp_comm if cp_comm is not None and cp_comm.size > 1 else None
        kv_heads = kv_heads or heads
        if head_dim is None and hidden % heads:
            raise ValueError(f"hidden={hidden} is not divisible by heads={heads}")
        self.head_dim = hidden // heads if head_dim is None else head_dim
        if heads % kv_heads:
            raise ValueError(f"kv_heads={kv_heads} must divide heads={heads}")
        self.heads_local = divide(heads, comm.size, "attention heads")
        self.cp_all_to_all = self.cp_comm is not None and mode.cp_comm == "all_to_all"  # tpframe/layers/ulysses.py
        self.kv_local = divide(kv_heads, comm.size, "attention kv_heads")
        if window is not None and window < 1:
            raise ValueError(f"a sliding window of {window} tokens: it needs at least 1 (None: full causal attention)")
        self.window, self.attention_dropout, self.rng_tracker = window, attention_dropout, rng_tracker
        q_size, kv_size = heads * self.head_dim, kv_heads * self.head_dim
        common = dict(bias=bias, sequence_parallel=sequence_parallel, comm=comm, dtype=dtype, device=device, mode=mode)
        self.qkv = ColumnParallelLinear(  # qkv_bias: this projection's biases alone (Qwen2); None: as `bias`
            hidden,
            q_size + 2 * kv_size,
            init_method=init_method,
            fused_parts=(("q", q_size), ("k", kv_size), ("v", kv_size)),
            lora_role="qkv",
            **{**common, "bias": bias if qkv_bias is None else qkv_bias},
        )
        out_init = output_init_method or init_method
        self.proj = RowParallelLinear(q_size, hidden, init_method=out_init, lora_role="proj", **common)
        # each rank normalizes only its heads: the norms' weights' gradients are partial over TP, summed there
        norm = dict(sequence_parallel=True, dtype=dtype, device=device, mode=mode)
        self.q_norm, self.k_norm = (
            (RMSNorm(self.head_dim, norm_eps, **norm) for _ in range(2)) if qk_norm else (None,) * 2
        )
        # the Triton split+rotary kernel on CUDA, a sliding window by flex_attention's block mask (else SDPA's dense
        # mask); and the Triton decode-attention kernel (else SDPA)
        self.fused = self.fused_decode = mode.fused_kernels

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache=None,
        *,
        entered: bool = False,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        """x [s, b, h] -> [s, b, h]. `cache`: one layer's view of a KV cache (`append(k, v)` -> every
        slot's keys and values [b, nkv/tp, L, d]; `mask` [b, 1, s, L], True where a query may look).
        `entered=True`: x is already `self.qkv.enter(x)` (selective recompute). `documents`: packed
        documents (tpframe/layers/documents.py), each attending only to itself."""
        qkv = self.qkv(x, entered=entered)  # [s, b, (nq + 2 nkv)/tp * d]
        s, b = qkv.shape[:2]
        d = self.head_dim
        # SDPA takes [b, n, s, d]
        dropout = self.attention_dropout if self.training else 0.0
        # the varlen kernel reads each document's tokens as rows of [b*s, n, d]: have them written that way
        token_major = (
            documents is not None
            and self.cp_comm is None
            and uses_varlen(qkv, documents, dropout, head_dim=d, window=self.window)
        )
        q, k, v = split_heads(
            qkv,
            self.heads_local,
            self.kv_local,
            d,
            rotary,
            fused=self.fused,
            token_major=token_major,
            qk_norm=(self.q_norm, self.k_norm) if self.q_norm is not None else None,
        )
        if cache is not None:  # generation: attend over every cached slot the mask allows
            k, v = cache.append(k, v)
            mask = cache.mask if self.window is None else cache.window_mask(self.window)
            if s <= DECODE_TOKENS and self.fused_decode and HAVE_TRITON and q.is_cuda:  # decode step
                out = decode_attention(q, k, v, mask)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
        elif dropout > 0 and self.rng_tracker is not None:
            with self.rng_tracker.fork():  # this rank's heads: its own dropout stream
                out = self._causal(q, k, v, dropout, documents)
        else:
            out = self._causal(q, k, v, dropout, documents)
        # [s, b, h] in memory too: the varlen path's output is token-major ([b, s, ...]), and a matmul of that
        # strided view (LoRA's F.linear) runs as s batched GEMMs of b rows (2.6x slower steps at 8B, b=2)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.heads_local * d).contiguous()
        return self.proj(out)

    def _causal(self, q, k, v, dropout: float, documents: Documents | None = None) -> torch.Tensor:
        if self.cp_all_to_all:  # the whole sequence of 1/cp of the heads (`documents`: of the whole rows)
            return ulysses_attention(q, k, v, self.cp_comm, lambda *qkv: self._whole(*qkv, dropout, documents))
        gqa = self.kv_local != self.heads_local
        if documents is not None and self.cp_comm is not None:
            return context_parallel_document_attention(
                q, k, v, self.cp_comm, documents, dropout_p=dropout, enable_gqa=gqa, window=self.window
            )
        if self.cp_comm is not None:  # this CP rank's queries over the whole sequence's keys
            return context_parallel_attention(
                q, k, v, self.cp_comm, dropout_p=dropout, enable_gqa=gqa, window=self.window, flex=self.fused
            )
        return self._whole(q, k, v, dropout, documents)

    def _whole(self, q, k, v, dropout: float, documents: Documents | None = None) -> torch.Tensor:
        """Causal attention of q [b, nq, s, d] over k, v [b, nkv, s, d] holding the whole sequence."""
        gqa = k.shape[1] != q.shape[1]
        if documents is not None:
            return document_attention(q, k, v, documents, dropout_p=dropout, enable_gqa=gqa, window=self.window)
        if self.window is not None:
            return sliding_window_attention(q, k, v, self.window, dropout_p=dropout, enable_gqa=gqa, flex=self.fused)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, enable_gqa=gqa)
