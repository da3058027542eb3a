"""The training loop: it only sequences the parts of a step, evaluates, logs and asks the checkpointer.

One optimizer step, in order:
  1. `forward_backward` (a schedule from tpframe.parallel.schedules) runs the micro-batches; gradients
     accumulate in fp32 and the strategy starts syncing them during the last backward;
  2. `strategy.finish_grad_sync()`: DP reduction done, sequence-parallel grads summed over TP;
  3. `strategy.clip_grad_norm()`: the global norm (each TP shard, DP shard and replicated param once);
  4. `strategy.step(lr)`: AdamW on fp32 masters (skipped, and counted, when the norm is not finite).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch
from torch import nn

from tpframe.optim import GradStrategy, lr_at
from tpframe.parallel.schedules import forward_only_no_pipelining
from tpframe.parallel.state import ParallelState
from tpframe.training.config import Config, grad_accumulation_steps


class Trainer:
    def __init__(self, cfg: Config, parallel: ParallelState, model: nn.Module, strategy: GradStrategy, train_data,
                 valid_data, logger, *, forward_backward: Callable, forward_only: Callable | None = None,
                 peak_tflops: float | None = None):
        self.cfg, self.parallel, self.model, self.strategy = cfg, parallel, model, strategy
        self.train_data, self.valid_data, self.logger = train_data, valid_data, logger
        self.forward_backward = forward_backward
        self.forward_only = forward_only or forward_only_no_pipelining  # evaluation
        self.accum = grad_accumulation_steps(cfg, parallel.world_size)
        self.tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
        self.flops_per_step = model.flops_per_token(cfg.train.seq_len) * self.tokens_per_step
        self.peak_tflops = peak_tflops
        self.step = 0  # optimizer steps done
        self.tokens_seen = 0
        self.skipped_steps = 0
        self.history: list[dict[str, Any]] = []
        self.stop_requested = False  # set when the checkpointer saw a preemption signal

    # -- checkpointed counters (the Stateful protocol) -------------------------------------------
    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.skipped_steps = state.get("skipped_steps", 0)

    # -- one step ---------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        cfg, parallel = self.cfg, self.parallel
        self.model.train()
        self.strategy.zero_grad()
        loss_sum = self.forward_backward(self.model, self.train_data, self.accum, grad_sync=self.strategy,
                                         device=parallel.device)
        self.strategy.finish_grad_sync()
        grad_norm = self.strategy.clip_grad_norm(cfg.optim.grad_clip)
        lr = lr_at(self.step, cfg.optim, cfg.train.steps)
        if math.isfinite(grad_norm):
            self.strategy.step(lr)
        else:
            self.skipped_steps += 1
            self.logger.info(f"step {self.step + 1}: non-finite gradient norm ({grad_norm}); update skipped")
        loss = parallel.dp_comm.all_reduce(loss_sum).item() / parallel.dp
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        return {"loss": loss, "lr": lr, "grad_norm": grad_norm}

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the same `eval_steps` held-out micro-batches every time, averaged over DP."""
        self.model.eval()
        self.valid_data.reset()
        mean = self.forward_only(self.model, self.valid_data, self.cfg.train.eval_steps, device=self.parallel.device)
        self.model.train()
        return self.parallel.dp_comm.all_reduce(mean).item() / self.parallel.dp

    # -- the loop ---------------------------------------------------------------------------------
    def train(self, checkpointer=None) -> list[dict[str, Any]]:
        cfg = self.cfg
        interval, eval_every = cfg.logging.interval, cfg.train.eval_interval
        window_start, window_steps = time.perf_counter(), 0
        while self.step < cfg.train.steps and not self.stop_requested:
            metrics = self.train_step()
            window_steps += 1
            record = {"step": self.step, **metrics}
            if self.step % interval == 0 or self.step == cfg.train.steps:
                if self.parallel.device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - window_start
                record.update(self._throughput(elapsed / window_steps))
                self.logger.log_train(self.step, {k: v for k, v in record.items() if k != "step"})
                window_start, window_steps = time.perf_counter(), 0
            if eval_every and cfg.train.eval_steps and (self.step % eval_every == 0 or self.step == cfg.train.steps):
                record["eval_loss"] = self.evaluate()
                self.logger.log_eval(self.step, {"loss": record["eval_loss"]})
                window_start = time.perf_counter()  # evaluation time is not training throughput
            self.history.append(record)
            if checkpointer is not None and checkpointer.after_step(self.step):
                self.stop_requested = True
        return self.history

    def _throughput(self, seconds_per_step: float) -> dict[str, float]:
        tokens_per_s = self.tokens_per_step / seconds_per_step
        tflops = self.flops_per_step / seconds_per_step / self.parallel.world_size / 1e12  # per device
        out = {"tokens_per_s": tokens_per_s, "tflops": tflops, "step_time": seconds_per_step}
        if self.peak_tflops:
            out["mfu"] = tflops / self.peak_tflops
        if self.parallel.device.type == "cuda":
            out["mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        else:
            import resource

            out["mem_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
        return out
