"""The non-pipelined schedule with every micro-batch's forward+backward replayed from a CUDA graph
(`train.cuda_graph`): one launch per micro-batch instead of thousands, which pays where kernels are
short (small models, small micro-batches) and costs nothing measurable at GPT-1.3B (benchmarks/RESULTS.md,
'train.cuda_graph=auto: what it measured and chose').

The first `warmup_steps` optimizer steps run eagerly (compilation, cuBLAS and NCCL set-up, the
Communicator's plans). The next step captures up to two graphs into one memory pool, reading static
input buffers the batches are copied into:
  - "first": the step's first micro-batch, whose gradient hooks *copy* into the fp32 `main_grad`
    (the gradient buffer's lazy zeroing, tpframe.optim.grad_buffer);
  - "rest": any later micro-batch, whose hooks *add*.
Python does not run on a replay, so the gradient buffer's own bookkeeping (which params still have a
stale `main_grad`) is set after each replay to what it was after the capture.

What the graphs hold: forward, backward, the gradient accumulation and the TP collectives (the
Communicator picks its graph-mode backend during capture). What they do not: the DP gradient sync, which
runs after the last replay in `finish_grad_sync` (no overlap with backward: at the shapes where graphs pay,
the gradients are small), clipping and the optimizer step. Not random: dropout must be 0
(the TP RNG tracker swaps generator states on the host, which a replay cannot repeat), so activation
recompute does not save RNG states (tpframe.parallel.recompute, `preserve_rng=False`).

`auto=True` (`train.cuda_graph=auto`) measures before it commits: after the warm-up, `probe_steps` eager
steps and, after the capture, as many replayed steps, each timed from one call to the next (the whole
step: optimizer, DP sync and logging included, the device synchronized at each call). The graphs are kept
only if the replayed steps' median is at least `min_gain` faster; else they are freed and the run goes on
eagerly. Either way one line says what was measured and chosen. A capture that fails leaves the run eager.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from tpframe.errors import ConfigError
from tpframe.parallel.schedules import forward_backward_no_pipelining


def cuda_graph_obstacle(cfg) -> str | None:
    """Why train.cuda_graph cannot replay the step of the run's Config `cfg` (a fixed, non-random forward+backward),
    as the line a ConfigError says for `true`; None if nothing in the config stands in the way (the device is
    checked at start-up: tpframe.run.preflight.check_device)."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    if p.pp > 1:
        return "train.cuda_graph graphs the non-pipelined step; set parallel.pp=1 or train.cuda_graph=false"
    if p.dp_strategy == "fsdp":
        return (
            "train.cuda_graph cannot capture FSDP's per-layer gathers; use parallel.dp_strategy=ddp or zero1, "
            "or set train.cuda_graph=false"
        )
    if m.dropout > 0 or m.attention_dropout > 0:
        return (
            f"train.cuda_graph replays fixed random numbers, so it needs model.dropout=0 and "
            f"model.attention_dropout=0 (got {m.dropout:g} and {m.attention_dropout:g})"
        )
    if cfg.data.eod_mask_loss:
        return (
            "train.cuda_graph replays a fixed loss scale, and data.eod_mask_loss scales each step by its count of "
            "tokens that carry a loss; set train.cuda_graph=false or data.eod_mask_loss=false"
        )
    if m.attention_mask == "document":
        return (
            "train.cuda_graph cannot replay model.attention_mask=document: the documents' boundaries, read on the "
            "host, change every batch; set train.cuda_graph=false or model.attention_mask=causal"
        )
    if p.cp > 1:  # train.compile works: CP attention runs eager between the compiled parts of a block
        return (
            "train.cuda_graph is not supported with parallel.cp > 1 yet (context-parallel attention's all-gather "
            "and chunk kernels are not verified under capture); set train.cuda_graph=false or parallel.cp=1"
        )
    if m.moe_experts and p.ep > 1:
        return (
            "train.cuda_graph is not supported with parallel.ep > 1 yet (the all-to-all is sized on the host, "
            "every layer); set train.cuda_graph=false or parallel.ep=1"
        )
    if m.moe_experts and (t.dtype != "bfloat16" or t.fp8):
        return (
            "train.cuda_graph captures MoE experts only as grouped GEMMs, which need train.dtype=bfloat16 and "
            "train.fp8=false (otherwise each expert's GEMM is sized on the host); change those or set "
            "train.cuda_graph=false"
        )
    return None


class GraphedForwardBackward:
    """A schedule function (same signature as `forward_backward_no_pipelining`) that replays CUDA graphs
    after `warmup_steps` eager calls. `grad_sync` must be a strategy with a GradBuffer `grads` (ddp, zero1)."""

    def __init__(
        self,
        *,
        warmup_steps: int = 2,
        auto: bool = False,
        probe_steps: int = 3,
        min_gain: float = 0.03,
        log: Callable[[str], None] | None = None,
        group: dist.ProcessGroup | None = None,
    ):
        if warmup_steps < 1:
            raise ValueError(f"a CUDA-graphed schedule needs at least one eager warm-up step, got {warmup_steps}")
        if auto and probe_steps < 1:
            raise ValueError(f"train.cuda_graph=auto needs at least one probe step, got {probe_steps}")
        self.warmup_steps, self.auto, self.probe_steps, self.min_gain = warmup_steps, auto, probe_steps, min_gain
        self.log = log or (lambda text: None)
        # auto: every rank of `group` (default: the world) must choose alike, since the TP collectives inside a
        # graph and outside it take different backends: timings and capture outcomes are agreed over it
        self.group = group
        self.decision: str | None = None if auto else "graph"  # auto: None while probing, then "graph" or "eager"
        self._timed: dict[str, list[float]] = {"eager": [], "graph": []}  # auto: seconds per probed step
        self._last: tuple[str, float] | None = None  # auto: what the last probed call ran, and when it began
        self.calls = 0
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self.losses: dict[str, torch.Tensor] = {}  # each graph's static output: its micro-batch's loss / n
        self.state_after: dict[str, tuple] = {}  # the gradient buffer's host bookkeeping after each graph
        self.keys: list[str] = []  # per micro-batch of a step: the graph it replays
        self.inputs: torch.Tensor | None = None
        self.labels: torch.Tensor | None = None

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def __call__(
        self, model: nn.Module, batches, num_micro_batches: int, *, grad_sync, device: torch.device
    ) -> torch.Tensor:
        self.calls += 1
        mode = "eager" if self.calls <= self.warmup_steps else self.decision or self._probe(device)
        if mode == "eager":
            return forward_backward_no_pipelining(model, batches, num_micro_batches, grad_sync=grad_sync, device=device)
        if self.captured and num_micro_batches != len(self.keys):
            raise RuntimeError(
                f"train.cuda_graph captured steps of {len(self.keys)} micro-batches, this one has {num_micro_batches}"
            )
        buffer = grad_sync.grads
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        for i in range(num_micro_batches):
            input_ids, labels = batches.next()
            if not self.captured:
                failed = None
                try:
                    self._capture(model, buffer, input_ids, labels, num_micro_batches, device)
                except ConfigError as e:
                    if not self.auto:
                        raise
                    failed = str(e)
                if self.auto and self._agree([1.0 if failed else 0.0], device)[0] > 0:
                    self._stay_eager(
                        f"the capture failed: {failed}" if failed else "the capture failed on another rank"
                    )
                    return self._eager_rest(model, batches, input_ids, labels, num_micro_batches, grad_sync, device)
            if input_ids.shape != self.inputs.shape or labels.shape != self.labels.shape:
                raise RuntimeError(
                    f"train.cuda_graph replays fixed shapes {tuple(self.inputs.shape)}, but a batch "
                    f"has {tuple(input_ids.shape)}; set train.cuda_graph=false for varying shapes"
                )
            self.inputs.copy_(input_ids, non_blocking=True)
            self.labels.copy_(labels, non_blocking=True)
            which = self.keys[i]
            self.graphs[which].replay()
            buffer.set_host_state(self.state_after[which])
            loss_sum += self.losses[which]
        return loss_sum

    # -- train.cuda_graph=auto -------------------------------------------------------------------------
    def _probe(self, device: torch.device) -> str:
        """What this call runs while auto is probing ("eager", "capture", "graph"), or the decision once each
        mode has `probe_steps` timed steps. A step is timed from its call to the next (the device synchronized
        at both); the capture step is not timed."""
        torch.cuda.synchronize(device)
        now = time.perf_counter()
        if self._last is not None and self._last[0] != "capture":
            self._timed[self._last[0]].append(now - self._last[1])
        if len(self._timed["graph"]) >= self.probe_steps:
            e, g = self._agree(
                [statistics.median(self._timed["eager"]), statistics.median(self._timed["graph"])], device
            )  # the slowest rank's medians: it paces the others
            what = (
                f"train.cuda_graph=auto: a step took {e * 1e3:.1f} ms eager and {g * 1e3:.1f} ms replayed from "
                f"CUDA graphs (median of {self.probe_steps} each, {e / g:.2f}x)"
            )
            if g <= e * (1.0 - self.min_gain):
                self.decision = "graph"
                self.log(f"{what}: keeping the graphs")
            else:
                self._stay_eager(f"{what}, not {self.min_gain:.0%} faster")
            return self.decision
        mode = "eager" if len(self._timed["eager"]) < self.probe_steps else ("graph" if self.captured else "capture")
        self._last = (mode, now)
        return mode

    def _agree(self, values: list[float], device: torch.device) -> list[float]:
        """The max of `values` over the group's ranks (the same list on every rank)."""
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def _stay_eager(self, why: str) -> None:
        """Free the graphs (and their memory pool) and run every later step eagerly."""
        self.decision = "eager"
        self.graphs.clear()
        self.losses.clear()
        self.state_after.clear()
        self.inputs = self.labels = None
        torch.cuda.empty_cache()
        self.log(f"{why}: running eagerly")

    @staticmethod
    def _eager_rest(model, batches, input_ids, labels, num_micro_batches, grad_sync, device) -> torch.Tensor:
        """This step eagerly, its first micro-batch already taken from `batches` (a capture failed on it)."""
        taken = iter([(input_ids, labels)])

        class _Rest:
            def next(self):
                return next(taken, None) or batches.next()

        return forward_backward_no_pipelining(model, _Rest(), num_micro_batches, grad_sync=grad_sync, device=device)

    def _capture(
        self,
        model: nn.Module,
        buffer,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        num_micro_batches: int,
        device: torch.device,
    ) -> None:
        """Capture each graph the step's micro-batches replay (`keys`), in step order; the buffer's bookkeeping is
        left as it was (a step's start: every main_grad stale, nothing launched), since capturing runs no kernel."""
        self.keys = keys = ["first"] + ["rest"] * (num_micro_batches - 1)  # the graph each micro-batch replays
        self.inputs = torch.empty_like(input_ids, device=device)
        self.labels = torch.empty_like(labels, device=device)
        at_start = buffer.host_state()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the eager steps' cached blocks: the graph pool takes their place
        pool = None
        try:
            for which in dict.fromkeys(keys):  # distinct, in step order
                graph = torch.cuda.CUDAGraph()
                # thread-local: a background checkpoint writer may touch CUDA while this thread captures
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    loss = model(self.inputs, self.labels).mean() / num_micro_batches
                    loss.backward()
                pool = graph.pool()
                self.graphs[which], self.losses[which] = graph, loss.detach()
                self.state_after[which] = buffer.host_state()
        except RuntimeError as e:
            self.graphs.clear()
            raise ConfigError(
                f"train.cuda_graph could not capture the training step ({str(e).strip().splitlines()[0][:160]}); "
                "set train.cuda_graph=false"
            ) from None
        finally:
            buffer.set_host_state(at_start)
