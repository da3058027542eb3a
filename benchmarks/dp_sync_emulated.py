"""Where a DP gradient sync's GPU work should run during backward: one GPU standing in for DP=2.

    torchrun --standalone --nproc-per-node 1 benchmarks/dp_sync_emulated.py
    APPEND=0 LAYERS=2 HIDDEN=256 HEADS=4 SEQ=256 MB=2 STEPS=3 torchrun --standalone --nproc-per-node 1 \\
        benchmarks/dp_sync_emulated.py                                # a quick look (CUDA only)

On 2x H200, overlapped ddp was 1.05-1.08x DP=1's step with NCCL and 1.065x with the copy-engine sync (RESULTS.md),
where the bytes move by DMA and the only SM work is one reduction kernel per bucket, on a side stream beside the
backward. This asks, on one GPU, what that placement costs: the real GPT-1.3B step at DP=1 (schedule -> gradient
buffer -> clip -> AdamW, bf16, micro-batch 8), and at each bucket's launch (the gradient buffer's own hook, in the
last backward) the GPU work DP=2 would add on this rank, emulated:

- "reduce beside backward": the copy-engine sync's reduction (fp32 own half-bucket += pulled half, scaled; the
  same Triton kernel) on a side stream, as `CopyEngineSync` runs it;
- "reduce in compute stream": the same kernel queued on the compute stream two buckets later, between backward's
  kernels (never beside them);
- "+ local DMA": before each reduction, the half-bucket copied into a scratch slot by cuMemcpyDtoDAsync on a side
  stream (a same-GPU stand-in for the pull over NVLink);
- "16-CTA copy beside backward": NCCL's stand-in (benchmarks/overlap.py): a copy kernel of 16 CTAs moving the
  bucket's bytes on a side stream, holding those SMs while it runs;
- ", high-priority stream": the same on a stream of the highest priority (parallel.dp_high_priority);
- "bf16 ... ": parallel.grad_reduce_dtype=bfloat16's own GPU work, the bucket rounded to bf16 at its launch and the
  result written back into the fp32 buffer, with the 16-CTA copy moving the bf16 bytes (half the fp32 row's):
  "all beside backward" as GradBuffer does it (rounding, copy and write-back queued on one side stream at the
  launch), "rounding in compute stream" as its first version did (rounding on the compute stream at the launch,
  write-back after the backward).

Each row also times, by CUDA events, every bucket's added work from its launch point on the compute stream to its
end ("lag"), and how long the last of it ends after the backward ("tail"). On two GPUs a bucket's transfer cannot
start before its work here has run (NCCL's kernel, or the reduction that frees a staging slot), so a side stream
that the backward's kernels starve of SMs shows here as a lag far above the work's own time, and on two GPUs as
transfers pushed behind the backward, exposed. High priority is the cure for that, if it is the cause.

Bytes per step at GPT-1.3B (1.41e9 params, fp32 buffer 5.6 GB): each reduction reads the half-bucket and the pulled
half and writes the half (8.5 GB per step over all buckets); the DMA moves 2.8 GB; the copy kernel 11.3 GB (read +
write of every bucket). FLOPs per step: 72*L*H^2*T + 12*L*H*S*T + 6*H*V*T, T = MB*SEQ.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def env(name: str, default):
    return type(default)(os.environ.get(name, default))


ROWS = [
    "DP=1 (nothing added)",
    "reduce beside backward",
    "reduce in compute stream",
    "local DMA + reduce beside backward",
    "local DMA + reduce in compute stream",
    "16-CTA copy beside backward",
    "reduce beside backward, high-priority stream",
    "16-CTA copy beside backward, high-priority stream",
    "bf16 rounding + 16-CTA copy + write-back, all beside backward",
    "bf16 rounding in compute stream + 16-CTA copy beside backward",
]


class Emulated:
    """Wraps a GradBuffer's bucket launch and finish with the GPU work of one DP=2 placement (module docstring)."""

    DEFER = 2  # compute-stream reductions run this many buckets after their bucket's launch

    def __init__(self, buf, mode: str):
        import torch

        from benchmarks.overlap import copy_kernel
        from tpframe.comm.copy_engine import RawEvent, stream_copy

        self.buf, self.mode, self.torch, self.stream_copy = buf, mode, torch, stream_copy
        widest = max((b.stop - b.start) // 2 for b in buf.buckets)
        self.slots = [torch.randn(widest, device=buf.buffer.device) for _ in range(self.DEFER + 1)]
        self.peer = torch.randn(buf.numel, device=buf.buffer.device)  # the "peer's" buffer the DMA reads
        self.peer16 = self.peer.bfloat16() if "bf16" in mode else None  # where the bf16 wire row's copy writes
        priority = torch.cuda.Stream.priority_range()[1] if "high-priority" in mode else 0  # parallel.dp_high_priority
        self.side, self.dma = torch.cuda.Stream(priority=priority), torch.cuda.Stream(priority=priority)
        self.pulled = [RawEvent() for _ in self.slots]
        self.copy = copy_kernel() if "16-CTA" in mode else None
        self.wires: dict = {}  # bucket index -> its bf16 copy (the bf16 wire row), written back at finish
        self.queue: list = []  # (bucket, slot) reductions not yet queued (compute-stream placement)
        self.count = 0
        self.started: dict = {}  # bucket index -> event on the compute stream at its launch
        self.done: dict = {}  # bucket index -> event after its added work, on the stream that ran it
        self.backward_end = None
        self._launch, self._finish = buf._launch, buf.finish_sync
        buf._launch, buf.finish_sync = self.launch, self.finish

    def remove(self) -> None:
        del self.buf._launch, self.buf.finish_sync  # the class's own methods again

    def operands(self, b, slot):
        half = (b.stop - b.start) // 2
        return self.buf.buffer[b.start : b.start + half], self.slots[slot][:half].view(1, half)

    def mark(self, marks: dict, index: int, stream) -> None:
        marks[index] = self.torch.cuda.Event(enable_timing=True)
        marks[index].record(stream)

    def lags(self) -> tuple[list[float], float]:
        """After a synchronized step: each bucket's launch-to-done time (ms), and how long after the backward's
        end the last added work ended (ms, 0 if before)."""
        lags = [self.started[i].elapsed_time(e) for i, e in self.done.items()]
        tail = max((self.backward_end.elapsed_time(e) for e in self.done.values()), default=0.0)
        return lags, max(tail, 0.0)

    def alone(self, b) -> float:
        """Bucket `b`'s added work timed the same way on an idle GPU (ms): the lag with nothing to wait behind."""
        torch = self.torch
        torch.cuda.synchronize()
        self.started.clear()
        self.done.clear()
        self.launch(b)
        while self.queue:
            self.reduce_in_compute(*self.queue.pop(0))
        torch.cuda.synchronize()
        self.count = 0
        self.wires.clear()
        return self.started[b.index].elapsed_time(self.done[b.index])

    def launch(self, b) -> None:
        from tpframe.kernels.scaled_sum import scaled_sum_

        torch = self.torch
        self._launch(b)
        if self.mode.startswith("DP=1"):
            return
        compute = torch.cuda.current_stream()
        self.mark(self.started, b.index, compute)
        if self.copy is not None:
            data = self.buf.buffer[b.start : b.stop]
            if "in compute stream" in self.mode:  # rounded on the compute stream, written back in finish()
                data = self.wires[b.index] = data.to(torch.bfloat16)
            self.side.wait_stream(compute)
            beside = "all beside" in self.mode  # as GradBuffer._launch queues it: round, move, write back
            with torch.cuda.stream(self.side):
                src = data.to(torch.bfloat16) if beside else data
                dst = self.peer if self.peer16 is None else self.peer16
                self.copy[(16,)](src, dst[: src.numel()], src.numel(), BLOCK=4096, CTAS=16, num_warps=8)
                if beside:
                    data.copy_(src)
            self.mark(self.done, b.index, self.side)
            return
        slot = self.count % len(self.slots)
        self.count += 1
        own, pulled = self.operands(b, slot)
        ready = self.side if "beside" in self.mode else compute
        if "DMA" in self.mode:
            self.dma.wait_stream(compute)
            self.stream_copy(self.dma, pulled.data_ptr(), self.peer.data_ptr(), pulled.numel() * 4)
            self.pulled[slot].record(self.dma.cuda_stream)
        if "beside" in self.mode:
            self.side.wait_stream(compute)
            if "DMA" in self.mode:
                self.pulled[slot].block(self.side.cuda_stream)
            with torch.cuda.stream(self.side):
                scaled_sum_(own, pulled, 0.5)
            self.mark(self.done, b.index, self.side)
            return
        self.queue.append((b, slot))
        while len(self.queue) > self.DEFER:
            self.reduce_in_compute(*self.queue.pop(0))

    def reduce_in_compute(self, b, slot) -> None:
        from tpframe.kernels.scaled_sum import scaled_sum_

        if "DMA" in self.mode:
            self.pulled[slot].block(self.torch.cuda.current_stream().cuda_stream)
        scaled_sum_(*self.operands(b, slot), 0.5)
        self.mark(self.done, b.index, self.torch.cuda.current_stream())

    def finish(self) -> None:
        self.backward_end = self.torch.cuda.Event(enable_timing=True)
        self.backward_end.record()
        self._finish()
        while self.queue:
            self.reduce_in_compute(*self.queue.pop(0))
        compute = self.torch.cuda.current_stream()
        compute.wait_stream(self.side)
        compute.wait_stream(self.dma)
        for index, wire in self.wires.items():  # GradBuffer.finish_sync's write-back into the fp32 buffer
            b = self.buf.buckets[index]
            self.buf.buffer[b.start : b.stop].copy_(wire)
        self.wires.clear()
        self.count = 0


def main() -> None:
    import torch

    from tpframe.models import BuildContext, build_model
    from tpframe.models.config import ModelConfig
    from tpframe.optim import OptimConfig, build_strategy
    from tpframe.parallel import destroy_parallel, initialize_parallel, seed_parallel_rng
    from tpframe.parallel.schedules import forward_backward_no_pipelining

    state = initialize_parallel(tp=1)
    if state.device.type != "cuda":
        print("dp_sync_emulated.py needs a CUDA GPU", file=sys.stderr)
        raise SystemExit(2)
    H, L, NH, S, MB, STEPS = (
        env("HIDDEN", 2048),
        env("LAYERS", 24),
        env("HEADS", 16),
        env("SEQ", 2048),
        env("MB", 8),
        env("STEPS", 15),
    )
    V = 50304
    cfg = ModelConfig(vocab_size=V, hidden=H, layers=L, heads=NH, max_seq_len=S, position="rotary", vocab_multiple=128)
    model = build_model(
        cfg, BuildContext(state.tp_comm, rng_tracker=seed_parallel_rng(1234), device=state.device, dtype=torch.bfloat16)
    )
    T = MB * S
    flops = 72 * L * H * H * T + 12 * L * H * S * T + 6 * H * V * T
    g = torch.Generator(device=state.device).manual_seed(0)

    class RandomBatches:
        def next(self):
            t = torch.randint(0, V, (MB, S + 1), device=state.device, generator=g)
            return t[:, :-1], t[:, 1:]

    opt = build_strategy(
        "ddp", model, OptimConfig(lr=1e-5, warmup_steps=0), state, overlap_grad_sync=True, compute_dtype=torch.bfloat16
    )
    buf = opt.grads
    # launch (and emulate) every bucket in the last backward as DP=2 would; this rank is alone, so the NCCL call
    # itself is skipped: the emulation stands in for its traffic
    buf.dp_size, buf._avg_in_collective, buf.dp_group = 2, True, None
    import torch.distributed as dist

    real, dist.all_reduce = dist.all_reduce, (lambda *a, **k: None)

    def step():
        opt.zero_grad()
        forward_backward_no_pipelining(model, RandomBatches(), 1, grad_sync=opt, device=state.device)
        opt.finish_grad_sync()
        opt.clip_grad_norm(1.0)
        opt.step(1e-5)

    results = []
    only = [r.strip() for r in os.environ.get("ROWS", "").split(";") if r.strip()]
    try:
        for name in ROWS * env("REPEAT", 1):
            if only and name not in only:
                continue
            emulated = Emulated(buf, name)
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            times, lags, tails = [], [], []
            for _ in range(STEPS):
                t0 = time.perf_counter()
                step()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                if emulated.done:
                    step_lags, tail = emulated.lags()
                    lags += step_lags
                    tails.append(tail)
            # a full 40 MB bucket (the second: the first holds the head); a small model's only one
            alone = emulated.alone(buf.buckets[min(1, len(buf.buckets) - 1)]) if lags else None
            emulated.remove()
            del emulated
            torch.cuda.empty_cache()
            lag = (
                (statistics.median(lags), sorted(lags)[int(0.9 * (len(lags) - 1))], statistics.median(tails), alone)
                if lags
                else None
            )
            results.append((name, statistics.median(times), len(buf.buckets), lag))
            print(name, f"{results[-1][1] * 1e3:.1f} ms", flush=True)
    finally:
        dist.all_reduce = real
    base = next((t for n, t, _, _ in results if n.startswith("DP=1")), None)
    buckets = results[0][2] if results else 0
    lines = [
        f"\n### DP=2's GPU work emulated on one GPU during the real GPT-1.3B step ({torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}, L={L} H={H} heads={NH} seq={S} micro-batch {MB}, bf16, {buckets} buckets)",
        "`torchrun --standalone --nproc-per-node 1 benchmarks/dp_sync_emulated.py`; median of "
        f"{STEPS} steps after 3 warm-up. Lag: a bucket's added work, launch point to end (median, 90th percentile over "
        "buckets and steps); alone: the same for one full bucket on an idle GPU; tail: how long its last piece ends "
        "after the backward (median over steps).",
        "",
        "| GPU work added per bucket | step ms | vs DP=1 | TFLOP/s | lag ms (median / p90) | alone ms | tail ms |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += (
        [
            f"| {n} | {t * 1e3:.1f} | {t / base:.3f}x | {flops / t / 1e12:.0f} | "
            + (f"{lag[0]:.2f} / {lag[1]:.2f} | {lag[3]:.2f} | {lag[2]:.2f} |" if lag else "| | |")
            for n, t, _, lag in results
        ]
        if base
        else []
    )
    table = "\n".join(lines)
    print(table)
    if env("APPEND", 1) and state.rank == 0:
        with open(ROOT / "benchmarks" / "RESULTS.md", "a") as f:
            f.write(table + "\n")
    destroy_parallel()


if __name__ == "__main__":
    main()
