"""tpframe's entry point.

    python -m tpframe.launch --nproc-per-node N train.py --config configs/X.yaml [section.key=value ...]
    torchrun --nproc-per-node N train.py ...                # works too; its own failure summary is longer
    python train.py --config configs/tiny_cpu.yaml parallel.tp=1     # one process, no launcher needed

The path of a token, top to bottom:
    build_data (tpframe/data/loader.py) -> Trainer.train_step (tpframe/training/trainer.py) -> the schedule
    (tpframe/parallel/schedules.py) -> model(input_ids, labels) (tpframe/models/gpt.py: embedding -> blocks -> head)
    -> vocab_parallel_cross_entropy (tpframe/layers/cross_entropy.py) -> per-token loss.

Configuration mistakes stop here with one line and exit code 2, before any process group exists and
before anything is written (`prepare`); exit codes 3 to 6 are tpframe/exits.py's.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch

from tpframe.errors import ArgumentParser
from tpframe.launch import launch_env, restart_attempt, single_process_env
from tpframe.run import LAUNCHER_PID_ENV
from tpframe.training.config import ConfigError, cuda_graph_obstacle, load_config, validate

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class _ArgumentParser(ArgumentParser):  # refuses --config given twice, too
    def error(self, message: str):  # one line, like every other mistake (argparse prints usage + error)
        raise ConfigError(f"{message} (usage: train.py [--config FILE] [section.key=value ...])")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from tpframe.run.help import help_table

    parser = _ArgumentParser(
        description=__doc__, epilog=help_table(), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="YAML config (defaults when omitted)")
    parser.add_argument(
        "overrides", nargs="*", help="section.key=value, e.g. parallel.tp=2 train.steps=100 (each key once)"
    )
    return parser.parse_intermixed_args(argv)  # overrides may come before and after --config


def _schedule(cfg, state, pipeline, log):
    """The forward+backward schedule: a pipeline schedule, the plain micro-batch loop, or CUDA graphs of it
    (train.cuda_graph; `auto` measures both and keeps the faster, where graphs can be used at all)."""
    from tpframe.parallel.graphed import GraphedForwardBackward
    from tpframe.parallel.schedules import get_forward_backward
    from tpframe.run.preflight import cuda_graph_device_obstacle

    graph = cfg.train.cuda_graph
    if graph == "auto":
        why = cuda_graph_obstacle(cfg) or cuda_graph_device_obstacle(cfg, state.device.type)
        if why is None:
            return GraphedForwardBackward(auto=True, log=log)
        if state.device.type == "cuda":  # on a CPU there is nothing to say
            log(f"train.cuda_graph=auto runs eagerly: {why.split('; set ')[0]}")
        graph = False
    return GraphedForwardBackward() if graph else get_forward_backward(cfg.parallel.pp, pipeline)


def _print_now(message: str) -> None:  # a non-main rank's own console line (logger.info prints on rank 0 only)
    print(message, flush=True)


def prepare(
    argv: list[str] | None, *, world_size: int | None = None, rank: int | None = None, device_check: bool = True
):
    """Parse and check everything that can be checked before any process group is built, and write nothing.
    `world_size`/`rank` default to the launcher's env; `device_check=False` skips the device-memory check
    (tpframe.launch's parent process, which must not touch the GPUs)."""
    from tpframe.checkpoint import preflight
    from tpframe.data import build_data
    from tpframe.models import (
        check_context_parallel_support,
        check_document_mask_support,
        check_pipeline_support,
        check_recompute_support,
        resolve_builder,
    )
    from tpframe.parallel.state import coords_of, cp_of
    from tpframe.run import preflight as checks

    args = parse_args(argv)
    env = launch_env() if world_size is None else None  # the launcher's parent checks for a world it will start
    world = world_size or env.world_size
    rank = env.rank if rank is None else rank
    cfg = load_config(args.config, args.overrides)
    validate(cfg, world)  # the env vars that override the config too
    builder = resolve_builder(cfg.model.name)
    check_pipeline_support(cfg.model.name, builder, cfg.parallel.pp)
    check_context_parallel_support(cfg.model.name, builder, cfg.parallel.cp)
    check_document_mask_support(cfg.model.name, builder, cfg.model.attention_mask)
    check_recompute_support(
        cfg.model.name, builder, selective=cfg.parallel.recompute == "selective", layers=cfg.parallel.recompute_layers
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    local_world, local_rank = (env.local_world_size, env.local_rank) if env else (world, 0)
    where = dict(device_type=device, local_rank=local_rank, local_world=local_world)
    if device_check or device == "cpu":  # a model too deep to build in a while: refused before it is built
        checks.check_memory_before_build(cfg, world, **where)
    model = checks.dry_build(cfg)  # the builder's own checks; shapes on the meta device
    checks.check_device(cfg, device, local_world=local_world, local_rank=local_rank)
    if env is not None:  # a worker (the launcher's parent knows no restarts yet)
        checks.check_snapshots(cfg, env)
    if device_check or device == "cpu":
        checks.check_memory(cfg, world, model, **where)
    p = cfg.parallel
    _, dp_rank, _ = coords_of(rank, world, p.tp, p.pp, cp=p.cp)
    dp = world // (p.tp * p.cp * p.pp)
    try:
        train_data, valid_data, data_vocab = build_data(
            cfg.data,
            cfg.train.seq_len,
            cfg.train.micro_batch_size,
            dp_rank,
            dp,
            cp_rank=cp_of(rank, p.tp, p.cp),
            cp_size=p.cp,
        )
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from None
    if data_vocab > cfg.model.vocab_size:
        raise ConfigError(
            f"the data has token ids up to {data_vocab - 1} but model.vocab_size={cfg.model.vocab_size}; "
            f"set model.vocab_size={data_vocab} or more"
        )
    checks.check_token_ids(cfg, train_data, valid_data)
    checks.resolve_loss_mask(cfg, train_data)
    checks.resolve_end_of_document(cfg, train_data)
    resume = preflight(cfg, restarted=restart_attempt() > 0)  # checked before anything is built
    checks.check_resume(cfg, *resume, train_data)
    checks.check_checkpoint_files(cfg, *resume, world_size=world, rank=rank)
    checks.check_init_from(cfg, model, resuming=resume[0] is not None and cfg.optim.lora_rank is None)
    checks.check_run_dir(cfg, resuming=resume[0] is not None, probe_lock=rank == 0)
    checks.check_checkpoint_dir(cfg, resume[0])
    return cfg, train_data, valid_data, resume


def _parallel_state(cfg):
    """The process groups of cfg.parallel (a rendezvous that times out is a CommFailure: one line, exit code 4)."""
    from tpframe.parallel import flight, initialize_parallel
    from tpframe.parallel.heartbeat import CommFailure, is_comm_failure

    p = cfg.parallel
    flight.configure(cfg.train.run_dir)  # before the process groups exist
    try:
        state = initialize_parallel(
            tp=p.tp,
            pp=p.pp,
            cp=p.cp,
            ep=p.ep,
            comm_backend=cfg.comm.backend,
            timeout_s=cfg.comm.timeout_s,
        )
    except Exception as e:
        if not is_comm_failure(e):
            raise
        raise CommFailure(
            f"the process groups could not be set up within comm.timeout_s={cfg.comm.timeout_s:g}: "
            f"{str(e).strip().splitlines()[0][:200]}"
        ) from None
    return state


def _build_model(cfg, state, tracker, resume) -> tuple[torch.nn.Module, list[str]]:
    """This rank's model (its pipeline stages' chunks; pp=1: the whole model) built in the layer mode of the config,
    compiled and initialized (init_from), and the lines that say what was done to it."""
    from tpframe.checkpoint.init_from import load_init_from
    from tpframe.layers.async_tp import resolve_auto
    from tpframe.layers.mode import LayerMode
    from tpframe.models import BuildContext, build_stages

    p, notes = cfg.parallel, []
    tokens = cfg.train.micro_batch_size * cfg.train.seq_len
    hidden, fp8 = cfg.model.hidden, cfg.train.fp8
    async_tp = resolve_auto(p, hidden=hidden, tokens=tokens, device=state.device, fp8=fp8)
    async_tp = async_tp if cfg.optim.lora_rank is None else None  # "auto" with LoRA: its layers take the plain path
    if async_tp and p.async_tp == "auto":
        notes.append(f"async TP on (parallel.async_tp=auto: measured faster at tp={p.tp}, hidden {hidden} on this GPU)")
    ctx = BuildContext(
        state.tp_comm,
        sequence_parallel=p.sequence_parallel,
        **p.recompute_context(),
        rng_tracker=tracker,
        dtype=torch.float32 if p.dp_strategy == "fsdp" else DTYPES[cfg.train.dtype],  # fsdp: fp32 masters
        device=state.device,
        seed=cfg.train.seed,
        # the blocks' linear layers in float8 where they gain; the head and embedding stay bf16 (torchtitan's choice)
        mode=LayerMode(
            fp8=cfg.train.fp8,
            async_tp=async_tp,
            cp_comm=p.cp_comm,
            lora=cfg.optim.lora(),
        ),
        cp_comm=state.cp_comm,
        ep_comm=state.ep_comm,
    )
    model = build_stages(
        cfg.model,
        ctx,
        pp_rank=state.pp_rank,
        pp=p.pp,
        virtual_stages=p.virtual_stages,
        layers_per_stage=p.layers_per_stage,
    )
    chunks = getattr(model, "chunks", [model])
    if cfg.train.fp8:
        from tpframe.layers.fp8 import recipe_of
        from tpframe.layers.linear import fp8_layers

        recipe = recipe_of(cfg.train.fp8)
        done = [fp8_layers(chunk, recipe) for chunk in chunks]
        skipped = [name for _, names in done for name in names]
        notes.append(
            f"float8 GEMMs ({recipe}) in {sum(n for n, _ in done)} linear layers"
            + (
                f"; {len(skipped)} stay in {cfg.train.dtype}: "
                + ", ".join(skipped[:3])
                + (" ..." if len(skipped) > 3 else "")
                if skipped
                else ""
            )
        )
    if cfg.train.compile:  # per block, before the strategy wraps anything (torchtitan's order)
        from tpframe.models.compile import compile_model

        for chunk in chunks:
            compile_model(chunk)
    # weights first: the strategy copies them; a LoRA run's base, resumed or not (its checkpoints hold the adapters)
    if cfg.checkpoint.init_from and (resume[0] is None or cfg.optim.lora_rank is not None):
        # partial: a pipeline stage holds some blocks, an EP rank some experts (the pre-flight matched the file
        # against the whole model)
        source = load_init_from(
            model,
            cfg.model,
            cfg.checkpoint.init_from,
            state.tp_rank,
            state.tp,
            partial=p.pp > 1 or p.virtual_stages > 1 or p.ep > 1,
        )
        notes.append(f"initialized the weights from {source}")
    return model, notes


def _describe(cfg, state, *, num_params: int, strategy, trainer) -> list[str]:
    """The start-up lines: the model and layout, the gradient strategy, activation recompute."""
    p = cfg.parallel
    schedule = f" ({p.pp_schedule})" if p.pp > 1 else ""
    lines = [
        f"tpframe: {num_params / 1e6:.2f}M params | world {state.world_size} = tp {state.tp} x "
        + (f"cp {state.cp} x " if state.cp > 1 else "")
        + f"dp {state.dp} x pp {state.pp}{schedule}"
        + (f" (experts over ep {state.ep})" if state.ep > 1 else "")
        + f" | {cfg.train.dtype} on {state.device.type} | "
        f"seq {cfg.train.seq_len}, global batch {cfg.train.global_batch_size} ({trainer.accum} micro-batches of "
        f"{cfg.train.micro_batch_size} per rank)",
        f"gradients and optimizer: {strategy.describe()}; "
        f"optimizer state {strategy.state_bytes() / 2**20:.2f} MiB per rank",
    ]
    if p.recompute != "none":
        what = {
            "selective": "selective (norms and activation functions; GEMM and attention outputs kept)",
            "full": "full (whole blocks from their input"
            + (f"; the first {p.recompute_layers} of each chunk)" if p.recompute_layers else ")"),
        }
        lines.append(f"activation recompute: {what[p.recompute]}")
    if cfg.model.attention_mask == "document":
        lines.append(f"attention within each document (token {cfg.model.eod_id} ends one; positions restart)")
    if cfg.data.eod_mask_loss:
        lines.append(
            f"no loss on the token after each {cfg.model.eod_id} (data.eod_mask_loss); the loss is the mean "
            "over the global batch's other tokens"
        )
    if cfg.train.time_limit_minutes is not None:
        lines.append(
            f"time limit: after {cfg.train.time_limit_minutes:g} minutes the step is saved and training stops "
            "(train.time_limit_minutes); the same command resumes it"
        )
    if trainer.weight_check is not None:
        lines.append(
            f"every {cfg.train.compare_replicas_every} steps the copies of each weight are compared: "
            f"{trainer.weight_check.compares}"
        )
    return lines


def _train(cfg, trainer, checkpointer, logger) -> None:
    """Train to train.steps (or a stop), save at the end; a run stopped on non-finite steps names the last
    healthy checkpoint."""
    from tpframe.checkpoint.files import last_healthy
    from tpframe.training.health import TrainingAborted

    try:
        trainer.train(checkpointer)
        trainer.guard.check_ended_healthy(trainer.step)  # ended inside a streak of skipped steps: exit code 3
        checkpointer.finish(trainer.step, trainer.stop_requested)
        if trainer.history:
            last = trainer.history[-1]
            logger.info(
                f"done at step {trainer.step}: loss {last['loss']:.4f}"
                + (f", eval loss {last['eval_loss']:.4f}" if "eval_loss" in last else "")
                + (
                    f"; checkpoint {checkpointer.root / f'step_{checkpointer.last_saved_step:08d}'}"
                    if checkpointer.last_saved_step >= 0
                    else ""
                )
            )
    except TrainingAborted as e:
        checkpointer.finish(trainer.step, stopped=True)  # an earlier, healthy step's background save publishes
        healthy = last_healthy(checkpointer.root)
        raise TrainingAborted(
            f"{e}; "
            + (
                f"the last healthy checkpoint is {healthy} (checkpoint.load={healthy})"
                if healthy
                else "no healthy checkpoint was saved"
            )
        ) from None
    finally:
        logger.close()


def _evaluate_only(cfg, trainer, logger) -> None:
    """train.eval_only: one evaluation of the loaded weights, logged (console and metrics.jsonl); nothing saved."""
    import math

    try:
        loss = trainer.evaluate()
        logger.log_eval(trainer.step, {"loss": loss})
        sequences = cfg.train.eval_steps * cfg.train.micro_batch_size * trainer.parallel.dp
        logger.info(
            f"evaluated the weights of step {trainer.step} on {sequences} held-out sequences of "
            f"{cfg.train.seq_len} tokens: loss {loss:.4f}, perplexity {math.exp(min(loss, 700)):.2f}"
        )
    finally:
        logger.close()


def _resume_changes(cfg, meta: dict, trainer) -> list[str]:
    """The lines saying how the world size, the learning-rate schedule and the model's computation differ from
    the resumed checkpoint's (none when nothing did)."""
    from tpframe.models.config import computation_change
    from tpframe.optim.lr import schedule_change
    from tpframe.training.config import from_dict

    saved = meta["config"]
    saved_cfg = from_dict({"optim": saved["optim"], "model": saved["model"]})
    step, world, was = trainer.step, trainer.parallel.world_size, meta["layout"]
    lines = [
        f"world {was['world']} -> {world} since the checkpoint: dp {was['dp']} -> {trainer.parallel.dp}, global "
        f"batch {cfg.train.global_batch_size} as before ({trainer.accum} micro-batches per rank), the same samples"
        if was["world"] != world
        else "",
        schedule_change(step, cfg.optim, cfg.train.steps, saved_cfg.optim, saved["train"]["steps"]),
        computation_change(cfg.model, saved_cfg.model),
    ]
    return [line for line in lines if line]


def run(cfg, train_data, valid_data, resume=(None, None)):
    """Build the parallel state, model, strategy, trainer and checkpointer, then train. Returns the trainer."""
    from tpframe.checkpoint.checkpointer import Checkpointer
    from tpframe.observe.flops import peak_tflops
    from tpframe.observe.logger import MetricsLogger
    from tpframe.observe.profiler import StepProfiler
    from tpframe.optim import build_strategy
    from tpframe.parallel import destroy_parallel, seed_parallel_rng
    from tpframe.parallel.heartbeat import Heartbeat, Progress
    from tpframe.parallel.pipeline import build_pipeline, pipeline_numel, pipeline_union
    from tpframe.parallel.rng import RNGState
    from tpframe.parallel.schedules import get_forward_only
    from tpframe.run.run_lock import run_folders
    from tpframe.run.shared_dir import check_shared
    from tpframe.training.trainer import Trainer

    p, dtype = cfg.parallel, DTYPES[cfg.train.dtype]
    state = _parallel_state(cfg)
    progress = Progress()  # what this rank is doing, for the heartbeat's reports
    beat = Heartbeat.start(state, timeout_s=cfg.comm.timeout_s, progress=progress)
    try:
        check_shared(run_folders(cfg), rank=state.rank)  # several nodes: one filesystem for the run's files
        tracker = seed_parallel_rng(cfg.train.seed)
        model, notes = _build_model(cfg, state, tracker, resume)
        num_params = pipeline_numel(model, state)  # every stage's, the tied copy once
        vocab_tables = [n for n, q in model.named_parameters() if q.vocab_rows]
        vocab_tensors = pipeline_union(state, vocab_tables)  # every stage's (embedding first, head last)
        pipeline = None
        if p.pp > 1:
            pipeline = build_pipeline(
                state,
                schedule=p.pp_schedule,
                virtual_stages=p.virtual_stages,
                seq_len=cfg.train.seq_len // p.cp,
                micro_batch_size=cfg.train.micro_batch_size,
                hidden=cfg.model.hidden,
                sequence_parallel=p.sequence_parallel,
                dtype=dtype,
                timeout_s=p.pp_timeout_s,
            )
        strategy = build_strategy(
            p.dp_strategy,
            model,
            cfg.optim,
            state,
            bucket_mb=p.grad_bucket_mb,
            overlap_grad_sync=p.overlap_grad_sync,
            compute_dtype=dtype,
            reduce_dtype=getattr(torch, p.grad_reduce_dtype),
        )
        start_step = resume[1]["train"]["step"] if resume[1] else 0
        logger = MetricsLogger(
            cfg.logging,
            cfg.train.run_dir,
            state.rank == 0,
            cfg.train.steps,
            cfg.to_dict(),
            start_step,
            open_files=False,
        )  # opened once the checkpoint has loaded: a corrupt one writes nothing
        trainer = Trainer(
            cfg,
            state,
            model,
            strategy,
            train_data,
            valid_data,
            logger,
            forward_backward=_schedule(cfg, state, pipeline, logger.info),
            forward_only=get_forward_only(p.pp, pipeline),
            progress=progress,
            peak_tflops=peak_tflops(state.device, dtype, cfg.logging.peak_tflops),
            profiler=StepProfiler.open(
                cfg.profile,
                rank=state.rank,
                device=state.device,
                run_dir=cfg.train.run_dir,
                log=logger.info if logger.is_main else _print_now,
            ),
        )
        checkpointer = Checkpointer(
            cfg,
            state,
            tensors=strategy,
            rng=RNGState(state.device, tracker),
            meta={"train": trainer, "data": train_data, "health": trainer.guard},
            vocab_tensors=vocab_tensors,
            resume=resume,
            log=logger.info,
            health=trainer.guard,
        )
        for kind, group in checkpointer.groups.items() if beat is not None else ():
            beat.watch(kind, group)  # a stop inside a save is named by its collective, like one in a step
        progress.mark(0, "load")
        checkpointer.load()  # model, optimizer, data position, RNG, step
        logger.open()  # config.yaml, metrics.jsonl
        for line in _describe(cfg, state, num_params=num_params, strategy=strategy, trainer=trainer) + notes:
            logger.info(line)
        if checkpointer.loaded_from is not None:
            ignored = (
                f" (checkpoint.init_from={cfg.checkpoint.init_from} ignored)"
                if cfg.checkpoint.init_from and cfg.optim.lora_rank is None
                else ""
            )
            logger.info(f"resumed at step {trainer.step} from {checkpointer.loaded_from}{ignored}")
            for line in _resume_changes(cfg, resume[1], trainer) if resume[1] is not None else []:
                logger.info(line)
        if cfg.train.eval_only:
            _evaluate_only(cfg, trainer, logger)
            return trainer
        if trainer.step >= cfg.train.steps:  # e.g. a finished run launched again
            logger.info(
                f"this run is already at its last step (step {trainer.step}, train.steps={cfg.train.steps}): "
                "nothing to train; raise train.steps to continue it, or use another train.run_dir"
                if trainer.step
                else "train.steps=0: nothing to train"
            )
        _train(cfg, trainer, checkpointer, logger)
        trainer.checkpointer = checkpointer
        return trainer
    except Exception as e:
        from tpframe.run.memory import is_out_of_memory, out_of_memory

        if is_out_of_memory(e):  # this rank alone: its line goes out now, before the teardown below
            from tpframe import exits

            failure = out_of_memory(
                e, cfg, rank=state.rank, dp=state.dp_cp, step=progress.step, phase=progress.phase, device=state.device
            )
            exits.report(f"out of memory: {failure}", show=True)
            raise failure from None
        failure = beat.explain(e) if beat is not None else e  # a communication failure, explained in one line
        if failure is e:
            raise
        raise failure from None
    finally:
        if beat is not None:
            beat.stop()
        destroy_parallel()


def _stop_with_the_launcher() -> None:
    """Under tpframe.launch, SIGTERM when the launcher dies (Linux's parent-death signal): an orphan saves and stops
    (the checkpointer's handler) instead of training on and holding the run's lock; one already orphaned stops now."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher and sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1: PR_SET_PDEATHSIG
        if os.getppid() != int(launcher):  # it died before the prctl
            signal.raise_signal(signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    """Train; the exit code (0, 2, 3, 4, 5, 6) and the one line each failure prints are tpframe/exits.py's."""
    from tpframe import exits
    from tpframe.checkpoint.files import SaveFailed
    from tpframe.parallel.heartbeat import CommFailure
    from tpframe.run.memory import OutOfMemory
    from tpframe.run.run_lock import locks_of
    from tpframe.training.health import TrainingAborted

    _stop_with_the_launcher()
    try:
        rank = launch_env().rank
    except ConfigError:  # prepare says what is wrong with it, as rank 0
        rank = 0
    try:
        prepared = prepare(argv)
    except ConfigError as e:
        return exits.config_error(str(e), rank)
    single_process_env()
    locks = locks_of(prepared[0]) if rank == 0 else []  # one training per run (and checkpoint) directory
    try:
        for lock in locks:
            lock.acquire()
    except ConfigError as e:
        for lock in locks:
            lock.release()
        return exits.config_error(str(e), rank)
    try:
        run(*prepared)
    except ConfigError as e:  # found once the process groups exist (e.g. a model that builds only for real)
        exits.report(f"config error: {e}", show=rank == 0)
        return exits.EXIT_CONFIG
    except TrainingAborted as e:
        exits.report(f"training stopped: {e}", show=rank == 0)
        return exits.EXIT_DIVERGED
    except CommFailure as e:
        exits.report(str(e), show=e.report)
        return exits.EXIT_COMM
    except SaveFailed as e:  # every rank raises it alike (tpframe/checkpoint/checkpointer.py)
        exits.report(f"checkpoint not saved: {e}", show=rank == 0)
        return exits.EXIT_SAVE
    except OutOfMemory:  # printed where it happened (run)
        return exits.EXIT_OOM
    except OSError as e:  # a full disk or a folder made read-only under another of the run's files (its config)
        if e.errno not in exits.DISK_FULL_OR_READ_ONLY:
            raise
        exits.report(
            f"cannot write {e.filename or 'a file of the run'} ({e.strerror}): free space or make it "
            "writable, then relaunch (the last checkpoint is intact)",
            show=True,
        )
        return exits.EXIT_SAVE
    except KeyboardInterrupt:
        return exits.EXIT_INTERRUPTED
    finally:
        for lock in locks:
            lock.release()
    return 0


if __name__ == "__main__":
    code = main()
    if code == 4:  # a peer is gone: skip the interpreter's teardown of process groups that may block on it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
