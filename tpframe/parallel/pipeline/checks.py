"""The `parallel:` section's pipeline keys (pp_schedule, virtual_stages, layers_per_stage, pp_timeout_s) checked
against the model and the batch, before any process group exists."""

from __future__ import annotations

from tpframe.comm.config import TIMEOUT_MAX_S
from tpframe.config import check_at_least, check_ranges
from tpframe.errors import ConfigError, shown


def check_pipeline(cfg, dp: int) -> None:
    """Pipeline keys of the run's Config `cfg` at data-parallel size `dp`."""
    p, layers = cfg.parallel, cfg.model.layers
    v, schedule = p.virtual_stages, p.pp_schedule
    check_ranges("parallel", p, (("pp_timeout_s", 0.0, TIMEOUT_MAX_S, False),))
    check_at_least("parallel", p, ("virtual_stages",))
    if p.pp == 1 and (v > 1 or p.layers_per_stage is not None):
        raise ConfigError("parallel.virtual_stages and parallel.layers_per_stage split a pipeline; set parallel.pp > 1")
    if p.pp == 1:
        return
    if schedule == "interleaved_1f1b" and v < 2:
        raise ConfigError("parallel.pp_schedule=interleaved_1f1b needs parallel.virtual_stages >= 2 (chunks per rank)")
    if schedule != "interleaved_1f1b" and v > 1:
        raise ConfigError(f"parallel.virtual_stages={v} needs parallel.pp_schedule=interleaved_1f1b (got {schedule})")
    _check_stages(p.layers_per_stage, stages=p.pp * v, layers=layers, pp=p.pp, v=v)
    micro = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)
    if micro < p.pp or (schedule == "interleaved_1f1b" and micro % p.pp):
        need = f"a multiple of parallel.pp={p.pp}" if schedule == "interleaved_1f1b" else f"at least parallel.pp={p.pp}"
        raise ConfigError(
            f"parallel.pp_schedule={schedule} needs the micro-batches per step, train.global_batch_size/"
            f"(train.micro_batch_size*dp) = {micro}, to be {need}; raise train.global_batch_size or lower "
            "train.micro_batch_size"
        )
    if p.dp_strategy == "fsdp" and schedule == "zb_h1":
        raise ConfigError(
            "parallel.pp_schedule=zb_h1 defers weight gradients past FSDP's reduce-scatter; use "
            "parallel.dp_strategy=ddp or zero1 with it"
        )


def _check_stages(counts: list[int] | None, *, stages: int, layers: int, pp: int, v: int) -> None:
    """model.layers over the pipeline's `stages`: evenly, or as parallel.layers_per_stage says."""
    if counts is None:
        if layers % stages:
            raise ConfigError(
                f"model.layers={layers} is not divisible by parallel.pp*parallel.virtual_stages = {pp}*{v} = "
                f"{stages}; change them or give parallel.layers_per_stage ({stages} counts that add up to {layers})"
            )
        return
    if len(counts) != stages or min(counts) < 1 or sum(counts) != layers:
        wrong = (
            f"it has {len(counts)}"
            if len(counts) != stages
            else f"a stage of {min(counts)} layers"
            if min(counts) < 1
            else f"they add up to {sum(counts)}"
        )
        raise ConfigError(
            f"parallel.layers_per_stage={shown(counts)} must be {stages} counts (parallel.pp*parallel.virtual_stages), "
            f"each at least 1, adding up to model.layers={layers} ({wrong})"
        )
