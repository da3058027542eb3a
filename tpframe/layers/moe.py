"""Mixture of experts: a router sends each token to `top_k` of `num_experts` MLPs (Mixtral, Megatron-Core's MoE).

    x [s(/tp), b, h] -> enter the TP region (all-gather of the sequence under SP) -> tokens [T, h]
      router   logits = tokens W_r^T in fp32 [T, E]; p = softmax(logits); top-k of p, renormalized to sum 1
      dispatch each token once per chosen expert, sorted by expert; with expert parallelism (ep > 1) an
               all-to-all over the EP group brings every rank the tokens of its E/ep experts, and back after
      experts  bias-free MLPs, each split over TP like the dense MLP (fc1 by rows, fc2 by columns)
      combine  each token's expert outputs weighted by its router weights and summed, still partial over TP
    -> leave the TP region: all-reduce (or reduce-scatter under SP) -> [s(/tp), b, h]

A shared expert (`shared_ffn_hidden` > 0: DeepSeek-MoE's, Megatron's moe_shared_expert_intermediate_size) is
one more bias-free MLP that every token goes through, its partial output added before the layer leaves the
TP region. So TP costs the same two collectives per direction as the dense MLP, and every TP rank routes the
same tokens the same way. Load balancing: Switch Transformer's auxiliary loss coeff * E * sum_e f_e * P_e (f_e
the share of routed slots that chose expert e, counted over the micro-batch's whole sequences, i.e. summed
over CP; P_e the mean router probability of e). ST-MoE's router z-loss (`z_loss_coeff` times the mean of
logsumexp(logits)^2) keeps the router's logits small. Both enter training through their gradients only
(Megatron's MoEAuxLossAutoScaler), so the reported loss stays the language-model loss; `aux_loss_scale` (set
to 1/micro-batches each step, by GPT.start_step) weighs them like the micro-batch's loss.

DeepSeek-V3's router is the other choice (`score="sigmoid"`, `expert_bias=True`): scores sigmoid(logits), the
top-k normalized to sum 1 (for k > 1), and auxiliary-loss-free balancing: a per-expert bias, added to the
scores only to choose the experts, moves by a fixed rate after every optimizer step toward balance
(`update_expert_biases`: down for an expert that took more than the mean of the step's routed slots, summed
over the data-parallel ranks, up for one that took fewer). The bias is an fp32 parameter without gradient
(`expert_bias`, replicated), so checkpoints, exports and generation carry it like the weights. A training
micro-batch's slots are counted in its backward, which runs once even when activation recompute runs the
forward twice.

Without autograd (generation, evaluation) and for at most `DENSE_MAX_TOKENS` tokens (a decode step), every
expert runs on every token instead, weighted by zero where it was not chosen: no host synchronization, so
the step can be a CUDA graph, and at those sizes reading the experts' weights is the cost either way.

On Hopper GPUs in bf16 the experts run as two grouped GEMMs (torch._grouped_mm) over their stacked weights,
with the group boundaries on the device: no host synchronization per layer, which at small widths costs
more than the GEMMs (benchmarks/RESULTS.md, 'train.py with MoE against dense, GPT-125M width').
Elsewhere (CPU, fp32, older GPUs, float8, expert parallelism) one GEMM pair per expert, sized on the host.
So the grouped path is also the one torch.compile traces whole and a training CUDA graph can hold
(train.compile, train.cuda_graph); under torch.compile the per-expert loop runs with a graph break at its
host synchronization, and a CUDA graph cannot capture it.

Every expert is always run, on zero tokens if none chose it, so each parameter gets a gradient every
backward (the bucketed gradient sync counts on that). Expert e's weights are drawn from their own seed
(the caller's seed and e), so they do not depend on TP, EP or which experts a rank builds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpframe.comm import Communicator
from tpframe.layers.linear import enter_tp_region
from tpframe.layers.mappings import all_to_all, reduce_from_tp, reduce_scatter_to_sp
from tpframe.layers.mlp import ParallelMLP
from tpframe.layers.mode import DEFAULT_MODE, LayerMode
from tpframe.layers.utils import InitMethod, normal_init, tag_param
from tpframe.parallel.recompute import RecomputedOutput
from tpframe.parallel.state import default_tp_comm

DENSE_MAX_TOKENS = 64
_GROUPED_MM = hasattr(torch, "_grouped_mm")


def grouped_gemms_available(device: torch.device | str) -> bool:
    """Whether experts on `device` can run as grouped GEMMs (torch._grouped_mm: CUDA, Hopper or newer)."""
    device = torch.device(device)
    return _GROUPED_MM and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def _bincount(top_i: torch.Tensor, n: int) -> torch.Tensor:
    """Slots per expert, [n] int64, without torch.bincount's device-to-host synchronization on CUDA."""
    flat = top_i.flatten()
    return torch.zeros(n, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


class _Gather(torch.autograd.Function):
    """x.index_select(0, index) whose backward gathers too: `inverse` maps each row of x's `copies`
    consecutive slots to where they went, and the slots are summed. A permutation both ways, so no
    scatter-add (and no atomics): dispatch + combine take less time than index_select + index_add, the more so
    with more experts (benchmarks/RESULTS.md, 'Numbers moved out of code comments')."""

    @staticmethod
    def forward(ctx, x, index, inverse, copies):
        ctx.save_for_backward(inverse)
        ctx.rows, ctx.copies = x.shape[0], copies
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        grad = grad.index_select(0, inverse)
        if ctx.copies > 1:
            grad = grad.view(ctx.rows, ctx.copies, -1).sum(dim=1)
        return grad, None, None, None


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on `x`; backward also sends `scale` as the gradient of the scalar `aux` (so d(total)/d(aux) = scale)."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class _CountInBackward(torch.autograd.Function):
    """Identity on `x`; its backward adds `counts` into `total` (once per micro-batch, recompute or not)."""

    @staticmethod
    def forward(ctx, x, counts, total):
        ctx.save_for_backward(counts)
        ctx.total = total
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (counts,) = ctx.saved_tensors
        ctx.total.add_(counts)
        return grad, None, None


@torch.no_grad()
def update_expert_biases(layers: list[nn.Module], comm: Communicator | None, rate: float) -> float | None:
    """After an optimizer step: each expert's selection bias moves by `rate` toward balance (down if it took more
    than the mean of the step's routed slots, up if fewer), the slots summed over `comm` (the data-parallel and
    context-parallel ranks; every TP rank routes the same tokens); then the counts start over. One all-reduce.
    Returns the step's worst imbalance: the most loaded expert's slots over the mean, of the worst layer (1.0:
    balanced), or None without such layers."""
    layers = [m for m in layers if isinstance(m, MoE) and m.expert_bias is not None]
    if not layers:
        return None
    load = torch.stack([m.expert_load for m in layers])  # [layers, E]
    if comm is not None and comm.size > 1:
        load = comm.all_reduce(load, donate=True)  # stack's output: fresh
    load = load.double()
    delta = (rate * torch.sign(load.mean(dim=1, keepdim=True) - load)).float()
    for m, d in zip(layers, delta):
        m.expert_bias.add_(d)
        m.expert_load.zero_()
    return float((load.max(dim=1).values / load.mean(dim=1).clamp(min=1e-9)).max())


def reset_expert_load(layers: list[nn.Module]) -> None:
    """Drop the slots counted so far (a step that is tried again counts from zero)."""
    for m in layers:
        if isinstance(m, MoE) and m.expert_bias is not None:
            m.expert_load.zero_()


class MoE(nn.Module):
    """[s, b, h] -> [s, b, h] (or [s/tp, b, h] in and out with sequence parallelism); see the module docstring.

    `ep_comm`: the expert-parallel group (ranks holding different data); this rank builds experts
    [rank * E/ep, (rank+1) * E/ep), kept under their global index (`experts.5` on any layout).
    `cp_comm`: the context-parallel group, over which the load-balancing counts are summed.
    """

    def __init__(
        self,
        hidden: int,
        ffn_hidden: int,
        num_experts: int,
        top_k: int,
        *,
        activation: str = "swiglu",
        aux_loss_coeff: float = 0.01,
        z_loss_coeff: float = 0.0,
        score: str = "softmax",
        expert_bias: bool = False,
        shared_ffn_hidden: int = 0,
        sequence_parallel: bool = False,
        comm: Communicator | None = None,
        ep_comm: Communicator | None = None,
        cp_comm: Communicator | None = None,
        init_method: InitMethod | None = None,
        output_init_method: InitMethod | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        mode: LayerMode = DEFAULT_MODE,
    ):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: top_k must be in 1..num_experts={num_experts}, got {top_k}")
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"MoE: score must be 'softmax' or 'sigmoid', got {score!r}")
        self.score = score
        self.comm = comm or default_tp_comm()
        self.ep_comm = ep_comm if ep_comm is not None and ep_comm.size > 1 else None
        self.cp_comm = cp_comm if cp_comm is not None and cp_comm.size > 1 else None
        ep, ep_rank = (self.ep_comm.size, self.ep_comm.rank) if self.ep_comm else (1, 0)
        if num_experts % ep:
            raise ValueError(f"MoE: num_experts={num_experts} is not divisible by the expert-parallel size {ep}")
        self.hidden, self.num_experts, self.top_k = hidden, num_experts, top_k
        self.local_experts = num_experts // ep
        self.first_expert = ep_rank * self.local_experts
        self.sequence_parallel, self.aux_loss_coeff, self.z_loss_coeff = sequence_parallel, aux_loss_coeff, z_loss_coeff
        self.aux_loss_scale = 1.0
        # the latest training forward's load-balancing loss and z-loss (detached), for logging
        self.last_aux_loss: torch.Tensor | None = None
        self.last_z_loss: torch.Tensor | None = None
        device = device or self.comm.device
        # decided here, not per call: torch.compile traces `_grouped` without asking the driver
        self._hopper = grouped_gemms_available(device)
        init_method = init_method or normal_init()
        self._build_router(init_method, expert_bias=expert_bias, dtype=dtype, device=device)
        mlp = dict(
            activation=activation,
            bias=False,
            sequence_parallel=sequence_parallel,
            comm=self.comm,
            init_method=init_method,
            output_init_method=output_init_method,
            dtype=dtype,
            device=device,
            mode=mode,
        )
        self._build_experts(ffn_hidden, shared_ffn_hidden, mlp)

    def _build_router(self, init_method: InitMethod, *, expert_bias: bool, dtype: torch.dtype, device) -> None:
        """The router [E, h] (and DeepSeek-V3's expert bias with its load counts)."""
        num_experts, hidden = self.num_experts, self.hidden
        router = torch.empty(num_experts, hidden, dtype=torch.float32)
        init_method(router)
        # replicated over TP, but each TP rank's gradient is partial (it weighs partial expert outputs): summed
        # over TP like a sequence-parallel parameter's
        self.router = nn.Linear(hidden, num_experts, bias=False, device="meta")  # [E, h]; used through F.linear
        self.router.weight = tag_param(
            nn.Parameter(router.to(device=device, dtype=dtype)), tp_dim=None, sequence_parallel=True
        )
        self.expert_bias = None
        if expert_bias:  # fp32 whatever the model's dtype: steps of 1e-3 vanish in bf16 next to a bias of ~1
            self.expert_bias = tag_param(
                nn.Parameter(torch.zeros(num_experts, device=device), requires_grad=False), tp_dim=None
            )
            self.register_buffer(
                "expert_load", torch.zeros(num_experts, dtype=torch.int64, device=device), persistent=False
            )  # routed slots of this step's micro-batches (this rank's tokens)

    def _build_experts(self, ffn_hidden: int, shared_ffn_hidden: int, mlp: dict) -> None:
        """This EP rank's experts (and the shared one), each drawn from its own seed: the same at any EP size."""
        base = torch.initial_seed()
        self.shared = None
        if shared_ffn_hidden:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(base + 7919 * (self.num_experts + 1))
                self.shared = ParallelMLP(self.hidden, shared_ffn_hidden, **mlp)
        experts = {}
        for e in range(self.first_expert, self.first_expert + self.local_experts):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(base + 7919 * (e + 1))
                experts[str(e)] = ParallelMLP(self.hidden, ffn_hidden, **mlp)
        self.experts = nn.ModuleDict(experts)  # each an FSDP unit of its own under EP (tpframe/optim/fsdp.py)
        for p in self.experts.parameters():
            tag_param(p, expert=True)  # split over EP: gradient strategies reduce it over the expert's replicas only

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """The input's entry into the TP region; forward(enter(x), entered=True) == forward(x)."""
        return enter_tp_region(x, self.comm, self.sequence_parallel)

    def forward(self, x: torch.Tensor, *, entered: bool = False, recompute_activation: bool = False) -> torch.Tensor:
        x = x if entered else self.enter(x)
        tokens = x.reshape(-1, self.hidden)
        router_dtype = torch.promote_types(x.dtype, torch.float32)  # fp32 (fp64 stays fp64)
        logits = F.linear(tokens.to(router_dtype), self.router.weight.to(router_dtype))  # [T, E]
        probs = torch.softmax(logits, dim=-1) if self.score == "softmax" else torch.sigmoid(logits)
        if self.expert_bias is None:
            top_p, top_i = probs.topk(self.top_k, dim=-1)
        else:  # the bias chooses, the scores weigh
            top_i = (probs.detach() + self.expert_bias).topk(self.top_k, dim=-1).indices
            top_p = probs.gather(1, top_i)
        if self.score == "softmax" or self.top_k > 1:
            top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        weights = top_p.to(x.dtype)
        counts = None if not torch.is_grad_enabled() else _bincount(top_i, self.num_experts)
        training = self.training and torch.is_grad_enabled()
        if training and self.expert_bias is not None:
            weights = _CountInBackward.apply(weights, counts, self.expert_load)
        if self.score == "sigmoid":  # the load-balancing loss weighs each token's scores as a distribution
            probs = probs / probs.sum(dim=-1, keepdim=True)
        # carried by the router weights' backward, which runs on every TP rank with the same value:
        # 1/tp of the gradient on each sums to one
        scale = self.aux_loss_scale / self.comm.size
        if training and self.aux_loss_coeff > 0:
            aux = self._aux_loss(probs, counts)
            self.last_aux_loss = aux.detach()
            weights = _AttachAuxLoss.apply(weights, aux, self.aux_loss_coeff * scale)
        if training and self.z_loss_coeff > 0:
            z = torch.logsumexp(logits, dim=-1).square().mean()
            self.last_z_loss = z.detach()
            weights = _AttachAuxLoss.apply(weights, z, self.z_loss_coeff * scale)
        if not torch.is_grad_enabled() and self.ep_comm is None and tokens.shape[0] <= DENSE_MAX_TOKENS:
            out = self._dense(tokens, top_i, weights)
        else:
            out = self._dispatch(tokens, top_i, weights, counts, recompute_activation)
        if self.shared is not None:
            out = out + self.shared(tokens, entered=True, reduce=False, recompute_activation=recompute_activation)
        out = out.view_as(x)
        if self.sequence_parallel:
            return reduce_scatter_to_sp(out, self.comm)
        return reduce_from_tp(out, self.comm, donate=True)

    def _aux_loss(self, probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """E * sum_e f_e * P_e: f_e over the whole sequences (counts summed over CP), P_e over this rank's tokens;
        the CP ranks' values average to the loss of the whole sequences."""
        counts = counts.float()
        tokens = probs.shape[0]
        if self.cp_comm is not None:
            counts = self.cp_comm.all_reduce(counts)
            tokens *= self.cp_comm.size
        share = counts / (tokens * self.top_k)
        return self.num_experts * (share * probs.mean(dim=0)).sum()

    def _dense(self, tokens, top_i, weights) -> torch.Tensor:
        """[T, h] -> [T, h] with every expert on every token, weighted by zero where not chosen (partial over TP)."""
        gates = weights.new_zeros(tokens.shape[0], self.num_experts).scatter(1, top_i, weights)
        out = tokens.new_zeros(tokens.shape)
        for e, expert in self.experts.items():
            out += gates[:, int(e), None] * expert(tokens, entered=True, reduce=False)
        return out

    def _dispatch(self, tokens, top_i, weights, counts, recompute_activation: bool) -> torch.Tensor:
        """[T, h] -> [T, h]: every token through its experts, weighted and summed (partial over TP)."""
        if counts is None:
            counts = _bincount(top_i, self.num_experts)
        order = torch.argsort(top_i.flatten(), stable=True)  # routed slots (token-major) sorted by expert
        slot = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        src = torch.div(order, self.top_k, rounding_mode="floor")  # the token of each sorted slot
        xs = _Gather.apply(tokens, src, slot, self.top_k)  # [T*k, h], sorted by expert
        if self.ep_comm is None and self._grouped(xs):
            ys = self._run_grouped(xs, counts, recompute_activation)  # no host synchronization
        elif xs.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "MoE: a CUDA graph can capture the experts only as grouped GEMMs (bf16 on Hopper or "
                "newer, no float8, parallel.ep=1); this layer sizes them on the host"
            )
        elif self.ep_comm is None:
            ys = self._run_experts(xs, counts.tolist(), recompute_activation)
        else:
            ys = self._run_expert_parallel(xs, counts, recompute_activation)
        ys = _Gather.apply(ys, slot, order, 1).view(*top_i.shape, -1)  # back to token-major [T, k, h]
        return (ys * weights.unsqueeze(-1)).sum(dim=1)

    def _run_experts(self, xs: torch.Tensor, sizes: list[int], recompute_activation: bool) -> torch.Tensor:
        """Rows of `xs` grouped by local expert (`sizes[i]` rows for the i-th) -> their partial outputs."""
        chunks = xs.split(sizes)
        return torch.cat(
            [
                expert(chunk, entered=True, reduce=False, recompute_activation=recompute_activation)
                for expert, chunk in zip(self.experts.values(), chunks)
            ]
        )

    def _grouped(self, xs: torch.Tensor) -> bool:
        """Whether the experts run as grouped GEMMs (torch._grouped_mm: bf16 on Hopper and newer, not float8)."""
        return (
            self._hopper
            and xs.is_cuda
            and xs.dtype == torch.bfloat16
            and not any(m.fc1.fp8 or m.fc2.fp8 for m in self.experts.values())
        )

    def _run_grouped(self, xs: torch.Tensor, counts: torch.Tensor, recompute_activation: bool) -> torch.Tensor:
        """`_run_experts` as two grouped GEMMs over the experts' stacked weights (torchtitan's route): the
        group boundaries stay on the device, so the CPU never waits for the router."""
        offsets = counts.cumsum(0).to(torch.int32)
        experts = list(self.experts.values())
        w1 = torch.stack([m.fc1.weight for m in experts])  # [E, fc1 rows/tp, h]; a copy, small next to the GEMMs
        w2 = torch.stack([m.fc2.weight for m in experts])  # [E, h, ffn/tp]
        h = torch._grouped_mm(xs, w1.transpose(1, 2), offs=offsets)
        act = experts[0].act
        if not recompute_activation:
            return torch._grouped_mm(act(h), w2.transpose(1, 2), offs=offsets)
        a = RecomputedOutput(act, h)
        y = torch._grouped_mm(a.output, w2.transpose(1, 2), offs=offsets)
        a.discard(after=y)
        return y

    def _run_expert_parallel(self, xs: torch.Tensor, counts: torch.Tensor, recompute_activation: bool) -> torch.Tensor:
        """Sorted slots to the EP ranks that own their experts, through the experts, and back."""
        ep, local = self.ep_comm.size, self.local_experts
        # received[j, e]: how many slots EP rank j sends to this rank's e-th expert
        received = self.ep_comm.all_to_all(counts, [local] * ep, [local] * ep).view(ep, local)
        send_splits = counts.view(ep, local).sum(dim=1).tolist()
        recv_splits = received.sum(dim=1).tolist()
        x_recv = all_to_all(xs, self.ep_comm, recv_splits, send_splits)  # by source rank, then expert
        # regroup by expert: block (j, e) starts at starts[j, e] in x_recv and goes to the e-major position
        lengths = received.t().flatten()  # blocks in (expert, source) order
        starts = (received.flatten().cumsum(0) - received.flatten()).view(ep, local).t().flatten()
        offsets = lengths.cumsum(0) - lengths
        perm = torch.arange(int(lengths.sum()), device=xs.device) + torch.repeat_interleave(starts - offsets, lengths)
        y_local = self._run_experts(x_recv.index_select(0, perm), received.sum(dim=0).tolist(), recompute_activation)
        y_recv = y_local.new_zeros(y_local.shape).index_copy(0, perm, y_local)
        return all_to_all(y_recv, self.ep_comm, send_splits, recv_splits)

    def extra_repr(self) -> str:
        ep = self.ep_comm.size if self.ep_comm else 1
        return (
            f"experts={self.num_experts} (experts {self.first_expert}..{self.first_expert + self.local_experts - 1} "
            f"here, ep={ep}), top_k={self.top_k}, score={self.score}, expert_bias={self.expert_bias is not None}, "
            f"aux_loss_coeff={self.aux_loss_coeff}, "
            f"z_loss_coeff={self.z_loss_coeff}, sp={self.sequence_parallel}"
        )
