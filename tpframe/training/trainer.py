"""The training loop: micro-batches -> backward -> grad sync -> clip -> AdamW, with eval and logging.

One optimizer step, in order:
  1. for each of the `accum` micro-batches: forward (per-token loss), backward; the GradBuffer hooks
     accumulate every gradient in fp32 (`param.main_grad`);
  2. sum the partial grads of sequence-parallel params over TP; average all grads over DP;
  3. clip by the global norm (each TP shard and each replicated param counted once);
  4. AdamW on the fp32 masters with this step's learning rate.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch import nn

from tpframe.parallel.data_parallel import GradBuffer
from tpframe.parallel.state import ParallelState
from tpframe.training.config import Config, grad_accumulation_steps
from tpframe.training.optim import MasterAdamW, clip_grad_norm_
from tpframe.training.schedule import lr_at


class Trainer:
    def __init__(self, cfg: Config, state: ParallelState, model: nn.Module, train_data, valid_data, logger, peak_tflops: float | None = None):
        self.cfg, self.state, self.model = cfg, state, model
        self.train_data, self.valid_data, self.logger = train_data, valid_data, logger
        self.grads = GradBuffer(model.parameters())
        self.optimizer = MasterAdamW(list(model.named_parameters()), cfg.optim)
        self.accum = grad_accumulation_steps(cfg, state.world_size)
        self.tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
        self.flops_per_step = model.flops_per_token(cfg.train.seq_len) * self.tokens_per_step
        self.peak_tflops = peak_tflops
        self.step = 0  # optimizer steps done
        self.tokens_seen = 0
        self.skipped_steps = 0
        self.history: list[dict[str, Any]] = []
        self.checkpointer = None  # set by train.py; called after every step
        self.stop_requested = False  # set by a preemption signal handler

    # -- one step ---------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        cfg, state = self.cfg, self.state
        self.model.train()
        self.grads.zero()
        loss_sum = torch.zeros((), dtype=torch.float32, device=state.device)
        for _ in range(self.accum):
            input_ids, labels = self.train_data.next()
            input_ids, labels = input_ids.to(state.device, non_blocking=True), labels.to(state.device, non_blocking=True)
            loss = self.model(input_ids, labels).mean() / self.accum
            loss.backward()
            loss_sum += loss.detach()
        self.grads.sync_sequence_parallel(state.tp_comm)
        self.grads.allreduce_data_parallel(state.dp_comm)
        grad_norm = clip_grad_norm_(self.grads, cfg.optim.grad_clip, state.mp_comm, state.tp_rank)
        lr = lr_at(self.step, cfg.optim, cfg.train.steps)
        if math.isfinite(grad_norm):
            self.optimizer.step(lr)
        else:
            self.skipped_steps += 1
            self.logger.info(f"step {self.step + 1}: non-finite gradient norm ({grad_norm}); update skipped")
        loss = state.dp_comm.all_reduce(loss_sum).item() / state.dp
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        return {"loss": loss, "lr": lr, "grad_norm": grad_norm}

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the same `eval_steps` held-out micro-batches every time, averaged over DP."""
        self.model.eval()
        self.valid_data.reset()
        total = torch.zeros((), dtype=torch.float32, device=self.state.device)
        for _ in range(self.cfg.train.eval_steps):
            input_ids, labels = self.valid_data.next()
            total += self.model(input_ids.to(self.state.device), labels.to(self.state.device)).mean()
        self.model.train()
        return self.state.dp_comm.all_reduce(total).item() / (self.state.dp * max(1, self.cfg.train.eval_steps))

    # -- the loop ---------------------------------------------------------------------------------
    def train(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        interval, eval_every = cfg.logging.interval, cfg.train.eval_interval
        window_start, window_steps = time.perf_counter(), 0
        while self.step < cfg.train.steps and not self.stop_requested:
            metrics = self.train_step()
            window_steps += 1
            record = {"step": self.step, **metrics}
            if self.step % interval == 0 or self.step == cfg.train.steps:
                if self.state.device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - window_start
                record.update(self._throughput(elapsed / window_steps))
                self.logger.log_train(self.step, {k: v for k, v in record.items() if k != "step"})
                window_start, window_steps = time.perf_counter(), 0
            if eval_every and self.cfg.train.eval_steps and (self.step % eval_every == 0 or self.step == cfg.train.steps):
                record["eval_loss"] = self.evaluate()
                self.logger.log_eval(self.step, {"loss": record["eval_loss"]})
                window_start = time.perf_counter()  # evaluation time is not training throughput
            self.history.append(record)
            if self.checkpointer is not None:
                self.checkpointer.after_step(self)
        return self.history

    def _throughput(self, seconds_per_step: float) -> dict[str, float]:
        tokens_per_s = self.tokens_per_step / seconds_per_step
        tflops = self.flops_per_step / seconds_per_step / self.state.world_size / 1e12  # per device
        out = {"tokens_per_s": tokens_per_s, "tflops": tflops, "step_time": seconds_per_step}
        if self.peak_tflops:
            out["mfu"] = tflops / self.peak_tflops
        if self.state.device.type == "cuda":
            out["mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        else:
            import resource

            out["mem_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
        return out
