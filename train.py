"""tpframe's entry point.

    torchrun --nproc-per-node N train.py --config configs/X.yaml [section.key=value ...]
    python train.py --config configs/tiny_cpu.yaml parallel.tp=1     # one process, no torchrun needed

The path of a token, top to bottom:
    build_data (tpframe/data/loader.py) -> Trainer.train_step (tpframe/training/trainer.py)
    -> model(input_ids, labels) (tpframe/models/gpt.py: embedding -> blocks -> head)
    -> vocab_parallel_cross_entropy (tpframe/layers/cross_entropy.py) -> per-token loss.

Configuration mistakes stop here with one line and exit code 2, before any process group exists.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch

from tpframe.training.config import ConfigError, load_config, validate

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from tpframe.training.config_help import help_table

    parser = argparse.ArgumentParser(description=__doc__, epilog=help_table(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config (defaults when omitted)")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. parallel.tp=2 train.steps=100")
    return parser.parse_args(argv)


def _single_process_env() -> None:
    """Let `python train.py` run without torchrun: a world of one process."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def prepare(argv: list[str] | None):
    """Parse and check everything that can be checked before any process group is built."""
    from tpframe.checkpoint import preflight
    from tpframe.data import build_data
    from tpframe.models import resolve_builder
    from tpframe.parallel.state import coords_of

    args = parse_args(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    cfg = load_config(args.config, args.overrides)
    validate(cfg, world)
    resolve_builder(cfg.model.name)
    _, dp_rank, _ = coords_of(rank, world, cfg.parallel.tp, cfg.parallel.pp)
    dp = world // (cfg.parallel.tp * cfg.parallel.pp)
    try:
        train_data, valid_data, data_vocab = build_data(cfg.data, cfg.train.seq_len, cfg.train.micro_batch_size, dp_rank, dp)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from None
    if data_vocab > cfg.model.vocab_size:
        raise ConfigError(
            f"the data has token ids up to {data_vocab - 1} but model.vocab_size={cfg.model.vocab_size}; "
            f"set model.vocab_size={data_vocab} or more"
        )
    resume = preflight(cfg)  # the checkpoint to resume from, checked before anything is built
    return cfg, train_data, valid_data, resume


def run(cfg, train_data, valid_data, resume=(None, None)):
    """Build the parallel state, model, strategy, trainer and checkpointer, then train. Returns the trainer."""
    from tpframe.checkpoint.checkpointer import Checkpointer
    from tpframe.checkpoint.init_from import load_init_from
    from tpframe.models import BuildContext, build_model
    from tpframe.optim import build_strategy
    from tpframe.parallel import destroy_parallel, initialize_parallel, seed_parallel_rng
    from tpframe.parallel.rng import RNGState
    from tpframe.parallel.schedules import get_forward_backward
    from tpframe.parallel.sharding import logical_numel
    from tpframe.training.flops import peak_tflops
    from tpframe.training.logger import MetricsLogger
    from tpframe.training.trainer import Trainer

    p = cfg.parallel
    state = initialize_parallel(tp=p.tp, pp=p.pp, comm_backend=cfg.comm.backend)
    try:
        tracker = seed_parallel_rng(cfg.train.seed)
        dtype = DTYPES[cfg.train.dtype]
        ctx = BuildContext(
            state.tp_comm, sequence_parallel=p.sequence_parallel, activation_checkpointing=p.activation_checkpointing,
            rng_tracker=tracker, dtype=torch.float32 if p.dp_strategy == "fsdp" else dtype,  # fsdp: fp32 masters
            device=state.device, seed=cfg.train.seed,
        )
        model = build_model(cfg.model, ctx)
        initialized = None
        if cfg.checkpoint.init_from and resume[0] is None:  # weights first: the strategy copies them
            initialized = load_init_from(model, cfg.model, cfg.checkpoint.init_from, state.tp_rank, state.tp)
        num_params = logical_numel(model, state.tp)
        vocab_tensors = [n for n, q in model.named_parameters() if getattr(q, "vocab_rows", None)]
        strategy = build_strategy(
            p.dp_strategy, model, cfg.optim, state, bucket_mb=p.grad_bucket_mb, overlap_grad_sync=p.overlap_grad_sync,
            overlap_param_gather=p.overlap_param_gather, compute_dtype=dtype,
        )
        start_step = resume[1]["train"]["step"] if resume[1] else 0
        logger = MetricsLogger(cfg.logging, cfg.train.run_dir, state.rank == 0, cfg.train.steps, cfg.to_dict(), start_step)
        trainer = Trainer(cfg, state, model, strategy, train_data, valid_data, logger,
                          forward_backward=get_forward_backward(p.pp), peak_tflops=peak_tflops(state.device, dtype, cfg.logging.peak_tflops))
        checkpointer = Checkpointer(cfg, state, tensors=strategy, meta={"train": trainer, "data": train_data},
                                    rng=RNGState(state.device, tracker), vocab_tensors=vocab_tensors, resume=resume, log=logger.info)
        checkpointer.load()  # model, optimizer, data position, RNG, step
        logger.info(
            f"tpframe: {num_params / 1e6:.2f}M params | world {state.world_size} = tp {state.tp} x dp {state.dp} "
            f"x pp {state.pp} | {cfg.train.dtype} on {state.device.type} | seq {cfg.train.seq_len}, global batch "
            f"{cfg.train.global_batch_size} ({trainer.accum} micro-batches of {cfg.train.micro_batch_size} per rank)"
        )
        logger.info(f"gradients and optimizer: {strategy.describe()}; optimizer state {strategy.state_bytes() / 2**20:.2f} MiB per rank")
        if checkpointer.loaded_from is not None:
            ignored = f" (checkpoint.init_from={cfg.checkpoint.init_from} ignored)" if cfg.checkpoint.init_from else ""
            logger.info(f"resumed at step {trainer.step} from {checkpointer.loaded_from}{ignored}")
        elif initialized:
            logger.info(f"initialized the weights from {initialized}")
        if trainer.step >= cfg.train.steps:  # e.g. a finished run launched again
            logger.info(f"this run is already at its last step (step {trainer.step}, train.steps={cfg.train.steps}): "
                        "nothing to train; raise train.steps to continue it, or use another train.run_dir"
                        if trainer.step else "train.steps=0: nothing to train")
        try:
            trainer.train(checkpointer)
            checkpointer.finish(trainer.step, trainer.stop_requested)
            if trainer.history:
                last = trainer.history[-1]
                logger.info(
                    f"done at step {trainer.step}: loss {last['loss']:.4f}"
                    + (f", eval loss {last['eval_loss']:.4f}" if "eval_loss" in last else "")
                    + (f"; checkpoint {checkpointer.root / ('step_%08d' % checkpointer.last_saved_step)}" if checkpointer.last_saved_step >= 0 else "")
                )
        finally:
            logger.close()
        trainer.checkpointer = checkpointer
        return trainer
    finally:
        destroy_parallel()


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, train_data, valid_data, resume = prepare(argv)
    except ConfigError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"tpframe: config error: {e}", file=sys.stderr)
        return 2
    _single_process_env()
    run(cfg, train_data, valid_data, resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())
