"""Next-token choice from vocab-parallel logits, without gathering the vocabulary where it can be avoided.

Each TP rank holds the logits of its vocabulary rows, [b, V_padded/tp]. Every rule reduces to an argmax:
  greedy        argmax of the logits: each rank's local max and its index, one all-gather of [b, 2]
  temperature   argmax of logits/T + Gumbel noise (the Gumbel-max trick samples exactly from
                softmax(logits/T)); the noise is drawn for the whole vocabulary from one seeded generator
                on every rank and each rank keeps its columns, so a seed gives the same tokens at any TP
  top-k         each rank's k best, one all-gather of [b, k] per rank, the k-th largest overall is the
                cut-off; logits under it are dropped before the Gumbel argmax
  top-p         the smallest set of most likely tokens holding probability >= p: from the top-k candidates
                when top-k is set (HF's order: temperature, top-k, top-p), else from the gathered vocabulary
Ties at a cut-off keep every tied token. Padding rows (ids >= vocab) and ids the tokenizer cannot decode
are never chosen. `pick` uses fixed shapes and no host synchronization, so it can run inside a CUDA graph
(the noise is drawn outside it, by `noise`, into a buffer the graph reads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpframe.comm import Communicator


@dataclass(frozen=True)
class SamplingConfig:
    greedy: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def validate(self) -> None:
        """Each value, with --greedy too (which ignores them: a NaN given is still a mistake). The temperature divides
        float32 logits: beyond float32's range it is 0 or inf there, and the padding rows' -inf / inf is NaN. The
        top-p is compared with float32 probabilities: below float32's range it is 0 there, and no token is kept."""
        t, f32 = self.temperature, torch.finfo(torch.float32)
        if not (isinstance(t, (int, float)) and f32.tiny <= t <= f32.max):  # False for NaN
            raise ValueError(
                f"--temperature must be a finite number > 0 within float32's range ({f32.tiny:.3g} to "
                f"{f32.max:.3g}; use --greedy for argmax), got {t}"
            )
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"--top-k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_p is not None and self.top_p < f32.tiny:
            raise ValueError(
                f"--top-p must be at least {f32.tiny:.3g}, float32's smallest normal number (below it is 0 "
                f"in float32 and no token would be kept; use --greedy for the most likely token), "
                f"got {self.top_p}"
            )


def vocab_parallel_argmax(logits: torch.Tensor, comm: Communicator, vocab_start: int) -> torch.Tensor:
    """Global argmax [b] (int64, the same on every rank) of local logits [b, V/tp] whose first column is
    global id `vocab_start`. Ties go to the lowest id, as torch.argmax over the full vocabulary does."""
    value, index = logits.max(dim=-1)
    if comm.size == 1:
        return index
    pair = torch.stack([value.float(), (index + vocab_start).float()], dim=-1)  # ids < 2**24 are exact in fp32
    everyone = comm.all_gather(pair.unsqueeze(0))  # [tp, b, 2]
    best = everyone[..., 0].argmax(dim=0, keepdim=True)  # the first rank holding the maximum
    return everyone[..., 1].gather(0, best).squeeze(0).long()


def nucleus_cutoff(candidates: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest logit [b, 1] inside the top-p nucleus of the distribution softmax(candidates [b, C])."""
    ordered = candidates.sort(dim=-1, descending=True).values
    probs = ordered.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability mass ranked strictly above each token
    keep = before < top_p  # always keeps the most likely token
    return ordered.masked_fill(~keep, float("inf")).min(dim=-1, keepdim=True).values


class VocabParallelSampler:
    """Picks the next token [b] from local logits [b, V_padded/tp]; identical on every TP rank.

    vocab_size: the ids that may be chosen (the model's vocabulary, or fewer: the tokenizer's).
    rows_per_rank: this rank's vocabulary rows (V_padded/tp); generator: the seeded source of noise.
    """

    def __init__(
        self,
        config: SamplingConfig,
        comm: Communicator,
        *,
        vocab_size: int,
        rows_per_rank: int,
        generator: torch.Generator | None,
        device: torch.device,
    ):
        config.validate()
        if vocab_size >= 2**24:
            raise ValueError(f"vocab_size {vocab_size} is too large for the fp32 index exchange (< 2**24)")
        self.config, self.comm = config, comm
        self.vocab_size, self.rows = vocab_size, rows_per_rank
        self.start = comm.rank * rows_per_rank
        self.generator, self.device = generator, device
        ids = torch.arange(self.start, self.start + rows_per_rank, device=device)
        self.bias = torch.zeros(rows_per_rank, device=device).masked_fill_(ids >= vocab_size, float("-inf"))
        # this rank's columns of the full-vocabulary noise, as a slice [lo, hi) of the real ids
        self._noise_cols = (min(self.start, vocab_size), min(self.start + rows_per_rank, vocab_size))

    @property
    def needs_noise(self) -> bool:
        return not self.config.greedy

    def noise(self, batch: int) -> torch.Tensor | None:
        """Gumbel noise for this rank's columns [b, V_padded/tp], from the full-vocabulary draw [b, V]."""
        if not self.needs_noise:
            return None
        u = torch.rand(batch, self.vocab_size, generator=self.generator, device=self.device)
        gumbel = -torch.log(-torch.log(u.clamp_(min=torch.finfo(torch.float32).tiny)))
        lo, hi = self._noise_cols
        out = torch.zeros(batch, self.rows, device=self.device)
        out[:, : hi - lo] = gumbel[:, lo:hi]
        return out

    def pick(self, logits: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [b] (int64) from local logits [b, V_padded/tp] and this step's `noise(b)`."""
        x = logits.float() + self.bias
        c = self.config
        if c.greedy:
            return vocab_parallel_argmax(x, self.comm, self.start)
        x = x / c.temperature
        candidates = None
        if c.top_k is not None:
            k = min(c.top_k, self.vocab_size)
            local = x.topk(min(k, self.rows), dim=-1).values  # [b, k']
            candidates = self._gather_columns(local)
            cutoff = candidates.topk(k, dim=-1).values[:, -1:]
            candidates = candidates.masked_fill(candidates < cutoff, float("-inf"))
            x = x.masked_fill(x < cutoff, float("-inf"))
        if c.top_p is not None and c.top_p < 1:
            if candidates is None:
                candidates = self._gather_columns(x)  # the nucleus needs the whole distribution
            x = x.masked_fill(x < nucleus_cutoff(candidates, c.top_p), float("-inf"))
        return vocab_parallel_argmax(x + noise, self.comm, self.start)

    def _gather_columns(self, local: torch.Tensor) -> torch.Tensor:
        """[b, c] on every rank -> [b, tp*c] (rank order)."""
        if self.comm.size == 1:
            return local
        everyone = self.comm.all_gather(local.unsqueeze(0).contiguous())  # [tp, b, c]
        return everyone.permute(1, 0, 2).reshape(local.shape[0], -1)
