"""Peak dense FLOP/s of a device, for MFU: a table by GPU name, or the user's `logging.peak_tflops`."""

from __future__ import annotations

import re

# dense (no sparsity) tensor-core peaks in TFLOP/s per GPU from the vendor's data sheets:
# (bf16/fp16, tf32, fp32 without tensor cores). The first pattern found in the device name wins.
PEAK_TFLOPS = (
    (r"\bH100\b.*\bPCIe\b", (756.0, 378.0, 51.0)),
    (r"\bH100\b.*\bNVL\b", (835.0, 418.0, 60.0)),
    (r"\b(H100|H200|GH200)\b", (989.0, 494.0, 67.0)),  # SXM
    (r"\bA100\b", (312.0, 156.0, 19.5)),
    (r"\bL40S\b", (362.0, 183.0, 91.6)),
    (r"\bL4\b", (121.0, 60.0, 30.3)),
    (r"\bA10\b", (125.0, 62.5, 31.2)),
)


def peak_tflops(device, dtype, override: float | None) -> float | None:
    """Peak dense TFLOP/s of one `device` for matmuls in `dtype` (torch.dtype or its name), for MFU.

    `override` (logging.peak_tflops) wins. float32 counts TF32 tensor cores only when PyTorch is
    allowed to use them (e.g. torch.set_float32_matmul_precision("high")); by default fp32 matmuls
    run at the plain fp32 peak (67 on H100 SXM). CPU or a GPU not in the table: None (no MFU).
    """
    if override is not None:
        return float(override)
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for pattern, (half, tf32, fp32) in PEAK_TFLOPS:
        if re.search(pattern, name):
            if str(dtype).replace("torch.", "") in ("bfloat16", "float16"):
                return half
            return tf32 if _tf32_matmuls(torch) else fp32
    return None


def _tf32_matmuls(torch) -> bool:
    """Whether fp32 CUDA matmuls may use TF32, under the new (torch >= 2.9) or the legacy API."""
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if precision in ("tf32", "ieee"):
        return precision == "tf32"
    try:
        return torch.get_float32_matmul_precision() != "highest"
    except RuntimeError:  # the legacy and new APIs were mixed; torch refuses to answer
        return False
