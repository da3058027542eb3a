"""GPT training on GPUs: the symm and nccl backends give the same losses; bf16 training resumes."""

import pytest

from tests.dist_utils import run_distributed
from tests.training_utils import train_in_process

pytestmark = pytest.mark.gpu(count=2)


def _losses_and_backend(overrides):
    """Per-step losses, how many collectives the symm kernels ran, and the device."""
    from tpframe.comm.communicator import Communicator

    symm_calls = [0]
    route = Communicator._route

    def counting_route(self, op, x):
        backend, call = route(self, op, x)
        symm_calls[0] += backend is self.symm
        return backend, call

    Communicator._route = counting_route
    trainer = train_in_process(overrides, keep_trainer=True)
    return [r["loss"] for r in trainer.history], symm_calls[0], str(trainer.parallel.device)


@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_symm_and_nccl_give_the_same_gpt_losses_at_tp2(tmp_path, sp):
    common = ["parallel.tp=2", f"parallel.sequence_parallel={str(sp).lower()}", "train.steps=10"]
    nccl, nccl_symm_calls, device = run_distributed(
        _losses_and_backend, 2, [*common, "comm.backend=nccl", f"train.run_dir={tmp_path}/n"], backend="nccl"
    )[0]
    symm, symm_calls, _ = run_distributed(
        _losses_and_backend, 2, [*common, "comm.backend=symm", f"train.run_dir={tmp_path}/s"], backend="nccl"
    )[0]
    assert device.startswith("cuda") and nccl_symm_calls == 0
    assert symm_calls >= 10 * 2 * 2 * 2, f"the symm run must really run its collectives on symm kernels ({symm_calls})"
    for step, (a, b) in enumerate(zip(symm, nccl), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: symm loss {a!r} vs nccl {b!r}"
    assert nccl[-1] < nccl[0]


def _graphed_losses(overrides):
    trainer = train_in_process(overrides, keep_trainer=True)
    return [r["loss"] for r in trainer.history], getattr(trainer.forward_backward, "captured", False)


def test_copy_engine_async_tp_trains_as_the_plain_path_eagerly_and_from_cuda_graphs_at_tp2(tmp_path):
    """The Trainer at TP=2 + SP with parallel.async_tp=copy_engine, eagerly and with train.cuda_graph (the pushes,
    flags and GEMM blocks replayed): the same fp32 losses as the plain path."""
    common = [
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "train.steps=8",
        "model.dropout=0",
        "model.attention_dropout=0",
        "train.dtype=float32",
    ]
    runs = {}
    for name, extra in (
        ("plain", []),
        ("copy_engine", ["parallel.async_tp=copy_engine"]),
        ("copy_engine+graph", ["parallel.async_tp=copy_engine", "train.cuda_graph=true"]),
    ):
        runs[name] = run_distributed(
            _graphed_losses, 2, [*common, *extra, f"train.run_dir={tmp_path}/{name}"], backend="nccl"
        )[0]
    plain = runs["plain"][0]
    assert runs["copy_engine+graph"][1] and not runs["copy_engine"][1]
    for name in ("copy_engine", "copy_engine+graph"):
        for step, (a, b) in enumerate(zip(runs[name][0], plain), 1):
            assert abs(a - b) <= 1e-4 * abs(b), f"{name} step {step}: loss {a!r} vs plain {b!r}"


def test_bf16_training_resumes_from_an_async_checkpoint_on_gpu(tmp_path):
    common = [
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "train.dtype=bfloat16",
        "train.steps=10",
        "comm.backend=auto",
    ]
    straight = run_distributed(_losses_and_backend, 2, [*common, f"train.run_dir={tmp_path}/a"], backend="nccl")[0][0]
    run_distributed(
        _losses_and_backend,
        2,
        [*common, "checkpoint.interval=5", "checkpoint.async_save=true", f"train.run_dir={tmp_path}/b"],
        backend="nccl",
    )
    ckpt = tmp_path / "b" / "checkpoints" / "step_00000005"
    resumed = run_distributed(
        _losses_and_backend, 2, [*common, f"checkpoint.load={ckpt}", f"train.run_dir={tmp_path}/c"], backend="nccl"
    )[0][0]
    assert len(resumed) == 5
    # flash attention's backward accumulates with atomics, so GPU runs agree to bf16 rounding, not bit for bit
    for step, (a, b) in enumerate(zip(resumed, straight[5:]), 6):
        assert abs(a - b) <= 2e-2 * abs(b), f"step {step}: resumed loss {a!r} vs uninterrupted {b!r}"


def _strategy_losses(root: str):
    out = {}
    for s in ("ddp", "zero1", "fsdp"):
        out[s] = [
            r["loss"]
            for r in train_in_process(
                [
                    "parallel.tp=1",
                    f"parallel.dp_strategy={s}",
                    "train.dtype=bfloat16",
                    "train.steps=10",
                    "train.micro_batch_size=2",
                    "parallel.grad_bucket_mb=0.05",
                    "checkpoint.save_at_end=true",
                    f"train.run_dir={root}/{s}",
                ]
            )
        ]
    return out


def test_every_dp_strategy_trains_the_same_on_gpu(tmp_path):
    losses = run_distributed(_strategy_losses, 2, str(tmp_path), backend="nccl")[0]
    for s in ("zero1", "fsdp"):  # bf16 compute: equal to bf16 rounding, not to the bit
        for step, (a, b) in enumerate(zip(losses[s], losses["ddp"]), 1):
            assert abs(a - b) <= 2e-2 * abs(b), f"{s} step {step}: loss {a!r} vs ddp {b!r}"
    assert losses["ddp"][-1] < losses["ddp"][0] - 0.5


def _bucket_means(mode: str):
    """A GradBuffer over NCCL at DP=2 (several buckets, overlapped): the synced buffer, the ranges this rank owns
    (reduce-scatter) and, per weight, its offset and the exact fp32 mean of both ranks' gradients."""
    import torch
    import torch.distributed as dist

    from tpframe.layers.utils import tag_param
    from tpframe.optim.grad_buffer import GradBuffer

    rank = dist.get_rank()
    torch.manual_seed(0)
    weights = [tag_param(torch.nn.Parameter(torch.randn(n, device="cuda")), tp_dim=None) for n in (37, 1000, 4096)]
    buf = GradBuffer(weights, dist.group.WORLD, dp_size=2, dp_rank=rank, bucket_bytes=4096, mode=mode)
    buf.zero()
    buf.start_sync()
    scales = (1.0 / 3.0, 7.0)  # per-rank loss scales whose mean is not exact in binary: rounding would show
    sum((w * w).sum() for w in weights).mul(scales[rank]).backward()
    buf.finish_sync()
    means = [((2 * w.detach() * scales[0] + 2 * w.detach() * scales[1]) / 2).cpu() for w in weights]
    owned = [buf.shard_range(b) for b in buf.buckets] if mode == "reduce_scatter" else [(0, buf.numel)]
    return buf._avg_in_collective, buf.buffer.cpu(), owned, [(buf.offsets[w], m) for w, m in zip(weights, means)]


@pytest.mark.parametrize("mode", ["all_reduce", "reduce_scatter"])
def test_nccl_gradient_buckets_average_inside_the_collective(mode):
    """ddp's all-reduce and zero1's reduce-scatter average with NCCL's ReduceOp.AVG (no scaling pass before the
    launch): each rank's buffer holds the fp32 mean of both ranks' gradients, over several overlapped buckets."""
    import torch

    for avg_in_collective, buffer, owned, expected in run_distributed(_bucket_means, 2, mode, backend="nccl"):
        assert avg_in_collective, "with NCCL the average must happen inside the collective"
        want = torch.zeros_like(buffer)
        for offset, mean in expected:
            want[offset : offset + mean.numel()] = mean
        for lo, hi in owned:
            torch.testing.assert_close(buffer[lo:hi], want[lo:hi], rtol=3e-7, atol=1e-6)


@pytest.mark.parametrize("mode", ["all_reduce", "reduce_scatter"])
def test_nccl_bf16_gradient_reduce_rounds_only_the_sum_over_dp(mode):
    """parallel.grad_reduce_dtype=bfloat16 over NCCL (ReduceOp.AVG in bf16, overlapped buckets): each rank's share of
    the fp32 accumulation rounded to bf16 once and summed, written back into the fp32 buffer."""
    from tests.test_data_parallel import _bf16_wire, check_bf16_wire

    for dtype in ("float32", "bfloat16"):
        check_bf16_wire(run_distributed(_bf16_wire, 2, mode, dtype, backend="nccl"), 2, dtype)
