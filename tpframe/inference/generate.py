"""Batched generation with one tensor-parallel model: prefill the prompts, then one decode step per token.

    gen = Generator(model, comm, sampling=SamplingConfig(greedy=True), vocab_size=256, eos_id=0)
    out = gen.generate([[72, 105], [87]], max_new_tokens=32)     # out.tokens: the new ids of each prompt

Prompts of different lengths are left-padded into one batch (kv_cache.py: each row keeps its own
positions, so a row's text does not depend on its neighbours). Prefill runs the padded prompts once and
picks the first new token; every further token is one decode step: the model on the last token of each
row with the KV cache, the vocab-parallel sampler, and the bookkeeping, all on device tensors allocated
up front. On CUDA the decode step is a CUDA graph (graph.py) unless `cuda_graph=False`; eager and graph
steps run the same operations, so they produce the same tokens. Generation stops when every row has
produced `eos_id` (an id, or several: Llama 3 stops at any of its end tokens; checked every EOS_CHECK steps, one
host sync each) or after `max_new_tokens`; each row's output ends before its first EOS.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from tpframe.comm import Communicator
from tpframe.inference.graph import CapturedStep
from tpframe.inference.kv_cache import KVCache
from tpframe.inference.sampling import SamplingConfig, VocabParallelSampler

EOS_CHECK = 16  # decode steps between checks whether every row has finished
SLOT_MULTIPLE = 16  # cache length rounding: fewer distinct shapes (graph captures), aligned attention masks


def cache_slots(longest_prompt: int, max_new_tokens: int) -> int:
    """The KV cache's length for a generation: prompt and new tokens, rounded up to SLOT_MULTIPLE."""
    return -(-(longest_prompt + max_new_tokens) // SLOT_MULTIPLE) * SLOT_MULTIPLE


@dataclass
class Generation:
    tokens: list[list[int]]  # the new ids of each prompt, ending before its first EOS
    prefill_s: float  # prompt processing and the first token
    decode_s: float  # every later token
    steps: int  # decode steps run after the prefill (tokens per row generated = steps + 1)


class Generator:
    """Generation with `model` (built for `comm`'s TP group, eval mode: tpframe/models/protocol.py's Model, with its
    kv_cache_spec) on `comm`'s ranks.

    vocab_size: ids that may be generated (the model's, or fewer: the tokenizer's). seed: the sampling
    noise generator's seed (the same on every rank). cuda_graph: capture the decode step (CUDA only).
    """

    def __init__(
        self,
        model: nn.Module,
        comm: Communicator,
        *,
        sampling: SamplingConfig,
        vocab_size: int,
        eos_id: int | list[int] | None = None,
        seed: int = 0,
        cuda_graph: bool = True,
        pad_id: int = 0,
    ):
        self.model, self.comm = model, comm
        weight = next(model.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        self.cuda_graph = cuda_graph and self.device.type == "cuda"
        self.pad_id = pad_id
        stops = () if eos_id is None else sorted({int(eos_id)} if isinstance(eos_id, int) else set(map(int, eos_id)))
        self._stops = set(stops)
        self._stop_ids = torch.tensor(stops, dtype=torch.long, device=self.device).view(1, -1) if stops else None
        rows = next(p.shape[0] for p in model.parameters() if p.vocab_rows)  # V_padded/tp
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        self.sampler = VocabParallelSampler(
            sampling,
            comm,
            vocab_size=vocab_size,
            rows_per_rank=rows,
            generator=generator,
            device=self.device,
        )
        self.cache_spec = model.kv_cache_spec()  # tpframe/models/protocol.py
        self._shape = None  # (batch, slots) the buffers below were made for
        self.graph = None

    # -- buffers ----------------------------------------------------------------------------------
    def _setup(self, batch: int, slots: int) -> None:
        """Static buffers (and the decode graph) for `batch` rows of up to `slots` cache slots."""
        if self._shape == (batch, slots):
            return
        self.graph = None
        dev = self.device
        spec = self.cache_spec
        self.cache = KVCache(
            spec.layers,
            batch=batch,
            max_len=slots,
            kv_heads=spec.kv_heads,
            head_dim=spec.head_dim,
            dtype=self.dtype,
            device=dev,
        )
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=dev)  # the decode step's input
        self.out = torch.zeros(batch, slots, dtype=torch.long, device=dev)  # every new token, by step
        self.step = torch.zeros(1, dtype=torch.long, device=dev)
        self.done = torch.zeros(batch, dtype=torch.bool, device=dev)
        self.noise = torch.zeros(batch, self.sampler.rows, device=dev) if self.sampler.needs_noise else None
        self._shape = (batch, slots)
        if self.cuda_graph:
            with torch.no_grad():
                self.graph = CapturedStep(self._decode_step)

    # -- the steps --------------------------------------------------------------------------------
    def _record(self, nxt: torch.Tensor) -> None:
        """Store the new tokens [b] as the next input and the step's output."""
        self.tokens.copy_(nxt.view(-1, 1))
        self.out.index_copy_(1, self.step, nxt.view(-1, 1))
        self.step += 1
        if self._stop_ids is not None:
            self.done |= (nxt.view(-1, 1) == self._stop_ids).any(1)

    def _decode_step(self) -> None:
        """One token for every row: static buffers in and out, no host synchronization (graph-safe)."""
        self.cache.begin(1)
        logits = self.model(self.tokens, cache=self.cache)  # [b, V/tp]
        self.cache.advance(1)
        self._record(self.sampler.pick(logits, self.noise))

    def _sync(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # -- generation -------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> Generation:
        """New tokens for every prompt (lists of ids, every rank the same), at most `max_new_tokens` each."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs at least one prompt, each of at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        batch, longest = len(prompts), max(len(p) for p in prompts)
        slots = cache_slots(longest, max_new_tokens)
        self._setup(batch, slots)
        ids = torch.full((batch, longest), self.pad_id, dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, longest - len(p) :] = torch.tensor(p, dtype=torch.long)
        start = torch.tensor([longest - len(p) for p in prompts], dtype=torch.long)
        self.cache.reset(start.to(self.device))
        self.step.zero_()
        self.done.zero_()
        t0 = self._sync()
        self.cache.begin(longest)
        logits = self.model(ids.to(self.device), cache=self.cache)
        self.cache.advance(longest)
        self._record(self.sampler.pick(logits, self.sampler.noise(batch)))
        t1 = self._sync()
        steps = 0  # decode steps run
        while steps + 1 < max_new_tokens:
            if self._stop_ids is not None and steps % EOS_CHECK == 0 and bool(self.done.all()):
                break
            if self.noise is not None:
                self.noise.copy_(self.sampler.noise(batch))
            if self.graph is not None:
                self.graph()
            else:
                self._decode_step()
            steps += 1
        t2 = self._sync()
        out = self.out[:, : steps + 1].tolist()
        if self._stops:
            out = [row[: next((i for i, t in enumerate(row) if t in self._stops), len(row))] for row in out]
        return Generation(out, t1 - t0, t2 - t1, steps)
