"""Launch the model's Triton kernels with less host time than `kernel[grid](...)`.

`FastKernel(jit_fn)[grid](*args, **kwargs)` keeps Triton's own argument binding and specialization (its binder:
pointer alignment, ints equal to 1 or divisible by 16, dtypes and constexprs choose the variant exactly as
Triton does). The first launch of a variant is Triton's own call, which compiles it; later launches of that
variant go straight to its compiled C entry point. Triton's call is taken instead whenever something is not
what this knows: launch hooks registered (a profiler), a kernel needing scratch memory, another launcher
layout, the CPU interpreter. tpframe/comm/symm/launch.py does the same for the collectives, whose variants
are fixed up front.
"""

from __future__ import annotations

import os

import torch

_UNSEEN = object()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _hooks_active() -> bool:
    """Whether a launch hook is registered (Triton >= 3.4 keeps an empty HookChain when none is; older: None)."""
    from triton import knobs

    return any(h is not None and getattr(h, "calls", True) for h in (knobs.runtime.launch_enter_hook,
                                                                     knobs.runtime.launch_exit_hook))


class FastKernel:
    """A `triton.jit` function launched as `kernel[grid](...)`, with the per-launch Python cut (module docstring)."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self._variants: dict = {}  # (device, specialization, options) -> C entry tuple, or None: use Triton's call
        self.fast = not _interpreting() and os.environ.get("TPFRAME_TRITON_LAUNCHER") != "1"
        self.fast_launches = 0  # launches that took the direct path (tests and benchmarks read it)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, *args, **kwargs)

    def launch(self, grid, *args, **kwargs) -> None:
        if not self.fast:
            self.fn[grid](*args, **kwargs)
            return
        try:
            device = torch.cuda.current_device()
            bound, key = self._bind(device, args, kwargs)
            entry = self._variants.get(key, _UNSEEN)
            hooks = _hooks_active()
        except Exception:  # noqa: BLE001 - not the Triton this knows: its own call from now on
            self.fast = False
            self.fn[grid](*args, **kwargs)
            return
        if entry is _UNSEEN or entry is None or hooks:
            kernel = self.fn[grid](*args, **kwargs)  # compiles a new variant (once), and launches it
            if entry is _UNSEEN:
                self._variants[key] = self._entry(kernel)
            return
        raw, function, cooperative, pdl, metadata = entry
        size = len(grid)
        raw(grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1, torch._C._cuda_getCurrentRawStream(device),
            function, cooperative, pdl, None, None, metadata, None, None, None, *bound.values())
        self.fast_launches += 1

    def _bind(self, device: int, args, kwargs):
        """Triton's binding of the call: (every argument by name in signature order, the variant's key)."""
        caches = self.fn.device_caches[device]
        if len(caches) != 5:
            raise TypeError("unknown Triton device cache layout")
        bound, specialization, options = caches[4](*args, **kwargs)
        return bound, (device, tuple(map(tuple, specialization)), tuple(options.items()))

    @staticmethod
    def _entry(kernel):
        """(C launch, CUfunction, cooperative, pdl, packed metadata) of a compiled kernel, or None where its
        launcher is not the layout this passes arguments in (then Triton's call launches it every time)."""
        if hasattr(kernel, "result"):  # an async-compile future
            kernel = kernel.result()
        runner = kernel.run  # loaded on this device by the launch that compiled it
        raw = getattr(runner, "launch", None)
        if (raw is None or not hasattr(runner, "launch_pdl") or getattr(runner, "global_scratch_size", 0)
                or getattr(runner, "profile_scratch_size", 0)):
            return None
        return raw, kernel.function, runner.launch_cooperative_grid, runner.launch_pdl, kernel.packed_metadata


def fast_launch(fn) -> FastKernel:
    """Decorator, above `@triton.jit`: launch through `FastKernel`."""
    return FastKernel(fn)
