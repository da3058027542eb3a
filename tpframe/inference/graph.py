"""One decode step as a CUDA graph: replaying it launches every kernel of the step, the TP collectives
included (the Communicator picks its graph-mode backend while the stream is being captured, so the symm
kernels run inside the graph), with no Python or launch overhead per kernel.

The step must read and write only tensors allocated before the capture (static buffers) and must not
synchronize with the host. Warm-up runs it eagerly first, on a side stream, so that kernels compile,
communicator plans and NCCL communicators exist before the capture: it changes the static state, which
the caller resets afterwards.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class CapturedStep:
    """`fn` captured once; calling the object replays it on the current stream."""

    def __init__(self, fn: Callable[[], object], warmup: int = 2):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            fn()

    def __call__(self) -> None:
        self.graph.replay()
