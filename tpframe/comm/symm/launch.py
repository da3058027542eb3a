"""Compile a Triton kernel once per variant and launch it with as little Python as possible.

`triton.JITFunction.__getitem__(grid)(...)` binds and specializes every argument on every call
(benchmarks/RESULTS.md, 'Numbers moved out of code comments'). A collective is one launch, so that Python
would dominate small messages. Here each variant (one set of constexprs) is compiled once with
`warmup`, and a call goes straight to the compiled kernel's own launcher with plain ints. (A smaller C
launcher of our own saved a few more microseconds per launch but nothing measurable in a step: removed, see
benchmarks/RESULTS.md, 'The symm kernels' own C launcher: no gain in a step, removed'.) Under TRITON_INTERPRET=1
(the CPU interpreter) the normal JIT call is used.
"""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class KernelLauncher:
    """One kernel with fixed constexprs, compiled once; `bind(grid, *args)` gives the launch closure."""

    def __init__(self, kernel, constexprs: dict, num_warps: int, device: torch.device):
        names = list(kernel.arg_names)
        self.runtime_names = [a for a in names if a not in constexprs]
        if names[: len(self.runtime_names)] != self.runtime_names:
            raise ValueError(
                f"{kernel.fn.__name__}: runtime arguments must precede the constexprs {sorted(constexprs)}"
            )
        self.kernel = kernel
        self.constexprs = dict(constexprs)
        self.num_warps = num_warps
        self.device = device
        # Triton's launcher takes every argument in signature order, constexprs included (and ignored).
        self._const_values = tuple(constexprs[a] for a in names if a in constexprs)
        self._fast = None if interpreting() else self._compile()

    def _compile(self):
        """The compiled kernel's C launch entry and its fixed arguments, or None (use the JIT call)."""
        with torch.cuda.device(self.device):
            compiled = self.kernel.warmup(
                *([0] * len(self.runtime_names)), grid=(1,), num_warps=self.num_warps, **self.constexprs
            )
            if hasattr(compiled, "result"):  # an async-compile future
                compiled = compiled.result()
            runner = compiled.run  # loads the module on this device
        scratch = getattr(runner, "global_scratch_size", 0) or getattr(runner, "profile_scratch_size", 0)
        raw = getattr(runner, "launch", None)
        if raw is None or scratch or not hasattr(runner, "launch_pdl"):
            return None  # not the launcher layout this fast path knows
        return raw, compiled.function, runner.launch_cooperative_grid, runner.launch_pdl, compiled.packed_metadata

    def bind(self, grid: int, *tail):
        """A closure run(*head): one launch on the current stream with runtime args (*head, *tail)."""
        consts = self._const_values
        if self._fast is None:
            kernel, kw = self.kernel, dict(num_warps=self.num_warps, **self.constexprs)

            def run_jit(*head):
                kernel[(grid,)](*head, *tail, **kw)

            return run_jit
        stream_of, index = torch._C._cuda_getCurrentRawStream, self.device.index
        raw, function, coop, pdl, meta = self._fast

        def run(*head):
            raw(
                grid,
                1,
                1,
                stream_of(index),
                function,
                coop,
                pdl,
                None,
                None,
                meta,
                None,
                None,
                None,
                *head,
                *tail,
                *consts,
            )

        return run
