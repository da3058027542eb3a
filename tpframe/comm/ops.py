"""The Communicator's collectives as torch custom ops, so `torch.compile` traces TP code without graph breaks.

    torch.ops.tpframe.all_reduce(x, comm_name, op)   -> Tensor like x
    torch.ops.tpframe.all_gather(x, comm_name)       -> [size * x.shape[0], ...]   (dim 0)
    torch.ops.tpframe.reduce_scatter(x, comm_name)   -> [x.shape[0] / size, ...]   (dim 0)

Each op is keyed by the name its Communicator registered here (a weak registry: a closed or collected
communicator disappears), runs that Communicator's eager path (so backend choice, symm kernels and plans
stay one code path), and has a fake implementation for tracing. `Communicator` calls these ops only while
torch.compile traces (`torch.compiler.is_compiling()`); eager calls never pay the op dispatch.
Outputs never alias inputs (a custom op's contract).
"""

from __future__ import annotations

import itertools
import weakref

import torch

_REGISTRY: weakref.WeakValueDictionary[str, object] = weakref.WeakValueDictionary()
_COUNTER = itertools.count()


def register(comm) -> str:
    """A process-unique name for `comm`, under which the ops find it."""
    group_name = getattr(comm.group, "group_name", "group")
    name = f"{group_name}/{next(_COUNTER)}"
    _REGISTRY[name] = comm
    return name


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def lookup(name: str):
    comm = _REGISTRY.get(name)
    if comm is None:
        raise RuntimeError(f"no open Communicator is registered as {name!r} (closed, or built in another process)")
    return comm


def _fresh(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return out.clone() if out is x or out.data_ptr() == x.data_ptr() else out


@torch.library.custom_op("tpframe::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, comm_name: str, op: str) -> torch.Tensor:
    return _fresh(lookup(comm_name).all_reduce(x, op), x)


@all_reduce.register_fake
def _(x, comm_name, op):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("tpframe::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, comm_name: str) -> torch.Tensor:
    return _fresh(lookup(comm_name).all_gather(x, 0), x)


@all_gather.register_fake
def _(x, comm_name):
    size = lookup(comm_name).size
    return x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))


@torch.library.custom_op("tpframe::reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, comm_name: str) -> torch.Tensor:
    return _fresh(lookup(comm_name).reduce_scatter(x, 0), x)


@reduce_scatter.register_fake
def _(x, comm_name):
    size = lookup(comm_name).size
    return x.new_empty((x.shape[0] // size,) + tuple(x.shape[1:]))
