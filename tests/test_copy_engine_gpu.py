"""Gradient buckets synced by copy engines (parallel.dp_comm=copy_engine, tpframe/comm/copy_engine.py).

On one GPU, two processes share their buffers by CUDA IPC: the protocol (flag handshakes, slot reuse, the
waits for a late peer) runs for real, copies included. On two GPUs, torch's symmetric memory: the buffers
equal NCCL's, and ddp and zero1 train as with NCCL.
"""

import pytest

from tests.dist_utils import run_distributed
from tests.training_utils import train_in_process


def _synced_buckets(mode: str, late_rank: int, high_priority: bool = False):
    """Three steps of a GradBuffer at DP=world size synced by copy engines (two micro-batches each, small buckets,
    overlapped); `late_rank`'s GPU sleeps before its last backward, so its peers' pulls must wait for it.
    Per step: the buffer, the ranges this rank owns, each weight's offset and exact mean gradient."""
    import functools
    import time

    import torch
    import torch.distributed as dist

    from tpframe.comm.copy_engine import ipc_peer_memory
    from tpframe.optim.grad_buffer import GradBuffer

    rank, n = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.device_count() - 1 if dist.get_backend() == "gloo" else rank)
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(n, device=device)) for n in (37, 1000, 4096, 3000, 50)]
    if dist.get_backend() == "gloo":  # both ranks on one GPU
        peer = functools.partial(ipc_peer_memory, dist.group.WORLD, device=device)
    else:
        from tpframe.comm.copy_engine import dp_peer_memory

        peer = dp_peer_memory("copy_engine", dist.group.WORLD, n, device)
    buf = GradBuffer(
        weights,
        dist.group.WORLD,
        dp_size=n,
        dp_rank=rank,
        bucket_bytes=2048,
        mode=mode,
        peer_memory=peer,
        high_priority=high_priority,
    )
    if high_priority:  # parallel.dp_high_priority: the sync's streams outrank the default one
        assert buf._ce.reduce.priority < torch.cuda.current_stream().priority
    buf.events = []
    out = []
    for step in range(3):
        scales = [[1.0 / 3.0 + step + r for r in range(n)], [7.0 - step - 0.5 * r for r in range(n)]]  # [mb][rank]
        buf.zero()
        sum((w * w).sum() for w in weights).mul(scales[0][rank]).backward()
        buf.start_sync()
        if rank == late_rank:
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before this rank's last gradients exist
        sum((w * w * w).sum() for w in weights).mul(scales[1][rank]).backward()
        buf.finish_sync()
        torch.cuda.synchronize()
        time.sleep(0.05 * step)  # the ranks drift apart on the host too
        means = []
        for w in weights:
            x = w.detach().double()
            means.append((sum(2 * x * scales[0][r] + 3 * x * x * scales[1][r] for r in range(n)) / n).float().cpu())
        owned = [buf.shard_range(b) for b in buf.buckets] if mode == "reduce_scatter" else [(0, buf.numel)]
        out.append((buf.buffer.cpu(), owned, [(buf.offsets[w], m) for w, m in zip(weights, means)]))
    last_grad = max(i for i, (kind, _) in enumerate(buf.events) if kind == "grad")
    first_launch = min(i for i, (kind, _) in enumerate(buf.events) if kind == "launch")
    return buf.sync_engine, len(buf.buckets), first_launch < last_grad, out


def _check(results, mode):
    import torch

    for engine, buckets, overlapped, steps in results:
        assert engine == "copy_engine" and buckets >= 4 and overlapped, (engine, buckets, overlapped)
        for step, (buffer, owned, expected) in enumerate(steps):
            want = torch.zeros_like(buffer)
            for offset, mean in expected:
                want[offset : offset + mean.numel()] = mean
            for lo, hi in owned:
                torch.testing.assert_close(
                    buffer[lo:hi], want[lo:hi], rtol=2e-6, atol=2e-6, msg=lambda m: f"{mode} step {step}: {m}"
                )


@pytest.mark.gpu(count=1)
@pytest.mark.parametrize("mode", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("late_rank,high_priority", [(0, False), (1, False), (1, True)])
def test_copy_engine_buckets_average_on_one_gpu(mode, late_rank, high_priority):
    """Two processes on one GPU (CUDA IPC): every bucket holds the fp32 mean of both ranks' gradients, three
    steps running (flags handed back and forth, scratch slots reused), with either rank late on the GPU; also
    on high-priority streams (parallel.dp_high_priority)."""
    _check(run_distributed(_synced_buckets, 2, mode, late_rank, high_priority, backend="gloo"), mode)


@pytest.mark.gpu(count=1)
@pytest.mark.parametrize("mode", ["all_reduce", "reduce_scatter"])
def test_copy_engine_buckets_average_at_dp4_on_one_gpu(mode):
    """Four processes on one GPU: each bucket pulled from three peers into three scratch rows, the last rank late."""
    _check(run_distributed(_synced_buckets, 4, mode, 3, backend="gloo"), mode)


def _graphed_steps(mode: str, late_rank: int, micro: int, steps: int = 6):
    """`steps` steps of a small model whose forward+backward is replayed from CUDA graphs after two eager steps
    (tpframe.parallel.graphed), the copy-engine DP sync captured inside the last micro-batch's backward. The params
    move every step (by the exact mean gradient) and every batch is new; `late_rank`'s GPU sleeps before each step.
    Per step: the worst error of this rank's synced gradients against a float64 computation of the mean over
    ranks, relative to the largest gradient. Also: whether a bucket launched before the captured backward's last
    gradient, and how many buckets the host launched after the capture (a replay launches them, not Python)."""
    import copy
    import functools

    import torch
    import torch.distributed as dist
    from torch import nn

    from tpframe.comm.copy_engine import ipc_peer_memory
    from tpframe.optim.grad_buffer import GradBuffer
    from tpframe.parallel.graphed import GraphedForwardBackward

    rank, n = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    torch.cuda.set_device(device)
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))
            self.unused = nn.Parameter(torch.ones(6))  # no gradient: its synced main_grad must be zero

        def forward(self, x, y):
            return (self.body(x) - y).square().mean(dim=-1)

    model = Net().to(device)
    reference = copy.deepcopy(model).double()
    buf = GradBuffer(
        list(model.parameters()),
        dist.group.WORLD,
        dp_size=n,
        dp_rank=rank,
        bucket_bytes=4096,
        mode=mode,
        peer_memory=functools.partial(ipc_peer_memory, dist.group.WORLD, device=device),
    )

    class Sync:
        grads = buf

        def start_grad_sync(self):
            buf.start_sync()

    def batch(step, i, r):
        g = torch.Generator().manual_seed(1000 * step + 10 * i + r)
        return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)

    class Batches:
        def __init__(self, step):
            self.step, self.i = step, 0

        def next(self):
            self.i += 1
            return batch(self.step, self.i - 1, rank)

    schedule = GraphedForwardBackward(warmup_steps=2)
    errors, overlapped, launched_after = [], None, 0
    for step in range(steps):
        buf.zero()
        if step == 2:
            buf.events = []  # the capturing step
        if rank == late_rank:
            torch.cuda._sleep(50_000_000)
        schedule(model, Batches(step), micro, grad_sync=Sync(), device=device)
        if step == 2:
            grads = [i for i, (kind, _) in enumerate(buf.events) if kind == "grad"]
            launches = [i for i, (kind, _) in enumerate(buf.events) if kind == "launch"]
            overlapped = bool(launches) and min(launches) < max(grads)
            buf.events = []
        buf.finish_sync()
        if step > 2:
            launched_after += sum(kind == "launch" for kind, _ in buf.events)
        reference.zero_grad()
        for r in range(n):
            for i in range(micro):
                x, y = batch(step, i, r)
                (reference(x.to(device).double(), y.to(device).double()).mean() / micro / n).backward()
        want = torch.zeros(buf.numel, dtype=torch.float64, device=device)
        for p, q in zip(model.parameters(), reference.parameters()):
            if q.grad is not None:
                want[buf.offsets[p] : buf.offsets[p] + p.numel()] = q.grad.reshape(-1)
        owned = [buf.shard_range(b) for b in buf.buckets] if mode == "reduce_scatter" else [(0, buf.numel)]
        scale = float(want.abs().max())  # fp32 model against float64: errors relative to the largest gradient
        worst = max(float((buf.buffer[lo:hi].double() - want[lo:hi]).abs().max()) / scale for lo, hi in owned)
        errors.append(worst)
        with torch.no_grad():  # every replica takes the exact mean step: the next replay reads moved params
            for p, q in zip(model.parameters(), reference.parameters()):
                if q.grad is not None:
                    q -= 0.05 * q.grad
                    p.copy_(q)
    return schedule.captured, len(buf.buckets), overlapped, launched_after, errors


@pytest.mark.gpu(count=1)
@pytest.mark.parametrize("mode,late_rank,micro", [("all_reduce", 1, 3), ("reduce_scatter", 0, 1), ("all_reduce", 0, 2)])
def test_copy_engine_sync_is_captured_and_replayed_inside_the_cuda_graphed_step(mode, late_rank, micro):
    """train.cuda_graph with parallel.dp_comm=copy_engine: the buckets sync inside the replayed last micro-batch,
    overlapped with its backward, and hold the mean gradient over ranks every step (params moving, new data,
    either rank late)."""
    for captured, buckets, overlapped, launched_after, errors in run_distributed(
        _graphed_steps, 2, mode, late_rank, micro, backend="gloo"
    ):
        assert captured and buckets >= 3 and overlapped, (captured, buckets, overlapped)
        assert launched_after == 0, f"the host launched {launched_after} buckets after the capture"
        assert max(errors) < 1e-5, errors


@pytest.mark.gpu(count=1)
def test_copy_engine_sync_inside_the_cuda_graphed_step_at_dp4():
    for captured, _, overlapped, launched_after, errors in run_distributed(
        _graphed_steps, 4, "reduce_scatter", 3, 2, backend="gloo"
    ):
        assert captured and overlapped and launched_after == 0 and max(errors) < 1e-4, errors


def _one_rank_never_syncs():
    """Rank 1 sets up but never syncs; once rank 0 has given up (or after 20 s) it releases rank 0's GPU by writing
    every flag of rank 0."""
    import functools
    import time

    import torch
    import torch.distributed as dist

    from tpframe.comm.copy_engine import ipc_peer_memory
    from tpframe.optim.grad_buffer import GradBuffer

    rank, device = dist.get_rank(), torch.device("cuda", torch.cuda.device_count() - 1)
    torch.cuda.set_device(device)
    weights = [torch.nn.Parameter(torch.randn(n, device=device)) for n in (1000, 3000)]
    buf = GradBuffer(
        weights,
        dist.group.WORLD,
        dp_size=2,
        dp_rank=rank,
        bucket_bytes=2048,
        mode="all_reduce",
        peer_memory=functools.partial(ipc_peer_memory, dist.group.WORLD, device=device, timeout_s=1.0),
    )
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        store.wait(["gave up"], __import__("datetime").timedelta(seconds=20))
        buf._ce.memory.flags[0].fill_(1000)  # rank 0's flags, through this process's view of them
        torch.cuda.synchronize()
        return None
    buf.zero()
    buf.start_sync()
    sum((w * w).sum() for w in weights).backward()
    t0 = time.monotonic()
    try:
        buf.finish_sync()
    except RuntimeError as e:
        message, waited = str(e), time.monotonic() - t0
    else:
        message, waited = None, time.monotonic() - t0
    store.set("gave up", "1")
    torch.cuda.synchronize()  # released by rank 1
    return message, waited


@pytest.mark.gpu(count=1)
def test_a_peer_that_never_syncs_ends_the_wait_with_a_message():
    message, waited = run_distributed(_one_rank_never_syncs, 2, backend="gloo")[0]
    assert message is not None and "copy-engine gradient sync: step 1 not done after 1 s" in message, message
    assert "DP peer(s) [1]" in message and 0.9 < waited < 5, (message, waited)


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("mode", ["all_reduce", "reduce_scatter"])
def test_copy_engine_buckets_average_over_symmetric_memory(mode):
    _check(run_distributed(_synced_buckets, 2, mode, 1, backend="nccl"), mode)


def _strategy_losses(root: str):
    out = {}
    for s in ("ddp", "zero1"):
        for comm, graph in (("nccl", False), ("copy_engine", False), ("copy_engine", True)):
            trainer = train_in_process(
                [
                    "parallel.tp=1",
                    f"parallel.dp_strategy={s}",
                    f"parallel.dp_comm={comm}",
                    "train.steps=8",
                    "train.micro_batch_size=2",
                    "train.global_batch_size=8",
                    "parallel.grad_bucket_mb=0.05",
                    "model.dropout=0",
                    "model.attention_dropout=0",
                    f"train.cuda_graph={str(graph).lower()}",
                    f"train.run_dir={root}/{s}-{comm}-{graph}",
                ],
                keep_trainer=True,
            )
            captured = getattr(trainer.forward_backward, "captured", False)
            out[s, comm + "+graph" * graph] = (
                [r["loss"] for r in trainer.history],
                trainer.strategy.describe(),
                captured,
            )
    return out


@pytest.mark.gpu(count=2)
def test_ddp_and_zero1_train_the_same_over_copy_engines_as_over_nccl(tmp_path):
    results = run_distributed(_strategy_losses, 2, str(tmp_path), backend="nccl")[0]
    for s in ("ddp", "zero1"):
        nccl = results[s, "nccl"]
        for comm in ("copy_engine", "copy_engine+graph"):  # the second with the sync inside a CUDA graph
            ce = results[s, comm]
            assert "copy-engine" in ce[1] and "copy-engine" not in nccl[1], (ce[1], nccl[1])
            assert ce[2] == comm.endswith("+graph"), (comm, ce[2])
            for step, (a, b) in enumerate(zip(ce[0], nccl[0]), 1):
                assert abs(a - b) <= 1e-5 * abs(b), f"{s} step {step}: {comm} loss {a!r} vs nccl {b!r}"
