"""train.cuda_graph: the forward+backward replayed from CUDA graphs trains exactly like the eager step.

CPU: the pieces the graphed schedule relies on (activation recompute without RNG state, the gradient
buffer's bookkeeping); the bad combinations are in tests/test_ops_inputs.py. GPU: whole runs through
train.py's pipeline, graphed against eager, with gradient accumulation, recompute, compiled blocks, TP and DP.
"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tests.dist_utils import run_distributed
from tests.training_utils import fp8_in_small_layers, train_in_process


def test_recompute_without_rng_state_saves_none_and_gives_the_same_gradients(monkeypatch):
    from tpframe.parallel.recompute import recompute

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    x = torch.randn(4, 8, requires_grad=True)
    block(x).square().sum().backward()
    want = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    for p in [*block.parameters(), x]:
        p.grad = None

    def forbidden(*args, **kwargs):
        raise AssertionError("a block without dropout must not save or restore RNG states")

    monkeypatch.setattr(torch, "get_rng_state", forbidden)
    monkeypatch.setattr(torch, "set_rng_state", forbidden)
    recompute(block, x, preserve_rng=False).square().sum().backward()
    for g, w in zip([p.grad for p in block.parameters()] + [x.grad], want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    with pytest.raises(AssertionError, match="must not save"):  # the default still replays RNG states
        recompute(block, x).square().sum().backward()


def test_gradient_buffer_bookkeeping_can_be_read_and_restored():
    """What a graph replay cannot do itself: mark the params whose gradient the replay copied in, so the
    end of the step zeroes only the params that really received none."""
    from tpframe.layers.utils import tag_param
    from tpframe.optim.grad_buffer import GradBuffer

    used, unused = nn.Linear(4, 4), nn.Linear(4, 4)
    params = [tag_param(p, tp_dim=None) for p in (*used.parameters(), *unused.parameters())]
    buf = GradBuffer(params, None, dp_size=1, bucket_bytes=64)
    buf.zero()
    at_start = buf.host_state()
    used(torch.ones(2, 4)).sum().backward()
    after = buf.host_state()

    def stale():
        return set().union(*(fresh for fresh, _, _ in buf.host_state()[0]))

    assert stale() == {id(p) for p in unused.parameters()}, "only the params without a gradient stay stale"
    buf.set_host_state(at_start)  # as if the backward had been a replay: the hooks did not run
    assert stale() == {id(p) for p in [*used.parameters(), *unused.parameters()]}
    buf.buffer.fill_(7.0)
    buf.set_host_state(after)
    buf.finish_sync()
    assert all(float(p.main_grad.abs().max()) == 0 for p in unused.parameters())
    assert all(float(p.main_grad.min()) == 7.0 for p in used.parameters()), "a received gradient is kept"
    assert all(b.launched for b in buf.buckets) and buf.syncing
    buf.set_host_state(after)  # a replayed step that synced nothing yet: its buckets are launched again
    assert not any(b.launched for b in buf.buckets) and not buf.syncing
    with pytest.raises(ValueError):
        buf.set_host_state((after[0][:-1], *after[1:]))


def _eager_and_graphed(overrides: list[str], root: str, fp8_everywhere: bool = False) -> dict:
    if fp8_everywhere:
        fp8_in_small_layers()
    out = {}
    for graph in (False, True):
        trainer = train_in_process(
            [*overrides, f"train.cuda_graph={str(graph).lower()}", f"train.run_dir={root}/{graph}"], keep_trainer=True
        )
        fb = trainer.forward_backward
        out[graph] = {
            "losses": [r["loss"] for r in trainer.history],
            "norms": [r["grad_norm"] for r in trainer.history],
            "captured": getattr(fb, "captured", None),
            "calls": getattr(fb, "calls", None),
            "device": str(trainer.parallel.device),
        }
    return out


def _assert_same_training(out: dict, rtol: float, steps: int) -> None:
    eager, graphed = out[False], out[True]
    assert graphed["device"].startswith("cuda") and graphed["captured"] is True and graphed["calls"] == steps
    assert eager["captured"] is None, "the eager run must not use the graphed schedule"
    assert len(graphed["losses"]) == len(eager["losses"]) == steps
    for step, (a, b) in enumerate(zip(graphed["losses"], eager["losses"]), 1):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: graphed loss {a!r} vs eager {b!r}"
    for step, (a, b) in enumerate(zip(graphed["norms"], eager["norms"]), 1):
        assert abs(a - b) <= 10 * rtol * abs(b), f"step {step}: graphed grad norm {a!r} vs eager {b!r}"
    assert eager["losses"][-1] < eager["losses"][0] - 0.5, "the runs must really train"


# fp32: the same kernels replayed, so the runs agree to flash/efficient attention's atomic-add ordering only
CASES = {
    "2-micro-batches": [],  # the "first" graph copies into main_grad, the "rest" graph adds
    "1-micro-batch-recompute": ["train.global_batch_size=4", "parallel.activation_checkpointing=true"],
    "zero1-bucketed": ["parallel.dp_strategy=zero1", "parallel.grad_bucket_mb=0.01"],
    # the freed norm and activation outputs are refilled inside the captured backward (host-side resizes)
    "selective-recompute": ["parallel.activation_checkpointing=selective"],
}


@pytest.mark.gpu(count=1)
@pytest.mark.parametrize("extra", CASES.values(), ids=CASES.keys())
def test_graphed_training_equals_eager_on_one_gpu(tmp_path, extra):
    common = ["parallel.tp=1", "train.steps=8", "model.position=rotary", *extra]
    out = run_distributed(_eager_and_graphed, 1, common, str(tmp_path), backend="nccl")[0]
    _assert_same_training(out, rtol=1e-4, steps=8)


@pytest.mark.gpu(count=1)
@pytest.mark.parametrize("fp8", ["false", "tensorwise", "rowwise"])
def test_graphed_training_of_compiled_bf16_blocks_equals_eager(tmp_path, fp8):
    """Compiled bf16 blocks, and the same with their GEMMs in float8 (the tiny layers too: fp8_in_small_layers),
    replayed from CUDA graphs train as the eager (ungraphed) step does."""
    common = ["parallel.tp=1", "train.steps=8", "train.dtype=bfloat16", "train.compile=true", f"train.fp8={fp8}"]
    out = run_distributed(_eager_and_graphed, 1, common, str(tmp_path), fp8 != "false", backend="nccl")[0]
    _assert_same_training(out, rtol=2e-2, steps=8)


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.tp=2", "parallel.sequence_parallel=true", "comm.backend=auto"],
        ["parallel.tp=1", "train.global_batch_size=16"],
    ],
    ids=["tp2-sp-auto", "dp2"],
)
def test_graphed_training_equals_eager_on_two_gpus(tmp_path, layout):
    """TP collectives inside the graph (the symm kernels where `auto` picks them); DP sync after it."""
    out = run_distributed(_eager_and_graphed, 2, [*layout, "train.steps=8"], str(tmp_path), backend="nccl")
    for rank_out in out:
        _assert_same_training(rank_out, rtol=1e-4, steps=8)


def _diverge_graphed(root: str) -> str:
    from tpframe.training.health import TrainingAborted

    try:
        train_in_process(
            [
                "parallel.tp=1",
                "train.steps=12",
                "train.cuda_graph=true",
                "optim.lr=1e30",
                "optim.grad_clip=0",
                "train.max_skipped_steps=3",
                f"train.run_dir={root}",
            ]
        )
    except TrainingAborted as e:
        return str(e)
    return "no abort"


@pytest.mark.gpu(count=1)
def test_a_graphed_run_that_diverges_is_rerun_skipped_and_stopped_with_a_message(tmp_path):
    """Non-finite losses come out of the replays like out of eager steps: re-run (a replay), skipped, and past
    train.max_skipped_steps the run stops, saying that the micro-batch is unknown because a graph ran."""
    message = run_distributed(_diverge_graphed, 1, str(tmp_path), backend="nccl")[0]
    assert "non-finite" in message and "train.max_skipped_steps=3" in message, message
    assert "replayed a CUDA graph" in message, message


def test_auto_is_refused_nowhere_and_names_what_keeps_it_eager():
    """train.cuda_graph=auto passes validation where `true` is refused; the obstacle is the line `true` gets."""
    from tpframe.run.preflight import check_device, cuda_graph_device_obstacle
    from tpframe.training.config import ConfigError, cuda_graph_obstacle, load_config, validate

    for extra, words in (
        (["parallel.pp=2", "parallel.tp=1", "train.micro_batch_size=2"], "non-pipelined step"),
        (["model.dropout=0.1"], "needs model.dropout=0"),
        (["parallel.dp_strategy=fsdp"], "cannot capture FSDP"),
    ):
        for setting in ("auto", "true"):
            cfg = load_config("configs/tiny_cpu.yaml", [*extra, f"train.cuda_graph={setting}"])
            if setting == "auto":
                validate(cfg, world_size=2)
                assert words in cuda_graph_obstacle(cfg)
            else:
                with pytest.raises(ConfigError, match=words):
                    validate(cfg, world_size=2)
    cfg = load_config("configs/tiny_cpu.yaml", ["train.cuda_graph=auto"])
    validate(cfg, world_size=2)
    assert cuda_graph_obstacle(cfg) is None
    check_device(cfg, "cpu", local_world=1, local_rank=0)  # auto on a CPU: no error, it runs eagerly
    assert "needs a CUDA device" in cuda_graph_device_obstacle(cfg, "cpu")
    import train
    from tpframe.parallel.graphed import GraphedForwardBackward
    from tpframe.parallel.schedules import forward_backward_no_pipelining

    said: list[str] = []
    schedule = train._schedule(cfg, SimpleNamespace(device=torch.device("cpu")), None, said.append)
    assert schedule is forward_backward_no_pipelining and not said
    cfg.model.dropout = 0.1  # on a GPU, auto with dropout runs eagerly too, and says why in one line
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "current_device", lambda: 0)
        schedule = train._schedule(cfg, SimpleNamespace(device=torch.device("cuda", 0)), None, said.append)
    assert schedule is forward_backward_no_pipelining and len(said) == 1 and "model.dropout=0" in said[0], said
    cfg.model.dropout = 0.0
    schedule = train._schedule(cfg, SimpleNamespace(device=torch.device("cuda", 0)), None, said.append)
    assert isinstance(schedule, GraphedForwardBackward) and schedule.auto and schedule.decision is None


def _auto_run(overrides: list[str], root: str, min_gain: float | None) -> dict:
    from tpframe.parallel import graphed

    lines: list[str] = []
    init = graphed.GraphedForwardBackward.__init__

    def patched(self, **kw):  # record the decision line; min_gain=10: no graph is that much faster
        init(self, **{**kw, "log": lines.append, **({"min_gain": min_gain} if min_gain is not None else {})})

    graphed.GraphedForwardBackward.__init__ = patched
    trainer = train_in_process([*overrides, "train.cuda_graph=auto", f"train.run_dir={root}/auto"], keep_trainer=True)
    fb = trainer.forward_backward
    eager = train_in_process([*overrides, "train.cuda_graph=false", f"train.run_dir={root}/eager"], keep_trainer=True)
    return {
        "decision": getattr(fb, "decision", None),
        "captured": getattr(fb, "captured", None),
        "losses": [r["loss"] for r in trainer.history],
        "eager": [r["loss"] for r in eager.history],
        "lines": lines,
    }


@pytest.mark.gpu(count=1)
@pytest.mark.parametrize("min_gain", [None, 10.0], ids=["graphs-faster", "graphs-not-faster"])
def test_auto_times_both_keeps_the_faster_and_trains_like_eager(tmp_path, min_gain):
    # tiny model, micro-batches of 4: host-bound, so replaying is faster by far; min_gain=10 forces the other way
    common = ["parallel.tp=1", "train.steps=14", "model.position=rotary"]
    out = run_distributed(_auto_run, 1, common, str(tmp_path), min_gain, backend="nccl")[0]
    want = "graph" if min_gain is None else "eager"
    assert out["decision"] == want and out["captured"] is (want == "graph"), out
    assert (
        len(out["lines"]) == 1 and ("keeping the graphs" if want == "graph" else "running eagerly") in out["lines"][0]
    ), out
    for step, (a, b) in enumerate(zip(out["losses"], out["eager"]), 1):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: auto {a!r} vs eager {b!r}"
    assert len(out["losses"]) == 14


def _agreed(values_by_rank: dict) -> list:
    from tpframe.parallel.graphed import GraphedForwardBackward

    fb = GraphedForwardBackward(auto=True)
    return fb._agree(values_by_rank[torch.distributed.get_rank()], torch.device("cpu"))


def test_auto_ranks_agree_on_the_slowest_timings_and_any_failed_capture():
    """Every rank must choose alike (TP collectives take other backends inside a graph): each value is maxed."""
    out = run_distributed(_agreed, 2, {0: [0.05, 0.03, 0.0], 1: [0.04, 0.035, 1.0]})
    assert out == [[0.05, 0.035, 1.0]] * 2


def _auto_two_ranks(overrides: list[str], root: str) -> dict:
    trainer = train_in_process([*overrides, "train.cuda_graph=auto", f"train.run_dir={root}/auto"], keep_trainer=True)
    eager = train_in_process([*overrides, "train.cuda_graph=false", f"train.run_dir={root}/eager"], keep_trainer=True)
    return {
        "decision": trainer.forward_backward.decision,
        "losses": [r["loss"] for r in trainer.history],
        "eager": [r["loss"] for r in eager.history],
    }


@pytest.mark.gpu(count=2)
def test_auto_decides_alike_on_two_ranks_and_trains_like_eager(tmp_path):
    out = run_distributed(
        _auto_two_ranks,
        2,
        ["parallel.tp=2", "parallel.sequence_parallel=true", "train.steps=14"],
        str(tmp_path),
        backend="nccl",
    )
    assert out[0]["decision"] == out[1]["decision"] in ("graph", "eager"), out
    for rank_out in out:
        for step, (a, b) in enumerate(zip(rank_out["losses"], rank_out["eager"]), 1):
            assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: auto {a!r} vs eager {b!r}"


def test_auto_goes_on_eagerly_with_the_micro_batch_a_failed_capture_took(monkeypatch):
    """The probing sequence (warm-up, timed eager steps, capture) on a CPU with the capture made to fail: the
    step that tried it runs eagerly from the micro-batch the capture had taken, and every later step too."""
    from tpframe.errors import ConfigError
    from tpframe.parallel.graphed import GraphedForwardBackward
    from tpframe.parallel.schedules import forward_backward_no_pipelining

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x, y):
            return ((x.float() * self.w).sum(-1) - y.float()) ** 2

    class Batches:
        def __init__(self):
            self.i = 0

        def next(self):
            self.i += 1
            return torch.full((2, 3), float(self.i)), torch.full((2,), float(self.i % 3))

    class Strategy:
        grads = None

        def start_grad_sync(self):
            pass

    def failing_capture(self, *args):
        raise ConfigError("train.cuda_graph could not capture the training step (a test); set train.cuda_graph=false")

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(GraphedForwardBackward, "_capture", failing_capture)
    said: list[str] = []
    fb = GraphedForwardBackward(auto=True, warmup_steps=1, probe_steps=2, log=said.append)
    model, ref = Model(), Model()
    got_batches, ref_batches = Batches(), Batches()
    for step in range(6):  # warm-up, 2 timed eager steps, the capture that fails, then eager steps
        loss = fb(model, got_batches, 2, grad_sync=Strategy(), device=torch.device("cpu"))
        want = forward_backward_no_pipelining(ref, ref_batches, 2, grad_sync=Strategy(), device=torch.device("cpu"))
        assert torch.equal(loss, want) and torch.equal(model.w.grad, ref.w.grad), step
    assert fb.decision == "eager" and got_batches.i == ref_batches.i == 12
    assert len(said) == 1 and "the capture failed" in said[0] and said[0].endswith("running eagerly"), said
