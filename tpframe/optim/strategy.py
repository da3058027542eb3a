"""The interface every gradient-and-optimizer strategy (`parallel.dp_strategy`) implements, and what they share.

One optimizer step, as the trainer sequences it:

    strategy.zero_grad()
    forward_backward(...)            # the schedule calls strategy.start_grad_sync() before the last backward
    strategy.finish_grad_sync()      # DP reduction done, sequence-parallel grads summed over TP
    norm = strategy.clip_grad_norm(max_norm)
    strategy.step(lr)                # skipped by the trainer when norm is not finite

`state_dict()` gives the model and optimizer state as pieces of *global logical tensors*
(`LogicalChunks`, named by tpframe.parallel.sharding): `model/<name>`, `optim/<name>/master` (bf16
runs), `optim/<name>/exp_avg`, `optim/<name>/exp_avg_sq`, `optim/step`. The names and shapes are the
same for every strategy and layout, so any checkpoint loads into any strategy, TP, DP or PP size.
The strategy owns the model's tensors in checkpoints because it owns their storage (ZeRO-1 moves
params into a flat buffer, FSDP2 shards them).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tpframe.comm import Communicator
from tpframe.optim.config import OptimConfig
from tpframe.parallel.sharding import LogicalChunks, chunks_of

STEP_KEY = "optim/step"
MOMENTS = ("exp_avg", "exp_avg_sq")


def counts_once(p: torch.Tensor, tp_rank: int, pp_rank: int = 0) -> bool:
    """Whether this rank's copy of `p` enters the global norm: TP shards always, replicated params on TP rank 0;
    a weight tied across pipeline stages (`pipeline_tied`) on the first stage only."""
    if p.pipeline_tied and pp_rank > 0:
        return False
    return p.tp_dim is not None or tp_rank == 0


def make_adamw(masters: list[torch.Tensor], params: list[torch.Tensor], cfg: OptimConfig) -> torch.optim.AdamW:
    """torch's AdamW over fp32 `masters` (of `params`, pairwise): weight decay where the param is a matrix,
    none on biases and norm weights."""
    decay = [m for m, p in zip(masters, params) if p.dim() >= 2]
    no_decay = [m for m, p in zip(masters, params) if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    first = (decay or no_decay)[0]
    on_cuda = first.device.type == "cuda"
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=on_cuda,
        foreach=None if on_cuda else True,
    )


def ensure_adamw_state(optimizer: torch.optim.AdamW) -> None:
    """Create AdamW's state (zeros, step 0) where torch has not yet, exactly as its first step would,
    so a checkpoint load has somewhere to write."""
    fused = bool(optimizer.defaults.get("fused"))
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                device = p.device if fused else "cpu"
                state["step"] = torch.zeros((), dtype=torch.float32, device=device)
                for key in MOMENTS:
                    state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)


def set_adamw_lr(optimizer: torch.optim.AdamW, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def adamw_step_count(optimizer: torch.optim.AdamW) -> torch.Tensor:
    ensure_adamw_state(optimizer)
    first = next(iter(optimizer.state.values()))["step"]
    return first.detach().reshape(1).to("cpu", copy=True)


def set_adamw_step_count(optimizer: torch.optim.AdamW, step: torch.Tensor) -> None:
    for state in optimizer.state.values():
        state["step"].fill_(step.item())


@torch.no_grad()
def clip_by_global_norm(
    counted: list[torch.Tensor],
    scaled: list[torch.Tensor],
    max_norm: float,
    comms: list[Communicator],
    device: torch.device,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    split: tuple[list[torch.Tensor], Communicator] | None = None,
) -> float:
    """L2 norm of all `counted` gradients summed over `comms`; scale `scaled` so it is at most `max_norm`
    (0 disables clipping). Returns the norm before clipping (non-finite if any gradient is).

    The factor is decided on the host (the trainer needs the norm there anyway) and only applied when it
    clips. With `optimizer` a fused (CUDA) torch AdamW, the scaling is folded into its kernel: its
    `grad_scale` divides each gradient as the update reads it, saving a pass over the fp32 gradients
    (the kernel stores the scaled gradient back, so `scaled` holds the clipped values after `step()`,
    as it would after an in-place scale). Otherwise `scaled` is scaled in place now.
    `split` = (grads, comm): more gradients, each rank of `comm` holding different ones (expert parallelism),
    their squares summed over `comm` before the rest.
    """
    sq = torch.zeros(1, dtype=torch.float32, device=device)
    if split is not None:
        grads, split_comm = split
        if grads:
            sq += torch.stack(torch._foreach_norm(grads)).float().square().sum()
        split_comm.all_reduce_(sq)
    if counted:
        sq += torch.stack(torch._foreach_norm(counted)).float().square().sum()
    for comm in comms:
        comm.all_reduce_(sq)
    norm = sq.sqrt().item()
    factor = clip_factor(norm, max_norm)
    if optimizer is not None:
        optimizer.grad_scale = None  # type: ignore[attr-defined]
    if factor < 1.0:
        if optimizer is not None and all(g.get("fused") for g in optimizer.param_groups):
            optimizer.grad_scale = torch.full((), 1.0 / factor, dtype=torch.float32, device=device)  # type: ignore
        else:
            torch._foreach_mul_(scaled, factor)
    return norm


def clip_factor(norm: float, max_norm: float) -> float:
    """What gradient clipping multiplies the gradients by: below 1 only when `norm` exceeds `max_norm` > 0
    (1.0 for a non-finite norm: that step is skipped, not scaled)."""
    if max_norm <= 0 or not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))


@torch.no_grad()
def step_masters(
    optimizer: torch.optim.AdamW,
    lr: float,
    masters: list[torch.Tensor],
    grads: list[torch.Tensor],
    params: list[torch.Tensor],
) -> None:
    """One AdamW update of the fp32 `masters` from `grads`, then each param whose master is a copy (a
    low-precision one) set to its master, rounded."""
    set_adamw_lr(optimizer, lr)
    for m, g in zip(masters, grads):
        m.grad = g
    optimizer.step()  # consumes the clip factor clip_by_global_norm may have folded into it
    optimizer.grad_scale = None  # type: ignore[attr-defined]
    for m in masters:
        m.grad = None
    low = [(p, m) for p, m in zip(params, masters) if m is not p]
    if low:  # one multi-tensor launch, not one copy per parameter
        torch._foreach_copy_([p for p, _ in low], [m for _, m in low])


@torch.no_grad()
def restore_masters(masters: list[torch.Tensor], params: list[torch.Tensor], state: dict) -> None:
    """After a checkpoint load into `state`, pair each copied master with its param: the param takes the
    weights the loaded fp32 master rounds to, or, without masters in the checkpoint (an fp32 checkpoint
    into a bf16 run, or weights only), the master takes the loaded weights."""
    loaded_masters = any(k.endswith("/master") for k in state)
    for p, m in zip(params, masters):
        if m is not p:
            if loaded_masters:
                p.copy_(m)
            else:
                m.copy_(p)


def master_state_bytes(masters: list[torch.Tensor], params: list[torch.Tensor]) -> int:
    """Bytes of fp32 masters held apart from their params, and of both AdamW moments of every master."""
    apart = sum(m.numel() for m, p in zip(masters, params) if m is not p)
    return 4 * (apart + len(MOMENTS) * sum(m.numel() for m in masters))


def add_chunks(
    out: dict, key_fmt: str, name: str, param: torch.Tensor, tp_rank: int, tp: int, flat: torch.Tensor, start: int = 0
) -> None:
    """Add `flat`'s pieces (elements [start, start+numel) of a tensor shaped like `param`) under `key_fmt`."""
    for logical, (shape, rects) in chunks_of(name, param, tp_rank, tp, flat, start).items():
        key = key_fmt.format(logical)
        if key in out:  # a second range of the same tensor (cannot happen for one flat range; kept safe)
            out[key] = LogicalChunks(shape, out[key].pieces + rects)
        else:
            out[key] = LogicalChunks(shape, rects)


def add_master_chunks(
    out: dict,
    optimizer: torch.optim.AdamW,
    name: str,
    param: torch.Tensor,
    master: torch.Tensor,
    tp_rank: int,
    tp: int,
    *,
    start: int = 0,
    own: bool = False,
) -> None:
    """Add the optimizer state of `master` (elements [start, start+numel) of `param`, flattened): both moments,
    and the master itself unless it is the param's own storage (`own`)."""
    if not own:
        add_chunks(out, "optim/{}/master", name, param, tp_rank, tp, master.view(-1), start)
    for key in MOMENTS:
        add_chunks(out, "optim/{}/" + key, name, param, tp_rank, tp, optimizer.state[master][key].view(-1), start)


def weights_key(available: set[str] | None) -> str:
    """Where an fp32 param that is its own master loads from: the checkpoint's exact fp32 masters when it
    has them (it was saved by a bf16 run), else its model weights."""
    if available is not None and any(k.endswith("/master") for k in available):
        return "optim/{}/master"
    return "model/{}"


def needed_keys(state: dict, available: set[str] | None) -> dict:
    """The entries of `state` a load should fill: all of them, or with `available` (the checkpoint's keys)
    every one it holds; a missing model or moment tensor is an error naming it."""
    if available is None:
        return state
    missing = sorted(k for k in state if k not in available and not k.endswith("/master"))
    if missing:
        raise KeyError(f"the checkpoint lacks {len(missing)} tensors this model needs, e.g. {missing[:3]}")
    return {k: v for k, v in state.items() if k in available}


class GradStrategy:
    """Base of ddp / zero1 / fsdp. Subclasses set `name` and implement the methods below."""

    name = "?"

    def zero_grad(self) -> None:
        raise NotImplementedError

    def start_grad_sync(self) -> None:
        """The next backward is the step's last: gradient sync may start as buckets fill."""

    def finish_grad_sync(self) -> None:
        raise NotImplementedError

    def clip_grad_norm(self, max_norm: float) -> float:
        raise NotImplementedError

    def step(self, lr: float) -> None:
        raise NotImplementedError

    def state_dict(self, available: set[str] | None = None) -> dict:
        """Logical tensor pieces (views into live storage). With `available` (the keys a checkpoint holds),
        the pieces a load of that checkpoint should fill."""
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        """After a load filled `state` (as returned by state_dict(available)): refresh what derives from it."""
        raise NotImplementedError

    def state_bytes(self) -> int:
        """Bytes of optimizer state (fp32 masters held apart from the params, and moments) on this rank."""
        raise NotImplementedError

    def describe(self) -> str:
        return self.name


def replicas_label(parallel) -> str:
    """The ranks a strategy reduces gradients over, for its description: "dp=2" or "dp x cp = 2 x 2"."""
    return f"dp={parallel.dp}" if parallel.cp == 1 else f"dp x cp = {parallel.dp} x {parallel.cp}"


def named_trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def named_frozen(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters without gradient that checkpoints keep (an MoE router's expert bias): no optimizer state, but part
    of the model. None in a LoRA model (optim.lora_rank): its frozen base is checkpoint.init_from's, and its
    checkpoints hold the adapters only."""
    if any(getattr(p, "lora", False) for p in model.parameters()):
        return []
    return [(n, p) for n, p in model.named_parameters() if not p.requires_grad]


def finish_state(
    out: dict,
    available: set[str] | None,
    *,
    optimizer: torch.optim.AdamW | None,
    frozen: list[tuple[str, nn.Parameter]],
    parallel,
) -> dict:
    """A strategy's `state_dict` from its model and optimizer pieces `out`: the step count added (where this
    rank has an optimizer), and the frozen parameters under model/<name> as they are (saved from and loaded
    into the tensors themselves); then `needed_keys`."""
    if optimizer is not None:
        out[STEP_KEY] = adamw_step_count(optimizer)
    for name, p in frozen:
        add_chunks(out, "model/{}", name, p, parallel.tp_rank, parallel.tp, p.detach().view(-1))
    return needed_keys(out, available)
