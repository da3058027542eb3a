"""Compile a Triton kernel once per variant and launch it with as little Python as possible.

`triton.JITFunction.__getitem__(grid)(...)` binds and specializes every argument on every call
(~10 us of Python per launch, measured on H200). A collective is one launch, so that overhead would
dominate small messages. Here each variant (one set of constexprs) is compiled once with
`warmup`, and a call goes straight to the compiled launcher's C entry point with plain ints.
Under TRITON_INTERPRET=1 (the CPU interpreter, used by the kernel tests) the normal JIT call is used.
"""

from __future__ import annotations

import os

import torch
import triton


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class KernelLauncher:
    """launch(grid, *runtime_args): one launch of `kernel` (fixed constexprs) on the current stream."""

    def __init__(self, kernel, constexprs: dict, num_warps: int, device: torch.device):
        names = list(kernel.arg_names)
        self.runtime_names = [a for a in names if a not in constexprs]
        if names[: len(self.runtime_names)] != self.runtime_names:
            raise ValueError(f"{kernel.fn.__name__}: runtime arguments must precede the constexprs {sorted(constexprs)}")
        self.kernel = kernel
        self.constexprs = dict(constexprs)
        self.num_warps = num_warps
        self.device = device
        # The C launcher takes every argument in signature order, constexprs included (and ignored).
        self._const_values = tuple(constexprs[a] for a in names if a in constexprs)
        self._fast = None if interpreting() else self._compile()

    def _compile(self):
        with torch.cuda.device(self.device):
            compiled = self.kernel.warmup(*([0] * len(self.runtime_names)), grid=(1,), num_warps=self.num_warps,
                                          **self.constexprs)
            if hasattr(compiled, "result"):  # an async-compile future
                compiled = compiled.result()
            runner = compiled.run  # loads the module on this device
        scratch = getattr(runner, "global_scratch_size", 0) or getattr(runner, "profile_scratch_size", 0)
        raw = getattr(runner, "launch", None)
        if raw is None or scratch:
            # Not the launcher layout this fast path knows: the compiled kernel's own runner.
            function, meta = compiled.function, compiled.packed_metadata
            consts = self._const_values

            def slow(grid, stream, *args):
                runner(grid, 1, 1, stream, function, meta, None, None, None, *args, *consts)

            return slow
        function, meta = compiled.function, compiled.packed_metadata
        coop, pdl = runner.launch_cooperative_grid, runner.launch_pdl
        consts = self._const_values

        def fast(grid, stream, *args):
            raw(grid, 1, 1, stream, function, coop, pdl, None, None, meta, None, None, None, *args, *consts)

        return fast

    def __call__(self, grid: int, *args) -> None:
        if self._fast is not None:
            self._fast(grid, torch._C._cuda_getCurrentRawStream(self.device.index), *args)
        else:
            self.kernel[(grid,)](*args, num_warps=self.num_warps, **self.constexprs)
