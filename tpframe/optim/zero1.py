"""`zero1`, the distributed optimizer: fp32 masters and both AdamW moments sharded over DP.

Params live in one flat buffer laid out like the fp32 gradient buffer (reverse order, buckets padded
to a multiple of dp). Each bucket's gradients are reduce-scattered (fp32, averaged), so DP rank d
gets slice d of every bucket; it keeps masters and moments for exactly that slice (a "segment" of
each param the slice touches), updates them, writes the result into its slice of the param buffer
and all-gathers the buckets over DP.

With expert parallelism (parallel.ep > 1) the experts are a second, separate set of buffers sharded over
their replicas (the `edp` group, dp*cp/ep ranks) instead of all of DP x CP: each rank of DP x CP still
holds a distinct slice of everything, so the global gradient norm is one sum over DP x CP as without EP.

Optimizer state per rank: 12 bytes per parameter / dp (8 when params are fp32 and their own master);
for experts / (dp*cp/ep).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tpframe.optim.config import OptimConfig
from tpframe.optim.grad_buffer import GradBuffer, allreduce_shared_grads, replica_grad_buffers
from tpframe.optim.strategy import (
    STEP_KEY,
    GradStrategy,
    add_chunks,
    add_master_chunks,
    clip_by_global_norm,
    counts_once,
    ensure_adamw_state,
    finish_state,
    make_adamw,
    master_state_bytes,
    named_frozen,
    named_trainable,
    replicas_label,
    restore_masters,
    set_adamw_step_count,
    step_masters,
    weights_key,
)
from tpframe.parallel.state import ParallelState

# torch 2.13 renamed the tensor collectives; 2.11 only has the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class Segment:
    """The part of param `name` this DP rank owns: `flat.numel()` elements from `start` (of the flattened param)."""

    name: str
    param: nn.Parameter
    start: int
    flat: torch.Tensor  # the param buffer's elements for this segment
    master: torch.Tensor  # fp32: `flat` itself for fp32 params, else a copy
    grad: torch.Tensor  # fp32 view into the gradient buffer, where the reduce-scatter leaves this rank's sum


@dataclass
class Sharded:
    """Params sharded over one DP group: their gradient buffer (reduce-scattered) and the flat param buffer
    laid out like it (each param's data a view into it)."""

    grads: GradBuffer
    params: torch.Tensor


class Zero1Strategy(GradStrategy):
    name = "zero1"

    def __init__(
        self,
        model: nn.Module,
        cfg: OptimConfig,
        parallel: ParallelState,
        *,
        bucket_bytes: int = 40 * 2**20,
        overlap: bool = True,
        reduce_dtype: torch.dtype = torch.float32,
    ):
        self.parallel = parallel
        self.named = named_trainable(model)
        self.frozen = named_frozen(model)
        params = [p for _, p in self.named]
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"zero1 needs parameters of one dtype, got {sorted(map(str, dtypes))}")
        self.segments: list[Segment] = []
        # the experts (expert parallelism) sharded over their replicas only (as in ddp)
        buffers = replica_grad_buffers(
            params,
            parallel,
            mode="reduce_scatter",
            bucket_bytes=bucket_bytes,
            overlap=overlap,
            reduce_dtype=reduce_dtype,
        )
        self.parts = [self._shard(grads) for grads in buffers]
        self.grads = self.parts[0].grads
        # each segment's fp32 master and the param-buffer elements it rounds to
        self.masters, self.flats = [sg.master for sg in self.segments], [sg.flat for sg in self.segments]
        self.optimizer = make_adamw(self.masters, [sg.param for sg in self.segments], cfg) if self.segments else None

    def _shard(self, grads: GradBuffer) -> Sharded:
        """Move the params of `grads` into a flat param buffer laid out like it; add this rank's segments of them."""
        params = grads.params
        buffer = torch.zeros(grads.numel, dtype=params[0].dtype, device=params[0].device)
        with torch.no_grad():
            for p in params:
                off = grads.offsets[p]
                view = buffer[off : off + p.numel()]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)
        name_of = {p: n for n, p in self.named}
        for b in grads.buckets:
            lo, hi = grads.shard_range(b)
            for p in b.params:
                off = grads.offsets[p]
                s, e = max(lo, off), min(hi, off + p.numel())
                if s >= e:
                    continue
                flat = buffer[s:e]
                master = flat if flat.dtype == torch.float32 else flat.float().clone()
                grad = grads.buffer[s:e]  # reduce-scattered in place
                self.segments.append(Segment(name_of[p], p, s - off, flat, master, grad))
        return Sharded(grads, buffer)

    # -- gradients -------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        for part in self.parts:
            part.grads.zero()

    def start_grad_sync(self) -> None:
        for part in self.parts:
            part.grads.start_sync()

    def finish_grad_sync(self) -> None:
        for part in self.parts:
            part.grads.finish_sync()
        # every TP rank has the same layout, so the same segments: sum the sequence-parallel ones over TP;
        # a tied weight has a bucket of its own: this slice is the same element range on both stages
        allreduce_shared_grads([(sg.param, sg.grad) for sg in self.segments], self.parallel)

    def clip_grad_norm(self, max_norm: float) -> float:
        tp_rank, pp_rank = self.parallel.tp_rank, self.parallel.pp_rank
        counted = [sg.grad for sg in self.segments if counts_once(sg.param, tp_rank, pp_rank)]
        # shards over DP x CP (experts: over their replicas x EP, the same ranks), then one model replica
        comms = [self.parallel.dp_cp_comm, self.parallel.mp_comm]
        shards = [s for part in self.parts for s in part.grads.shards()]
        return clip_by_global_norm(counted, shards, max_norm, comms, self.grads.buffer.device, optimizer=self.optimizer)

    # -- the update ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, lr: float) -> None:
        if self.optimizer is not None:
            step_masters(self.optimizer, lr, self.masters, [sg.grad for sg in self.segments], self.flats)
        self.gather_params()

    def gather_params(self) -> None:
        """All-gather every bucket of the param buffers over DP (each rank contributes its updated slice)."""
        for part in self.parts:
            if part.grads.dp_size == 1:
                continue
            for b in part.grads.buckets:
                lo, hi = part.grads.shard_range(b)
                # In place: this rank's slice of the output is its input (NCCL skips the self-copy; gloo
                # gathers into a scratch buffer and copies out), so no clone of the shard is needed.
                _all_gather(part.params[b.start : b.stop], part.params[lo:hi], group=part.grads.dp_group)

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self, available: set[str] | None = None) -> dict:
        tp_rank, tp = self.parallel.tp_rank, self.parallel.tp
        out: dict = {}
        fp32 = self.parts[0].params.dtype == torch.float32
        for name, p in self.named:  # the whole (TP-local) model on every DP rank
            add_chunks(out, weights_key(available) if fp32 else "model/{}", name, p, tp_rank, tp, p.detach().view(-1))
        if self.optimizer is not None:
            ensure_adamw_state(self.optimizer)
            for sg in self.segments:
                own = sg.master is sg.flat
                add_master_chunks(
                    out, self.optimizer, sg.name, sg.param, sg.master, tp_rank, tp, start=sg.start, own=own
                )
        return finish_state(out, available, optimizer=self.optimizer, frozen=self.frozen, parallel=self.parallel)

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if self.optimizer is not None and STEP_KEY in state:
            set_adamw_step_count(self.optimizer, state[STEP_KEY])
        restore_masters(self.masters, self.flats, state)
        self.gather_params()
        self.zero_grad()

    def state_bytes(self) -> int:
        if self.optimizer is None:
            return 0
        ensure_adamw_state(self.optimizer)
        return master_state_bytes(self.masters, self.flats)

    def describe(self) -> str:
        reduced = ", reduced in bf16" if self.grads.reduce_dtype == torch.bfloat16 else ""
        n = sum(len(part.grads.buckets) for part in self.parts)
        experts = (
            f", experts over ep={self.parallel.ep} and their {self.parallel.edp} replicas"
            if len(self.parts) > 1
            else ""
        )
        return (
            f"zero1 (optimizer state sharded over {replicas_label(self.parallel)}{experts}, "
            f"{n} gradient bucket{'s' * (n != 1)}{reduced})"
        )
