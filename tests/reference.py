"""Comparison helpers for parallel-vs-reference tests: errors against a reference, a TP model's full tensors, the
sequence-parallel slicing of an input, and the bytes autograd keeps for backward."""

from __future__ import annotations

import torch

from tpframe.parallel.sharding import param_shards

FP32_TOL = 1e-5
BF16_TOL = 2e-2  # bf16 keeps 8 bits of mantissa; partial sums are rounded before the reduce


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().double(), ref.detach().double()
    if got.shape != ref.shape:
        raise AssertionError(f"shape {tuple(got.shape)} != reference {tuple(ref.shape)}")
    if not torch.isfinite(got).all():
        raise AssertionError("non-finite values")
    denom = ref.norm().item()
    return (got - ref).norm().item() / (denom if denom > 0 else 1.0)


def assert_close(got: torch.Tensor, ref: torch.Tensor, tol: float, what: str, atol: float = 0.0) -> None:
    """‖got - ref‖ <= tol * ‖ref‖ + atol (atol for tensors that are zero in exact arithmetic)."""
    err = rel_err(got, ref)
    if not err <= tol:
        abs_err = (got.detach().double() - ref.detach().double()).norm().item()
        if abs_err <= tol * ref.detach().double().norm().item() + atol:
            return
        raise AssertionError(f"{what}: relative error {err:.3e} > {tol:.1e} (absolute {abs_err:.3e})")


def tol_for(dtype: torch.dtype) -> float:
    return FP32_TOL if dtype == torch.float32 else BF16_TOL


def leaf(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A fresh leaf copy of `t` in `dtype` that records its gradient."""
    return t.detach().clone().to(dtype).requires_grad_()


def loss_and_full_tensors(model, ids: torch.Tensor, labels: torch.Tensor, comm):
    """A TP model's per-token loss on (ids, labels), after its backward of the mean, with its full logical weights and
    gradients (sequence-parallel gradients summed over TP first): what a plain single-process model is checked by."""
    from tpframe.optim.grad_buffer import allreduce_sequence_parallel_grads

    loss = model(ids, labels)
    loss.mean().backward()
    allreduce_sequence_parallel_grads(sequence_parallel_grads(model.parameters()), comm)
    return loss, gather_full_tensors(model, comm), gather_full_tensors(model, comm, source="grad")


def sequence_parallel_grads(params) -> list[torch.Tensor]:
    """The gradients of the sequence-parallel params among `params` (partial over TP until summed)."""
    return [p.grad for p in params if p.sequence_parallel and p.grad is not None]


@torch.no_grad()
def gather_full_tensors(model, comm, source: str = "param") -> dict[str, torch.Tensor]:
    """Every logical tensor of a TP model in full on every TP rank; `source`: "param" (the weights) or "grad"."""
    full: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        local = p.detach() if source == "param" else getattr(p, source)
        # untrimmed pieces are equal-sized on every rank; the vocabulary padding is cut after the gather
        for shard in param_shards(name, p, comm.rank, comm.size, trim_vocab=False):
            if shard.tp_dim is None:
                full[shard.name] = local.clone()
                continue
            gathered = comm.all_gather(shard.view(local).contiguous(), dim=shard.tp_dim)
            rows = p.vocab_rows
            full[shard.name] = gathered[:rows] if rows is not None else gathered
    return full


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.chunk(comm.size, dim=0)[comm.rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_gather(grad, dim=0), None


def scatter_to_sp(x: torch.Tensor, comm) -> torch.Tensor:
    """[s, ...] -> [s/tp, ...]: this rank's sequence slice (a sequence-parallel layer's input); all-gather the
    gradient."""
    return x if comm.size == 1 else _ScatterToSP.apply(x, comm)


def kept_for_backward(fn, *args, besides=frozenset()):
    """fn(*args) and the bytes of the storages autograd keeps for its backward (an input's own included), counted
    when fn returns (a storage freed by selective recompute reads 0 bytes until backward refills it), but for those
    whose data pointers are in `besides` (a model's parameters)."""
    kept = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in besides:
            kept[id(t.untyped_storage())] = t.untyped_storage()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, sum({st.data_ptr(): st.nbytes() for st in kept.values() if st.nbytes()}.values())
