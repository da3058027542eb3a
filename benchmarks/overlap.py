"""A GEMM beside a communication kernel: does it overlap, and which SM margin makes it (tpframe/comm/margin.py)?

    python benchmarks/overlap.py                                   # 1 GPU: a copy kernel of G CTAs stands in
    python benchmarks/overlap.py --layers                          # 1 GPU: GPT-1.3B's TP=2 linear layers, emulated
    torchrun --nproc-per-node 2 benchmarks/overlap.py              # 2+ GPUs: the real NCCL collectives (TP group),
                                                                   # and the same bytes moved by the copy engines

Each row times, on CUDA events with the host queued ahead (median of ITERS, each the mean of 10 back-to-back
calls after warm-up): the GEMM alone (leaving `margin` SMs free, cuBLASLt's SM count target), the communication
alone, and both launched together, the communication first on its own stream, as tpframe's overlaps launch them
(`Communicator.*_async` / `exchange_async`, then the GEMM under `Communicator.beside`). "serial" is the sum of the
two alone; "both / serial" under 1 means the overlap pays. GEMM: [M x K] x [K x N] bf16, FLOPs = 2*M*N*K
(GPT-1.3B's qkv at TP=2 + SP, micro-batch 8, one sequence block: M=8192 K=2048 N=3072). Messages: 32 MiB per
rank (one sequence block of the same layer's input). Appends the table to benchmarks/RESULTS.md (NO_APPEND=1: not).
Env: ITERS (default 15), MARGINS (default 0,8,16,32), CTAS (1 GPU: copy CTAs, default 8,16,32).

--layers: rank 0 of a TP=2 + SP group on one GPU, its peer emulated (`EmulatedPeer`): every transfer is a 16-CTA
copy of the real message size (32 MiB per sequence block: ~135 us on an H100, about NCCL's NVLink time), blocking
on the compute stream for the plain path's collectives, on a side stream for the started ones. GPT-1.3B's four
linear layers (S=2048, MB=8, H=2048; qkv, attention proj, fc1, fc2) through tpframe's own column/row functions,
forward and forward+backward: plain, comm.overlap_backward, parallel.async_tp=ring, each with and without an SM margin.
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpframe.comm.margin import gemm_sm_margin  # noqa: E402

M, K, N = 8192, 2048, 3072
MESSAGE = 32 << 20  # bytes per rank
ITERS = int(os.environ.get("ITERS", "15"))


def ints(name: str, default: str) -> list[int]:
    return [int(v) for v in os.environ.get(name, default).split(",")]


def timed(fn, inner: int = 10) -> float:
    """Median over ITERS of the mean microseconds of `inner` back-to-back calls, the host queued ahead."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(ITERS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(20_000_000)  # ~10 ms: the calls below are queued before the GPU reaches them
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    return statistics.median(times)


def copy_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy(src, dst, n, BLOCK: tl.constexpr, CTAS: tl.constexpr):
        for start in range(tl.program_id(0) * BLOCK, n, CTAS * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)

    return copy


def rows_one_gpu(a, b):
    """A copy kernel of `ctas` CTAs (NCCL's kernels are a few CTAs moving data for the whole transfer)."""
    copy, side = copy_kernel(), torch.cuda.Stream()
    src = torch.randn(MESSAGE // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    out = []
    for ctas in ints("CTAS", "8,16,32"):

        def comm(ctas=ctas):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                copy[(ctas,)](src, dst, src.numel(), BLOCK=4096, CTAS=ctas, num_warps=8)
            return side

        def join(stream):
            torch.cuda.current_stream().wait_stream(stream)

        alone = timed(lambda: join(comm()))
        for margin in ints("MARGINS", "0,8,16,32"):
            out.append((f"copy kernel, {ctas} CTAs", margin, alone, *both(a, b, margin, comm, join)))
    return out


def rows_nccl(a, b, comm):
    """The collectives tpframe overlaps, on the TP group (all ranks): reduce-scatter (the backward's input gradient
    under SP) and one ring step's send/receive pair (async TP)."""
    n = comm.size
    x_rs = torch.randn(n * MESSAGE // 2, device="cuda", dtype=torch.bfloat16)
    send = torch.randn(MESSAGE // 2, device="cuda", dtype=torch.bfloat16)
    recv = torch.empty_like(send)
    calls = {
        f"NCCL reduce-scatter, {n * MESSAGE >> 20} MiB in": lambda: comm.reduce_scatter_async(x_rs),
        "NCCL send/receive pair (ring step), 32 MiB": lambda: comm.exchange_async(
            send, to=(comm.rank + 1) % n, recv=recv, source=(comm.rank - 1) % n
        ),
    }
    out = []
    for name, start in calls.items():
        alone = timed(lambda start=start: start().wait())
        for margin in ints("MARGINS", "0,8,16,32"):
            out.append((name, margin, alone, *both(a, b, margin, start, lambda p: p.wait())))
    start, wait = copy_engine_exchange(comm, recv)
    name = "copy-engine pull from every peer (a ring step's bytes), 32 MiB"
    alone = timed(lambda: wait(start()))
    for margin in ints("MARGINS", "0,8,16,32"):
        out.append((name, margin, alone, *both(a, b, margin, start, wait)))
    return out


def copy_engine_exchange(comm, recv):
    """A ring step's transfer by the copy engines (tpframe/comm/copy_engine.py's means): each rank's 32 MiB sit in
    its symmetric buffer; every rank says so to its peers (a stream write), waits for theirs (a stream wait), pulls
    the previous rank's block with cudaMemcpyAsync, and waits until its own block has been read before the next
    call may overwrite it. No SM is used while the bytes move."""
    from tpframe.comm.copy_engine import stream_wait, stream_write, symmetric_peer_memory

    n, r = comm.size, comm.rank
    mem = symmetric_peer_memory(comm.group, numel=MESSAGE // 4, flags=2 * n, device=recv.device)
    mem.buffer.view(torch.bfloat16).normal_()
    source = mem.buffers[(r - 1) % n].view(torch.bfloat16)[: recv.numel()]
    side, epoch = torch.cuda.Stream(recv.device), [0]

    def flag(rank, kind, src):  # kind 0: my block is ready; 1: I am done reading yours
        return mem.flags[rank].data_ptr() + 4 * (kind * n + src)

    def start():
        epoch[0] += 1
        side.wait_stream(torch.cuda.current_stream())
        for p in range(n):
            if p != r:
                stream_write(side, flag(p, 0, r), epoch[0])
        stream_wait(side, flag(r, 0, (r - 1) % n), epoch[0])
        with torch.cuda.stream(side):
            recv.copy_(source)
        stream_write(side, flag((r - 1) % n, 1, r), epoch[0])
        stream_wait(side, flag(r, 1, (r + 1) % n), epoch[0])
        return side

    def wait(stream):
        torch.cuda.current_stream().wait_stream(stream)

    return start, wait


def both(a, b, margin, start, wait):
    """(GEMM alone with `margin`, communication started then the GEMM beside it)."""
    gemm_alone = timed(lambda: _gemm(a, b, margin))

    def together():
        handle = start()
        _gemm(a, b, margin)
        wait(handle)

    return gemm_alone, timed(together)


def _gemm(a, b, margin):
    with gemm_sm_margin(margin, a.device):
        return a @ b


class EmulatedPeer:
    """A TP=2 communicator for rank 0 on one GPU: the peer's data is this rank's; each transfer is a 16-CTA copy."""

    size, rank, has_symmetric_memory = 2, 0, False

    def __init__(self):
        self.device, self.side, self.copy = torch.device("cuda"), torch.cuda.Stream(), copy_kernel()
        self.overlap_backward, self.overlap_sm_margin = False, 0

    def _move(self, src, dst):
        self.copy[(16,)](src.reshape(-1), dst.reshape(-1), src.numel(), BLOCK=4096, CTAS=16, num_warps=8)
        return dst

    def _started(self, src, dst, keep):
        from tpframe.comm.communicator import Pending

        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            self._move(src, dst)
            done = torch.cuda.Event()
            done.record()

        class Work:
            def wait(self):
                torch.cuda.current_stream().wait_event(done)

        return Pending(dst, Work(), keep=keep)  # as NCCL: inputs kept until the wait, no record_stream

    def beside(self, pending):
        return gemm_sm_margin(self.overlap_sm_margin if pending is not None else 0, self.device)

    def exchange_async(self, send, *, to, recv, source):
        return self._started(send, recv, send)

    def reduce_scatter_async(self, x):
        half = x.shape[0] // 2
        return self._started(x[half:], torch.empty_like(x[:half]), x)

    def all_gather(self, x, dim=0):
        out = x.new_empty((2 * x.shape[0],) + x.shape[1:])
        out[: x.shape[0]].copy_(x)
        self._move(x, out[x.shape[0] :])
        return out

    def reduce_scatter(self, x, dim=0):
        return self._move(x[x.shape[0] // 2 :], torch.empty_like(x[: x.shape[0] // 2]))


def layers_table() -> str:
    from tpframe.layers.linear import column_parallel_linear, row_parallel_linear

    comm = EmulatedPeer()
    s, b, h = 2048, 8, 2048
    bf = dict(device="cuda", dtype=torch.bfloat16)
    layers = {
        "qkv (column, 2048 -> 3072 per rank)": ("column", 3072, h),
        "fc1 (column, 2048 -> 4096)": ("column", 4096, h),
        "proj (row, 1024 -> 2048)": ("row", h, 1024),
        "fc2 (row, 4096 -> 2048)": ("row", h, 4096),
    }
    variants = {
        "plain": (None, False, 0),
        "overlap_backward": (None, True, 0),
        "overlap_backward, margin 16": (None, True, 16),
        "ring": ("ring", False, 0),
        "ring, margin 16": ("ring", False, 16),
        "ring, margin 32": ("ring", False, 32),
    }
    rows, total = [], {}
    for name, (kind, out_f, in_f) in layers.items():
        w = (torch.randn(out_f, in_f, **bf) * 0.02).requires_grad_()
        bias = torch.zeros(out_f, **bf) if kind == "column" else None
        x = torch.randn(s // 2 if kind == "column" else s, b, in_f, **bf).requires_grad_()
        fn = column_parallel_linear if kind == "column" else row_parallel_linear
        for what in ("forward", "forward+backward"):
            cells = []
            for v, (mode, overlap, margin) in variants.items():
                comm.overlap_backward, comm.overlap_sm_margin = overlap, margin

                def step(mode=mode, what=what):
                    y = fn(x, w, bias, comm, True, async_tp=mode)
                    if what != "forward":
                        y.backward(torch.ones_like(y))

                us = timed(step)
                total[(what, v)] = total.get((what, v), 0.0) + us
                cells.append(f"{us:.0f}")
            rows.append(f"| {name} | {what} | " + " | ".join(cells) + " |")
    for what in ("forward", "forward+backward"):
        base = total[(what, "plain")]
        rows.append(
            f"| all four | {what} | "
            + " | ".join(f"{total[(what, v)]:.0f} ({total[(what, v)] / base:.2f}x)" for v in variants)
            + " |"
        )
    head = [
        f"### GPT-1.3B's linear layers at TP=2 + SP, the peer emulated on one {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}, {datetime.date.today()}",
        "",
        "Command: `python benchmarks/overlap.py --layers`. Microseconds per call (median of "
        f"{ITERS}); each transfer a 16-CTA copy of its real size. The ratios are against plain.",
        "",
        "| layer | pass | " + " | ".join(variants) + " |",
        "|---|---|" + "---|" * len(variants),
    ]
    return "\n".join(head + rows) + "\n"


def main() -> None:
    for var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(var, "0" if var == "NCCL_NVLS_ENABLE" else "1")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    comm = None
    if world > 1:
        from tpframe.parallel import initialize_parallel

        comm = initialize_parallel(tp=world, comm_backend="nccl").tp_comm
    if "--layers" in sys.argv[1:]:
        return publish(layers_table())
    device = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(M, K, device=device, generator=g).bfloat16()
    b = torch.randn(K, N, device=device, generator=g).bfloat16()
    rows = rows_nccl(a, b, comm) if comm is not None else rows_one_gpu(a, b)
    if comm is not None and comm.rank != 0:
        return
    name = torch.cuda.get_device_name()
    head = (
        f"GEMM [{M} x {K}] x [{K} x {N}] bf16 ({2 * M * N * K / 1e9:.0f} GFLOP) beside communication, "
        f"{world}x {name}, torch {torch.__version__}, {datetime.date.today()}"
    )
    launcher = f"torchrun --nproc-per-node {world}" if world > 1 else "python"
    lines = [
        f"### {head}",
        "",
        f"Command: `{launcher} benchmarks/overlap.py` (NCCL_MAX_CTAS={os.environ.get('NCCL_MAX_CTAS', 'unset')}). "
        f"Microseconds, median of {ITERS}.",
        "",
        "| communication | SM margin | comm alone | GEMM alone | both | serial | both / serial |",
        "|---|---|---|---|---|---|---|",
    ]
    for what, margin, comm_us, gemm_us, both_us in rows:
        serial = comm_us + gemm_us
        lines.append(
            f"| {what} | {margin} | {comm_us:.0f} | {gemm_us:.0f} | {both_us:.0f} | {serial:.0f} | "
            f"{both_us / serial:.2f} |"
        )
    publish("\n".join(lines) + "\n")


def publish(text: str) -> None:
    print(text)
    if os.environ.get("NO_APPEND") != "1":
        with open(Path(__file__).resolve().parent / "RESULTS.md", "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
