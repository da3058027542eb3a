"""How much memory one rank needs for a layout, estimated before anything is allocated.

    est = estimate(cfg, world_size, params=local_param_count, buffer_bytes=..., device_type="cuda")
    check_fits(cfg, est, device_type="cuda", local_rank=0, local_world=8)   # ConfigError naming both numbers

Parts, per rank (P = this rank's parameters, already divided by TP; d = DP size times CP size):
  ddp    params P*b + fp32 grads 4P + (bf16: fp32 masters 4P) + AdamW moments 8P   (16 B/param fp32, 18 bf16)
  zero1  params P*b + fp32 grads 4P + (masters + moments) / d
  fsdp   (fp32 params 4P + grads 4P + moments 8P) / d, plus a gathered layer or two in compute dtype
  (parallel.grad_reduce_dtype=bfloat16 adds a bucket's bf16 copy or two in flight: not counted)
  LoRA (optim.lora_rank): grads, masters and moments for the adapters alone; the frozen base is params only
  pipelines: P is the fullest rank's stages; activations times the schedule's forwards in flight (pipeline_factor)
Activations of one micro-batch (Korthikanti et al. 2022, bytes for 2-byte activations, per layer):
  s*b*h*(10 + 24/t + 5*a*s/(h*t)) with TP t; s*b*h*(34 + 5*a*s/h)/t with sequence parallelism; the 24 is
  attention's 8 (q, k, v and the projection's input) and the MLP's 16 at GPT's shapes, in general
  4*(A + K)/h with A = heads*head_dim and K = kv_heads*head_dim (grouped-query attention, Qwen3's wide heads)
  and 2*(ffn + ffn)/h, 2*(2*ffn + ffn)/h for SwiGLU (16 at ffn 4h, and at SwiGLU's 8h/3);
  2*s*b*h (/t with SP) per layer with activation checkpointing, plus the larger of one layer's worth (being
  recomputed) and the head's logits with their input gradient (freed before backward reaches a block: measured
  at 32k-128k tokens, benchmarks/RESULTS.md, "train.py's peak memory at long context"). The 5*a*s/h term
  (attention scores) is left out where SDPA's fused kernels keep no scores (CUDA; CPU without
  attention dropout). fp32 activations count twice. The fused head + loss keeps s*b*V/t logits in the compute
  dtype and no fp32 copy (tpframe/layers/cross_entropy.py). With context parallelism (CP c) s is the rank's S/c
  tokens; parallel.cp_comm=all_gather also keeps each layer's whole-sequence keys and values, 4*S*b*K/t bytes;
  all_to_all keeps its whole-sequence share of q, k and v, as many bytes as the local ones, plus the kv heads
  it repeats (4*(f-1)*s*b*K/t, f the copies: tpframe/layers/ulysses.py). Measured on CPU against the tensors
  autograd saves: tests/test_context_parallel.py.
It is an estimate meant to refuse what cannot fit (a 65536-wide model on one GPU, a micro-batch of a
billion), not to pack a device to the last GiB: runs near the limit may still fail to allocate.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tpframe.errors import ConfigError
from tpframe.layers.documents import varlen_runs
from tpframe.layers.ulysses import kv_copies
from tpframe.models.config import ffn_hidden_size, head_dim, moe_ffn_hidden_size, padded_vocab

GIB = 2**30
# CUDA context, NCCL buffers, allocator slack; the interpreter, torch and the data on CPU.
OVERHEAD = {"cuda": 1.5 * GIB, "cpu": 0.5 * GIB}


@dataclass
class MemoryEstimate:
    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    overhead: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers + self.overhead

    def describe(self) -> str:
        parts = [
            ("params", self.params),
            ("grads", self.grads),
            ("optimizer", self.optimizer),
            ("activations", self.activations),
            ("buffers", self.buffers),
            ("overhead", self.overhead),
        ]
        return " + ".join(f"{name} {gib(v)}" for name, v in parts if v >= 0.005 * GIB)


def gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB" if n < 1e5 * GIB else f"{n / GIB:.3g} GiB"


def activation_bytes(cfg, device_type: str) -> float:
    """Activations one micro-batch keeps for backward on one rank (all layers, head and loss)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    s, b, h, a, L, tp = t.seq_len // p.cp, t.micro_batch_size, m.hidden, m.heads, m.layers, p.tp  # CP: local tokens
    scale = 2 if t.dtype == "float32" else 1  # the formula counts 2-byte activations
    scores_kept = device_type == "cpu" and m.attention_dropout > 0
    score_term = 5 * a * s / h if scores_kept else 0.0
    sbh = float(s) * b * h

    def mlp(ffn: int) -> float:  # what an MLP keeps inside the TP region, per sbh (16 at a GELU ffn of 4h)
        return 2.0 * ((2 if m.activation == "swiglu" else 1) * ffn + ffn) / h

    width, kv_width = m.heads * head_dim(m), (m.kv_heads or m.heads) * head_dim(m)
    split = 4.0 * (width + kv_width) / h + mlp(ffn_hidden_size(m))  # inside the TP region: 24 at GPT's shapes
    varlen = varlen_runs(
        device_type, getattr(torch, t.dtype), m.attention_dropout, head_dim=head_dim(m), window=m.sliding_window
    )
    if m.attention_mask == "document" and p.cp == 1 and varlen:  # its output is token-major: the layer keeps the
        split += 2.0 * width / h  # [s, b, h] copy the projection reads as well
    # selective recompute drops the two norm outputs (2 sbh each) and the activation output (8 sbh at ffn 4h)
    norms, act = (4.0, 2.0 * ffn_hidden_size(m) / h) if p.recompute == "selective" else (0.0, 0.0)
    if p.sequence_parallel:
        per_layer = sbh * (10 + split - norms - act + score_term) / tp
    else:
        per_layer = sbh * (10 - norms + (split - act) / tp + score_term / tp)
    if m.moe_experts:  # MoE: top_k expert MLPs per token instead of one, plus the dispatched tokens and outputs
        per_layer += sbh * (m.moe_top_k * (mlp(moe_ffn_hidden_size(m)) / tp + 4.0) - mlp(ffn_hidden_size(m)) / tp)
        per_layer += sbh * (mlp(m.moe_shared_ffn) / tp + 2.0 / tp) if m.moe_shared_ffn else 0.0
    if p.cp > 1 and p.cp_comm == "all_to_all":  # the kv heads repeated for the exchange
        per_layer += 4.0 * (kv_copies((m.kv_heads or m.heads) // tp, p.cp) - 1) * s * b * kv_width / tp
    elif p.cp > 1:  # attention keeps the whole sequence's keys and values, all-gathered
        per_layer += 4.0 * t.seq_len * b * kv_width / tp
    act_bytes = 2 * scale
    vocab = padded_vocab(m, tp)
    loss = float(s) * b * vocab / tp * act_bytes  # the fused head + loss: logits in the compute dtype only
    embedding = sbh * act_bytes
    if p.recompute != "full":
        return L * per_layer * scale + loss + embedding
    whole = L if p.recompute_layers is None else min(p.recompute_layers, L)  # blocks that keep only their input
    kept = whole * 2 * sbh / (tp if p.sequence_parallel else 1) + (L - whole) * per_layer
    # backward starts at the head: its logits (and the input gradient it makes from them) are freed before the
    # first block is recomputed, so the peak holds one or the other, not both
    head = loss + sbh * act_bytes
    return kept * scale + embedding + (max(per_layer * scale, head) if whole else loss)


def pipeline_factor(cfg, world_size: int) -> float:
    """The activations a pipeline rank holds at its peak, over one micro-batch's of the whole model: the schedule's
    forwards in flight times a chunk's share of the layers (1 under 1F1B; AFAB: micro-batches / pp)."""
    from tpframe.parallel.pipeline.orders import peak_in_flight

    p, t = cfg.parallel, cfg.train
    if p.pp == 1:
        return 1.0
    dp = max(1, world_size // (p.tp * p.pp * p.cp))
    micro = max(1, t.global_batch_size // (t.micro_batch_size * dp))
    try:
        held = peak_in_flight(p.pp_schedule, pp=p.pp, num_micro_batches=micro, virtual_stages=p.virtual_stages)
    except ValueError:  # micro-batches the schedule cannot run: the config's own check says so
        return 1.0
    return held / (p.pp * p.virtual_stages)


def estimate(
    cfg,
    world_size: int,
    *,
    params: int,
    expert_params: int = 0,
    trained_params: int | None = None,
    buffer_bytes: int = 0,
    device_type: str = "cuda",
) -> MemoryEstimate:
    """Bytes one rank needs: `params` is its parameter count (TP-sharded, before any DP sharding), of which
    `expert_params` are MoE experts (zero1 and fsdp shard those over dp/ep replicas only) and `trained_params`
    get gradients and optimizer state (default: all; a LoRA run: its adapters)."""
    p = cfg.parallel
    dp = max(1, world_size // (p.tp * p.pp))
    compute = 2 if cfg.train.dtype == "bfloat16" else 4
    P = float(params)
    trained = 1.0 if trained_params is None or P == 0 else trained_params / P  # the share of P with state
    sharded = (P - expert_params) / dp + expert_params * p.ep / dp  # experts: over their dp/ep replicas
    if p.dp_strategy == "fsdp":
        layer = P * p.pp / max(1, cfg.model.layers)  # P: a pipeline rank's share of the layers
        weights = 4 * sharded + 2 * layer * compute  # fp32 shards + the gathered layer (and the next, prefetched)
        grads = (4 * sharded + layer * 4) * trained
        optimizer = 8 * sharded * trained
    else:
        weights, grads = P * compute, 4 * P * trained
        per_param = (4 if compute == 2 else 0) + 8  # fp32 master (bf16 params) and two moments
        if p.dp_strategy == "zero1":
            optimizer = per_param * sharded * trained
        else:
            optimizer = per_param * P * trained
    return MemoryEstimate(
        weights,
        grads,
        optimizer,
        activation_bytes(cfg, device_type) * pipeline_factor(cfg, world_size),
        float(buffer_bytes),
        OVERHEAD.get(device_type, OVERHEAD["cpu"]),
    )


# -- what the device has -----------------------------------------------------------------------------


def _cgroup_available() -> float | None:
    """Bytes the container may still use (cgroup v2, then v1), or None without a limit."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            raw = Path(limit_file).read_text().strip()
            if raw == "max" or int(raw) >= 2**60:
                return None
            return float(int(raw) - int(Path(usage_file).read_text().strip()))
        except (OSError, ValueError):
            continue
    return None


def available_ram() -> float | None:
    """MemAvailable, lowered to the container's remaining allowance; None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = float(line.split()[1]) * 1024
                limit = _cgroup_available()
                return min(avail, limit) if limit is not None else avail
    except OSError:
        pass
    return None


def device_memory(device_type: str, local_rank: int) -> tuple[float, str] | None:
    """(bytes one rank may use, how they were found), or None when unknown."""
    if device_type == "cuda":
        props = torch.cuda.get_device_properties(local_rank)
        return float(props.total_memory), f"cuda:{local_rank} ({props.name}) has {gib(props.total_memory)}"
    ram = available_ram()
    if ram is None:
        return None
    return ram, f"this host has {gib(ram)} of RAM available"


def check_fits(cfg, est: MemoryEstimate, *, device_type: str, local_rank: int = 0, local_world: int = 1) -> None:
    """ConfigError when the estimate does not fit; CPU ranks of one host share its RAM."""
    have = device_memory(device_type, local_rank)
    if have is None:
        return
    capacity, what = have
    need = est.total * (local_world if device_type == "cpu" else 1)
    if need <= capacity:
        return
    per = f"{gib(est.total)} per rank"
    if device_type == "cpu" and local_world > 1:
        per += f" x {local_world} ranks on this host"
    raise ConfigError(
        f"this run needs about {per} ({est.describe()}) but {what}; try {', '.join(_fixes(cfg))} "
        "(train.check_memory=false skips this estimate)"
    )


def _fixes(cfg, dp: int | None = None) -> list[str]:
    """What makes a layout need less memory per rank, of what this config does not do already (`dp`: the ranks
    zero1 or fsdp would shard over; None: unknown)."""
    p = cfg.parallel
    fixes = [
        "a smaller train.micro_batch_size (the global batch stays: more accumulation) or model",
        "a larger parallel.tp" + ("" if p.sequence_parallel else " with parallel.sequence_parallel=true"),
    ]
    if p.recompute != "full":
        fixes.append(
            "parallel.activation_checkpointing=selective or full"
            if p.recompute == "none"
            else "parallel.activation_checkpointing=full"
        )
    if p.dp_strategy == "ddp" and (dp is None or dp > 1):
        fixes.append("parallel.dp_strategy=zero1 or fsdp")
    return fixes


class OutOfMemory(Exception):
    """The device ran out of memory during the run (the estimate let it start): exit code 6, one line."""


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocation that failed: torch.OutOfMemoryError (CUDA), or the CPU allocator's
    RuntimeError ("DefaultCPUAllocator: can't allocate memory")."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error)
    )


def out_of_memory(
    error: BaseException, cfg, *, rank: int, dp: int, step: int, phase: str, device: torch.device
) -> OutOfMemory:
    """`error` (`is_out_of_memory`) as the one line a user acts on: where, how much, and what to change."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    first = first.split("err == 0. ")[-1]  # the CPU allocator's "[enforce fail at alloc_cpu.cpp:N] err == 0. "
    first = first.split(" Including non-PyTorch memory")[0].split(" Of the allocated memory")[0][:240].rstrip(".")
    peak = f"; tpframe's peak so far {gib(torch.cuda.max_memory_allocated(device))}" if device.type == "cuda" else ""
    return OutOfMemory(
        f"rank {rank} ran out of {device.type} memory in step {step} ({phase}): {first}{peak}; "
        f"to fit, try {', '.join(_fixes(cfg, dp))}"
    )
