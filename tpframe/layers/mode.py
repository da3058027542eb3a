"""How the layers compute: one `LayerMode`, resolved once from the run's config (train.py builds it into the
BuildContext) and handed to every layer when it is built.

Each layer decides from it and its own shapes what it runs, and keeps that: a linear layer computes in float8 when
the mode asks and its shard gains (`uses_fp8`), pipelines its collective with its GEMM when the mode asks for async
TP and the layer is sequence-parallel, runs the one-row decode kernel with `fused_kernels`; norms and attention take
their Triton kernels with `fused_kernels`; a linear layer whose role `lora` targets builds its adapter. Nothing is
switched on a built model.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpframe.layers.async_tp import normalize_mode
from tpframe.layers.fp8 import fp8_refusal, recipe_of
from tpframe.layers.lora import LoRA


@dataclass(frozen=True)
class LayerMode:
    """What the layers run (see the module docstring); frozen: a layer reads it once, when it is built."""

    # tpframe/kernels' Triton kernels on CUDA (norms, rotary, decode attention, one-row GEMMs, head + loss) and
    # flex_attention's sliding-window mask; False: torch's ops
    fused_kernels: bool = True
    # float8 GEMMs (tpframe/layers/fp8.py: a recipe, True for tensorwise) in the column/row-parallel layers whose shards
    # gain; None: the compute dtype
    fp8: str | bool | None = None
    # "copy_engine" (True): the sequence-parallel linear layers pipeline their collective with their GEMM
    # (tpframe/layers/async_tp.py); None: off
    async_tp: str | bool | None = None
    cp_comm: str = "all_gather"  # context-parallel attention: "all_gather" or "all_to_all" (layers/context.py)
    lora: LoRA | None = None  # low-rank adapters on the linear layers it targets (tpframe/layers/lora.py); None: none

    def __post_init__(self):
        object.__setattr__(self, "async_tp", normalize_mode(self.async_tp))
        object.__setattr__(self, "fp8", recipe_of(self.fp8))

    def uses_fp8(self, local_out: int, local_in: int) -> str | None:
        """The float8 recipe a linear layer with this per-rank weight [out, in] runs its GEMMs in, or None."""
        return self.fp8 if self.fp8 and fp8_refusal(local_out, local_in, self.fp8) is None else None


DEFAULT_MODE = LayerMode()  # fused kernels, GEMMs in the compute dtype, no async TP
