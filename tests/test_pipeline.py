"""Pipeline parallelism: schedule orders, deferred weight gradients, and training runs on CPU (gloo)
equal to PP=1 for every schedule, composed with TP+SP and DP, plus resharding checkpoints across PP.

The training runs share one module fixture (three spawned worlds, several layouts each); the tests
below it each assert one claim on their results. Every run: 8 tiny layers, fp32, dropout 0, constant
learning rate after warm-up (so a 10-step run is the first 10 steps of a 15-step one), and no gradient
clipping: clipping scales every gradient by max_norm/norm, whose last bits depend on the order the
stages' squares are summed, and Adam amplifies those bits in the near-zero attention q/k gradients
(up to 6e-5 after 10 steps with an untied head). The global norm itself is compared step by step.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.training_utils import REPO, torchrun_env, train_in_process, with_overrides
from tpframe.parallel.pipeline import SCHEDULES, schedule_order, simulate, split_layers, theoretical_bubble

# -- schedule orders (pure functions) ------------------------------------------------------------

CASES = [
    (s, pp, m, v)
    for pp in (2, 3, 4, 8)
    for m in (pp, 2 * pp, 3 * pp + 1)
    for s, v in (("afab", 1), ("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3))
    if not (s == "interleaved_1f1b" and m % pp)
]


def _orders(schedule, pp, m, v):
    return [schedule_order(schedule, pp=pp, rank=r, num_micro_batches=m, virtual_stages=v) for r in range(pp)]


def test_every_schedule_order_completes_with_fifo_links_and_the_theoretical_bubble():
    for schedule, pp, m, v in CASES:
        sim = simulate(_orders(schedule, pp, m, v), virtual_stages=v)  # raises on deadlock or out-of-order links
        assert abs(sim.bubble - theoretical_bubble(schedule, pp, m, v)) < 1e-9, (schedule, pp, m, v, sim.bubble)


def test_zb_h1_halves_the_1f1b_bubble_at_the_same_peak_activation_memory():
    def peak_in_flight(order):
        live = peak = 0
        for a in order:
            live += {"F": 1, "B": -1, "W": 0}[a.kind]
            peak = max(peak, live)
        return peak

    for pp, m in ((2, 8), (4, 8), (8, 16)):
        zb, one = _orders("zb_h1", pp, m, 1), _orders("1f1b", pp, m, 1)
        assert [peak_in_flight(o) for o in zb] == [peak_in_flight(o) for o in one] == [pp - r for r in range(pp)]
        unit = simulate(one).makespan / (3 * m + 3 * (pp - 1))  # F = B = W = 1: 1F1B idles 3(pp-1)
        assert unit == 1.0 and simulate(zb).makespan == 3 * m + (pp - 1)
        assert all(o[-1].kind == "W" for o in zb) and sum(a.kind == "W" for a in zb[0]) == m


def test_a_deadlocking_order_is_caught_by_the_simulation():
    orders = _orders("1f1b", 2, 4, 1)
    orders[1] = orders[1][1:] + orders[1][:1]  # the last stage wants a backward before its first forward
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(orders)


def test_layers_split_by_stage():
    assert split_layers(8, 4) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert split_layers(8, 2, [3, 5]) == [(0, 1, 2), (3, 4, 5, 6, 7)]
    for bad in ([4, 3], [8, 0], [2, 2, 4]):
        with pytest.raises(ValueError):
            split_layers(8, 2, bad)
    assert set(SCHEDULES) == {"afab", "1f1b", "interleaved_1f1b", "zb_h1"}


# -- deferred weight gradients (zero-bubble B/W split) ------------------------------------------


def test_deferred_weight_gradients_equal_autograd_and_fire_each_hook_once():
    from tpframe.parallel.pipeline.weight_grad import WeightGradStore, linear
    from tpframe.parallel.recompute import recompute

    torch.manual_seed(0)
    w1, w2 = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(4, 6))
    b1 = torch.nn.Parameter(torch.randn(6))
    x = torch.randn(5, 3, 4, requires_grad=True)
    hooks = []
    for p in (w1, w2, b1):
        p.register_post_accumulate_grad_hook(lambda p: hooks.append(p))

    def block(x):  # w1 used twice, as a shared weight would be
        return linear(torch.tanh(linear(x, w1, b1)), w2) + linear(x, w1).sum(-1, keepdim=True)

    block(x).square().sum().backward()
    reference = [t.grad.clone() for t in (x, w1, w2, b1)]
    for t in (x, w1, w2, b1):
        t.grad = None
    hooks.clear()
    store = WeightGradStore()
    with store.capturing():
        recompute(block, x).square().sum().backward()  # activation recompute inside the split backward
        store.seal("mb0")
        assert w1.grad is None and w2.grad is None and b1.grad is not None and x.grad is not None
        assert hooks == [b1]
        store.flush("mb0")
    assert len(store) == 0 and sorted(map(id, hooks)) == sorted(map(id, (w1, w2, b1)))  # one accumulation each
    for got, want in zip((x.grad, w1.grad, w2.grad, b1.grad), reference):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_watchdog_names_the_late_receive():
    from tpframe.parallel.pipeline.p2p import Watchdog

    class Pending:
        def is_completed(self):
            return False

    class Done:
        def is_completed(self):
            return True

    fired = []
    dog = Watchdog(0.2, on_timeout=fired.append, poll_s=0.05)
    dog.watch(Done(), "fine")
    dog.watch(Pending(), "stage 1 waits for micro-batch 3 from stage 0")
    deadline = time.monotonic() + 5
    while not fired and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fired == ["stage 1 waits for micro-batch 3 from stage 0"]
    assert dog.thread is None or not dog.thread.is_alive() or dog.watched == []


# -- training runs -------------------------------------------------------------------------------

COMMON = [
    "parallel.tp=1",
    "model.layers=8",
    "optim.decay=constant",
    "optim.grad_clip=0",
    "train.micro_batch_size=2",
    "train.eval_interval=10",
    "train.eval_steps=2",
    "checkpoint.save_at_end=true",
]
PP2 = {  # name -> overrides, at world 2
    "pp2-afab": ["parallel.pp=2", "parallel.pp_schedule=afab"],
    "pp2-1f1b": ["parallel.pp=2", "parallel.pp_schedule=1f1b"],
    "pp2-zb_h1": ["parallel.pp=2", "parallel.pp_schedule=zb_h1"],
    "pp2-interleaved": ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.virtual_stages=2"],
    "pp2-untied": ["parallel.pp=2", "model.tie_embeddings=false"],
    "pp2-uneven": ["parallel.pp=2", "parallel.layers_per_stage=[3,5]"],
    "pp2-recompute-zb_h1": ["parallel.pp=2", "parallel.pp_schedule=zb_h1", "parallel.activation_checkpointing=true"],
}
PP4 = {  # at world 4
    "pp4-afab": ["parallel.pp=4", "parallel.pp_schedule=afab"],
    "pp4-1f1b": ["parallel.pp=4", "parallel.pp_schedule=1f1b"],
    "pp4-zb_h1": ["parallel.pp=4", "parallel.pp_schedule=zb_h1"],
    "pp4-interleaved": ["parallel.pp=4", "parallel.pp_schedule=interleaved_1f1b", "parallel.virtual_stages=2"],
    "pp2-dp2": ["parallel.pp=2", "train.micro_batch_size=1"],
    "pp2-dp2-zero1-zb_h1": [
        "parallel.pp=2",
        "train.micro_batch_size=1",
        "parallel.dp_strategy=zero1",
        "parallel.pp_schedule=zb_h1",
    ],
    "pp2-dp2-fsdp-interleaved": [
        "parallel.pp=2",
        "train.micro_batch_size=1",
        "parallel.dp_strategy=fsdp",
        "parallel.pp_schedule=interleaved_1f1b",
        "parallel.virtual_stages=2",
    ],
    # 15 steps, a checkpoint at step 10 that the resharding runs resume from
    "tp2-pp2-sp": [
        "parallel.tp=2",
        "parallel.pp=2",
        "parallel.sequence_parallel=true",
        "train.steps=15",
        "checkpoint.interval=10",
        "checkpoint.save_at_end=false",
    ],
}
REFERENCE = {
    "pp1": ["train.steps=15", "checkpoint.interval=10", "checkpoint.save_at_end=false"],
    "pp1-untied": ["model.tie_embeddings=false"],
}
PP2["tp2-pp1-sp"] = ["parallel.tp=2", "parallel.sequence_parallel=true"]  # TP=2xPP=2's weights are held to this
REFERENCE_OF = {"pp2-untied": "pp1-untied", "tp2-pp2-sp": "tp2-pp1-sp"}


def _histories(runs: list[tuple[str, list[str]]]) -> dict[str, list[dict]]:
    return {name: train_in_process(overrides) for name, overrides in runs}


def _world(world: int, runs: dict[str, list[str]], root, extra=()) -> dict[str, list[dict]]:
    todo = [(name, [*COMMON, *overrides, *extra, f"train.run_dir={root / name}"]) for name, overrides in runs.items()]
    per_rank = run_distributed(_histories, world, todo, timeout=300)
    for name in runs:  # the loss reaches every rank, not only the last stage
        assert all([r["loss"] for r in h[name]] == [r["loss"] for r in per_rank[0][name]] for h in per_rank), name
    return per_rank[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    t0 = time.monotonic()
    ckpt = root / "tp2-pp2-sp" / "checkpoints" / "step_00000010"  # written by the world-4 run before it is read
    resume = [f"checkpoint.load={ckpt}", "train.steps=15", "checkpoint.save_at_end=false"]
    out = _world(4, {**PP4, "resume-pp4": ["parallel.pp=4", *resume]}, root)
    from tpframe.checkpoint.export import export_consolidated

    export_consolidated(root / "pp4-1f1b" / "checkpoints" / "step_00000010", root / "pp4.safetensors")
    init = [f"checkpoint.init_from={root / 'pp4.safetensors'}", "train.steps=2", "checkpoint.save_at_end=false"]
    out.update(_world(1, {**REFERENCE, "resume-pp1": resume, "init-pp1": init}, root))
    out.update(_world(2, {**PP2, "init-pp2": ["parallel.pp=2", *init]}, root))
    print(f"pipeline training runs: {time.monotonic() - t0:.1f}s")
    return root, out


def _losses(history):
    return [r["loss"] for r in history]


def _assert_close(got, want, what, rtol=1e-5):
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= rtol * abs(b), f"{what}: step {i + 1}: {a!r} vs {b!r}"


def _weights(root, name, step=10):
    from tpframe.checkpoint.export import read_model_tensors

    return read_model_tensors(root / name / "checkpoints" / f"step_{step:08d}")


def _assert_equal_to_pp1(root, out, name):
    """Losses, global grad norms and the step-10 eval loss within 1e-5 of PP=1; final weights within 1e-5
    of PP=1 at the same TP (TP=2 reorders reductions: its weights sit ~7e-6 from TP=1's after 10 steps)."""
    ref = "pp1-untied" if name == "pp2-untied" else "pp1"
    mine, theirs = out[name][:10], out[ref][:10]
    _assert_close(_losses(mine), _losses(theirs), f"{name} vs {ref} losses")
    _assert_close([r["grad_norm"] for r in mine], [r["grad_norm"] for r in theirs], f"{name} vs {ref} grad norms")
    _assert_close([mine[-1]["eval_loss"]], [theirs[-1]["eval_loss"]], f"{name} vs {ref} eval loss at step 10")
    ref = REFERENCE_OF.get(name, "pp1")
    got, want = _weights(root, name), _weights(root, ref)
    assert got.keys() == want.keys(), (name, sorted(set(got) ^ set(want)))
    for key, w in want.items():
        if key.endswith("attn.qkv.k.bias"):
            continue  # zero gradient in exact arithmetic: Adam amplifies rounding noise there (test_checkpoint.py)
        err = ((got[key] - w).norm() / w.norm().clamp_min(1e-12)).item()
        assert err < 1e-5, f"{name}: {key} differs from {ref} by {err:.2e} after 10 steps"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp2-afab", "pp2-1f1b", "pp2-zb_h1", "pp2-interleaved"])
def test_pp2_schedule_equals_pp1(runs, name):
    _assert_equal_to_pp1(*runs, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp4-afab", "pp4-1f1b", "pp4-zb_h1", "pp4-interleaved"])
def test_pp4_schedule_equals_pp1(runs, name):
    _assert_equal_to_pp1(*runs, name)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "tp2-pp2-sp",
        "pp2-dp2",
        "pp2-dp2-zero1-zb_h1",
        "pp2-dp2-fsdp-interleaved",
        "pp2-recompute-zb_h1",
        "pp2-untied",
        "pp2-uneven",
    ],
)
def test_pp2_composed_with_tp_sp_dp_recompute_untied_head_and_uneven_stages_equals_pp1(runs, name):
    _assert_equal_to_pp1(*runs, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resume-pp1", "resume-pp4"])
def test_tp2_pp2_checkpoint_resumes_at_another_pipeline_layout(runs, name):
    root, out = runs
    assert [r["step"] for r in out[name]] == [11, 12, 13, 14, 15]
    _assert_close(_losses(out[name]), _losses(out["tp2-pp2-sp"])[10:], f"{name} vs the uninterrupted TP=2xPP=2 run")


@pytest.mark.slow
def test_weights_exported_from_pp4_start_a_pp2_run_like_a_pp1_run(runs):
    _, out = runs
    _assert_close(_losses(out["init-pp2"]), _losses(out["init-pp1"]), "init_from at PP=2 vs PP=1")
    assert out["init-pp1"][0]["loss"] < out["pp1"][0]["loss"] - 1.0  # trained weights, not a fresh model


@pytest.mark.slow
def test_export_reads_a_pp4_checkpoint_like_a_pp1_one(runs, tmp_path):
    from tpframe.checkpoint.export import export_consolidated

    root, _ = runs
    pp4 = export_consolidated(root / "pp4-1f1b" / "checkpoints" / "step_00000010", tmp_path / "pp4.safetensors")
    pp1 = export_consolidated(root / "pp1" / "checkpoints" / "step_00000010", tmp_path / "pp1.safetensors")
    assert pp4.keys() == pp1.keys() and "head.weight" not in pp4 and pp4["embedding.weight"].shape[0] == 256
    assert {k for k in pp4 if k.startswith("blocks.")} == {k for k in pp1 if k.startswith("blocks.")}


@pytest.mark.gpu(count=2)
def test_every_schedule_on_nccl_trains_like_pp1(tmp_path):
    """The same runs over NCCL on 2 GPUs (fp32; GPU kernels need not be bit-reproducible: 1e-4)."""
    gpu = ["parallel.tp=1", "model.layers=8", "optim.decay=constant", "train.micro_batch_size=2", "train.steps=6"]
    runs = {
        s: ["parallel.pp=2", f"parallel.pp_schedule={s}", f"parallel.virtual_stages={2 if 'inter' in s else 1}"]
        for s in SCHEDULES
    }
    todo = [(s, [*gpu, *o, f"train.run_dir={tmp_path / s}"]) for s, o in runs.items()]
    out = run_distributed(_histories, 2, todo, backend="nccl", timeout=600)[0]
    ref = run_distributed(_histories, 1, [("pp1", [*gpu, f"train.run_dir={tmp_path / 'pp1'}"])], backend="nccl")[0]
    for s in runs:
        _assert_close(_losses(out[s]), _losses(ref["pp1"]), f"{s} on nccl vs pp1", rtol=1e-4)


# -- a stage that never receives ----------------------------------------------------------------


def _stage_waits_for_a_lost_message(timeout_s):
    from tpframe.models import BuildContext, build_stages
    from tpframe.models.config import ModelConfig
    from tpframe.parallel import initialize_parallel, seed_parallel_rng
    from tpframe.parallel.pipeline import PipelineTimeout, build_pipeline

    state = initialize_parallel(pp=2)
    cfg = ModelConfig(layers=2, hidden=32, heads=4, max_seq_len=16)
    ctx = BuildContext(state.tp_comm, rng_tracker=seed_parallel_rng(0), device=state.device)
    model = build_stages(cfg, ctx, pp_rank=state.pp_rank, pp=2)
    pipeline = build_pipeline(
        state,
        schedule="1f1b",
        seq_len=16,
        micro_batch_size=2,
        hidden=32,
        sequence_parallel=False,
        dtype=torch.float32,
        timeout_s=timeout_s,
    )
    send = pipeline.links.send
    sent = []

    def lossy_send(kind, tensor):  # stage 0 sends micro-batch 0's activations, then none: as if it hung
        sent.append(kind)
        if kind != "act" or sent.count("act") == 1:
            send(kind, tensor)

    pipeline.links.send = lossy_send

    class Batches:
        def next(self):
            ids = torch.randint(0, 256, (2, 17))
            return ids[:, :-1], ids[:, 1:]

    class NoSync:
        def start_grad_sync(self):
            pass

    start = time.monotonic()
    try:
        pipeline.forward_backward(model, Batches(), 4, grad_sync=NoSync(), device=state.device)
    except PipelineTimeout as e:
        return str(e), time.monotonic() - start
    return None, time.monotonic() - start


def test_a_stage_that_never_receives_stops_with_a_message_naming_stage_micro_batch_and_peer():
    (msg0, t0), (msg1, t1) = run_distributed(_stage_waits_for_a_lost_message, 2, 1.0, timeout=60)
    assert msg1 is not None and "pipeline stage 1 (rank 1)" in msg1, msg1
    assert "activations of micro-batch 1 from stage 0 (rank 0)" in msg1, msg1
    assert msg0 is not None and "pipeline stage 0 (rank 0)" in msg0, msg0
    assert "output gradient of micro-batch 1 from stage 1 (rank 1)" in msg0, msg0
    assert t1 < 10 and t0 < 10


# -- bad configurations: one line, exit code 2 ---------------------------------------------------

BAD_PIPELINE_CONFIGS = [
    (["parallel.pp=2"], "3", "world size 3 is not divisible by parallel.tp*parallel.pp = 1*2"),
    (
        ["parallel.pp=2", "train.micro_batch_size=8"],
        "2",
        "parallel.pp_schedule=1f1b needs the micro-batches per step, "
        "train.global_batch_size/(train.micro_batch_size*dp) = 1, to be at least parallel.pp=2",
    ),
    (
        [
            "parallel.pp=2",
            "parallel.pp_schedule=interleaved_1f1b",
            "parallel.virtual_stages=2",
            "model.layers=4",
            "train.micro_batch_size=1",
            "train.global_batch_size=3",
        ],
        "2",
        "to be a multiple of parallel.pp=2",
    ),
    (
        ["parallel.pp=2", "model.layers=3"],
        "2",
        "model.layers=3 is not divisible by parallel.pp*parallel.virtual_stages = 2*1 = 2",
    ),
    (
        ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.virtual_stages=2", "model.layers=6"],
        "2",
        "model.layers=6 is not divisible by parallel.pp*parallel.virtual_stages = 2*2 = 4",
    ),
    (
        ["parallel.pp=2", "model.layers=4", "parallel.layers_per_stage=[1,2]"],
        "2",
        "parallel.layers_per_stage=[1, 2] must be 2 counts (parallel.pp*parallel.virtual_stages), each at least 1, "
        "adding up to model.layers=4 (they add up to 3)",
    ),
    # the count that breaks the rule is named, not the sum (which is right here)
    (["parallel.pp=2", "model.layers=4", "parallel.layers_per_stage=[0,4]"], "2", "(a stage of 0 layers)"),
    (["parallel.pp=2", "model.layers=4", "parallel.layers_per_stage=[1,1,2]"], "2", "(it has 3)"),
    (["parallel.pp=2", "parallel.layers_per_stage=three"], "2", "parallel.layers_per_stage='three' must be a list"),
    (
        ["parallel.pp=2", "parallel.virtual_stages=2"],
        "2",
        "parallel.virtual_stages=2 needs parallel.pp_schedule=interleaved_1f1b",
    ),
    (["parallel.pp=2", "model.name=examples.parallel_llama:build"], "2", "does not build pipeline stages"),
]


@pytest.mark.parametrize("overrides,world,message", BAD_PIPELINE_CONFIGS)
def test_bad_pipeline_config_exits_2_with_one_clear_line(overrides, world, message, monkeypatch, capsys):
    import train

    for key, value in torchrun_env(int(world)).items():
        monkeypatch.setenv(key, value)
    code = train.main(
        with_overrides(
            [
                "--config",
                os.path.join(REPO, "configs", "tiny_cpu.yaml"),
                "parallel.tp=1",
                "model.layers=2",
                "train.global_batch_size=8",
                "train.micro_batch_size=2",
            ],
            overrides,
        )
    )
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and message in lines[0], lines


@pytest.mark.slow
def test_pipeline_benchmark_runs_full_trainer_steps_on_cpu():
    """The benchmark drives the real Trainer (step guard included): a CPU dry run keeps it in step with it."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [
            sys.executable,
            "benchmarks/pipeline.py",
            "hidden=32",
            "layers=2",
            "heads=2",
            "seq=16",
            "vocab=128",
            "dtype=float32",
            "gbs=4",
            "steps=2",
            "warmup=1",
            "append=0",
            "layouts=pp-1f1b,tp-sp",
            "row_timeout=120",
            "fwdbwd=1",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    rows = [line for line in out.stdout.splitlines() if line.startswith("| tp=")]
    # two layout rows, then the non-pipelined one's train step against its bare forward+backward
    assert out.returncode == 0 and len(rows) == 3, out.stdout[-2000:] + out.stderr[-2000:]
    assert "failed" not in out.stdout
    cells = [c.strip() for c in rows[2].split("|")[1:-1]]
    fwd_bwd, step = float(cells[1]), float(cells[2])
    assert fwd_bwd > 0 and step > 0 and "fwd_bwd" in cells[5] and "optim" in cells[5], rows[2]
