"""Which GPUs a group's ranks sit on and whether they reach each other: the checks before anything maps a peer's
memory (the symm backend, async TP's copy-engine mode). Reports are plain dicts, gathered over the group by the
caller: {"host", "uuid", "peers": {uuid: can access}, "nvlink": {uuid: ok} or None}.
"""

from __future__ import annotations

import socket

import torch


def local_report(device: torch.device) -> dict:
    """What this rank knows: host, its GPU, and which visible GPUs it can reach peer-to-peer."""
    uuid = _uuid(device.index)
    peers = {
        _uuid(i): torch.cuda.can_device_access_peer(device.index, i)
        for i in range(torch.cuda.device_count())
        if i != device.index
    }
    return {"host": socket.gethostname(), "uuid": uuid, "peers": peers, "nvlink": _nvml_nvlink_peers(uuid)}


def p2p_problem(reports: list[dict]) -> str:
    """What stops the ranks (`local_report`s, in group rank order) reaching each other's GPUs peer-to-peer,
    naming the first such pair; "" if nothing does."""
    uuids = [r["uuid"] for r in reports]
    for rank, rep in enumerate(reports):
        for peer, uuid in enumerate(uuids):
            if peer != rank and rep["peers"].get(uuid) is False:  # None: that GPU is not visible to this rank
                return f"rank {rank} has no peer-to-peer access to rank {peer}'s GPU"
    return ""


def _uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid).removeprefix("GPU-")


def nvlink_verdict(reports: list[dict]) -> bool | None:
    """True if NVML says every pair of the group's GPUs is NVLink-connected, False if some pair is not,
    None if NVML could not tell. Also raises if a rank sees a group peer without P2P access."""
    problem = p2p_problem(reports)
    if problem:
        raise RuntimeError(problem)
    uuids = [r["uuid"] for r in reports]
    verdicts = []
    for rep in reports:
        if rep["nvlink"] is None:
            return None
        verdicts.extend(rep["nvlink"].get(u, False) for u in uuids if u != rep["uuid"])
    return all(verdicts)


def _nvml_nvlink_peers(uuid: str) -> dict | None:
    """{peer uuid: NVLink P2P ok} for every GPU NVML sees, or None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML: cannot tell
        return None
    try:
        me = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        out = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            other = pynvml.nvmlDeviceGetUUID(h)
            other = other.decode() if isinstance(other, bytes) else other
            if other.removeprefix("GPU-") == uuid:
                continue
            status = pynvml.nvmlDeviceGetP2PStatus(me, h, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
            out[other.removeprefix("GPU-")] = status == pynvml.NVML_P2P_STATUS_OK
        return out
    except Exception:  # noqa: BLE001 - an NVML that cannot answer: cannot tell
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
