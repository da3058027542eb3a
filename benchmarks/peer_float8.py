"""Peer for train.fp8: the plain GPT of ../shared/peers/bench_torch_gpt.py (LayerNorm, rotary, GELU 4h, biases,
SDPA attention) trained in float8 by torchao, the way torchtitan does it: `convert_to_float8_training` with the
recipe's `Float8LinearConfig` and torchao's own size filter (`_auto_filter_for_recipe`, the head left bf16), each
block compiled (fullgraph).

    python benchmarks/peer_float8.py      # env: FP8=none (0)|tensorwise|rowwise EMULATE_TP COMPILE LAYERS HIDDEN
                                          #   HEADS SEQ MB STEPS
    torchrun --nproc-per-node 4 benchmarks/peer_float8.py                # TP=4 + SP, DTensor

Under torchrun with more than one process the model is tensor-parallel over all of them with sequence parallelism,
torchtitan's plan: PyTorch's DTensor styles (vocab-parallel embedding and loss_parallel, SequenceParallel norms,
column-parallel qkv and fc1 taking the sequence-sharded input, row-parallel proj and fc2 reduce-scattering to it),
and with tensorwise float8 torchao's Float8ColwiseParallel / Float8RowwiseParallel, whose all-gathers carry float8
(torchtitan's `enable_float8_tensorwise_tp`; rowwise takes the plain styles, as there). The fused qkv weight holds
each head's q, k and v together, so a column shard is whole heads.

EMULATE_TP=n builds one rank of TP=n + SP as benchmarks/gpt.py's EMULATE_TP does for tpframe: heads, the MLP width
and the vocabulary split n ways, the norms on the rank's 1/n of the tokens, the all-gather n local copies and the
reduce-scatter the sum of n chunks (the bytes, no transfer). FP8=none is the same model in bf16, the base of the
recipe rows. torchao is not a tpframe dependency: `benchmarks/gpt.py --compare --fp8` installs its wheel from the
peers folder and adds these rows where it imports. Same timing as the other peers (3 warm-up steps, STEPS timed
forward+backward steps, gradients dropped, no optimizer) and FLOP count
    (72*L*H^2*T + 12*L*H*S*T + 6*H*V*T) / n per GPU (T = MB*S tokens).
Runs on CPU (fp32, FP8=none) as a smoke test; prints one RESULT line.
"""

import contextlib
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel

e = lambda k, d: int(os.environ.get(k, d))  # noqa: E731
H, L, NH, S, MB, STEPS = e("HIDDEN", 2048), e("LAYERS", 24), e("HEADS", 16), e("SEQ", 2048), e("MB", 8), e("STEPS", 10)
N, V, HD = e("EMULATE_TP", 1), 50304, H // NH
FP8, COMPILE = os.environ.get("FP8", "none").replace("0", "none"), e("COMPILE", 1) == 1  # FP8=0: none
cuda = torch.cuda.is_available()
dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
TP = e("WORLD_SIZE", 1)  # under torchrun: tensor-parallel over every process
if TP > 1:
    import torch.distributed as dist

    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
if NH % (N * TP) or S % (N * TP) or V % (N * TP) or (N > 1 and TP > 1):
    raise SystemExit(f"peer_float8: HEADS={NH}, SEQ={S} and {V} must divide by EMULATE_TP={N} or TP={TP}, not both")

inv = 1.0 / 10000 ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD)
ang = torch.outer(torch.arange(S, dtype=torch.float64), inv)
ang = torch.cat([ang, ang], -1)[None, None]  # [1, 1, s, d]
COS, SIN = ang.cos().to(dev, dtype), ang.sin().to(dev, dtype)


def rotate(x):  # x [b, n, s, d]
    x1, x2 = x.chunk(2, -1)
    return x * COS + torch.cat([-x2, x1], -1) * SIN


def gather(x):  # the sequence-parallel all-gather, local: n copies of this rank's tokens
    return torch.cat([x] * N, 1) if N > 1 else x


def scatter(x):  # the reduce-scatter, local: the sum of n sequence chunks
    return sum(x.chunk(N, 1)) if N > 1 else x


class Block(nn.Module):
    def __init__(s):
        super().__init__()
        s.ln1, s.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        s.qkv, s.proj = nn.Linear(H, 3 * H // N), nn.Linear(H // N, H)
        s.fc1, s.fc2 = nn.Linear(H, 4 * H // N), nn.Linear(4 * H // N, H)

    def forward(s, x):  # x [b, s/n, h]
        b = x.shape[0]
        q, k, v = s.qkv(gather(s.ln1(x))).view(b, S, -1, 3, HD).permute(3, 0, 2, 1, 4)  # [b, heads, s, hd] each
        y = F.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True)
        x = x + scatter(s.proj(y.transpose(1, 2).reshape(b, S, -1)))
        return x + scatter(s.fc2(F.gelu(s.fc1(gather(s.ln2(x))), approximate="tanh")))


class GPT(nn.Module):
    def __init__(s):
        super().__init__()
        s.emb, s.blocks = nn.Embedding(V // N, H), nn.ModuleList(Block() for _ in range(L))
        s.ln, s.head = nn.LayerNorm(H), nn.Linear(H, V // N, bias=False)

    def forward(s, idx, labels):  # the rank's vocabulary shard: token ids modulo its size
        x = scatter(s.emb(idx % (V // N)))
        for blk in s.blocks:
            x = blk(x)
        logits = s.head(gather(s.ln(x))).float()
        return F.cross_entropy(logits.flatten(0, 1), (labels % (V // N)).flatten())


def is_float8(m: nn.Module) -> bool:
    return type(m).__name__ == "Float8Linear"  # torchao's, made by convert_to_float8_training


def tensor_parallel(model: GPT) -> None:
    """torchtitan's TP + SP plan over every process (see the module docstring)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    float8_col, float8_row = ColwiseParallel, RowwiseParallel  # rowwise float8: the plain styles
    if FP8 == "tensorwise":
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel as float8_col
        from torchao.float8.float8_tensor_parallel import Float8RowwiseParallel as float8_row
    mesh = init_device_mesh(dev, (TP,))
    seq = Shard(1)
    parallelize_module(
        model,
        mesh,
        {
            "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "ln": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
        },
    )
    for blk in model.blocks:  # a layer torchao's filter left bf16 takes the plain style
        plan = {"ln1": SequenceParallel(), "ln2": SequenceParallel()}
        for name in ("qkv", "fc1"):
            plan[name] = (float8_col if is_float8(getattr(blk, name)) else ColwiseParallel)(input_layouts=seq)
        for name in ("proj", "fc2"):
            plan[name] = (float8_row if is_float8(getattr(blk, name)) else RowwiseParallel)(output_layouts=seq)
        parallelize_module(blk, mesh, plan)


torch.manual_seed(0)
with torch.device(dev):
    model = GPT().to(dtype)
converted = 0
if FP8 != "none":
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    config = Float8LinearConfig.from_recipe_name(FP8)
    convert_to_float8_training(model, config=config, module_filter_fn=_auto_filter_for_recipe(FP8, ["head"]))
    converted = sum(map(is_float8, model.modules()))
if TP > 1:
    tensor_parallel(model)
if COMPILE:
    for i, blk in enumerate(model.blocks):
        model.blocks[i] = torch.compile(blk, fullgraph=True)
tokens = torch.randint(0, V, (MB, S + 1), device=dev, generator=torch.Generator(device=dev).manual_seed(0))
inp, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def step():
    with contextlib.nullcontext() if TP == 1 else loss_parallel():
        loss = model(inp, labels)
        loss.backward()
    for p in model.parameters():
        p.grad = None
    return loss


sync = torch.cuda.synchronize if cuda else (lambda: None)
for _ in range(3):
    step()
sync()
t0 = time.perf_counter()
for _ in range(STEPS):
    loss = step()
sync()
dt = (time.perf_counter() - t0) / STEPS
T = MB * S
flops = 72 * L * H * H * T + 12 * L * H * S * T + 6 * H * V * T
mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
if TP == 1 or dist.get_rank() == 0:
    print(
        f"RESULT torchao-float8 fp8={FP8} float8_linears={converted} emulate_tp={N} tp={TP} compile={int(COMPILE)} "
        f"mb={MB} seq={S} L={L} H={H}: step {dt * 1e3:.1f} ms, {T / dt:.0f} tok/s per TP group, "
        f"{flops / dt / N / TP / 1e12:.1f} TFLOP/s per GPU, mem {mem:.1f} GiB, loss {loss.item():.6f}",
        flush=True,
    )
if TP > 1:
    dist.barrier()
    dist.destroy_process_group()
