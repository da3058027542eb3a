"""A plain single-process GPT in batch-first torch, written independently of tpframe.layers.

It takes the full logical tensors (tpframe.parallel.sharding names) and computes the per-token loss,
so a parallel model at any TP size can be checked against it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tests.reference import assert_close, loss_and_full_tensors
from tpframe.models.config import ModelConfig


def _norm(cfg: ModelConfig, x, P, prefix):
    if cfg.norm == "layernorm":
        return F.layer_norm(x, (cfg.hidden,), P[f"{prefix}.weight"], P.get(f"{prefix}.bias"), cfg.norm_eps)
    rms = x.pow(2).mean(-1, keepdim=True).add(cfg.norm_eps).rsqrt()
    return x * rms * P[f"{prefix}.weight"]


def _rope(x, theta):  # x [b, n, s, d]
    d, s = x.shape[-1], x.shape[-2]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.outer(torch.arange(s, dtype=torch.float64), inv)
    cos, sin = torch.cat([ang, ang], -1).cos().to(x.dtype), torch.cat([ang, ang], -1).sin().to(x.dtype)
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def reference_loss(cfg: ModelConfig, P: dict, input_ids, labels):
    """Per-token loss [b, s] of the GPT described by `cfg` with full weights `P`."""
    b, s = input_ids.shape
    nh, nkv = cfg.heads, cfg.kv_heads or cfg.heads
    d = cfg.hidden // nh
    x = F.embedding(input_ids, P["embedding.weight"])
    if cfg.position == "learned":
        x = x + P["position"][:s]
    mask = torch.full((s, s), float("-inf")).triu(1)
    if cfg.sliding_window is not None:  # keys sliding_window or more behind a query are hidden too
        mask = mask + torch.full((s, s), float("-inf")).tril(-cfg.sliding_window)
    for i in range(cfg.layers):
        pre = f"blocks.{i}"
        h = _norm(cfg, x, P, f"{pre}.norm1")
        q, k, v = (F.linear(h, P[f"{pre}.attn.qkv.{n}.weight"], P.get(f"{pre}.attn.qkv.{n}.bias")) for n in "qkv")
        q = q.view(b, s, nh, d).transpose(1, 2)
        k = k.view(b, s, nkv, d).transpose(1, 2)
        v = v.view(b, s, nkv, d).transpose(1, 2)
        if cfg.position == "rotary":
            q, k = _rope(q, cfg.rope_theta), _rope(k, cfg.rope_theta)
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d) + mask, dim=-1)
        o = (att @ v).transpose(1, 2).reshape(b, s, cfg.hidden)
        x = x + F.linear(o, P[f"{pre}.attn.proj.weight"], P.get(f"{pre}.attn.proj.bias"))
        h = _norm(cfg, x, P, f"{pre}.norm2")
        if cfg.activation == "swiglu":
            gate = F.linear(h, P[f"{pre}.mlp.fc1.gate.weight"], P.get(f"{pre}.mlp.fc1.gate.bias"))
            up = F.linear(h, P[f"{pre}.mlp.fc1.up.weight"], P.get(f"{pre}.mlp.fc1.up.bias"))
            h = F.silu(gate) * up
        else:
            h = F.linear(h, P[f"{pre}.mlp.fc1.weight"], P.get(f"{pre}.mlp.fc1.bias"))
            h = F.gelu(h, approximate="tanh") if cfg.activation == "gelu" else F.relu(h)
        x = x + F.linear(h, P[f"{pre}.mlp.fc2.weight"], P.get(f"{pre}.mlp.fc2.bias"))
    x = _norm(cfg, x, P, "final_norm")
    head = P["embedding.weight"] if cfg.tie_embeddings else P["head.weight"]
    logits = x @ head.t()
    return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), labels.reshape(-1), reduction="none").view(b, s)


def assert_matches_reference(cfg: ModelConfig, model, ids, labels, comm, case: str) -> tuple[torch.Tensor, dict]:
    """A TP model's per-token loss and gradients on (ids, labels) against `reference_loss` with the model's own full
    weights (fp32: 1e-5 relative; atol for gradients zero in exact arithmetic, e.g. the key bias's, since softmax is
    shift-invariant); returns the model's loss and its full logical weights."""
    loss, weights, grads = loss_and_full_tensors(model, ids, labels, comm)
    P = {k: v.clone().requires_grad_() for k, v in weights.items()}
    ref = reference_loss(cfg, P, ids, labels)
    ref.mean().backward()
    assert_close(loss, ref, 1e-5, f"{case}: per-token loss")
    assert set(grads) == set(P), f"{case}: logical tensors differ: {set(grads) ^ set(P)}"
    for name in P:
        assert_close(grads[name], P[name].grad, 1e-5, f"{case}: grad of {name}", atol=1e-7)
    return loss, weights
