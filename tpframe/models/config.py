"""A model's shape and options (the `model:` section of a run config) and their checks, beside the models that
read them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from tpframe.config import check_at_least, check_ranges, read_section
from tpframe.errors import ConfigError
from tpframe.layers.embedding import padded_vocab_size
from tpframe.layers.mlp import ACTIVATIONS


@dataclass
class ModelConfig:
    name: str = "gpt"  # "gpt", or "package.module:build_fn" for a model of your own (README)
    vocab_size: int = 256  # token ids 0..vocab_size-1 (at least the data's vocabulary)
    hidden: int = 128  # model width h
    layers: int = 2  # transformer blocks
    heads: int = 4  # attention heads (split across TP)
    kv_heads: int | None = None  # grouped-query attention; None: as many as heads
    head_dim: int | None = None  # each attention head's width; None: hidden/heads (Qwen3 and Mistral-Nemo set it)
    # RMSNorm of every query and key head over its head_dim (one weight each, shared by the heads) before rotary:
    # Qwen3's attention, Megatron-LM's --qk-layernorm
    qk_norm: bool = False
    ffn_hidden: int | None = None  # None: 4*hidden (GELU) or 8/3*hidden rounded to 64 (SwiGLU)
    max_seq_len: int = 128  # longest sequence; sizes the learned position table
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"  # layernorm (GPT-2) or rmsnorm (Llama)
    norm_eps: float = 1e-5  # epsilon of every norm
    position: Literal["learned", "rotary"] = "learned"  # learned table (GPT-2) or rotary, rotate-half (Llama)
    rope_theta: float = 10000.0  # rotary base wavelength
    # Llama 3.1's rotary scaling (HF rope_type "llama3", Megatron-LM's --use-rope-scaling): wavelengths longer than
    # rope_original_max_seq_len/rope_low_freq_factor are stretched this many times, those shorter than
    # rope_original_max_seq_len/rope_high_freq_factor kept, the band between blended; None: unscaled
    rope_scaling_factor: float | None = None
    rope_low_freq_factor: float = 1.0  # with rope_scaling_factor: Llama 3.1's 1
    rope_high_freq_factor: float = 4.0  # with rope_scaling_factor: Llama 3.1's 4
    rope_original_max_seq_len: int = 8192  # with rope_scaling_factor: the context the model was first trained at
    # causal: every token sees all earlier tokens of its row; document: only those of its own document, and
    # positions restart at each document (README: Data, packed documents)
    attention_mask: Literal["causal", "document"] = "causal"
    # sliding-window attention (Mistral's, Phi-3's; Hugging Face's sliding_window): each token sees itself and the
    # sliding_window-1 tokens before it (within its document with attention_mask=document); null: every earlier one
    sliding_window: int | None = None
    eod_id: int | None = None  # the token that ends a document (attention_mask=document); None: the data's
    activation: Literal[ACTIVATIONS] = "gelu"  # MLP: gelu (tanh approximation), swiglu (gated), relu
    bias: bool = True  # biases in the linear layers and LayerNorm
    # biases on the query/key/value projection alone; None: as model.bias. bias=false with qkv_bias=true is Qwen2's
    # attention (Megatron-LM's --add-qkv-bias)
    qkv_bias: bool | None = None
    dropout: float = 0.0  # on the residual branches and embeddings
    attention_dropout: float = 0.0  # on the attention probabilities
    tie_embeddings: bool = True  # the output head reuses the embedding table
    init_std: float = 0.02  # std of the normal init (output projections scaled by 1/sqrt(2*layers))
    vocab_multiple: int = 128  # pad the vocabulary to a multiple of this (and of tp)
    # mixture of experts (README: mixture of experts): every block's MLP becomes `moe_experts` bias-free MLPs of
    # which a router picks `moe_top_k` per token; 0: a dense MLP
    moe_experts: int = 0
    moe_top_k: int = 2  # experts per token
    moe_ffn_hidden: int | None = None  # each expert's hidden size; None: as the dense MLP's (ffn_hidden)
    moe_aux_loss: float = 0.01  # weight of the load-balancing loss (Switch Transformer's); 0: none
    moe_z_loss: float = 0.0  # weight of the router z-loss (ST-MoE's: mean logsumexp(logits)^2); 0: none
    moe_shared_ffn: int = 0  # hidden size of a shared expert every token also goes through; 0: none
    moe_router_score: Literal["softmax", "sigmoid"] = "softmax"  # sigmoid: DeepSeek-V3's scores (top-k renormalized)
    moe_expert_bias: bool = False  # auxiliary-loss-free balancing (DeepSeek-V3): a per-expert selection bias
    moe_expert_bias_rate: float = 1e-3  # how far each bias moves per optimizer step toward balance


def rope_scaling(m: ModelConfig) -> tuple[float, float, float, int] | None:
    """(factor, low_freq_factor, high_freq_factor, original context) of Llama 3.1's rotary scaling, or None."""
    if m.rope_scaling_factor is None:
        return None
    return m.rope_scaling_factor, m.rope_low_freq_factor, m.rope_high_freq_factor, m.rope_original_max_seq_len


def head_dim(m: ModelConfig) -> int:
    """Each attention head's width (model.head_dim, or hidden/heads when that is None)."""
    return m.hidden // m.heads if m.head_dim is None else m.head_dim


def qkv_bias(m: ModelConfig) -> bool:
    """Whether the query/key/value projection has biases (model.qkv_bias, or model.bias when that is None)."""
    return m.bias if m.qkv_bias is None else m.qkv_bias


def ffn_hidden_size(m: ModelConfig) -> int:
    if m.ffn_hidden is not None:
        return m.ffn_hidden
    if m.activation == "swiglu":
        return 64 * -(-int(8 * m.hidden / 3) // 64)
    return 4 * m.hidden


def moe_ffn_hidden_size(m: ModelConfig) -> int:
    """Each expert's hidden size (MoE models)."""
    return m.moe_ffn_hidden if m.moe_ffn_hidden is not None else ffn_hidden_size(m)


# Fields that fix tensor shapes or semantics: a checkpoint loads only into a model with equal values.
ARCH_FIELDS = (
    "name",
    "vocab_size",
    "hidden",
    "layers",
    "heads",
    "kv_heads",
    "ffn_hidden",
    "norm",
    "position",
    "activation",
    "bias",
    "tie_embeddings",
    "max_seq_len",
)


def architecture(m: ModelConfig) -> dict:
    """The fields two models must share for one's weights to load into the other (ffn size resolved;
    max_seq_len only where it sizes a tensor, i.e. learned positions)."""
    arch = {key: getattr(m, key) for key in ARCH_FIELDS}
    arch["ffn_hidden"] = ffn_hidden_size(m)
    if m.position != "learned":
        arch.pop("max_seq_len")
    # keys a model holds only where it departs from the default, so older checkpoints keep their keys
    arch.update({k: v for k, v in _optional_arch(m).items() if v != _OPTIONAL_DEFAULT[k](m)})
    if m.moe_experts:  # dense models keep the keys their checkpoints were written with
        arch.update(moe_experts=m.moe_experts, moe_top_k=m.moe_top_k, moe_ffn_hidden=moe_ffn_hidden_size(m))
        if m.moe_shared_ffn:
            arch.update(moe_shared_ffn=m.moe_shared_ffn)
        if m.moe_router_score != "softmax":
            arch.update(moe_router_score=m.moe_router_score)
        if m.moe_expert_bias:  # a tensor more per MoE layer
            arch.update(moe_expert_bias=True)
    return arch


# Fields that change what the model computes but none of its tensors: a resume may change them (a longer context's
# rotary base, dropout for fine-tuning), and its log names each one that did (`computation_change`).
_SCALING_COMPANIONS = ("rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_seq_len")
COMPUTATION_FIELDS = (
    "rope_theta",
    "rope_scaling_factor",
    *_SCALING_COMPANIONS,
    "norm_eps",
    "attention_mask",
    "eod_id",
    "sliding_window",
    "dropout",
    "attention_dropout",
)


def computation_change(mine: ModelConfig, saved: ModelConfig) -> str | None:
    """One line naming the COMPUTATION_FIELDS a resumed run changed since its checkpoint (`saved`), or None. The
    scaling's companions count only while a scaling is on."""
    unscaled = mine.rope_scaling_factor is None and saved.rope_scaling_factor is None
    keys = [
        k
        for k in COMPUTATION_FIELDS
        if getattr(mine, k) != getattr(saved, k) and not (unscaled and k in _SCALING_COMPANIONS)
    ]
    if not keys:
        return None
    return (
        "the model computes differently from the checkpoint's ("
        + ", ".join(f"model.{k} {_plain(getattr(saved, k))} -> {_plain(getattr(mine, k))}" for k in keys)
        + "); its weights load unchanged"
    )


def _plain(value) -> str:
    return "null" if value is None else str(value)


# architecture keys a model holds only where it departs from their default (a function of the other fields)
_OPTIONAL_DEFAULT = {
    "qkv_bias": lambda m: m.bias,
    "head_dim": lambda m: m.hidden // m.heads,
    "qk_norm": lambda m: False,
}


def _optional_arch(m: ModelConfig) -> dict:
    return {"qkv_bias": qkv_bias(m), "head_dim": head_dim(m), "qk_norm": m.qk_norm}


def architecture_diffs(mine: ModelConfig, theirs: dict, theirs_model: dict) -> list[tuple[str, object, object]]:
    """(key, mine, theirs) for each architecture field two models do not share, by key. `theirs` is the other
    model's architecture() and `theirs_model` its model section: a key only one side's architecture holds
    (max_seq_len with learned positions, the MoE keys) is compared with the other side's configured value."""
    ours = architecture(mine)
    for key in _OPTIONAL_DEFAULT:  # a side without the key has its default, found from the side's other fields
        if key in ours or key in theirs:
            configured = theirs_model.get(key)
            if configured is None:
                configured = _OPTIONAL_DEFAULT[key](ModelConfig(**{k: theirs[k] for k in ("hidden", "heads", "bias")}))
            ours, theirs = {key: _optional_arch(mine)[key], **ours}, {key: configured, **theirs}
    pairs = (
        (k, ours.get(k, getattr(mine, k, None)), theirs.get(k, theirs_model.get(k))) for k in sorted({*ours, *theirs})
    )
    return [(k, a, b) for k, a, b in pairs if a != b]


def padded_vocab(m: ModelConfig, tp: int) -> int:
    """Rows of the vocabulary tables at TP size `tp` (a multiple of model.vocab_multiple and of tp)."""
    return padded_vocab_size(m.vocab_size, tp, m.vocab_multiple)


def read_model_config(section: dict[str, Any]) -> ModelConfig:
    """A recorded `model:` section (a checkpoint's meta.json, an export's header) as a ModelConfig, each value checked
    as a run's config is: ConfigError naming the key."""
    return read_section(ModelConfig, section, "model")


# -- checks: the model alone, then against the layout -------------------------------------------------

# (key, lowest, highest, lowest included); every float is finite already (tpframe.config.check_finite)
RANGES = (
    ("norm_eps", 0.0, 1.0, False),
    ("init_std", 0.0, None, False),
    ("rope_theta", 0.0, None, False),
    ("rope_scaling_factor", 0.0, None, False),
    ("rope_low_freq_factor", 0.0, None, False),
    ("rope_high_freq_factor", 0.0, None, False),
)


def check_model(m: ModelConfig) -> None:
    """The `model:` section alone: sizes, heads, rotary positions, attention, dropout, the MoE keys."""
    check_ranges("model", m, RANGES)
    check_at_least("model", m, ("vocab_size", "hidden", "layers", "heads", "max_seq_len", "vocab_multiple"))
    check_at_least("model", m, ("ffn_hidden", "moe_ffn_hidden"), note=" (null: sized from model.hidden)")
    check_at_least("model", m, ("head_dim",), note=" (or null: model.hidden/model.heads)")
    if m.head_dim is None and m.hidden % m.heads:
        raise ConfigError(
            f"model.hidden={m.hidden} is not divisible by model.heads={m.heads}; give each head's width "
            "as model.head_dim, or pick heads that divide it"
        )
    kv = m.kv_heads if m.kv_heads is not None else m.heads
    if kv < 1 or m.heads % kv:
        raise ConfigError(f"model.kv_heads={kv} must divide model.heads={m.heads}")
    _check_rotary(m)
    if m.sliding_window is not None and (isinstance(m.sliding_window, bool) or m.sliding_window < 1):
        raise ConfigError(
            f"model.sliding_window={m.sliding_window} must be a number of tokens >= 1 (or null: full causal attention)"
        )
    if m.eod_id is not None and not 0 <= m.eod_id < m.vocab_size:
        raise ConfigError(
            f"model.eod_id={m.eod_id} is not a token id of model.vocab_size={m.vocab_size}; give the "
            "token that ends a document, or null for the data's own"
        )
    for key, value in (("model.dropout", m.dropout), ("model.attention_dropout", m.attention_dropout)):
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{key}={value} must be in [0, 1)")
    _check_moe_keys(m)


def _check_rotary(m: ModelConfig) -> None:
    if m.position == "rotary" and head_dim(m) % 2:
        where = "hidden/model.heads" if m.head_dim is None else "head_dim"
        raise ConfigError(f"rotary positions need an even head dim; model.{where} = {head_dim(m)}")
    if m.rope_scaling_factor is None:
        return
    if m.position != "rotary":
        raise ConfigError(
            f"model.rope_scaling_factor={m.rope_scaling_factor} scales rotary positions; set "
            "model.position=rotary or leave model.rope_scaling_factor unset"
        )
    if not m.rope_high_freq_factor > m.rope_low_freq_factor:
        raise ConfigError(
            f"model.rope_high_freq_factor={m.rope_high_freq_factor} must exceed "
            f"model.rope_low_freq_factor={m.rope_low_freq_factor} (Llama 3.1's are 4 and 1)"
        )
    check_at_least("model", m, ("rope_original_max_seq_len",), note=" (Llama 3.1's is 8192)")


def _check_moe_keys(m: ModelConfig) -> None:
    """model.moe_* (tpframe/layers/moe.py) by themselves: a dense model sets none of them."""
    check_at_least("model", m, ("moe_experts",), 0, note=" (0: a dense MLP)")
    if not m.moe_experts:
        for key in ("moe_shared_ffn", "moe_z_loss", "moe_expert_bias"):
            if getattr(m, key):
                raise ConfigError(
                    f"model.{key}={getattr(m, key)} belongs to a mixture-of-experts model; set "
                    f"model.moe_experts (e.g. 8) or model.{key}=0"
                )
        return
    if not 1 <= m.moe_top_k <= m.moe_experts:
        raise ConfigError(f"model.moe_top_k={m.moe_top_k} must be in 1..model.moe_experts={m.moe_experts}")
    check_at_least("model", m, ("moe_z_loss",), 0, note=" (0: no router z-loss)")
    check_at_least("model", m, ("moe_aux_loss",), 0, note=" (0: no load-balancing loss)")
    if m.moe_expert_bias and not 0 < m.moe_expert_bias_rate < math.inf:
        raise ConfigError(
            f"model.moe_expert_bias_rate={m.moe_expert_bias_rate} must be a positive number (how far "
            "each expert's bias moves per step; e.g. 0.001)"
        )


def check_tensor_parallel(m: ModelConfig, tp: int) -> None:
    """parallel.tp splits the heads and the widths: it must divide each."""
    for key, value in (
        ("model.heads", m.heads),
        ("model.kv_heads", m.kv_heads or m.heads),  # not 0: check_model
        ("model.hidden", m.hidden),
        ("model.ffn_hidden", ffn_hidden_size(m)),
    ):
        if value % tp:
            raise ConfigError(f"parallel.tp={tp} does not divide {key}={value}; pick a tp that divides it")


def check_experts(cfg, dp: int) -> None:
    """A mixture-of-experts model (model.moe_experts) against the layout: parallel.tp splits each expert,
    parallel.ep the experts (over ranks holding different data). `cfg` is the run's Config."""
    m, p = cfg.model, cfg.parallel
    if not m.moe_experts:
        if p.ep > 1:
            raise ConfigError(
                f"parallel.ep={p.ep} splits the experts of a mixture-of-experts model; set "
                "model.moe_experts (e.g. 8) or parallel.ep=1"
            )
        return
    ffn = moe_ffn_hidden_size(m)
    if ffn < 1 or ffn % p.tp:
        raise ConfigError(f"parallel.tp={p.tp} must divide each expert's hidden size model.moe_ffn_hidden={ffn}")
    if m.moe_shared_ffn < 0 or m.moe_shared_ffn % p.tp:
        raise ConfigError(
            f"model.moe_shared_ffn={m.moe_shared_ffn} (the shared expert's hidden size; 0: none) must "
            f"be a non-negative multiple of parallel.tp={p.tp}"
        )
    if (dp * p.cp) % p.ep:
        raise ConfigError(
            f"parallel.ep={p.ep} must divide dp*cp = {dp}*{p.cp} = {dp * p.cp} (experts are split over "
            "ranks holding different data); change parallel.ep or the number of processes"
        )
    if m.moe_experts % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} must divide model.moe_experts={m.moe_experts}")
    if cfg.train.compile and p.ep > 1:
        raise ConfigError(
            "train.compile is not supported with parallel.ep > 1 yet (the all-to-all is sized on "
            "the host, every layer); set train.compile=false or parallel.ep=1"
        )


def gemm_widths(m: ModelConfig) -> tuple[tuple[str, int], ...]:
    """(what, width) of each dimension the blocks' GEMMs split over TP (float8 checks them: layers/fp8.py)."""
    return (
        ("model.hidden", m.hidden),
        ("the ffn width", ffn_hidden_size(m)),
        ("model.heads * head dim", m.heads * head_dim(m)),
        ("model.kv_heads * head dim", (m.kv_heads or m.heads) * head_dim(m)),
    )
