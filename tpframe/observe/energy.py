"""Energy per step and per token on NVIDIA GPUs, from NVML's total energy counter.

    meter = EnergyMeter.open(device, warn)   # None on CPU, without pynvml, or on a GPU without the counter
    joules = meter.joules_since_last()       # this GPU, since the previous call (or open)
    total = sum_over_ranks(joules, device)   # every rank's GPU (one all-reduce of one number), None if any lacks it

`nvmlDeviceGetTotalEnergyConsumption` counts millijoules since the driver loaded (Volta and newer), the whole
board: whatever else runs on the GPU is counted too. The trainer reads it when it logs (a cheap call:
benchmarks/RESULTS.md, 'Numbers moved out of code comments') and reports joules per step and per token over windows
of at least MIN_WINDOW_S: the counter moves in increments tens of milliseconds apart, so a log every few short steps
could read 0 J and then twice the truth; shorter windows add up until they are long enough (their records have no
energy fields). CPU runs report nothing (the fields are absent, not zero).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


def _nvml_handle(pynvml, device: torch.device):
    """This CUDA device's NVML handle. NVML numbers every GPU, CUDA only the visible ones, so look it up
    by UUID, else by PCI bus id, else by torch's CUDA_VISIBLE_DEVICES-aware index."""
    props = torch.cuda.get_device_properties(device)
    lookups = []
    if getattr(props, "uuid", None) is not None:
        lookups.append(lambda: pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{props.uuid}"))
    if hasattr(props, "pci_bus_id"):
        bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        lookups.append(lambda: pynvml.nvmlDeviceGetHandleByPciBusId(bus))
    lookups.append(lambda: pynvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(device)))
    for lookup in lookups[:-1]:
        try:
            return lookup()
        except Exception:  # noqa: BLE001 - NVMLError, or bindings that want bytes: try the next way
            pass
    return lookups[-1]()


MIN_WINDOW_S = 1.0  # seconds of training an energy figure spans at least


class EnergyMeter:
    def __init__(self, read_mj: Callable[[], int]):
        self._read_mj = read_mj
        self._last = read_mj()
        self._pending = (0.0, 0, 0.0)  # joules, steps, seconds not yet reported

    @classmethod
    def open(cls, device, warn: Callable[[str], None] = lambda msg: None) -> EnergyMeter | None:
        device = torch.device(device)
        if device.type != "cuda":
            return None
        try:
            import pynvml
        except ImportError:
            warn("energy per step needs NVML's Python bindings: pip install nvidia-ml-py (continuing without)")
            return None
        try:
            pynvml.nvmlInit()
            handle = _nvml_handle(pynvml, device)
            return cls(lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle))
        except Exception as e:  # noqa: BLE001 - e.g. NVML_ERROR_NOT_SUPPORTED before Volta, no driver
            warn(f"NVML cannot read this GPU's energy counter ({e}); continuing without energy per step")
            return None

    def joules_since_last(self) -> float:
        now = self._read_mj()
        joules, self._last = (now - self._last) / 1e3, now
        return joules

    def per_step(self, joules: float, steps: int, seconds: float) -> float | None:
        """Joules per step over this window and the unreported ones before it, or None while they span less
        than MIN_WINDOW_S (the next call reports them)."""
        j, n, t = (a + b for a, b in zip(self._pending, (joules, steps, seconds)))
        if t < MIN_WINDOW_S or n == 0:
            self._pending = (j, n, t)
            return None
        self._pending = (0.0, 0, 0.0)
        return j / n

    def reset(self) -> None:
        """Start the next window now (the time since the last read, e.g. evaluation, is not counted)."""
        self._last = self._read_mj()


def sum_over_ranks(joules: float | None, device: torch.device) -> float | None:
    """Sum of every rank's joules; None when any rank has no meter. One all-reduce on the world group
    (every rank calls it: on CUDA always, on CPU never)."""
    if torch.device(device).type != "cuda" or not dist.is_initialized():
        return joules
    t = torch.tensor([float("nan") if joules is None else joules], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    total = t.item()
    return None if total != total else total
