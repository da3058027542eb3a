"""Peer for the Llama-style shape: a plain PyTorch Llama (torchtitan's llama3 model: RMSNorm, SwiGLU w1/w3/w2,
grouped-query attention, rotary positions, no biases, untied head), at TP=1 as one plain module (whole model
under torch.compile with COMPILE=1, like ../shared/peers/bench_torch_gpt.py), at TP>1 made tensor-parallel with
PyTorch's DTensor plans exactly as torchtitan's `apply_tp` does for llama3 (ColwiseParallel wq/wk/wv/w1/w3,
RowwiseParallel wo/w2, SequenceParallel norms, PrepareModuleInput, vocab-parallel embedding and loss_parallel;
torch.compile per block, fullgraph, with COMPILE=1; Inductor's async TP with ASYNC_TP=1).

    torchrun --nproc-per-node 2 benchmarks/peer_llama.py   # env: TP SP COMPILE ASYNC_TP LAYERS HIDDEN HEADS
                                                           #   KV_HEADS SEQ MB STEPS

The ../shared/peers harnesses model only the GPT (LayerNorm, GELU, biases); this one exists so that
`benchmarks/gpt.py --compare --shapes llama` has a torch-native row to divide by. Same timing as those harnesses
(3 warm-up steps, STEPS timed forward+backward steps, gradients dropped, no optimizer) and the FLOP count of
tpframe's `GPT.flops_per_token` for this architecture (every matmul, GQA's smaller k/v, SwiGLU's three):
    3 * (L * (2 * (H*(H + 2*KV) + H*H + 3*H*F) + 4*S*H) + 2*H*V) per token, KV = kv heads * head dim,
    F = the SwiGLU width, 64 * ceil(8H/3 / 64) (tpframe's `ffn_hidden_size`).
Runs on CPU with gloo (fp32) as a smoke test; prints one RESULT line.
"""

import contextlib
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

e = lambda k, d: int(os.environ.get(k, d))  # noqa: E731
H, L, NH, S, MB, STEPS = e("HIDDEN", 4096), e("LAYERS", 8), e("HEADS", 32), e("SEQ", 2048), e("MB", 8), e("STEPS", 10)
NKV = e("KV_HEADS", 4) or NH
V, HD = e("VOCAB", 50304), H // NH
FFN = e("FFN", 0) or 64 * -(-int(8 * H / 3) // 64)
SP, COMPILE, ASYNC_TP = e("SP", 1) == 1, e("COMPILE", 0) == 1, e("ASYNC_TP", 0) == 1
cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if cuda:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
TP = e("TP", world)


def rope_tables():
    inv = 1.0 / 10000 ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD)
    ang = torch.outer(torch.arange(S, dtype=torch.float64), inv)
    ang = torch.cat([ang, ang], -1)[None, :, None]  # [1, s, 1, d]
    return ang.cos().to(dev, dtype), ang.sin().to(dev, dtype)


def rotate(x, cos, sin):  # x [b, s, n, d]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Attention(nn.Module):
    def __init__(s):
        super().__init__()
        s.wq, s.wo = nn.Linear(H, NH * HD, bias=False), nn.Linear(NH * HD, H, bias=False)
        s.wk, s.wv = nn.Linear(H, NKV * HD, bias=False), nn.Linear(H, NKV * HD, bias=False)

    def forward(s, x):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, HD) for w in (s.wq, s.wk, s.wv))  # -1: this rank's heads
        q, k = rotate(q, *ROT), rotate(k, *ROT)
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=NKV != NH)
        return s.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(s):
        super().__init__()
        s.w1, s.w3, s.w2 = nn.Linear(H, FFN, bias=False), nn.Linear(H, FFN, bias=False), nn.Linear(FFN, H, bias=False)

    def forward(s, x):
        return s.w2(F.silu(s.w1(x)) * s.w3(x))


class Block(nn.Module):
    def __init__(s):
        super().__init__()
        s.attention_norm, s.attention = nn.RMSNorm(H, eps=1e-5), Attention()
        s.ffn_norm, s.feed_forward = nn.RMSNorm(H, eps=1e-5), FeedForward()

    def forward(s, x):
        x = x + s.attention(s.attention_norm(x))
        return x + s.feed_forward(s.ffn_norm(x))


class Llama(nn.Module):
    def __init__(s):
        super().__init__()
        s.tok_embeddings = nn.Embedding(V, H)
        s.layers = nn.ModuleList(Block() for _ in range(L))
        s.norm, s.output = nn.RMSNorm(H, eps=1e-5), nn.Linear(H, V, bias=False)

    def forward(s, idx):
        x = s.tok_embeddings(idx)
        for blk in s.layers:
            x = blk(x)
        return s.output(s.norm(x))


torch.manual_seed(0)
ROT = rope_tables()
with torch.device(dev):
    model = Llama().to(dtype)
if TP > 1:
    if NKV % TP or NH % TP:
        raise SystemExit(f"peer_llama: KV_HEADS={NKV} and HEADS={NH} must divide by TP={TP}")
    mesh = init_device_mesh(dev, (TP,), mesh_dim_names=("tp",))
    seq = Shard(1) if SP else Replicate()
    parallelize_module(
        model,
        mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
        }
        if SP
        else {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        },
    )
    for blk in model.layers:
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if SP:
            plan.update(
                {
                    "attention_norm": SequenceParallel(),
                    "ffn_norm": SequenceParallel(),
                    "attention": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
                    "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
                }
            )
        parallelize_module(blk, mesh, plan)
    if ASYNC_TP:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        torch._inductor.config._micro_pipeline_tp = True
        enable_symm_mem_for_group(mesh["tp"].get_group().group_name)
    if COMPILE:
        for i, blk in enumerate(model.layers):
            model.layers[i] = torch.compile(blk, fullgraph=True)
    fn = model
else:
    fn = torch.compile(model) if COMPILE else model

g = torch.Generator(device=dev).manual_seed(0)  # same batch on every TP rank
tokens = torch.randint(0, V, (MB, S + 1), device=dev, generator=g)
inp, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def step():
    with loss_parallel() if TP > 1 else contextlib.nullcontext():
        loss = F.cross_entropy(fn(inp).float().flatten(0, 1), labels.flatten())
        loss.backward()
    for p in model.parameters():
        p.grad = None
    return loss


sync = torch.cuda.synchronize if cuda else (lambda: None)
for _ in range(3):
    step()
sync()
dist.barrier()
t0 = time.perf_counter()
for _ in range(STEPS):
    loss = step()
sync()
dt = (time.perf_counter() - t0) / STEPS
T = MB * S
per_token = 3 * (L * (2 * (H * (H + 2 * NKV * HD) + H * H + 3 * H * FFN) + 4 * S * H) + 2 * H * V)
flops = per_token * T
mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
if rank == 0:
    print(
        f"RESULT llama-peer tp={TP} sp={int(SP and TP > 1)} compile={int(COMPILE)} async_tp={int(ASYNC_TP)} "
        f"mb={MB} seq={S} L={L} H={H} kv_heads={NKV} flops/token={per_token}: step {dt * 1e3:.1f} ms, "
        f"{T / dt:.0f} tok/s per TP group, "
        f"{flops / dt / TP / 1e12:.1f} TFLOP/s per GPU, mem {mem:.1f} GiB, loss {loss.item():.3f}",
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
