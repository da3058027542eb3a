"""torch.compile applied per transformer block (torchtitan's apply_compile), after every other parallelism.

Each block is compiled in place (`nn.Module.compile`), so parameter names, checkpoints and hooks are
unchanged; identical blocks share one compiled graph. The TP collectives inside are tpframe's custom
ops (tpframe/comm/ops.py), so a block traces whole, with no graph breaks, with or without sequence
parallelism. Embedding, head and loss stay eager (the head+loss path is already a fused kernel).
"""

from __future__ import annotations

from torch import nn


def compile_model(
    model: nn.Module, *, backend: str = "inductor", fullgraph: bool = False, mode: str | None = None
) -> int:
    """Compile every block of `model.blocks` in place; returns how many were compiled.

    `fullgraph=True` turns any graph break into an error (the tests use it); the default lets an unusual
    block (a custom model's) run with breaks instead of failing. `mode`: torch.compile's (None or "default": its
    default). A CUDA-graphing mode ("reduce-overhead") does not mix with the decode step's own graph capture."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise ValueError(
            f"compile_model: {type(model).__name__} has no `blocks` to compile (see tpframe/models/gpt.py)"
        )
    for block in blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks:
        block.compile(backend=backend, fullgraph=fullgraph, mode=mode)
    return len(blocks)
