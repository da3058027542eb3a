"""tpframe GPT forward+backward throughput, alone or side by side with the peers.

    torchrun --nproc-per-node 2 benchmarks/gpt.py     # one run; env: TP SP MB SEQ LAYERS HIDDEN HEADS STEPS COMM
                                                      #   CKPT CKPT_LAYERS COMPILE ASYNC_TP FUSED KV_HEADS NORM
                                                      #   ACT BIAS PROFILE GRAPH FP8
                                                      #   EMULATE_TP DOC_LEN HEAD_DIM QK_NORM WINDOW
    python benchmarks/gpt.py --compare [--shapes 1.3b,125m,llama] [--tp 2] [--budget-s 420] [--peers .peers]
    python benchmarks/gpt.py --compare --shapes 7b --tp 4      # the shapes TP is for: 7b, 13b, llama3-8b
    python benchmarks/gpt.py --compare --recompute [--shapes 1.3b]   # activation recompute modes, tpframe alone
    python benchmarks/gpt.py --compare --fp8 --shapes 1.3b,7b --tp 4  # bf16 beside each train.fp8 recipe, and
                                      # torchao's (benchmarks/peer_float8.py) where its wheel is in --peers
    python benchmarks/gpt.py --compare --fp8 --shapes 7b --tp 4 --layers 8  # 8 of the shape's blocks

One run: the GPT of tpframe.models.gpt (LayerNorm, rotary, GELU 4h, biases, tied embeddings, V=50304 unless
the env says otherwise), bf16, 3 warm-up steps then STEPS timed forward+backward steps with the gradients
dropped, no optimizer: the timing of ../shared/peers/bench_*.py, so the RESULT lines compare directly.
COMPILE=1 compiles each block (tpframe/models/compile.py), ASYNC_TP=1 (or copy_engine) overlaps the SP
collectives with the GEMMs by copy-engine pushes (tpframe/layers/async_tp.py), FUSED=0 turns the Triton kernels off
(LayerMode.fused_kernels; NORM_MIN_NUMEL=n: the kernel norms from n elements up).
PROFILE=path writes a torch.profiler table of one more step there.
The RESULT line ends with the memory one forward holds for its backward (activations, measured once).
GRAPH=1 (CUDA) captures the whole forward+backward in one CUDA graph after the warm-up (gradients land in the
graph's static buffers) and times its replays: what a training-step CUDA graph would save over launching the same
kernels one by one. CKPT=full|selective recomputes in backward (parallel.activation_checkpointing; CKPT_LAYERS=N:
only the first N blocks, with full). FP8=tensorwise|rowwise runs the blocks' GEMMs in float8 with that
recipe (train.fp8; FP8=1: tensorwise; TFLOP/s still counts the model's FLOPs, so it compares directly with bf16
rows). EMULATE_TP=n (one process) times one rank of TP=n with its collectives local and free (`emulate_tp`): the
step async TP could reach if it hid all TP communication; with ASYNC_TP=copy_engine the pushes go into local
stand-ins (copy engines, every flag wait passing): that path's own work.
HEAD_DIM=n gives the heads their own width (model.head_dim), QK_NORM=1 adds Qwen3's per-head query/key norms
(model.qk_norm), WINDOW=n sliding-window attention (model.sliding_window; TFLOP/s still counts whole-row causal
attention). DOC_LEN=n packs documents of 1..2n-1 tokens (mean n) into each row and attends within each
(model.attention_mask=document; TFLOP/s still counts whole-row causal attention).
    FLOPs per step = flops_per_token(S) * T = 72*L*H^2*T + 12*L*H*S*T + 6*H*V*T for the GPT shapes
    (T = MB*S tokens per TP group; the Llama shape counts its SwiGLU and GQA matmuls exactly).

--compare runs, in one call on one machine, each shape's jobs in priority order until --budget-s is spent
(each job is a subprocess with its own timeout; single-GPU jobs run two at a time, one per GPU): plain torch
eager and torch.compile at TP=1 (bench_torch_gpt.py), DTensor + compile with and without async TP at TP=2
(bench_dtensor_gpt.py, torchtitan's way), Megatron-Core local at TP=2 (bench_mcore_gpt.py; its wheel is
installed to /tmp/site), and tpframe at TP=1 and TP=2 + SP, eager and compiled, with the ceiling: one TP rank's
work with its collectives free (EMULATE_TP, its 'of ceiling' column). For the 7b, 13b and llama3-8b shapes the TP
rows run first (VOCAB and FFN env vars size the vocabulary and the MLP). The ../shared peers model only
the GPT shapes (their env has no RMSNorm/SwiGLU/GQA): the Llama shape's plain-torch and DTensor rows come from
benchmarks/peer_llama.py (torchtitan's llama3 model and TP plan), and it has no Megatron row. Prints the table with
ratios against the strongest peer at the same TP and appends it, with the command and device, to RESULTS.md.
One shape takes about 6 minutes on 2x H200 (the peers' torch.compile dominates): run one shape per device call.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import glob
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SITE = Path("/tmp/site")  # where --compare installs the peers' wheels (Megatron-Core, torchao)
sys.path.insert(0, str(ROOT))

V = int(os.environ.get("VOCAB", 50304))


def env(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def flag(name: str, default: str = "0") -> bool:
    return os.environ.get(name, default) == "1"


def fp8_recipe() -> str | None:
    """FP8: 0 (bf16), 1 (tensorwise) or a train.fp8 recipe."""
    from tpframe.layers.fp8 import RECIPES

    value = {"0": None, "1": "tensorwise"}.get(os.environ.get("FP8", "0"), os.environ.get("FP8"))
    if value is not None and value not in RECIPES:
        raise SystemExit(f"FP8={value!r}: use 0, 1 or one of {RECIPES}")
    return value


def async_mode() -> str | bool:
    value = os.environ.get("ASYNC_TP", "0")
    modes = {"0": False, "1": "copy_engine", "copy_engine": "copy_engine"}
    if value not in modes:
        raise SystemExit(f"ASYNC_TP={value!r}: use 0, 1 or copy_engine")
    return modes[value]


def emulate_tp(comm, n: int) -> None:
    """Make a one-rank TP group pass for rank 0 of `n`: the layers build rank 0's shards, and the collectives stay
    local, each with the bytes a real one writes here (all-gather: n copies; reduce-scatter: the sum of n blocks)
    but no transfer and no wait; async TP's copy-engine pushes go into local buffers and every flag wait passes.
    The values are not a real TP=n model's; the per-GPU work and the host's are."""
    comm.size, comm.rank = n, 0
    comm.all_gather = lambda x, dim=0: torch.cat([x] * n, dim)
    comm.reduce_scatter = lambda x, dim=0: sum(x.chunk(n, dim))
    comm.all_reduce = lambda x, op="sum", *, donate=False: x if donate else x.clone()
    if comm.device.type == "cuda":  # async_tp=copy_engine: pushes copied into local stand-ins, every wait passed
        from tpframe.comm.peer_exchange import PeerExchange
        from tpframe.comm.peer_memory import PeerMemory, stream_wait, stream_write

        def memory(*, nbytes: int, flags: int) -> PeerMemory:
            return PeerMemory(
                0,
                n,
                [torch.empty(nbytes, dtype=torch.uint8, device=comm.device) for _ in range(n)],
                [torch.zeros(flags, dtype=torch.int32, device=comm.device) for _ in range(n)],
            )

        class LocalExchange(PeerExchange):
            """Every flag operation still queued (its host and GPU cost), on flags where it passes: waits on one
            that stays 1, writes into another."""

            flags = torch.tensor([1, 0], dtype=torch.int32, device=comm.device)
            always, scratch = flags.data_ptr(), flags.data_ptr() + 4

            def _take(self, stream, address):
                stream_wait(stream, self.always, 1)
                stream_write(stream, self.scratch, 0)

            def _set(self, stream, address, value):
                stream_write(stream, self.scratch, value)

        comm.use_peer_exchange(LocalExchange(memory, rank=0, size=n, device=comm.device))


# -- one run (under torchrun) ---------------------------------------------------------------------
def run_one() -> None:
    from tpframe.layers.mode import LayerMode
    from tpframe.models import BuildContext, build_model
    from tpframe.models.compile import compile_model
    from tpframe.models.config import ModelConfig
    from tpframe.parallel import destroy_parallel, initialize_parallel, seed_parallel_rng

    state = initialize_parallel(
        tp=env("TP", int(os.environ.get("WORLD_SIZE", 1))),
        comm_backend=os.environ.get("COMM", "auto"),
    )
    tp = state.tp
    if flag("GRAPH") and state.device.type == "cuda":
        # everything on one side stream, the capture's too: autograd's gradient accumulators keep the stream they
        # were made on, and one on the legacy stream cannot join a capture
        torch.cuda.set_stream(torch.cuda.Stream())
    if env("EMULATE_TP", 0) > 1:
        if state.world_size != 1:
            raise SystemExit("EMULATE_TP=n runs one process")
        tp = env("EMULATE_TP", 0)
        emulate_tp(state.tp_comm, tp)
    H, L, NH = env("HIDDEN", 2048), env("LAYERS", 24), env("HEADS", 16)
    S, MB, STEPS = env("SEQ", 2048), env("MB", 8), env("STEPS", 10)
    sp = flag("SP") and tp > 1
    doc_len = env("DOC_LEN", 0)  # packed documents of mean length doc_len (0: causal rows)
    cfg = ModelConfig(
        vocab_size=V,
        hidden=H,
        layers=L,
        heads=NH,
        kv_heads=env("KV_HEADS", 0) or None,
        ffn_hidden=env("FFN", 0) or None,
        max_seq_len=S,
        position="rotary",
        vocab_multiple=128,
        norm=os.environ.get("NORM", "layernorm"),
        activation=os.environ.get("ACT", "gelu"),
        bias=flag("BIAS", "1"),
        attention_mask="document" if doc_len else "causal",
        eod_id=0,
        head_dim=env("HEAD_DIM", 0) or None,
        qk_norm=flag("QK_NORM"),
        sliding_window=env("WINDOW", 0) or None,
    )
    tracker = seed_parallel_rng(1234)
    ckpt = {"0": "none", "1": "full"}.get(os.environ.get("CKPT", "0"), os.environ.get("CKPT", "0"))
    if ckpt not in ("none", "full", "selective"):
        raise SystemExit(f"CKPT={ckpt!r}: use 0, 1 (full), full or selective")
    ctx = BuildContext(
        state.tp_comm,
        sequence_parallel=sp,
        activation_checkpointing=ckpt == "full",
        recompute_layers=env("CKPT_LAYERS", 0) or None,
        selective_recompute=ckpt == "selective",
        rng_tracker=tracker,
        dtype=torch.bfloat16,
        device=state.device,
        seed=1234,
        # FP8: the blocks' GEMMs in float8 where they gain (train.fp8)
        mode=LayerMode(
            fused_kernels=flag("FUSED", "1"),
            fp8=fp8_recipe(),
            async_tp=async_mode() if sp else None,
        ),
    )
    model = build_model(cfg, ctx)
    if "NORM_MIN_NUMEL" in os.environ:  # the size under which eager norms take torch's ops (0: the kernel always)
        import tpframe.kernels.norm

        tpframe.kernels.norm.FUSED_MIN_NUMEL = env("NORM_MIN_NUMEL", 0)
    if flag("COMPILE"):
        compile_model(model)
    g = torch.Generator(device=state.device).manual_seed(state.dp_rank)  # TP ranks share the batch
    tokens = torch.randint(1 if doc_len else 0, V, (MB, S + 1), device=state.device, generator=g)
    if doc_len:  # packed documents of 1..2*DOC_LEN-1 tokens (mean DOC_LEN), each ended by token 0
        tokens.view(-1)[document_ends(tokens.numel(), doc_len).to(state.device)] = 0
    inp, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step():
        loss = model(inp, labels).mean()
        loss.backward()
        for p in model.parameters():
            p.grad = None
        return loss

    cuda = state.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if flag("GRAPH") and not cuda:
        raise SystemExit("GRAPH=1 needs a CUDA device")
    held = torch.cuda.memory_allocated() if cuda else 0  # what the forward keeps for the backward (activations)
    loss = model(inp, labels).mean()
    held = (torch.cuda.memory_allocated() - held) / 2**30 if cuda else 0.0
    loss.backward()
    for p in model.parameters():
        p.grad = None
    for _ in range(3):
        step()
    if flag("GRAPH"):
        step = graphed_step(model, inp, labels)
    sync()
    torch.distributed.barrier()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        loss = step()
    sync()
    dt = (time.perf_counter() - t0) / STEPS
    T = MB * S
    flops = model.flops_per_token(S) * T
    mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    if os.environ.get("PROFILE"):
        profile_step(step, os.environ["PROFILE"], state.rank)
    if state.rank == 0:
        from tpframe.layers.async_tp import async_tp_available

        mode = ctx.mode  # else the layers fell back to the plain path
        ran_async = mode.async_tp and async_tp_available(state.tp_comm, inp)
        tags = (
            f"compile={int(flag('COMPILE'))} graph={int(flag('GRAPH'))} async_tp={mode.async_tp if ran_async else 0} "
            f"fused={int(mode.fused_kernels)} fp8={mode.fp8 or 0} ckpt={ckpt}"
            + (f" doc_len={doc_len}" if doc_len else "")
        )
        line = (
            f"RESULT tpframe tp={tp}{' emulated (collectives local)' if tp != state.tp else ''} sp={int(sp)} "
            f"comm={state.tp_comm.requested} {tags} world={state.world_size} "
            f"mb={MB} seq={S} L={L} H={H}: step {dt * 1e3:.1f} ms, {T / dt:.0f} tok/s per TP group, "
            f"{flops / dt / tp / 1e12:.1f} TFLOP/s per GPU, mem {mem:.1f} GiB, loss {loss.item():.3f}, "
            f"activations {held:.2f} GiB"
        )
        print(line, flush=True)
        if not flag("NO_APPEND"):
            with open(Path(__file__).resolve().parent / "RESULTS.md", "a") as f:
                f.write(
                    f"\n- `torchrun benchmarks/gpt.py` env TP={state.tp} EMULATE_TP={tp} SP={int(sp)} MB={MB} SEQ={S} "
                    f"LAYERS={L} HIDDEN={H} HEADS={NH} on {torch.cuda.get_device_name() if cuda else 'CPU'} "
                    f"x{state.world_size}, torch {torch.__version__}:\n  {line}\n"
                )
    destroy_parallel()


def document_ends(n: int, mean: int, seed: int = 0) -> torch.Tensor:
    """Positions of the end-of-document tokens in a stream of n tokens whose documents are 1..2*mean-1 long."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 2 * mean, (n // mean + 2,), generator=g)
    ends = torch.cumsum(lengths, 0) - 1
    return ends[ends < n]


def graphed_step(model, inp, labels):
    """The forward+backward captured in one CUDA graph, as train.py's train.cuda_graph captures it
    (tpframe/parallel/graphed.py): two eager steps first, on the side stream run_one set (kernels compiled, the
    copy-engine slots sized, communicators set up), then the capture on that stream, thread-local; calling the result
    replays it and returns its (static) loss. Gradients are dropped before the capture and allocated inside it, so
    each replay rewrites them in place."""
    losses = []

    def fwd_bwd():
        losses[:] = [model(inp, labels).mean()]
        losses[0].backward()

    for _ in range(2):
        model.zero_grad(set_to_none=True)
        fwd_bwd()
    model.zero_grad(set_to_none=True)  # freed outside the capture: a block freed inside it syncs other streams
    losses.clear()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.current_stream(), capture_error_mode="thread_local"):
        fwd_bwd()

    def replay():
        graph.replay()
        return losses[0]

    return replay


def profile_step(step, path: str, rank: int) -> None:
    """A torch.profiler table of one more step at `path` (rank 0), its chrome trace beside it, and how long the
    GPU sat idle during the step: the most a CUDA graph of the step (which removes launch gaps, not kernel
    time) could save. (Training runs get the same from the config's `profile` section.)"""
    from torch.profiler import ProfilerActivity, profile

    from tpframe.observe.profiler import gpu_busy, op_table

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    if rank == 0:
        table = op_table(prof, cuda=cuda, rows=45)
        if cuda:
            trace = str(Path(path).with_suffix(".json"))
            prof.export_chrome_trace(trace)
            span, busy = gpu_busy(trace)
            table += (
                f"\nGPU timeline of the step: {span:.2f} ms from first kernel to last, busy {busy:.2f} ms, "
                f"idle {span - busy:.2f} ms ({1 - busy / span:.1%}): the most a CUDA graph could save\n"
            )
            print(table.splitlines()[-1], flush=True)
        Path(path).write_text(table)
        print(f"profile of one step written to {path}", flush=True)


# -- --compare ------------------------------------------------------------------------------------
SHAPES = {
    "125m": dict(name="GPT-125M", LAYERS=12, HIDDEN=768, HEADS=12, SEQ=1024, MB=16),
    "1.3b": dict(name="GPT-1.3B", LAYERS=24, HIDDEN=2048, HEADS=16, SEQ=2048, MB=8),
    "llama": dict(
        name="Llama-style (RMSNorm, SwiGLU, GQA 4 kv heads, no bias)",
        LAYERS=8,
        HIDDEN=4096,
        HEADS=32,
        KV_HEADS=4,
        NORM="rmsnorm",
        ACT="swiglu",
        BIAS=0,
        SEQ=2048,
        MB=8,
    ),
    # the shapes TP is for (issue 46): TP=4 (and 8) rows, their TP=1 rows only where one GPU holds them
    "7b": dict(name="7B-class GPT", LAYERS=32, HIDDEN=4096, HEADS=32, SEQ=2048, MB=4),
    "13b": dict(name="13B-class GPT", LAYERS=40, HIDDEN=5120, HEADS=40, SEQ=2048, MB=2),
    "llama3-8b": dict(
        name="Llama-3-8B (RMSNorm, SwiGLU 14336, GQA 8 kv heads, V=128256, no bias)",
        LAYERS=32,
        HIDDEN=4096,
        HEADS=32,
        KV_HEADS=8,
        FFN=14336,
        VOCAB=128256,
        NORM="rmsnorm",
        ACT="swiglu",
        BIAS=0,
        SEQ=2048,
        MB=4,
    ),
    "tiny": dict(name="tiny (a CPU smoke test of the driver)", LAYERS=2, HIDDEN=64, HEADS=4, SEQ=32, MB=2),
}
LLAMA_SHAPES = ("llama", "llama3-8b")  # their peers are benchmarks/peer_llama.py
TP_SHAPES = ("7b", "13b", "llama3-8b")
RESULT = re.compile(r"step ([\d.]+) ms, (\d+) tok/s.*?, ([\d.]+) TFLOP/s.*?mem ([\d.]+) GiB, loss ([\d.na]+)")


def recompute_jobs(tp: int) -> list[dict]:
    """--recompute: tpframe at TP=1 (and TP=tp + SP on a multi-GPU machine), eager and compiled, with no
    recompute, selective and full: the memory each mode saves and the time it costs."""
    out, ours = [], str(ROOT / "benchmarks" / "gpt.py")
    layouts = [("TP=1", 1, {"TP": "1"})]
    if tp > 1:
        layouts.append((f"TP={tp} + SP", tp, {"TP": str(tp), "SP": "1"}))
    for name, gpus, dims in layouts:
        for mode, extra in (("eager", {}), ("compile", {"COMPILE": "1"})):
            for ckpt in ("none", "selective", "full"):
                out.append(
                    dict(
                        label=f"tpframe {name}, {mode}, recompute {ckpt}",
                        script=ours,
                        gpus=gpus,
                        env={"STEPS": "10", "ROPE": "1", "CKPT": "0" if ckpt == "none" else ckpt, **dims, **extra},
                    )
                )
    return out


def fp8_jobs(shape: str, tp: int, emulate_tp: int) -> list[dict]:
    """--fp8: compiled tpframe in bf16 and each train.fp8 recipe at TP=1 (the shapes TP is for: one rank of
    TP=emulate_tp with its collectives free, EMULATE_TP), and at TP=tp + SP on a multi-GPU machine; beside each
    layout the same recipes of torchao's float8 training on the plain GPT (benchmarks/peer_float8.py) where torchao
    is installed in /tmp/site (its wheel in the peers folder)."""
    from tpframe.layers.fp8 import RECIPES

    if shape in TP_SHAPES and emulate_tp > 1:
        one_gpu = (f"TP={emulate_tp} + SP emulated (EMULATE_TP)", {"TP": "1", "SP": "1", "EMULATE_TP": str(emulate_tp)})
    else:
        one_gpu = ("TP=1", {"TP": "1"})
    peer = (SITE / "torchao").exists() and shape not in LLAMA_SHAPES
    layouts = [("tpframe", *one_gpu, 1, "gpt.py")] + ([("torchao peer", *one_gpu, 1, "peer_float8.py")] if peer else [])
    if tp > 1:  # the peer at TP > 1: torchtitan's DTensor plan, float8 all-gathers with tensorwise
        tp_sp = (f"TP={tp} + SP", {"TP": str(tp), "SP": "1"}, tp)
        layouts += [("tpframe", *tp_sp, "gpt.py")] + ([("torchao peer", *tp_sp, "peer_float8.py")] if peer else [])
    return [
        dict(
            label=f"{who} {name}, compile, fp8 {recipe}",
            script=str(ROOT / "benchmarks" / script),
            gpus=gpus,
            env={"STEPS": "10", "ROPE": "1", "COMPILE": "1", "FP8": "0" if recipe == "none" else recipe, **dims},
        )
        for who, name, dims, gpus, script in sorted(layouts, key=lambda layout: layout[3] == 1)  # real TP first
        for recipe in ("none", *RECIPES)
    ]


def jobs_for(shape: str, peers: Path | None, tp: int) -> list[dict]:
    """Each shape's runs, most important first. `gpus` 1 runs on one GPU (two such jobs may pair up). The GPT
    shapes take the ../shared/peers harnesses; the Llama shape takes benchmarks/peer_llama.py (the same plain
    model and DTensor plans, for RMSNorm/SwiGLU/GQA), so it needs no peers folder."""
    out = []

    def add(label, script, gpus, **extra):
        out.append(dict(label=label, script=script, gpus=gpus, env={"STEPS": "10", "ROPE": "1", **extra}))

    ours = str(ROOT / "benchmarks" / "gpt.py")
    if shape in LLAMA_SHAPES:
        plain = dtensor = str(ROOT / "benchmarks" / "peer_llama.py")
    else:
        plain, dtensor = (
            (str(peers / name) for name in ("bench_torch_gpt.py", "bench_dtensor_gpt.py")) if peers else (None, None)
        )
    if plain:
        add("plain torch, 1 GPU, eager", plain, 1, TP="1")
    add("tpframe TP=1, eager", ours, 1, TP="1")
    if plain:
        add("plain torch, 1 GPU, torch.compile", plain, 1, TP="1", COMPILE="1")
    add("tpframe TP=1, compile", ours, 1, TP="1", COMPILE="1")
    if torch.cuda.is_available():  # what a CUDA graph of the whole forward+backward would add
        add("tpframe TP=1, eager, one CUDA graph", ours, 1, TP="1", GRAPH="1")
        add("tpframe TP=1, compile, one CUDA graph", ours, 1, TP="1", COMPILE="1", GRAPH="1")
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):  # train.fp8
        add("tpframe TP=1, fp8, eager", ours, 1, TP="1", FP8="1")
        add("tpframe TP=1, fp8, compile", ours, 1, TP="1", FP8="1", COMPILE="1")
    if tp == 1:  # one GPU: the single-GPU rows only
        return out
    # the ceiling: one TP rank's work with its collectives free (the most overlap could give)
    add(
        f"tpframe TP={tp} + SP, collectives free (EMULATE_TP={tp}, one GPU): ceiling",
        ours,
        1,
        TP="1",
        SP="1",
        EMULATE_TP=str(tp),
    )
    if dtensor:
        add(f"DTensor TP={tp} + SP, compile", dtensor, tp, TP=str(tp), SP="1", COMPILE="1")
        add(f"DTensor TP={tp} + SP, compile + async TP", dtensor, tp, TP=str(tp), SP="1", COMPILE="1", ASYNC_TP="1")
    add(f"tpframe TP={tp} + SP, eager", ours, tp, TP=str(tp), SP="1")
    add(f"tpframe TP={tp} + SP, eager + async TP (copy engines)", ours, tp, TP=str(tp), SP="1", ASYNC_TP="copy_engine")
    add(f"tpframe TP={tp} + SP, compile", ours, tp, TP=str(tp), SP="1", COMPILE="1")
    if torch.cuda.is_available():
        add(f"tpframe TP={tp} + SP, compile, one CUDA graph", ours, tp, TP=str(tp), SP="1", COMPILE="1", GRAPH="1")
        add(
            f"tpframe TP={tp} + SP, compile + async TP (copy engines), one CUDA graph",
            ours,
            tp,
            TP=str(tp),
            SP="1",
            COMPILE="1",
            GRAPH="1",
            ASYNC_TP="copy_engine",
        )
        if torch.cuda.get_device_capability() >= (8, 9):
            add(f"tpframe TP={tp} + SP, fp8, compile", ours, tp, TP=str(tp), SP="1", COMPILE="1", FP8="1")
    if shape not in LLAMA_SHAPES and peers and (SITE / "megatron").exists():
        add(f"Megatron-Core local, TP={tp}", str(peers / "bench_mcore_gpt.py"), tp, TP=str(tp))
    if shape in TP_SHAPES:  # the TP rows first (the ceiling with them), the single-GPU ones after
        out.sort(key=lambda job: job["gpus"] == 1 and "EMULATE_TP" not in job["env"])
    return out


def launch(job: dict, shape: dict, gpu: int | None, timeout: float, log_dir: Path, layers: int = 0) -> dict:
    from train_runs import run_job  # --compare only: tests load this file's run_one by path, without benchmarks/

    environ = dict(
        os.environ,
        NO_APPEND="1",
        PYTHONUNBUFFERED="1",
        NCCL_NVLS_ENABLE="0",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
        NVSHMEM_DISABLE_NVLS="1",
    )
    environ.update({k: str(v) for k, v in shape.items() if k != "name"})
    if layers:  # --layers: fewer blocks than the shape's (the table says so)
        environ["LAYERS"] = str(layers)
    environ.update(job["env"])
    if job["gpus"] == 1:
        environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
        port = 29600 + gpu
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "1",
            "--master-port",
            str(port),
            job["script"],
        ]
        if "bench_torch_gpt" in job["script"]:
            cmd = [sys.executable, job["script"]]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(job["gpus"]),
            "--master-port",
            "29500",
            job["script"],
        ]
    t0 = time.time()
    code, text = run_job(cmd, env=environ, timeout=timeout)
    status = f"timeout after {timeout:.0f} s" if code is None else "ok" if code == 0 else f"exit {code}"
    with open(log_dir / "compare_logs.txt", "a") as f:  # one file: the device returns few files
        f.write(f"\n===== {shape['name']} | {job['label']} | {status} | {' '.join(cmd)} | env {job['env']}\n")
        f.write("\n".join(text.splitlines()[-120:]) + "\n")
    result = [ln for ln in text.splitlines() if ln.startswith("RESULT")]
    m = RESULT.search(result[-1]) if result else None
    row = dict(job, wall=time.time() - t0, status=status if m or status != "ok" else "no RESULT line")
    if m:
        row.update(step_ms=float(m[1]), tokens=int(m[2]), tflops=float(m[3]), mem=float(m[4]), loss=m[5], status="ok")
    else:
        tail = [ln for ln in text.splitlines() if ln.strip()][-1:] or [""]
        row["error"] = tail[0][-160:]
    print(
        f"  [{row['wall']:5.0f} s] {job['label']}: "
        + (f"{row['tflops']} TFLOP/s per GPU, {row['mem']} GiB" if m else f"{row['status']}: {row.get('error', '')}"),
        flush=True,
    )
    return row


def compare(args) -> None:
    peers = Path(args.peers) if args.peers and Path(args.peers).exists() else None
    for package, pattern in (("megatron", "megatron_core-*.whl"), ("torchao", "torchao-*.whl")):
        wheel = sorted(glob.glob(str(Path(args.peers) / pattern))) if peers else []
        if wheel and not (SITE / package).exists():
            pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(SITE)]
            subprocess.run([*pip, wheel[-1]], check=False)
    if SITE.exists():
        os.environ["PYTHONPATH"] = f"{SITE}:" + os.environ.get("PYTHONPATH", "")
    n_gpus = torch.cuda.device_count()
    tp = min(args.tp, n_gpus) if n_gpus else args.tp  # no GPU: a smoke test on gloo
    log_dir = Path(args.logs)
    log_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + args.budget_s
    rows: dict[str, list[dict]] = {}
    for key in args.shapes.split(","):
        shape = SHAPES[key]
        print(f"{shape['name']}:", flush=True)
        rows[key] = []
        if args.fp8:
            pending = fp8_jobs(key, tp if n_gpus > 1 else 1, args.tp)
        else:
            pending = recompute_jobs(tp) if args.recompute else jobs_for(key, peers, tp)
        pending = [job for job in pending if re.search(args.only, job["label"])]
        while pending and time.time() < deadline - 20:
            left = deadline - time.time()
            job = pending.pop(0)
            mate = next((j for j in pending if j["gpus"] == 1), None) if job["gpus"] == 1 and n_gpus > 1 else None
            if mate is not None:
                pending.remove(mate)
                with concurrent.futures.ThreadPoolExecutor(2) as pool:
                    futures = [
                        pool.submit(launch, j, shape, gpu, min(args.job_timeout_s, left), log_dir, args.layers)
                        for gpu, j in enumerate((job, mate))
                    ]
                    rows[key].extend(f.result() for f in futures)
            else:
                rows[key].append(launch(job, shape, 0, min(args.job_timeout_s, left), log_dir, args.layers))
        for job in pending:
            rows[key].append(dict(job, status="not run (budget spent)"))
    report(args, rows, tp)


VARIANTS = {  # --recompute and --fp8: each row's variant after `sep` in its label, compared with the `base` one
    "recompute": dict(
        sep=", recompute",
        title="Activation recompute modes",
        note="TFLOP/s counts the model's FLOPs (recomputed work is not counted), so it falls with the recompute.",
    ),
    "fp8": dict(
        sep=", fp8",
        title="Float8 recipes (train.fp8) beside bf16",
        note="TFLOP/s counts the model's FLOPs (bf16 GEMMs'), so the rows compare directly; norms, attention and "
        "the head stay bf16.",
    ),
}


def variants_report(args, rows: dict, device: str, kind: str) -> list[str]:
    """The --recompute or --fp8 table: each row's time and memory against the same layout's base variant (with
    --fp8, tpframe's TFLOP/s also against the torchao peer's at the same layout and recipe)."""
    sep, title, note = (VARIANTS[kind][k] for k in ("sep", "title", "note"))
    layers = f" --layers {args.layers}" if args.layers else ""
    lines = [
        f"## {title}, {device}, {datetime.date.today().isoformat()}",
        "",
        f"Command: `python benchmarks/gpt.py --compare --{kind} --shapes {args.shapes} --tp {args.tp}{layers} "
        f"--budget-s {args.budget_s:.0f}` (one device call, every run a subprocess). torch {torch.__version__}, "
        f"bf16, forward+backward, 3 warm-up steps then 10 timed, random tokens. {note} Peak GiB = "
        f"torch.cuda.max_memory_allocated on rank 0; 'time' and 'memory' are against the same run's{sep} none"
        + ("; 'vs torchao' = our TFLOP/s over the torchao peer's, same layout and recipe." if kind == "fp8" else "."),
        "",
        "| shape | run | step ms | TFLOP/s per GPU | peak GiB | time | memory |"
        + (" vs torchao |" if kind == "fp8" else ""),
        "|---|---|---|---|---|---|---|" + ("---|" if kind == "fp8" else ""),
    ]
    for key, shape_rows in rows.items():
        dims = SHAPES[key]
        dims_text = (
            f"{dims['name']}: L={args.layers or dims['LAYERS']} H={dims['HIDDEN']} S={dims['SEQ']} MB={dims['MB']}"
        )
        done = {r["label"]: r for r in shape_rows if "tflops" in r}
        base = {label.rsplit(sep, 1)[0]: r for label, r in done.items() if label.endswith(" none")}
        for r in shape_rows:
            if "tflops" not in r:
                lines.append(f"| {dims_text} | {r['label']} | {r['status']} {r.get('error', '')} | | | | |")
                continue
            b = base.get(r["label"].rsplit(sep, 1)[0])
            time_ratio = f"{r['step_ms'] / b['step_ms']:.3f}x" if b else "-"
            mem_ratio = f"{r['mem'] / b['mem']:.2f}x" if b and b["mem"] else "-"
            line = f"| {dims_text} | {r['label']} | {r['step_ms']:.1f} | {r['tflops']:.1f} | {r['mem']:.1f} | "
            line += f"{time_ratio} | {mem_ratio} |"
            if kind == "fp8":
                peer = done.get(r["label"].replace("tpframe ", "torchao peer ", 1))
                ours = peer and peer["tflops"] and r["label"].startswith("tpframe")
                line += f" {r['tflops'] / peer['tflops']:.2f}x |" if ours else " |"
            lines.append(line)
    return lines


def report(args, rows: dict, tp: int) -> None:
    device = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "no GPU"
    if args.recompute or args.fp8:
        text = "\n".join(variants_report(args, rows, device, "fp8" if args.fp8 else "recompute"))
        print(text, flush=True)
        if args.results:
            with open(args.results, "a") as f:
                f.write("\n" + text + "\n")
        return
    only = f"--only {args.only!r} " if args.only else ""
    lines = [
        f"## GPT throughput, tpframe vs the torch-native peers and Megatron-Core, {device}, "
        f"{datetime.date.today().isoformat()}",
        "",
        f"Command: `python benchmarks/gpt.py --compare --shapes {args.shapes} --tp {args.tp} "
        f"{only}--budget-s {args.budget_s:.0f}` (one device call; every job a subprocess on one machine; single-GPU "
        f"jobs two at a time, one per GPU). torch {torch.__version__}, bf16, forward+backward only (no optimizer), "
        "3 warm-up steps then 10 timed, random tokens, rotary positions everywhere. FLOPs per step = 72*L*H^2*T + "
        "12*L*H*S*T + 6*H*V*T (GPT shapes; the "
        "Llama shape counts its SwiGLU and GQA matmuls), T = MB*S tokens per TP group; TFLOP/s per GPU = FLOPs / "
        "step time / tp. 'vs peer' = our TFLOP/s per GPU over the best torch-native peer's at the same TP "
        "(plain torch + compile at TP=1; DTensor + compile (+ async TP) at TP=2; the Llama shape's peers are "
        "benchmarks/peer_llama.py). Peak GiB = "
        "torch.cuda.max_memory_allocated on rank 0. 'of ceiling' = a multi-GPU row's TFLOP/s per GPU over the "
        "ceiling row's: one TP rank's same work with its collectives free (EMULATE_TP), how much of the TP cost "
        "is left.",
        "",
        "| shape | run | step ms | tokens/s per TP group | TFLOP/s per GPU | peak GiB | loss | vs peer | of ceiling |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, shape_rows in rows.items():
        name = SHAPES[key]["name"]
        dims = SHAPES[key]
        dims_text = (
            f"{name}: L={dims['LAYERS']} H={dims['HIDDEN']} heads={dims['HEADS']} S={dims['SEQ']} MB={dims['MB']}"
        )
        at_tp = lambda r: tp if r["gpus"] > 1 or "EMULATE_TP" in r["env"] else 1  # noqa: E731
        best, ceiling = {}, None
        for r in shape_rows:
            if "tflops" in r and not r["label"].startswith(("tpframe", "Megatron")):
                best[at_tp(r)] = max(best.get(at_tp(r), 0.0), r["tflops"])
            if "tflops" in r and "EMULATE_TP" in r["env"]:
                ceiling = r["tflops"]
        for r in shape_rows:
            if "tflops" not in r:
                lines.append(f"| {dims_text} | {r['label']} | {r['status']} {r.get('error', '')} | | | | | | |")
                continue
            ratio = f"{r['tflops'] / best[at_tp(r)]:.2f}x" if best.get(at_tp(r)) else "-"
            of_ceiling = f"{r['tflops'] / ceiling:.2f}" if ceiling and r["gpus"] > 1 else "-"
            lines.append(
                f"| {dims_text} | {r['label']} | {r['step_ms']:.1f} | {r['tokens']:,} | "
                f"{r['tflops']:.1f} | {r['mem']:.1f} | {r['loss']} | {ratio} | {of_ceiling} |"
            )
    text = "\n".join(lines)
    print(text, flush=True)
    if args.results:
        with open(args.results, "a") as f:
            f.write("\n" + text + "\n")
        record_async_tp(rows, tp)


def record_async_tp(rows: dict, tp: int) -> None:
    """parallel.async_tp=auto's table (tpframe/layers/async_tp_auto.json): for each shape that ran both, async TP's
    eager forward+backward speed over the plain path's at this TP on this GPU model."""
    from tpframe.layers.async_tp import record

    for key, shape_rows in rows.items():
        speed = {r["label"]: r["tflops"] for r in shape_rows if "tflops" in r}
        plain, overlapped = (speed.get(f"tpframe TP={tp} + SP, eager{s}") for s in ("", " + async TP (copy engines)"))
        if tp > 1 and plain and overlapped and torch.cuda.is_available():
            dims = SHAPES[key]
            row = dict(gpu=torch.cuda.get_device_name(), tp=tp, hidden=int(dims["HIDDEN"]))
            row.update(tokens=int(dims["MB"]) * int(dims["SEQ"]), speedup=round(overlapped / plain, 3))
            record(dict(row, section=f"{dims['name']}, benchmarks/gpt.py --compare, {datetime.date.today()}"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", action="store_true", help="run ours and the peers side by side (see above)")
    p.add_argument("--shapes", default="1.3b,125m,llama", help=f"comma list of {sorted(SHAPES)}")
    p.add_argument("--tp", type=int, default=2, help="TP size of the multi-GPU runs")
    p.add_argument(
        "--recompute",
        action="store_true",
        help="with --compare: tpframe's activation recompute modes (none, selective, full) instead of the peers",
    )
    p.add_argument(
        "--fp8",
        action="store_true",
        help="with --compare: tpframe compiled in bf16 and each train.fp8 recipe (TP=1, EMULATE_TP=--tp, TP=--tp)",
    )
    p.add_argument(
        "--peers", default=str(ROOT / ".peers"), help="folder with the peer scripts and wheels (Megatron-Core, torchao)"
    )
    p.add_argument("--layers", type=int, default=0, help="with --compare: this many blocks instead of the shape's")
    p.add_argument("--only", default="", help="with --compare: the runs whose label matches this regex (e.g. TP=2)")
    p.add_argument("--budget-s", type=float, default=420.0, help="stop starting jobs after this many seconds")
    p.add_argument("--job-timeout-s", type=float, default=240.0)
    p.add_argument(
        "--logs", default=os.environ.get("OUT", "/tmp"), help="folder for compare_logs.txt (every job's output)"
    )
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    args = p.parse_args()
    if not args.compare:
        run_one()
        return
    for key in args.shapes.split(","):
        if key not in SHAPES:
            p.error(f"--shapes: {key!r} is not one of {sorted(SHAPES)}")
    compare(args)


if __name__ == "__main__":
    main()
