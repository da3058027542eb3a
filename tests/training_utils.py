"""Run train.py's own pipeline (prepare -> run) inside test processes, on a tiny model."""

from __future__ import annotations

import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = [
    "model.vocab_size=256",
    "model.hidden=32",
    "model.layers=2",
    "model.heads=4",
    "model.max_seq_len=32",
    "train.seq_len=32",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.steps=10",
    "train.eval_interval=0",
    "data.synthetic_tokens=50000",
    "optim.warmup_steps=2",
    "optim.lr=1e-2",
    "logging.interval=1",
    "logging.progress=false",
    "checkpoint.save_at_end=false",
    "checkpoint.auto_resume=false",
    "checkpoint.verify=crc",
]
# Llama's shape as overrides (RMSNorm, rotary positions, SwiGLU, no biases, an untied head); tests add the heads
LLAMA_SHAPE = [
    "model.norm=rmsnorm",
    "model.position=rotary",
    "model.activation=swiglu",
    "model.bias=false",
    "model.tie_embeddings=false",
]


def torchrun_env(world_size: int, rank: int = 0) -> dict[str, str]:
    """The env torchrun gives rank `rank` of `world_size` processes on one host: train.py's and generate.py's
    pre-flight check all of it (tpframe.launch.launch_env), so a test that sets WORLD_SIZE sets the rest too."""
    return {
        "WORLD_SIZE": str(world_size),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }


def override_key(arg: str) -> str | None:
    """The `section.key` of a `section.key=value` argument of train.py; None for any other (--config, its file)."""
    head, eq, _ = arg.partition("=")
    return head.strip() if eq and not arg.startswith("-") and "." in head and "/" not in head else None


def with_overrides(base: list[str], overrides: list[str]) -> list[str]:
    """train.py's arguments `base` without the keys `overrides` sets (and without its `--config FILE` when they
    have one), then `overrides` as given (a key twice in them stays twice): train.py refuses a key or option given
    twice, so a test's layers of settings replace each other here."""
    keys = {override_key(a) for a in overrides} - {None}
    out, drop_config = [], "--config" in overrides
    for i, arg in enumerate(base):
        config_pair = drop_config and (arg == "--config" or (i > 0 and base[i - 1] == "--config"))
        if not config_pair and override_key(arg) not in keys:
            out.append(arg)
    return out + list(overrides)


def merge_overrides(*groups: list[str]) -> list[str]:
    """Layers of train.py arguments (defaults first), a later `section.key=value` replacing an earlier one."""
    out: list[str] = []
    for arg in (a for group in groups for a in group):
        out = with_overrides(out, [arg])
    return out


def fp8_in_small_layers() -> None:
    """train.fp8 also in the linear layers too small to gain (every layer of a tiny test model): `fp8_pays` says yes
    to every shape, in this process (a run_distributed worker, before it builds the model)."""
    from tpframe.layers import fp8

    fp8.fp8_pays = lambda local_out, local_in, recipe: True


def train_in_process(overrides: list[str], keep_trainer: bool = False, config: str = "tiny_cpu.yaml"):
    """train.py's prepare + run in this (already distributed) process, from configs/<config> made TINY (`overrides`
    replace TINY's values, later ones earlier ones); returns per-step records."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import train

    argv = merge_overrides(["--config", os.path.join(REPO, "configs", config)], TINY, overrides)
    cfg, train_data, valid_data, resume = train.prepare(argv)
    trainer = train.run(cfg, train_data, valid_data, resume)
    return trainer if keep_trainer else trainer.history


def assert_layouts_follow(ref_history: list[dict], results: dict, *, grad_norm_rel: float, rel: float = 1e-5) -> None:
    """Every layout's per-step loss, eval loss and gradient norm equal the reference run's; a run named
    "resumed ..." holds steps 6-10 (it resumed at step 5), every other run steps 1-10. `results`: {name:
    (history, weights)}."""
    ref = {r["step"]: r for r in ref_history}
    for name, (history, _) in results.items():
        assert [r["step"] for r in history] == (
            list(range(6, 11)) if name.startswith("resumed") else list(range(1, 11))
        ), name
        for r in history:
            for key, tol in (("loss", rel), ("eval_loss", rel), ("grad_norm", grad_norm_rel)):
                if key in r:
                    assert math.isclose(r[key], ref[r["step"]][key], rel_tol=tol, abs_tol=1e-7), (
                        name,
                        r["step"],
                        key,
                        r[key],
                        ref[r["step"]][key],
                    )
