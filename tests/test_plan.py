"""python -m tpframe.plan: the layouts that fit, ranked by the cost model, the others named with the reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.training_utils import REPO
from tpframe.plan import Layout, _divisors, layout_config, layouts, main, measure, plan, run_overrides, step_ms
from tpframe.training.config import load_config

GPT13 = f"{REPO}/configs/gpt_1.3b.yaml"
GPT125 = f"{REPO}/configs/gpt_125m.yaml"


def test_gpt_1_3b_on_four_h200s_ranks_data_parallel_over_tensor_parallel():
    """At 1.3B, 4 GPUs of 141 GiB: the model and its optimizer fit on one GPU, so DP=4 with sharded optimizer state
    comes first (measured: TP=2 x DP=2 ran 1.28x faster than TP=4, and DP=2 at 1.04-1.07x of DP=1: RESULTS.md)."""
    cfg = load_config(GPT13)
    fits, refused = plan(cfg, 4, gpu_gib=141)
    assert fits[0].layout == Layout(tp=1, pp=1, dp=4, cp=1, strategy="zero1", recompute="none", micro_batch=16)
    order = [p.step_ms for p in fits]
    assert order == sorted(order)
    by_tp = {tp: min(p.step_ms for p in fits if p.layout.tp == tp and p.layout.pp == 1) for tp in (1, 2, 4)}
    assert by_tp[1] < by_tp[2] < by_tp[4]  # the ranking measured on 4x H200
    assert all("micro-batches per step" in why for _, why in refused)  # pipelines need more micro-batches


def test_a_small_gpu_refuses_layouts_by_memory_and_ranks_what_still_fits():
    cfg = load_config(GPT13)
    fits, refused = plan(cfg, 4, gpu_gib=16)
    assert fits and all(p.memory_gib <= 16 for p in fits)
    assert any(why.startswith("needs ") and "more than 16" in why for _, why in refused)
    assert fits[0].layout.recompute != "none" or fits[0].layout.micro_batch < 8  # memory is what it trades


def test_a_layout_the_config_refuses_is_named_with_the_configs_own_line():
    cfg = load_config(GPT13, ["model.heads=12", "model.hidden=1536"])
    _, refused = plan(cfg, 8, gpu_gib=141)
    tp8 = [why for layout, why in refused if layout.tp == 8]
    assert tp8 and all("parallel.tp=8 does not divide model.heads=12" in why for why in tp8)


def test_a_data_parallel_size_that_cannot_divide_the_global_batch_is_named_too():
    """3 GPUs and a global batch of 16: DP=3 has no micro-batch at all, and is named with the config's own line
    instead of missing from the table."""
    cfg = load_config(f"{REPO}/configs/tiny_cpu.yaml")
    fits, refused = plan(cfg, 3, gpu_gib=141)
    dp3 = [why for layout, why in refused if layout.dp == 3]
    assert not fits and len(dp3) == 1
    assert dp3[0].startswith("train.global_batch_size=16 is not divisible by train.micro_batch_size*dp = 1*3 = 3")


def test_layouts_multiply_to_the_gpus_and_divide_the_global_batch():
    cfg = load_config(GPT13)
    for layout in layouts(cfg, 8):
        assert layout.tp * layout.pp * layout.dp * layout.cp == 8
        assert cfg.train.global_batch_size % (layout.micro_batch * layout.dp) == 0


def test_the_cost_model_charges_tensor_parallel_traffic_and_the_pipeline_bubble():
    cfg = load_config(GPT13)
    base = Layout(1, 1, 4, 1, "ddp", "none", 8)
    params = 1.3e9
    tp4 = step_ms(cfg, Layout(4, 1, 1, 1, "ddp", "none", 8), params / 4)
    pp4 = step_ms(cfg, Layout(1, 4, 1, 1, "ddp", "none", 8), params / 4)
    full = step_ms(cfg, Layout(1, 1, 4, 1, "ddp", "full", 8), params)
    assert step_ms(cfg, base, params) < min(tp4, pp4, full)


def test_bad_arguments_are_one_line_and_exit_2(capsys):
    assert main(["--config", GPT13, "--gpus", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--gpus" in err[0]
    assert main(["--config", GPT13, "--gpus", "4", "model.hiden=4"]) == 2
    assert "did you mean 'model.hidden'" in capsys.readouterr().err


@pytest.mark.slow
def test_measure_times_the_first_layouts_with_train_py():
    """On CPU (gloo) the measured column is train.py's own step time on the layout the planner ranked first."""
    out = subprocess.run(
        [sys.executable, "-m", "tpframe.plan", "--config", f"{REPO}/configs/tiny_cpu.yaml", "--gpus", "1"]
        + ["--top", "2", "--measure", "1", "--steps", "4"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.strip().startswith(("1 ", "2 "))]
    assert float(rows[0][-1]) > 0 and rows[1][-1] == "-"


LORA = ["optim.lora_rank=4", "checkpoint.init_from=base.safetensors", "parallel.tp=1"]  # sized on meta: no file read


@pytest.mark.parametrize("extra", [[], ["model.moe_experts=4", "parallel.ep=2"], LORA])
def test_each_layout_needs_the_memory_the_pre_flight_estimates_for_it(extra):
    """tiny_cpu.yaml sets parallel.tp=2: a layout at TP 1 holds the whole model, not the half that config's TP rank
    holds; a MoE rank holds 1/ep of the experts. The planner's number is the pre-flight's (train.py refuses by it)."""
    from tpframe.plan import layout_config
    from tpframe.run.memory import GIB
    from tpframe.run.preflight import dry_build, estimate_for

    cfg = load_config(f"{REPO}/configs/tiny_cpu.yaml", extra)
    fits, _ = plan(cfg, 4, gpu_gib=141)
    for tp in (1, 2):
        p = next(p for p in fits if p.layout.tp == tp)
        lcfg = layout_config(cfg, p.layout)
        assert p.memory_gib == pytest.approx(estimate_for(lcfg, 4, dry_build(lcfg), device_type="cuda").total / GIB)


def test_a_model_without_pipeline_context_parallel_or_selective_recompute_gets_no_such_layout():
    """examples.parallel_llama builds no pipeline stages, takes no CP chunks and has no selective recompute: train.py
    refuses those layouts, so the planner names them with its lines instead of ranking them."""
    cfg = load_config(f"{REPO}/configs/tiny_llama_cpu.yaml")
    fits, refused = plan(cfg, 4, gpu_gib=141)
    assert fits and all(p.layout.pp == p.layout.cp == 1 and p.layout.recompute != "selective" for p in fits)
    whys = {why.split(";")[0] for _, why in refused}
    assert any("does not implement context parallelism" in why for why in whys)
    assert any("does not build pipeline stages" in why for why in whys)
    assert any("does not implement selective recompute" in why for why in whys)


def test_an_interleaved_pipeline_keeps_its_virtual_stages_and_the_overrides_run_each_layout_as_planned():
    """A config with pp_schedule=interleaved_1f1b and virtual_stages=2: its pipelines keep the two chunks per rank
    (planned at virtual_stages=1, every one was refused for a reason the planner made), and train.py's overrides of a
    layout without a pipeline reset what that layout dropped (virtual_stages, recompute_layers)."""
    extra = ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.virtual_stages=2"]
    extra += ["parallel.activation_checkpointing=full", "parallel.recompute_layers=6", "train.global_batch_size=64"]
    cfg = load_config(GPT125, extra)
    fits, refused = plan(cfg, 4, gpu_gib=141)
    assert not any("needs parallel.virtual_stages >= 2" in why for _, why in refused)
    assert any(p.layout.pp == 2 for p in fits) and any(p.layout.pp == 1 for p in fits)
    for p in fits[:3] + [next(p for p in fits if p.layout.pp == 2)]:
        keys = run_overrides(cfg, p.layout)
        ran = load_config(GPT125, [o for o in extra if o.split("=")[0] not in {k.split("=")[0] for k in keys}] + keys)
        assert ran.parallel == layout_config(cfg, p.layout).parallel
        assert ran.train == layout_config(cfg, p.layout).train


def test_context_parallel_ranks_are_gradient_replicas_too():
    """The gradients are reduced, and zero1/fsdp shard, over dp x cp (tpframe/optim): at dp 1 and cp 2 zero1 and fsdp
    still halve the optimizer state, and the step pays the same gradient sync as at dp 2."""
    cfg = load_config(GPT125)
    assert {"zero1", "fsdp"} <= {x.strategy for x in layouts(cfg, 2) if (x.dp, x.cp) == (1, 2)}

    def per_param(layout: Layout) -> float:  # the milliseconds the parameters add: gradient sync, optimizer step
        return step_ms(cfg, layout, 1e9) - step_ms(cfg, layout, 0)

    for strategy in ("ddp", "zero1"):
        cp2 = per_param(Layout(1, 1, 1, 2, strategy, "none", 8))
        assert cp2 == pytest.approx(per_param(Layout(1, 1, 2, 1, strategy, "none", 8)))


def test_a_refusal_is_printed_with_the_whole_reason(capsys):
    """The config's line for cp=3 is 'parallel.cp=3 cuts each sequence into 2*cp = 6 equal chunks; train.seq_len=1024
    is not divisible by 6': its first clause alone does not say what is wrong."""
    assert main(["--config", GPT125, "--gpus", "3"]) == 0
    cp3 = [line for line in capsys.readouterr().out.splitlines() if "parallel.cp=3" in line]
    assert len(cp3) == 1 and "train.seq_len=1024 is not divisible by 6" in cp3[0]


@pytest.mark.parametrize(
    "bad, named",
    [(["--gpu-gib", "nan"], "--gpu-gib"), (["--gpu-gib", "0"], "--gpu-gib"), (["--gpu-gib", "-8"], "--gpu-gib")]
    + [(["--gpu-gib", "inf"], "--gpu-gib"), (["--steps", "2"], "--steps"), (["--steps", "-1"], "--steps")],
)
def test_a_memory_or_step_count_that_means_nothing_is_one_line_and_exit_2(capsys, bad, named):
    """--gpu-gib nan fitted every layout (no number is more than nan), 0 or less fitted none; --measure leaves the
    first two steps out, so --steps 2 or less timed nothing."""
    assert main(["--config", f"{REPO}/configs/tiny_cpu.yaml", "--gpus", "2", *bad]) == 2
    out = capsys.readouterr()
    err = out.err.strip().splitlines()
    assert not out.out and len(err) == 1 and named in err[0]


@pytest.mark.parametrize(
    "args, said",
    [
        (["--gpus", "3"], "45 of 76 layouts because parallel.cp=3 cuts each sequence"),
        (["--gpus", "2", "model.hidden=0"], "no layout fits on 2 GPUs of 141 GiB: model.hidden=0 must be at least 1"),
        (["--gpus", "2", "--gpu-gib", "1"], "more memory than a GPU has (the least of them needs 1.5 GiB)"),
    ],
)
def test_a_config_no_layout_fits_is_one_line_and_exit_2(capsys, args, said):
    """Nothing to rank (a global batch of 16 on 3 GPUs, a config mistake every layout shares, too little memory): one
    line on stderr with the most common reason, exit code 2, instead of an empty table and exit code 0."""
    assert main(["--config", f"{REPO}/configs/tiny_cpu.yaml", *args]) == 2
    out = capsys.readouterr()
    err = out.err.strip().splitlines()
    assert not out.out and len(err) == 1 and said in err[0], err


def _fake_train(monkeypatch, step_ms=(50.0, 40.0, 10.0, 12.0, 11.0), returncode=0, stderr=""):
    """subprocess.run standing in for the launch --measure makes: the commands it was given; each run writes
    `step_ms` as train records to its train.run_dir's metrics.jsonl (none: no file)."""
    calls = []

    def run(cmd, **kwargs):
        calls.append((cmd, kwargs))
        run_dir = Path(next(k.split("=", 1)[1] for k in cmd if k.startswith("train.run_dir=")))
        if step_ms is not None:
            rows = [json.dumps({"step": i + 1, "kind": "train", "step_ms": ms}) for i, ms in enumerate(step_ms)]
            (run_dir / "metrics.jsonl").write_text("\n".join(rows) + "\n")
        return subprocess.CompletedProcess(cmd, returncode, "", stderr)

    monkeypatch.setattr("tpframe.plan.subprocess.run", run)
    return calls


def test_measure_leaves_out_the_first_two_steps_not_the_two_fastest(monkeypatch):
    """Steps 1 and 2 (compiling, warming up) took 50 and 40 ms, the rest 10-12: the median of steps 3-5 is 11 (the
    times were sorted before two were left out, which kept the warm-up and reported 40)."""
    _fake_train(monkeypatch)
    keys = Layout(1, 1, 1, 1, "ddp", "none", 16).overrides()
    assert measure(f"{REPO}/configs/tiny_cpu.yaml", [], keys, gpus=1, steps=5) == 11.0


def test_measure_gives_train_py_each_key_once(monkeypatch):
    """Overrides given to the planner that the layout or the measurement sets too (parallel.tp, train.steps) were
    passed twice, which train.py refuses: every such layout showed '-' as if never measured."""
    calls = _fake_train(monkeypatch)
    cfg = load_config(f"{REPO}/configs/tiny_cpu.yaml", ["parallel.tp=1", "train.steps=50", "optim.lr=0.01"])
    keys = run_overrides(cfg, Layout(1, 1, 2, 1, "zero1", "none", 8))
    config = f"{REPO}/configs/tiny_cpu.yaml"
    assert measure(config, ["parallel.tp=1", "train.steps=50", "optim.lr=0.01"], keys, gpus=2, steps=5) == 11.0
    given = calls[0][0][calls[0][0].index(config) + 1 :]
    assert len({k.split("=")[0] for k in given}) == len(given) and "optim.lr=0.01" in given
    ran = load_config(config, given)
    assert (ran.parallel.tp, ran.train.steps, ran.train.micro_batch_size, ran.optim.lr) == (1, 5, 8, 0.01)


def test_measure_runs_train_py_where_the_planner_runs(monkeypatch, tmp_path):
    """A relative --config (and data paths) name files from the directory the planner runs in: train.py ran in the
    repository's, where they are not."""
    calls = _fake_train(monkeypatch)
    (tmp_path / "my.yaml").write_text(Path(f"{REPO}/configs/tiny_cpu.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    measure("my.yaml", [], Layout(1, 1, 1, 1, "ddp", "none", 16).overrides(), gpus=1, steps=5)
    cmd, kwargs = calls[0]
    where = Path(kwargs.get("cwd") or Path.cwd())
    assert (where / cmd[cmd.index("--config") + 1]).is_file()
    assert (where / cmd[cmd.index("--config") - 1]).resolve() == Path(f"{REPO}/train.py").resolve()


def test_measure_is_a_fresh_run_that_logs_its_steps_and_touches_no_checkpoint(monkeypatch):
    """A config's logging.jsonl=false left no metrics.jsonl (a traceback ended the table); its checkpoint.dir or
    checkpoint.load made the measurement resume from that run's checkpoints, and checkpoint.interval save among them."""
    calls = _fake_train(monkeypatch, step_ms=None)
    config = f"{REPO}/configs/tiny_cpu.yaml"
    user = ["logging.jsonl=false", "checkpoint.dir=/data/ckpt", "checkpoint.load=/data/ckpt/step_100"]
    user += ["checkpoint.snapshot_interval=10"]  # host-memory snapshots: train.py refuses them without --max-restarts
    assert "no step" in measure(config, user, Layout(1, 1, 1, 1, "ddp", "none", 16).overrides(), gpus=1, steps=5)
    ran = load_config(config, calls[0][0][calls[0][0].index(config) + 1 :])
    assert ran.logging.jsonl and (ran.checkpoint.dir, ran.checkpoint.load, ran.checkpoint.interval) == (None, None, 0)
    assert ran.checkpoint.snapshot_interval == 0


def test_a_layout_that_fails_to_run_is_marked_failed_with_train_pys_reason(monkeypatch, capsys):
    """A measured layout whose train.py exits non-zero showed '-', as the ones never measured; now 'failed', its
    last error line on stderr, and the table goes on."""
    _fake_train(monkeypatch, step_ms=None, returncode=2, stderr="launching\ntpframe: config error: no such data\n")
    assert main(["--config", f"{REPO}/configs/tiny_cpu.yaml", "--gpus", "1", "--top", "2", "--measure", "1"]) == 0
    out = capsys.readouterr()
    rows = [line.split() for line in out.out.splitlines() if line.strip().startswith(("1 ", "2 "))]
    assert [row[-1] for row in rows] == ["failed", "-"]
    assert out.err.count("\n") == 1 and "#1" in out.err and "tpframe: config error: no such data" in out.err


def test_measure_on_fewer_gpus_than_the_plan_is_one_line_and_exit_2(monkeypatch, capsys):
    """--gpus 8 --measure 2 on a machine with 2 GPUs: every launch failed (train.py refuses more ranks than GPUs) after
    the planner had run; now refused at once. (Without CUDA, --measure runs its ranks on the CPU: gloo.)"""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    calls = _fake_train(monkeypatch)
    assert main(["--config", f"{REPO}/configs/tiny_cpu.yaml", "--gpus", "8", "--measure", "2"]) == 2
    out = capsys.readouterr()
    err = out.err.strip().splitlines()
    assert not calls and not out.out and len(err) == 1 and "--measure" in err[0] and "2 GPUs" in err[0]


def test_divisors_of_a_huge_gpu_count_come_at_once():
    """--gpus 1000000000 once walked a billion candidates before its one line; divisors come from up to sqrt(n)."""
    assert _divisors(12) == [1, 2, 3, 4, 6, 12]
    assert _divisors(1) == [1] and _divisors(49) == [1, 7, 49]
    assert len(_divisors(10**9)) == 100 and _divisors(10**9)[-1] == 10**9


def test_a_reader_that_stops_early_gets_no_traceback():
    """`python -m tpframe.plan ... | head -1`: the table is larger than the pipe's buffer, so the planner writes into a
    closed pipe; it stops quietly, exit 0, as Unix tools do."""
    cmd = [sys.executable, "-m", "tpframe.plan", "--config", "configs/tiny_cpu.yaml", "--gpus", "64", "--top", "100000"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert " layouts fit on 64 GPUs" in proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0 and "Traceback" not in err and "Broken" not in err, err
