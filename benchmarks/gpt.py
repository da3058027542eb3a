"""tpframe GPT forward+backward throughput under torchrun, on the peer harness's terms.

    torchrun --nproc-per-node 2 benchmarks/gpt.py          # env: TP SP MB SEQ LAYERS HIDDEN HEADS STEPS COMM CKPT

Same model shape (LayerNorm, rotary, GELU 4h, biases, tied embeddings, V=50304), same timing (3 warm-up
steps, then STEPS timed fwd+bwd with grads dropped, no optimizer) and same FLOP formula as
../shared/peers/bench_mcore_gpt.py, so the two RESULT lines compare directly:
    FLOPs per step = 72*L*H^2*T + 12*L*H*S*T + 6*H*V*T   (T = MB*S tokens per TP group)
Appends its line, the command and the device to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tpframe.models import BuildContext, build_model  # noqa: E402
from tpframe.parallel import destroy_parallel, initialize_parallel, seed_parallel_rng  # noqa: E402
from tpframe.models.config import ModelConfig  # noqa: E402


def env(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def main() -> None:
    state = initialize_parallel(tp=env("TP", int(os.environ.get("WORLD_SIZE", 1))), comm_backend=os.environ.get("COMM", "auto"))
    H, L, NH, S, MB, STEPS = env("HIDDEN", 2048), env("LAYERS", 24), env("HEADS", 16), env("SEQ", 2048), env("MB", 8), env("STEPS", 10)
    sp = os.environ.get("SP", "0") == "1" and state.tp > 1
    V = 50304
    cfg = ModelConfig(vocab_size=V, hidden=H, layers=L, heads=NH, max_seq_len=S, position="rotary", vocab_multiple=128)
    tracker = seed_parallel_rng(1234)
    ctx = BuildContext(state.tp_comm, sequence_parallel=sp, activation_checkpointing=os.environ.get("CKPT", "0") == "1",
                       rng_tracker=tracker, dtype=torch.bfloat16, device=state.device, seed=1234)
    model = build_model(cfg, ctx)
    g = torch.Generator(device=state.device).manual_seed(state.dp_rank)  # TP ranks share the batch
    tokens = torch.randint(0, V, (MB, S + 1), device=state.device, generator=g)
    inp, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step():
        loss = model(inp, labels).mean()
        loss.backward()
        for p in model.parameters():
            p.grad = None
        return loss

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.distributed.barrier()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        loss = step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / STEPS
    T = MB * S
    flops = 72 * L * H * H * T + 12 * L * H * S * T + 6 * H * V * T
    if state.rank == 0:
        line = (
            f"RESULT tpframe tp={state.tp} sp={int(sp)} comm={state.tp_comm.requested} world={state.world_size} mb={MB} "
            f"seq={S} L={L} H={H}: step {dt * 1e3:.1f} ms, {T / dt:.0f} tok/s per TP group, "
            f"{flops / dt / state.tp / 1e12:.1f} TFLOP/s per GPU, mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB, "
            f"loss {loss.item():.3f}"
        )
        print(line, flush=True)
        with open(Path(__file__).resolve().parent / "RESULTS.md", "a") as f:
            f.write(f"\n- `{' '.join(['torchrun', 'benchmarks/gpt.py'])}` env TP={state.tp} SP={int(sp)} MB={MB} SEQ={S} "
                    f"LAYERS={L} HIDDEN={H} HEADS={NH} on {torch.cuda.get_device_name()} x{state.world_size}, "
                    f"torch {torch.__version__}:\n  {line}\n")
    destroy_parallel()


if __name__ == "__main__":
    main()
