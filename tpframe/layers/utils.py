"""Small helpers shared by the parallel layers: divisibility checks, shard init, parameter tags."""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable

import torch

InitMethod = Callable[[torch.Tensor], object]


def eager(fn: Callable) -> Callable:
    """torch.compiler.disable(fn) (inside a compiled block, a graph break and fn run eagerly) without importing Dynamo
    when the module is: that import is a second or more of every process's start, and most runs never compile. The
    wrapper carries the mark Dynamo reads when it traces a call; called while Dynamo is loaded it runs fn through
    torch.compiler.disable's own wrapper (nothing inside fn is compiled); before, nothing can be compiling."""
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal disabled
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    call._torchdynamo_disable = True
    return call


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator, or a ValueError naming `what` when it does not divide."""
    if numerator % denominator:
        raise ValueError(f"{what} = {numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def normal_init(std: float = 0.02) -> InitMethod:
    return lambda w: torch.nn.init.normal_(w, mean=0.0, std=std)


def scaled_normal_init(std: float, num_layers: int) -> InitMethod:
    """GPT-2's init for the projections that write into the residual stream."""
    return normal_init(std / math.sqrt(2.0 * num_layers))


def init_shard(
    full_shape: tuple[int, ...],
    tp_dim: int | None,
    rank: int,
    size: int,
    init_method: InitMethod,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Initialize the full master tensor in fp32 on CPU and return this rank's contiguous shard.

    Every TP size draws the same master from the same generator state, so a TP=1 and a TP=4
    model built with the same seed are the same model.
    """
    master = torch.empty(full_shape, dtype=torch.float32)
    init_method(master)
    if tp_dim is not None and size > 1:
        master = master.chunk(size, dim=tp_dim)[rank]
    return master.to(device=device, dtype=dtype).contiguous()


# What checkpoints, gradient sync and generation read off every parameter, with its default: declared once (Megatron-
# Core's _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS), set by `tag_param`, read as attributes (`p.tp_dim`, `p.expert`).
PARAM_ATTRIBUTES = {
    "tp_dim": None,  # the dim split across TP ranks; None: replicated on every TP rank
    # replicated, but each TP rank sees only its slice of the sequence under SP: its gradient is partial, summed
    # over TP
    "sequence_parallel": False,
    "fused_parts": None,  # ((name, rows), ...): logical tensors fused along dim 0, each split over TP on its own
    "vocab_rows": None,  # a vocabulary table's real rows; those past it are padding (not in checkpoints)
    "pipeline_tied": False,  # held by the first and the last pipeline stage (a tied embedding): gradients summed
    "expert": False,  # a MoE expert's, split over EP: gradients reduced over the expert's replicas only
    "lora": False,  # a low-rank adapter's (optim.lora_rank): trained while the base is frozen; not in the base's files
}


def tag_param(param: torch.nn.Parameter, **tags) -> torch.nn.Parameter:
    """Set `tags` (names of PARAM_ATTRIBUTES) on `param`, and the defaults of those it does not carry yet; returns
    `param`. Its first tagging names `tp_dim` (None: replicated); later ones may add tags (`expert=True`)."""
    unknown = tags.keys() - PARAM_ATTRIBUTES.keys()
    if unknown:
        raise TypeError(f"tag_param: unknown tags {sorted(unknown)}; the tags are {', '.join(PARAM_ATTRIBUTES)}")
    if "tp_dim" not in tags and not hasattr(param, "tp_dim"):
        raise TypeError("tag_param: a parameter's first tags name tp_dim (None: replicated over TP)")
    for name, default in PARAM_ATTRIBUTES.items():
        if name in tags or not hasattr(param, name):
            setattr(param, name, tags.get(name, default))
    param.sequence_parallel = bool(param.sequence_parallel and param.tp_dim is None)
    return param


def param_tags(param: torch.Tensor) -> dict:
    """`param`'s tags, to give a parameter that replaces it (FSDP2's) with `tag_param(new, **tags)`."""
    return {name: getattr(param, name) for name in PARAM_ATTRIBUTES}


def is_tagged(param: torch.Tensor) -> bool:
    return all(hasattr(param, name) for name in PARAM_ATTRIBUTES)
