"""The data-parallel peers: what a PyTorch user runs instead of tpframe's ddp/zero1/fsdp, full optimizer steps.

    torchrun --nproc-per-node 2 benchmarks/peer_dp.py ddp    # nanoGPT's way: fp32 weights, bf16 autocast,
                                                             #   torch DDP (fp32 gradients, 25 MB buckets,
                                                             #   overlapped), fused AdamW
    torchrun --nproc-per-node 2 benchmarks/peer_dp.py fsdp   # torchtitan's way: FSDP2 per block, bf16 compute,
                                                             #   fp32 reduction, fused AdamW on fp32 shards
    torchrun --nproc-per-node 1 benchmarks/peer_dp.py ddp    # DP=1: the same model and step with no DP wrapper

benchmarks/data_parallel.py runs these as its "torch ... peer" rows, beside tpframe's, in the same call, and
divides each peer's DP=N step by the peer's own DP=1 step: how much of the fp32 gradient traffic PyTorch's own DP
hides on the same machine. The model is tpframe's benchmark GPT in plain torch (LayerNorm, rotary rotate-half,
GELU 4h, biases, tied embedding/head, V=50304; SDPA flash attention), on random tokens, same env (LAYERS HIDDEN
HEADS SEQ MB ACCUM STEPS CKPT PROFILE) and the same FLOP count: 72*L*H^2*T + 12*L*H*S*T + 6*H*V*T per step, T =
MB*ACCUM*SEQ. One step = ACCUM micro-batches (DDP's no_sync / FSDP2's set_requires_gradient_sync on all but the
last), clip_grad_norm_(1.0), AdamW. 3 warm-up steps, then the median of STEPS; prints one RESULT line (the keys of
data_parallel.py's). On CPU (gloo) it runs in fp32 without autocast: a smoke test.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from data_parallel import env, profile_step  # noqa: E402

V = 50304


class Block(nn.Module):
    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x, cos, sin):
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


def rotate(x, cos, sin):
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class GPT(nn.Module):
    def __init__(self, h: int, layers: int, heads: int, seq: int, recompute: bool):
        super().__init__()
        self.emb = nn.Embedding(V, h)
        self.blocks = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(h)
        self.recompute = recompute
        d = h // heads
        inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        ang = torch.outer(torch.arange(seq, dtype=torch.float64), inv)
        ang = torch.cat([ang, ang], -1)[None, None]
        self.register_buffer("cos", ang.cos().float(), persistent=False)
        self.register_buffer("sin", ang.sin().float(), persistent=False)
        for m in self.modules():  # GPT-2's init (std 0.02, zero biases): a first loss near ln(V), as tpframe's
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, idx, labels):
        x = self.emb(idx)
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        for block in self.blocks:
            x = checkpoint(block, x, cos, sin, use_reentrant=False) if self.recompute else block(x, cos, sin)
        logits = F.linear(self.ln(x), self.emb.weight)  # tied head
        return F.cross_entropy(logits.float().view(-1, V), labels.reshape(-1))


def main(strategy: str) -> None:
    cuda = torch.cuda.is_available()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    H, L, NH, S, MB, ACCUM, STEPS = (
        env("HIDDEN", 2048),
        env("LAYERS", 24),
        env("HEADS", 16),
        env("SEQ", 2048),
        env("MB", 8),
        env("ACCUM", 1),
        env("STEPS", 10),
    )
    torch.manual_seed(1234)
    model = GPT(H, L, NH, S, recompute=env("CKPT", 0) == 1).to(device)  # fp32 weights, as both peers keep them
    bf16 = torch.bfloat16 if cuda else torch.float32
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
    if strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (world,))
        policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32)
        for i, block in enumerate(model.blocks):  # torchtitan: the last block stays gathered for the backward
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=i < L - 1)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        wrapped, autocast = model, contextlib.nullcontext  # FSDP2 casts the parameters itself

        def no_sync(last: bool):
            model.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
    elif strategy == "ddp" and world > 1:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)

        def no_sync(last: bool):
            return contextlib.nullcontext() if last else wrapped.no_sync()
    elif strategy == "ddp":  # DP=1: nanoGPT's single-GPU run, no wrapper
        wrapped = model

        def no_sync(last: bool):
            return contextlib.nullcontext()
    else:
        raise SystemExit(f"peer_dp.py: unknown strategy {strategy!r}; use ddp or fsdp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=cuda)
    g = torch.Generator(device=device).manual_seed(rank)

    def step():
        opt.zero_grad(set_to_none=True)
        for i in range(ACCUM):
            t = torch.randint(0, V, (MB, S + 1), device=device, generator=g)
            with no_sync(i == ACCUM - 1), autocast():
                loss = wrapped(t[:, :-1], t[:, 1:])
            (loss / ACCUM).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        step()
    sync()
    resident = torch.cuda.memory_allocated() / 2**30 if cuda else float("nan")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(STEPS):
        dist.barrier()
        t0 = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, dt)
    T = MB * ACCUM * S
    flops = 72 * L * H * H * T + 12 * L * H * S * T + 6 * H * V * T
    local = [
        t.to_local() if hasattr(t, "to_local") else t
        for s in opt.state.values()
        for t in s.values()
        if torch.is_tensor(t)
    ]
    profiled = profile_step(step, os.environ.get("PROFILE"), f"peer-{strategy}-dp{world}", rank, cuda, sync)
    if rank == 0:
        print(
            "RESULT "
            + json.dumps(
                {
                    "strategy": f"torch {strategy}",
                    "overlap": True,
                    "dp": world,
                    "step_s": dt,
                    "tflops": flops / dt / 1e12,
                    "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
                    "opt_state_gib": sum(t.numel() * t.element_size() for t in local) / 2**30,
                    "loss": float(loss),
                    "resident_gib": resident,
                    "rank_step_s": per_rank,
                    **profiled,
                }
            ),
            flush=True,
        )
    dist.barrier()  # every rank's collectives done before any tears the group down
    dist.destroy_process_group()
    # FSDP2's and DTensor's meshes keep process groups alive into interpreter shutdown, where freeing them
    # now and then aborts a rank ('terminate called without an active exception': 1 run in 4 on gloo) and
    # loses a row whose result is printed: leave without that shutdown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "ddp")
