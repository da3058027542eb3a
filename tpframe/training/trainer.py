"""The training loop: it only sequences the parts of a step, evaluates, logs and asks the checkpointer.

One optimizer step, in order:
  1. `forward_backward` (a schedule from tpframe.parallel.schedules) runs the micro-batches; gradients
     accumulate in fp32 and the strategy starts syncing them during the last backward;
  2. `strategy.finish_grad_sync()`: DP reduction done, sequence-parallel grads summed over TP;
  3. `strategy.clip_grad_norm()`: the global norm (each TP shard, DP shard and replicated param once);
  4. `strategy.step(lr)`: AdamW on fp32 masters.
Steps 1-3 are one try; a try whose loss or norm is not finite is re-run once and then applied, skipped
or ends training, as `guard` (tpframe/training/health.py) decides.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tpframe.observe.energy import EnergyMeter, sum_over_ranks
from tpframe.observe.profiler import StepProfiler
from tpframe.observe.stragglers import StragglerReport
from tpframe.observe.timers import PhaseTimers, TimedBatches
from tpframe.optim import GradStrategy, lr_at
from tpframe.parallel.heartbeat import Progress
from tpframe.parallel.rng import RNGState
from tpframe.parallel.schedules import forward_only_no_pipelining
from tpframe.parallel.state import ParallelState
from tpframe.training.config import Config, grad_accumulation_steps
from tpframe.training.health import StepGuard
from tpframe.training.loss_mask import StepBatches, per_token_scale
from tpframe.training.replica_weights import ReplicaWeightCheck
from tpframe.training.replicas import ReplicaGradCheck


class Trainer:
    def __init__(
        self,
        cfg: Config,
        parallel: ParallelState,
        model: nn.Module,
        strategy: GradStrategy,
        train_data,
        valid_data,
        logger,
        *,
        forward_backward: Callable,
        forward_only: Callable | None = None,
        peak_tflops: float | None = None,
        guard: StepGuard | None = None,
        progress: Progress | None = None,
        profiler: StepProfiler | None = None,
    ):
        self.cfg, self.parallel, self.model, self.strategy = cfg, parallel, model, strategy
        self.train_data, self.valid_data, self.logger = train_data, valid_data, logger
        self.forward_backward = forward_backward
        self.forward_only = forward_only or forward_only_no_pipelining  # evaluation
        rng = RNGState(parallel.device, parallel.rng_tracker)
        self.guard = guard or StepGuard(
            cfg.train,
            model,
            data=train_data,
            rng=rng,
            dp_comm=parallel.dp_cp_comm,
            cp=parallel.cp,
            rank=parallel.rank,
            log=logger.info,
        )
        self.progress = progress or Progress()  # what this rank is doing, for timeout reports
        self.profiler = profiler  # the config's `profile` window on this rank, or None
        self.accum = grad_accumulation_steps(cfg, parallel.world_size)
        self.eod_mask = cfg.model.eod_id if cfg.data.eod_mask_loss else None  # labels after it carry no loss
        self.tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
        self.flops_per_step = model.flops_per_token(cfg.train.seq_len) * self.tokens_per_step
        self.peak_tflops = peak_tflops
        self.step = 0  # optimizer steps done
        self.tokens_seen = 0
        self.skipped_steps = 0
        self.history: list[dict[str, Any]] = []
        self.stop_requested = False  # set when the checkpointer saw a preemption signal
        self.timers = PhaseTimers(parallel.device, cfg.logging.timers)
        self.energy = EnergyMeter.open(parallel.device, logger.info)  # None on CPU: no energy fields
        self._open_checks(cfg, parallel, model)

    def _open_checks(self, cfg: Config, parallel: ParallelState, model: nn.Module) -> None:
        """The checks the config asks for: TP replicas' gradients in the launch's first step, slow ranks at each log
        step, every train.compare_replicas_every steps the copies of each weight."""
        self.replica_check = self.stragglers = self.weight_check = None
        if cfg.train.check_replicas and parallel.tp > 1:
            self.replica_check = ReplicaGradCheck(model, parallel.tp_comm, device=parallel.device)
        if parallel.world_size > 1 and cfg.logging.timers != "none":  # the DP replicas wait for a slow rank
            self.stragglers = StragglerReport(
                pp_rank=parallel.pp_rank,
                world=parallel.world_size,
                ratio=cfg.logging.straggler_ratio,
                device=parallel.device,
            )
        if cfg.train.compare_replicas_every:
            self.weight_check = ReplicaWeightCheck(model, parallel, every=cfg.train.compare_replicas_every)

    # -- checkpointed counters (the Stateful protocol) -------------------------------------------
    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.skipped_steps = state.get("skipped_steps", 0)

    # -- one step ---------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        cfg = self.cfg
        self.model.train()
        loss, grad_norm, apply = self.guard.run_step(self.step + 1, self._attempt)
        lr = lr_at(self.step, cfg.optim, cfg.train.steps)
        finished = {}
        if apply:
            self.progress.mark(self.step + 1, "optimizer")
            self.strategy.step(lr)
            finish = getattr(self.model, "finish_step", None)  # the model's own after-update work (MoE: expert biases)
            finished = finish(self.parallel.dp_cp_comm) if finish is not None else {}
        else:
            self.skipped_steps += 1
        self.timers.mark("optim")
        self.step += 1
        if self.weight_check is not None and self.weight_check.due(self.step):
            self.progress.mark(self.step, "compare_replicas")
            self.weight_check.verify(self.step)  # ReplicasDiverged (exit code 3) on every rank, or nothing
        self.tokens_seen += self.tokens_per_step
        return {"loss": loss, "lr": lr, "grad_norm": grad_norm, **self._aux_losses(), **finished}

    def _aux_losses(self) -> dict[str, float]:
        """The model's auxiliary losses (MoE: load balancing, router z-loss), each the mean over every rank's layers:
        summed over a model replica (TP x PP), then over the replicas (DP x CP)."""
        aux = getattr(self.model, "aux_losses", None)
        losses = aux() if aux is not None else {}
        if not losses:
            return {}
        total = torch.stack(list(losses.values())).to(self.parallel.device, torch.float32)  # [kinds, (sum, count)]
        for comm in (self.parallel.mp_comm, self.parallel.dp_cp_comm):
            if comm.size > 1:
                total = comm.all_reduce(total, donate=True)
        means = (total[:, 0] / total[:, 1].clamp(min=1)).tolist()
        return dict(zip(losses, means))

    def _attempt(self) -> tuple[float, float]:
        """One try of the step: (loss averaged over DP, global gradient norm); no update yet."""
        parallel, mark, step = self.parallel, self.progress.mark, self.step + 1
        self.timers.begin()  # a re-run starts the phase times over
        self.strategy.zero_grad()
        start = getattr(self.model, "start_step", None)  # the model's own (MoE: loads counted anew, aux losses scaled)
        if start is not None:
            start(self.accum)
        mark(step, "forward_backward")
        check, self.replica_check = self.replica_check, None
        batches, extra = self._batches(TimedBatches(self.train_data, self.timers), self.accum)
        with check or contextlib.nullcontext():
            loss_sum = self.forward_backward(
                self.model, batches, self.accum, grad_sync=self.strategy, device=parallel.device, **extra
            )
        if check is not None:
            check.verify()  # before any update: a ConfigError, exit code 2
        self.timers.mark("fwd_bwd")
        mark(step, "grad_sync")
        self.strategy.finish_grad_sync()
        self.timers.mark("grad_sync")
        mark(step, "grad_norm")
        grad_norm = self.strategy.clip_grad_norm(self.cfg.optim.grad_clip)
        mark(step, "loss")
        return parallel.dp_cp_comm.all_reduce(loss_sum).item() / parallel.dp_cp, grad_norm  # CP: each rank's tokens

    def _batches(self, batches, n: int) -> tuple[Any, dict[str, float]]:
        """What a schedule reads `n` micro-batches from, and its extra keywords: with data.eod_mask_loss the
        micro-batches read up front, masked, and the `loss_scale` of their tokens that carry a loss."""
        if self.eod_mask is None:
            return batches, {}
        batches = StepBatches(batches, n, self.eod_mask)
        return batches, {"loss_scale": per_token_scale(batches.valid_tokens, self.parallel)}

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the same `eval_steps` held-out micro-batches every time, averaged over DP."""
        self.progress.mark(self.step, "eval")
        self.model.eval()
        self.valid_data.reset()
        batches, extra = self._batches(self.valid_data, self.cfg.train.eval_steps)
        mean = self.forward_only(self.model, batches, self.cfg.train.eval_steps, device=self.parallel.device, **extra)
        self.model.train()
        return self.parallel.dp_cp_comm.all_reduce(mean).item() / self.parallel.dp_cp

    # -- the loop ---------------------------------------------------------------------------------
    def train(self, checkpointer=None) -> list[dict[str, Any]]:
        with scheduled_gc(self.cfg.train.gc_interval):
            return self._train(checkpointer)

    def _train(self, checkpointer) -> list[dict[str, Any]]:
        cfg = self.cfg
        gc_every = cfg.train.gc_interval
        interval, eval_every = cfg.logging.interval, cfg.train.eval_interval
        first_step = self.step + 1  # always logged: the starting loss of every launch is visible
        window_start, window_steps = time.perf_counter(), 0
        if self.energy is not None:
            self.energy.reset()
        while self.step < cfg.train.steps and not self.stop_requested:
            if self.profiler is not None:
                self.profiler.before_step(self.step + 1)
            metrics = self.train_step()
            if self.profiler is not None:
                window_start += self.profiler.after_step(self.step)  # writing the trace is not training time
            window_steps += 1
            if gc_every and self.step % gc_every == 0:  # every rank at the same step (scheduled_gc)
                gc.collect(1)
            record = {"step": self.step, **metrics}
            self.progress.mark(self.step, "checkpoint")
            stop = checkpointer is not None and checkpointer.after_step(self.step)
            self.timers.mark("ckpt")
            if self.step % interval == 0 or self.step in (first_step, cfg.train.steps) or stop:
                if self.parallel.device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - window_start
                record.update(self._throughput(elapsed / window_steps))
                record.update(self.timers.window())
                if self.stragglers is not None and "fwd_bwd_ms" in record:
                    found, line = self.stragglers(record["fwd_bwd_ms"])
                    record.update(found)
                    if line is not None and self.step != first_step:  # the first step's time is each rank's warm-up
                        self.logger.info(line)
                record.update(self._energy(window_steps, elapsed))
                self.logger.log_train(self.step, {k: v for k, v in record.items() if k != "step"})
                window_start, window_steps = time.perf_counter(), 0
            if eval_every and cfg.train.eval_steps and (self.step % eval_every == 0 or self.step == cfg.train.steps):
                record["eval_loss"] = self.evaluate()
                self.logger.log_eval(self.step, {"loss": record["eval_loss"]})
                window_start = time.perf_counter()  # evaluation time (and energy) is not training throughput
                if self.energy is not None:
                    self.energy.reset()
            self.history.append(record)
            self.stop_requested = stop
        if self.profiler is not None:
            self.profiler.close()  # a window the last step (or a stop) cut short
        return self.history

    def _energy(self, steps: int, seconds: float) -> dict[str, float]:
        """Joules per step and per token, summed over every rank's GPU, over at least energy.MIN_WINDOW_S of
        training (shorter windows add up: their records have none); {} without NVML."""
        joules = sum_over_ranks(self.energy.joules_since_last() if self.energy else None, self.parallel.device)
        per_step = None if joules is None or self.energy is None else self.energy.per_step(joules, steps, seconds)
        if per_step is None:
            return {}
        return {"energy_j": per_step, "energy_j_per_token": per_step / self.tokens_per_step}

    def _throughput(self, seconds_per_step: float) -> dict[str, float]:
        tokens_per_s = self.tokens_per_step / seconds_per_step
        tflops = self.flops_per_step / seconds_per_step / self.parallel.world_size / 1e12  # per device
        out = {"tokens_per_s": tokens_per_s, "step_ms": seconds_per_step * 1e3}
        if self.parallel.device.type == "cuda":  # achieved FLOP/s and MFU mean something on an accelerator only
            out["tflops"] = tflops
            if self.peak_tflops:
                out["mfu"] = tflops / self.peak_tflops
            out["mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        else:
            import resource

            out["mem_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
        return out


@contextlib.contextmanager
def scheduled_gc(interval: int):
    """train.gc_interval > 0: Python's automatic garbage collector off while training (the loop collects the young
    generations every `interval` steps, on every rank at the same step). An automatic collection pauses one rank at
    a moment of its own, and the others wait for it at the next collective; torchtitan's `gc_freq` and Megatron's
    `--manual-gc` do the same. The collector's state is restored afterwards."""
    if not interval:
        yield
        return
    enabled = gc.isenabled()
    gc.disable()
    gc.collect()  # start from a clean heap
    try:
        yield
    finally:
        if enabled:
            gc.enable()
