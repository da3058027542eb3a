"""The performance paths on CPU (gloo), each against the plain path it replaces.

- torch.compile over TP code: the Communicator's collectives are custom ops, so a block traces whole. At TP=2 with
  the aot_eager backend (AOTAutograd traces forward and backward through the ops' fake implementations; no C++
  toolchain needed): fullgraph=True (any graph break is an error), one frame per block, the collectives visible in
  the graph, loss and gradients equal to eager; train.compile=true trains like eager.
- The fused head + cross entropy equals the head GEMM + vocab_parallel_cross_entropy (TP 1/2, SP on/off).
- Async TP's keys; train.compile at TP=2 + SP trains like eager (tests/test_async_tp.py has async TP's CPU tests).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.reference import assert_close
from tpframe.models.config import ModelConfig

GPT_CFG = ModelConfig(vocab_size=101, hidden=32, layers=2, heads=4, max_seq_len=16, vocab_multiple=8, position="rotary")
LLAMA_CFG = dataclasses.replace(
    GPT_CFG, hidden=64, heads=8, kv_heads=4, norm="rmsnorm", activation="swiglu", bias=False, tie_embeddings=False
)
B, S = 2, 8


def _graph_code(gm: torch.fx.GraphModule) -> str:
    return "\n".join(m.code for m in gm.modules() if isinstance(m, torch.fx.GraphModule))


def _compiled_model_matches_eager(cases):
    from torch._dynamo.backends.registry import lookup_backend

    from tpframe.models import BuildContext, build_model
    from tpframe.models.compile import compile_model
    from tpframe.parallel import initialize_parallel, seed_parallel_rng

    state = initialize_parallel(tp=torch.distributed.get_world_size())
    report = []
    for cfg, sp in cases:
        torch._dynamo.reset()
        graphs = []

        def counting_aot_eager(gm, example_inputs):
            graphs.append(gm)
            return lookup_backend("aot_eager")(gm, example_inputs)

        models = []
        for _ in range(2):
            tracker = seed_parallel_rng(0)
            ctx = BuildContext(state.tp_comm, sequence_parallel=sp, rng_tracker=tracker, seed=5)
            models.append(build_model(cfg, ctx))
        eager, compiled = models
        assert compile_model(compiled, backend=counting_aot_eager, fullgraph=True) == cfg.layers
        g = torch.Generator().manual_seed(7)
        ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
        labels = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
        losses = []
        for model in (eager, compiled):
            loss = model(ids, labels)
            loss.mean().backward()
            losses.append(loss)
        case = f"{cfg.norm}/{cfg.activation} tp={state.tp} sp={sp}"
        assert_close(losses[1], losses[0], 1e-5, f"{case}: compiled loss")
        for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
            assert_close(q.grad, p.grad, 1e-5, f"{case}: grad of {name}", atol=1e-7)
        # identical blocks share one graph; fullgraph=True already turned any break into an error
        assert len(graphs) == 1, f"{case}: {len(graphs)} graphs compiled, expected 1"
        code = _graph_code(graphs[0])
        wanted = ("tpframe.all_gather", "tpframe.reduce_scatter") if sp else ("tpframe.all_reduce",)
        missing = [op for op in wanted if op not in code]
        assert not missing, f"{case}: {missing} not traced into the graph"
        explained = torch._dynamo.explain(eager.blocks["0"])(eager.embed(ids), eager.rotary(S, torch.float32))
        report.append((case, explained.graph_break_count))
    assert all(n == 0 for _, n in report), f"graph breaks: {report}"
    return report


def test_compiled_blocks_match_eager_with_no_graph_breaks_at_tp2():
    run_distributed(_compiled_model_matches_eager, 2, [(GPT_CFG, False), (LLAMA_CFG, True)], timeout=300)


def _head_loss_matches_unfused(sp: bool, chunk: int):
    from tests.reference import scatter_to_sp
    from tpframe.layers import ParallelLMHead, vocab_parallel_cross_entropy
    from tpframe.layers.cross_entropy import vocab_parallel_head_cross_entropy
    from tpframe.parallel import initialize_parallel

    state = initialize_parallel(tp=torch.distributed.get_world_size())
    comm, tp = state.tp_comm, state.tp
    vocab, hidden, s, b = 45, 16, 6, 3  # padded to 48 at multiple 8: the last rank holds padding columns
    torch.manual_seed(0)
    head = ParallelLMHead(hidden, vocab, pad_to_multiple_of=8, sequence_parallel=sp, comm=comm)
    g = torch.Generator().manual_seed(1)
    x_full = torch.randn(s * tp, b, hidden, generator=g)
    target = torch.randint(0, vocab, (s * tp, b), generator=g)
    target[0, 0] = target[3, 2] = -100  # ignored tokens
    grad_out = torch.rand(s * tp, b, generator=g)
    results = {}
    for smoothing in (0.0, 0.1):
        for fused in (False, True):
            x = (scatter_to_sp(x_full, comm) if sp else x_full).clone().requires_grad_()
            head.weight.grad = None
            if fused:
                loss = vocab_parallel_head_cross_entropy(
                    x,
                    head.weight,
                    target,
                    comm=comm,
                    sequence_parallel=sp,
                    vocab_size=vocab,
                    label_smoothing=smoothing,
                    chunk=chunk,
                )
            else:
                loss = vocab_parallel_cross_entropy(
                    head(x), target, comm=comm, vocab_size=vocab, label_smoothing=smoothing
                )
            (loss * grad_out).sum().backward()
            results[fused] = (loss.detach(), x.grad, head.weight.grad.clone())
        case = f"tp={tp} sp={sp} smoothing={smoothing} chunk={chunk}"
        for what, got, want in zip(("loss", "grad x", "grad W"), results[True], results[False]):
            assert_close(got, want, 1e-5, f"{case}: {what}", atol=1e-7)
        assert torch.all(results[True][0][0, 0] == 0)
    return True


def test_head_cross_entropy_equals_unfused_path_at_tp1():
    run_distributed(_head_loss_matches_unfused, 1, False, 4)


def test_head_cross_entropy_equals_unfused_path_at_tp2_with_and_without_sp():
    run_distributed(_head_loss_matches_unfused, 2, False, 5)
    run_distributed(_head_loss_matches_unfused, 2, True, 7)


def test_compile_and_async_tp_keys_parse_and_async_tp_needs_sequence_parallel():
    import pytest

    from tpframe.training.config import ConfigError, load_config, validate

    cfg = load_config(
        None, ["train.compile=true", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.async_tp=true"]
    )
    validate(cfg, 2)
    assert cfg.train.compile is True and cfg.parallel.async_tp is True
    with pytest.raises(ConfigError, match="parallel.async_tp .* set parallel.sequence_parallel=true"):
        validate(load_config(None, ["parallel.tp=2", "parallel.async_tp=true"]), 2)


def _train_compiled_and_eager(tmp, common, compiled_extra, fullgraph):
    import torch._dynamo

    from tests.training_utils import train_in_process
    from tpframe.models import compile as compile_module

    inductor, compiled_blocks = compile_module.compile_model, []
    # aot_eager: AOTAutograd traces forward and backward through the collectives' fake implementations without
    # needing a C++ toolchain; train.py's wiring is what is under test here
    compile_module.compile_model = lambda model, **kw: compiled_blocks.append(
        inductor(model, backend="aot_eager", fullgraph=fullgraph)
    )
    torch._dynamo.reset()
    losses = {}
    for name, extra in (("eager", []), ("compiled", ["train.compile=true", *compiled_extra])):
        losses[name] = [r["loss"] for r in train_in_process([*common, *extra, f"train.run_dir={tmp}/{name}"])]
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    return losses, compiled_blocks, breaks


def _assert_compiled_trains_like_eager(losses, compiled_blocks):
    assert compiled_blocks == [2], f"train.compile=true must compile the 2 blocks once, got {compiled_blocks}"
    eager, compiled = losses["eager"], losses["compiled"]
    assert len(eager) == len(compiled) == 3
    for step, (a, b) in enumerate(zip(compiled, eager), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: compiled loss {a!r} vs eager {b!r}"


def test_train_compile_trains_like_eager_at_tp2_with_sp(tmp_path):
    common = ["parallel.tp=2", "parallel.sequence_parallel=true", "train.steps=3"]
    losses, compiled_blocks, _ = run_distributed(
        _train_compiled_and_eager, 2, str(tmp_path), common, [], True, timeout=300
    )[0]
    _assert_compiled_trains_like_eager(losses, compiled_blocks)


@pytest.mark.slow
def test_train_compile_with_context_parallelism_trains_like_eager(tmp_path):
    """CP attention runs eager between the compiled parts of each block (one graph break each)."""
    common = ["parallel.tp=1", "parallel.cp=2", "model.position=rotary", "train.steps=3"]
    losses, compiled_blocks, breaks = run_distributed(
        _train_compiled_and_eager, 2, str(tmp_path), common, [], False, timeout=300
    )[0]
    _assert_compiled_trains_like_eager(losses, compiled_blocks)
    assert breaks >= 1, "CP attention must run as a graph break (torch.compiler.disable)"


def test_rotary_custom_op_has_fake_shapes_for_tracing():
    """torch.compile traces the fused rotary as tpframe::qkv_rotary (and its backward op) through these fakes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import tpframe.kernels.rotary  # noqa: F401  (registers the ops)

    s, b, nq, nkv, d = 7, 3, 4, 2, 8
    with FakeTensorMode():
        qkv = torch.empty(s, b, (nq + 2 * nkv) * d, dtype=torch.bfloat16)
        cos = sin = torch.empty(s, 1, 1, d, dtype=torch.bfloat16)
        q, k, v = torch.ops.tpframe.qkv_rotary(qkv, cos, sin, nq, nkv, d)  # [s, b, n, d], permuted by the caller
        g = torch.ops.tpframe.qkv_rotary_backward(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), cos, sin, nq, nkv, d)
        tm = torch.ops.tpframe.qkv_rotary(qkv, cos, sin, nq, nkv, d, True)  # token-major: [b, n, s, d] views
    assert [tuple(t.shape) for t in (q, k, v)] == [(s, b, nq, d), (s, b, nkv, d), (s, b, nkv, d)]
    assert all(t.is_contiguous() for t in (q, k, v))
    assert [tuple(t.shape) for t in tm] == [(b, nq, s, d), (b, nkv, s, d), (b, nkv, s, d)]
    assert tuple(g.shape) == (s, b, (nq + 2 * nkv) * d) and g.dtype == torch.bfloat16


def test_gpu_busy_is_the_union_of_kernel_intervals(tmp_path):
    """The profiler's idle-time measure (what a CUDA graph of the step could save at most), also benchmarks/gpt.py's."""
    import json

    from tpframe.observe.profiler import gpu_busy

    trace = tmp_path / "t.json"
    trace.write_text(
        json.dumps(
            {
                "traceEvents": [
                    {"ph": "X", "cat": "kernel", "ts": 0, "dur": 10},
                    {"ph": "X", "cat": "kernel", "ts": 5, "dur": 10},
                    {"ph": "X", "cat": "gpu_memcpy", "ts": 20, "dur": 5},
                    {"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 100},
                ]
            }
        )
    )
    span, busy = gpu_busy(str(trace))
    assert (span, busy) == (0.025, 0.020)  # 0-15 and 20-25 us busy; host ops ignored


def test_gpu_timeline_counts_the_collective_time_no_computation_hid(tmp_path):
    """How much of the collectives' GPU time ran with no compute kernel beside it (data_parallel.py's PROFILE and the
    training profiler's summary): NCCL kernels, symm kernels and peer copies are communication, the rest compute."""
    import json

    from tpframe.observe.profiler import gpu_busy, gpu_timeline

    def k(name, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    trace = tmp_path / "t.json"
    trace.write_text(
        json.dumps(
            {
                "traceEvents": [
                    k("sm90_xmma_gemm_bf16", 0, 100),
                    k("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 50, 100),  # 50 us hidden
                    k("vectorized_elementwise_kernel", 120, 10),
                    k("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 140, 20),
                    k("two_shot_all_reduce_kernel", 300, 40),
                    k("Memcpy PtoP (Device -> Device)", 330, 20, "gpu_memcpy"),
                    k("layer_norm_fwd", 345, 100),
                    {"ph": "X", "cat": "cpu_op", "name": "nccl:all_reduce", "ts": 0, "dur": 900},
                ]
            }
        )
    )
    comm, exposed = gpu_timeline(str(trace))[2:]
    # collectives: 50-160 and 300-350 = 160 us; compute beside them: 50-100, 120-130, 345-350 = 65 us
    assert (round(comm * 1e3, 6), round(exposed * 1e3, 6)) == (160.0, 95.0)
    assert gpu_busy(str(trace)) == (0.445, 0.305)  # 0-160 and 300-445 busy
    trace.write_text(json.dumps({"traceEvents": [k("gemm", 0, 10)]}))
    assert gpu_timeline(str(trace))[2:] == (0.0, 0.0)


@pytest.mark.slow
def test_llama_peer_counts_tpframes_flops_and_its_tp2_plan_equals_tp1():
    """benchmarks/peer_llama.py, the torch-native row of the Llama shape in `benchmarks/gpt.py --compare`: its FLOP
    count per token is tpframe's for the same architecture (so the TFLOP/s columns compare), and its DTensor TP=2 +
    SP plan computes the loss of the plain TP=1 model (so the plan is a correct peer, not a faster wrong one)."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    from tpframe.models.config import ModelConfig
    from tpframe.models.gpt import GPT

    root = Path(__file__).resolve().parent.parent
    dims = dict(LAYERS="2", HIDDEN="64", HEADS="8", KV_HEADS="2", SEQ="16", MB="2", STEPS="1")
    results = {}
    for nproc, sp in ((1, "0"), (2, "1")):
        env = dict(os.environ, **dims, SP=sp, OMP_NUM_THREADS="1")
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                str(nproc),
                "--master-port",
                str(29700 + nproc),
                str(root / "benchmarks" / "peer_llama.py"),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
        assert proc.returncode == 0 and line, proc.stdout[-2000:] + proc.stderr[-2000:]
        results[nproc] = re.search(r"flops/token=(\d+):.*loss ([\d.]+)", line[0]).groups()
    cfg = ModelConfig(
        vocab_size=50304,
        hidden=64,
        layers=2,
        heads=8,
        kv_heads=2,
        max_seq_len=16,
        position="rotary",
        vocab_multiple=128,
        norm="rmsnorm",
        activation="swiglu",
        bias=False,
    )
    assert int(results[1][0]) == GPT.flops_per_token(
        SimpleNamespace(cfg=cfg, comm=SimpleNamespace(size=1), named_parameters=dict), 16
    )
    assert results[2] == results[1]  # same FLOPs and the same loss (3 decimals) at TP=2 + SP


def _emulated_tp2_rank():
    import importlib.util
    from pathlib import Path

    from tpframe.layers import ColumnParallelLinear, RowParallelLinear
    from tpframe.models import BuildContext, build_model
    from tpframe.parallel import initialize_parallel, seed_parallel_rng

    spec = importlib.util.spec_from_file_location(
        "bench_gpt", Path(__file__).resolve().parent.parent / "benchmarks" / "gpt.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    state = initialize_parallel(tp=1)
    bench.emulate_tp(state.tp_comm, 2)
    x = torch.arange(12.0).view(6, 2)
    assert torch.equal(state.tp_comm.all_gather(x), torch.cat([x, x]))
    assert torch.equal(state.tp_comm.reduce_scatter(x), x[:3] + x[3:])
    model = build_model(GPT_CFG, BuildContext(state.tp_comm, sequence_parallel=True, rng_tracker=seed_parallel_rng(0)))
    shapes = {
        name: tuple(m.weight.shape)
        for name, m in model.named_modules()
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
    }
    ids = torch.randint(0, GPT_CFG.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    loss = model(ids, ids).mean()
    loss.backward()
    return shapes, loss.item(), all(p.grad is not None for p in model.parameters())


def test_emulated_tp_runs_one_ranks_shards_with_local_collectives():
    """benchmarks/gpt.py EMULATE_TP=2: one process builds rank 0's shards of TP=2 (half of every column layer's
    outputs, half of every row layer's inputs) and trains through the local stand-ins of the collectives."""
    shapes, loss, grads = run_distributed(_emulated_tp2_rank, 1)[0]
    h = GPT_CFG.hidden
    assert shapes and all(
        (out * 2 in (3 * h, 4 * h) and inp == h) or (out == h and inp * 2 in (h, 4 * h)) for out, inp in shapes.values()
    ), shapes
    assert math.isfinite(loss) and grads


def test_the_torchao_peer_emulates_the_same_tp_rank(monkeypatch, capsys):
    """benchmarks/peer_float8.py EMULATE_TP=2 (the torchao float8 row of `gpt.py --compare --fp8`) builds the shards
    tpframe's EMULATE_TP=2 rank builds: qkv and fc1 with half their outputs, proj and fc2 with half their inputs, a
    half vocabulary; and its step runs (bf16 here: torchao is not a tpframe dependency)."""
    import runpy
    from pathlib import Path

    dims = dict(LAYERS="2", HIDDEN="64", HEADS="4", SEQ="32", MB="2", STEPS="1", EMULATE_TP="2", COMPILE="0", FP8="0")
    for key, value in dims.items():
        monkeypatch.setenv(key, value)
    peer = runpy.run_path(str(Path(__file__).resolve().parent.parent / "benchmarks" / "peer_float8.py"))
    blk = peer["model"].blocks[0]
    assert [tuple(getattr(blk, n).weight.shape) for n in ("qkv", "proj", "fc1", "fc2")] == [
        (96, 64),
        (64, 32),
        (128, 64),
        (64, 128),
    ]
    assert peer["model"].head.weight.shape == (50304 // 2, 64)
    line = capsys.readouterr().out
    assert "RESULT torchao-float8 fp8=none float8_linears=0 emulate_tp=2" in line and "loss" in line, line


@pytest.mark.slow
def test_the_torchao_peers_tp2_plan_computes_the_tp1_loss():
    """benchmarks/peer_float8.py under torchrun (the torchao row at TP>1 of `gpt.py --compare --fp8`): torchtitan's
    TP + SP plan over its fused per-head qkv gives the TP=1 model's loss, so the row is a correct peer (bf16 styles
    here: gloo cannot all-gather float8)."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = str(Path(__file__).resolve().parent.parent / "benchmarks" / "peer_float8.py")
    env = dict(os.environ, LAYERS="2", HIDDEN="64", HEADS="4", SEQ="32", MB="2", STEPS="1", COMPILE="0", FP8="0")
    env["OMP_NUM_THREADS"] = "1"
    losses = []
    for cmd in (
        [sys.executable, script],
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29711", script],
    ):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
        assert proc.returncode == 0 and len(line) == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
        losses.append(float(re.search(r"loss ([\d.]+)", line[0])[1]))
    assert "tp=2" in line[0] and abs(losses[0] - losses[1]) < 1e-5, losses


def test_eager_keeps_its_function_out_of_the_graph_and_dynamo_out_of_start_up():
    """`tpframe.layers.utils.eager` (torch.compiler.disable applied at the first call): importing train.py does not
    import Dynamo (a second of every process's start), and inside a compiled function the wrapped one runs eagerly
    (a host read-back there would otherwise be traced)."""
    import subprocess
    import sys

    from tests.training_utils import REPO
    from tpframe.layers.utils import eager

    probe = "import sys, train; print('torch._dynamo' in sys.modules, 'torch.distributed.tensor' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr
    seen = []

    @eager
    def host_side(x):
        seen.append(torch.compiler.is_compiling())
        return x * float(x.sum().item() > 0)

    f = torch.compile(lambda x: host_side(x + 1) * 2, backend="eager")
    x = torch.ones(3)
    assert torch.equal(f(x), (x + 1) * 2) and seen == [False]


def test_a_benchmark_job_past_its_timeout_is_ended_with_everything_it_started(tmp_path):
    """benchmarks/train_runs.py run_job, how the benchmarks run a job under torchrun: past the timeout the worker
    ends too (torchrun starts its workers in sessions of their own, so killing torchrun alone left them running,
    on the GPU the next job was timed on); a job that ends gives its exit code and output."""
    import os
    import sys
    import time
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from train_runs import run_job

    worker = tmp_path / "worker.py"
    worker.write_text("import os, time\nprint('worker', os.getpid(), flush=True)\ntime.sleep(120)\n")
    t0 = time.monotonic()
    code, output = run_job(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", str(worker)], timeout=12
    )
    pids = [int(line.split()[-1]) for line in output.splitlines() if line.startswith("worker")]
    assert code is None and len(pids) == 1 and time.monotonic() - t0 < 60, output
    time.sleep(0.5)
    state = Path(f"/proc/{pids[0]}/stat")
    assert not state.exists() or state.read_text().split()[2] == "Z", "torchrun's worker outlived the timeout"
    assert run_job([sys.executable, "-c", "print('done'); raise SystemExit(3)"], env=dict(os.environ)) == (3, "done\n")
