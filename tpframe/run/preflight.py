"""Pre-flight: every check that needs the model's shapes, the data, the run directory or a checkpoint,
run before any process group exists and before anything is written. Each failure is one ConfigError.

    model = dry_build(cfg)                        # the model of TP rank 0 on the meta device (no memory)
    check_device(cfg, "cuda", local_world=2, local_rank=0)  # switches this machine cannot run, one GPU per rank
    check_memory(cfg, world, model, ...)          # the estimate against the device (train.check_memory)
    check_memory_before_build(cfg, world, ...)    # the same from builds of 1 and 2 layers (a very deep model)
    check_run_dir(cfg)                            # a file, not writable, another run's, or in use now
    check_checkpoint_dir(cfg, resume_path)        # checkpoints (or a user's step_* folder) a save would replace
    check_token_ids(train_data, valid_data, cfg)  # token files whose ids exceed their sidecar's vocab
    check_resume(cfg, meta, train_data)           # the checkpoint's config and data position fit this run
    check_checkpoint_files(cfg, path, meta, ...)  # checkpoint.verify=size: its index and RNG files unpickle
    check_init_from(cfg, model)                   # consolidated weights: a safetensors file of this model
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch import nn

from tpframe.errors import ConfigError
from tpframe.layers.async_tp import asked
from tpframe.models.config import ModelConfig, architecture
from tpframe.paths import check_creatable
from tpframe.run.run_lock import check_free, run_folders

# What makes two runs the same run: a run directory holds one; a checkpoint resumes only into it.
DATA_IDENTITY = ("source", "seed", "synthetic_tokens", "valid_fraction")


def cuda_graph_device_obstacle(cfg, device: str) -> str | None:
    """Why train.cuda_graph cannot run on this machine (no CUDA device; MoE without grouped GEMMs), or None."""
    if device == "cpu":
        return "train.cuda_graph needs a CUDA device and none is visible; set train.cuda_graph=false"
    if cfg.model.moe_experts:
        from tpframe.layers.moe import grouped_gemms_available

        if not grouped_gemms_available(torch.device("cuda", torch.cuda.current_device())):
            return (
                "train.cuda_graph with model.moe_experts needs grouped expert GEMMs (torch._grouped_mm, "
                "compute capability 9.0+: Hopper); set train.cuda_graph=false on this GPU"
            )
    return None


def check_device(cfg, device: str, *, local_world: int, local_rank: int) -> None:
    """What this machine cannot run: CUDA-only switches without a GPU, float8 without float8 GEMMs (or
    uncompiled, where it is slower than bf16), and more ranks on this host than GPUs."""
    t = cfg.train
    if t.cuda_graph is True and (why := cuda_graph_device_obstacle(cfg, device)):
        raise ConfigError(why)
    if device == "cpu":
        if asked(cfg.parallel.async_tp) and cfg.parallel.tp > 1:
            value = str(cfg.parallel.async_tp).lower()
            raise ConfigError(
                f"parallel.async_tp={value} moves data between GPUs and no CUDA device is visible; "
                "set parallel.async_tp=false"
            )
        if cfg.profile.memory and cfg.profile.start_step:
            raise ConfigError(
                "profile.memory records the CUDA allocator and no CUDA device is visible; set profile.memory=false"
            )
        return
    if t.fp8 and torch.cuda.get_device_capability() < (8, 9):
        major, minor = torch.cuda.get_device_capability()
        raise ConfigError(
            f"train.fp8 needs float8 GEMMs (compute capability 8.9+: Ada, Hopper); this GPU is "
            f"{major}.{minor}; set train.fp8=false"
        )
    if t.fp8 and not t.compile:
        raise ConfigError(
            "train.fp8 on GPUs needs train.compile=true: uncompiled, the float8 casts are separate "
            "passes over each GEMM's inputs, which cost more than the float8 GEMMs save; set train.compile=true"
        )
    gpus = torch.cuda.device_count()
    if max(local_world, local_rank + 1) > gpus:
        raise ConfigError(
            f"{local_world} processes on this host but it has {gpus} CUDA device(s), and each rank "
            f"needs its own GPU; launch at most {gpus} per host (--nproc-per-node) or make more GPUs "
            "visible (CUDA_VISIBLE_DEVICES)"
        )


def dry_build(cfg) -> nn.Module | None:
    """TP rank 0's model built on the meta device: the builder's own checks run, shapes and parameter
    counts are known, nothing is allocated. None when the builder cannot build on meta (the checks
    that need shapes are then skipped)."""
    from tpframe.layers.lora import check_targets
    from tpframe.models import build_model, check_experts_built

    try:
        with torch.device("meta"):
            model = build_model(cfg.model, _meta_context(cfg))
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(
            f"model.name={cfg.model.name!r}: building the model failed: {type(e).__name__}: {e}"
        ) from None
    except RuntimeError as e:
        if "overflow" in str(e):  # a shape whose bytes pass 2^63 (model.hidden=1e9): it fits in no memory at all
            raise ConfigError(
                f"model.* makes a tensor too large for any memory ({str(e).strip().splitlines()[0][:120]}); "
                "choose smaller model dimensions"
            ) from None
        return None  # a builder that needs real tensors: checked when the run builds it
    except Exception:  # noqa: BLE001 - as above
        return None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.name={cfg.model.name!r} returned a {type(model).__name__}, not a torch.nn.Module")
    check_targets(cfg.optim.lora(), model, cfg.model.name)
    check_experts_built(cfg.model, model)
    return model


def _meta_context(cfg):
    """The BuildContext of TP rank 0 on the meta device."""
    from tpframe.layers.mode import LayerMode
    from tpframe.models import BuildContext, ShapeComm

    p = cfg.parallel
    return BuildContext(
        ShapeComm(p.tp),
        sequence_parallel=p.sequence_parallel,
        **p.recompute_context(),
        rng_tracker=None,
        dtype=torch.bfloat16 if cfg.train.dtype == "bfloat16" and p.dp_strategy != "fsdp" else torch.float32,
        device=torch.device("meta"),
        seed=cfg.train.seed,
        mode=LayerMode(lora=cfg.optim.lora()),
    )


def rank_sizes(cfg, model: nn.Module) -> tuple[int, int, int, int]:
    """`_sizes` of what the fullest rank holds: `model` (dry_build's) without a pipeline; with one, each pipeline
    rank's stages built on the meta device, the one with the most parameters."""
    from tpframe.models import build_stages

    p = cfg.parallel
    if p.pp == 1:
        return _sizes(model)
    try:
        with torch.device("meta"):
            ranks = [
                build_stages(
                    cfg.model,
                    _meta_context(cfg),
                    pp_rank=r,
                    pp=p.pp,
                    virtual_stages=p.virtual_stages,
                    layers_per_stage=p.layers_per_stage,
                )
                for r in range(p.pp)
            ]
    except Exception:  # noqa: BLE001 - a builder whose stages need real tensors: the whole model, as an upper bound
        return _sizes(model)
    return max((_sizes(m) for m in ranks), key=lambda sizes: sizes[0])


def _sizes(model: nn.Module) -> tuple[int, int, int, int]:
    """(parameters, of which MoE experts, buffer bytes, parameters trained: all but a LoRA base) of a model built
    whole."""
    params = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for p in model.parameters() if p.expert)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return params, experts, sum(b.numel() * b.element_size() for b in model.buffers()), trained


def estimate_for(cfg, world_size: int, sizes: tuple[int, int, int, int] | nn.Module, *, device_type: str):
    """The memory estimate check_memory compares with the device, from `sizes` (`rank_sizes`) or a model built whole
    (`dry_build`'s, no pipeline)."""
    from tpframe.run.memory import estimate

    params, experts, buffers, trained = _sizes(sizes) if isinstance(sizes, nn.Module) else sizes
    frozen = params - trained  # a LoRA base: no gradients, no optimizer state
    params -= experts - experts // cfg.parallel.ep  # built whole here; a rank holds 1/ep of the experts
    return estimate(
        cfg,
        world_size,
        params=params,
        expert_params=experts // cfg.parallel.ep,
        trained_params=params - frozen,
        buffer_bytes=buffers,
        device_type=device_type,
    )


def _check_sizes(cfg, world_size: int, sizes: tuple[int, int, int, int], **device) -> None:
    from tpframe.run.memory import check_fits

    check_fits(cfg, estimate_for(cfg, world_size, sizes, device_type=device["device_type"]), **device)


def check_memory(
    cfg, world_size: int, model: nn.Module | None, *, device_type: str, local_rank: int, local_world: int
) -> None:
    if not cfg.train.check_memory or model is None:
        return
    _check_sizes(
        cfg, world_size, rank_sizes(cfg, model), device_type=device_type, local_rank=local_rank, local_world=local_world
    )


# A meta-device build's time grows with the layers (a very deep model: minutes of silence before the estimate could
# run; benchmarks/RESULTS.md, 'Numbers moved out of code comments'): above this many, builds of 1 and 2 layers
EXTRAPOLATE_ABOVE_LAYERS = 16


def check_memory_before_build(cfg, world_size: int, *, device_type: str, local_rank: int, local_world: int) -> None:
    """check_memory before `dry_build` for a model of many layers: its sizes extrapolated to model.layers from
    meta builds of one and two layers, so a model far too deep for the device is refused at once."""
    if not cfg.train.check_memory or cfg.model.layers <= EXTRAPOLATE_ABOVE_LAYERS:
        return
    try:
        small = [dry_build(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, layers=n))) for n in (1, 2)]
    except ConfigError:  # a builder that needs more layers: the full build says what it needs
        return
    if None in small:
        return
    one, two = map(_sizes, small)  # embedding and head both counted: exact without a pipeline, above it with one
    sizes = tuple(a + (b - a) * (_rank_layers(cfg) - 1) for a, b in zip(one, two))
    _check_sizes(cfg, world_size, sizes, device_type=device_type, local_rank=local_rank, local_world=local_world)


def _rank_layers(cfg) -> int:
    """The most blocks one pipeline rank holds (model.layers without a pipeline)."""
    from tpframe.parallel.pipeline.layout import local_stages, split_layers

    p = cfg.parallel
    stages = split_layers(cfg.model.layers, p.pp * p.virtual_stages, p.layers_per_stage)
    return max(sum(len(stages[s]) for s in local_stages(r, p.pp, p.virtual_stages)) for r in range(p.pp))


# -- the run directory ------------------------------------------------------------------------------


def _check_writable_dir(key: str, path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key}={str(path)!r} is a file, not a directory; pick another {key}")
    check_creatable(f"{key}={str(path)!r}", path, directory=True)


def identity(config: dict) -> dict[str, Any]:
    """The fields (flattened, `section.key`) that make a run the run it is, from a config dict."""
    model = config.get("model") or {}
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    try:
        arch = architecture(ModelConfig(**{k: v for k, v in model.items() if k in known}))
    except (TypeError, ValueError):
        arch = {k: model.get(k) for k in sorted(known)}
    data, train = config.get("data") or {}, config.get("train") or {}
    out = {f"model.{k}": v for k, v in arch.items()}
    out.update({f"data.{k}": data.get(k) for k in DATA_IDENTITY})
    out["train.seq_len"] = train.get("seq_len")
    optim = config.get("optim") or {}
    if optim.get("lora_rank") is not None:  # LoRA: the adapters' shapes and their base (checkpoints hold no base)
        out.update({f"optim.{k}": optim.get(k) for k in ("lora_rank", "lora_alpha", "lora_targets")})
        base = (config.get("checkpoint") or {}).get("init_from")
        out["checkpoint.init_from"] = str(Path(base).resolve()) if base else None
    return out


def differences(saved: dict, current: dict, where: str) -> list[str]:
    a, b = identity(saved), identity(current)
    return [
        f"{k} is {a.get(k)!r} {where} but {b.get(k)!r} now" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)
    ]


def _resolved(paths) -> list[Path] | None:
    """A `data.path` value (one path, or a blend's list of them) as resolved paths; None when unset."""
    if paths is None:
        return None
    return [Path(p).resolve() for p in (paths if isinstance(paths, (list, tuple)) else [paths])]


def _paths_differ(saved: dict, current: dict) -> list[str]:
    out = []
    for key in ("path", "valid_path"):
        a, b = (saved.get("data") or {}).get(key), (current.get("data") or {}).get(key)
        if _resolved(a) != _resolved(b):
            out.append(f"data.{key} is {a!r} there but {b!r} now")
    return out


def check_run_dir(cfg, resuming: bool = False, *, probe_lock: bool = True) -> None:
    """The run directory (and checkpoint dir) can be written, and holds no other run. When resuming, the
    checkpoint's data position has already proven the data the same, wherever its file now lives.
    `probe_lock`: whether no training holds it now (rank 0 only: its own launch's rank 0 may already hold it)."""
    run_dir = Path(cfg.train.run_dir)
    _check_writable_dir("train.run_dir", run_dir)
    if probe_lock:
        for key, path in run_folders(cfg):
            check_free(path, key)
    if cfg.checkpoint.dir:
        _check_writable_dir("checkpoint.dir", Path(cfg.checkpoint.dir))
    # what the run writes there, in the way: found now, not when the first save fails after hours of training
    if not cfg.checkpoint.dir and (run_dir / "checkpoints").is_file():
        raise ConfigError(
            f"train.run_dir={str(run_dir)!r} holds a file named checkpoints, where the run saves its "
            "checkpoints; pick another train.run_dir or set checkpoint.dir"
        )
    if (run_dir / "metrics.jsonl").is_dir():
        raise ConfigError(
            f"train.run_dir={str(run_dir)!r} holds a directory named metrics.jsonl, where the run "
            "writes its metrics; pick another train.run_dir"
        )
    if cfg.logging.jsonl and (run_dir / "metrics.jsonl").exists():  # the run appends to it
        from tpframe.observe.logger import foreign_metrics

        if why := foreign_metrics(run_dir / "metrics.jsonl"):
            raise ConfigError(
                f"train.run_dir={str(run_dir)!r} holds a metrics.jsonl that tpframe did not write ({why}), "
                "where the run appends its metrics; move it away or pick another train.run_dir"
            )
    saved_file = run_dir / "config.yaml"
    if not saved_file.exists():
        return
    try:
        saved = yaml.safe_load(saved_file.read_text(encoding="utf-8"))
        if not isinstance(saved, dict) or not all(isinstance(v, dict) for v in saved.values()):
            raise ValueError("not a mapping of sections")
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise ConfigError(
            f"train.run_dir={str(run_dir)!r} holds a config.yaml that cannot be read ({e}); pick another train.run_dir"
        ) from None
    current = cfg.to_dict()
    diffs = differences(saved, current, "there")
    if cfg.data.source == "tokens" and not resuming:
        diffs += _paths_differ(saved, current)
    if diffs:
        raise ConfigError(
            f"train.run_dir={str(run_dir)!r} holds another run ({'; '.join(diffs[:3])}"
            f"{'; ...' if len(diffs) > 3 else ''}): pick another train.run_dir, or delete that one to start over"
        )


def check_checkpoint_dir(cfg, resume_path: Path | None) -> None:
    """The folder the run saves into (checkpoint.dir, or <train.run_dir>/checkpoints) holds nothing a save or
    `checkpoint.keep_last` would replace or delete that is not this run's: no step_* entry that is not a checkpoint
    (a user's folder), and no checkpoints unless the run resumes from one of them (`resume_path`, checkpoint.load
    inside the folder included: going back to an older step replaces the later ones, as asked)."""
    from tpframe.checkpoint.files import LATEST, META, checkpoint_root, foreign_steps, published_steps, snapshot_root

    ck = cfg.checkpoint
    root = checkpoint_root(cfg)
    saves = not cfg.train.eval_only and (
        ck.save_at_end
        or ck.save_on_signal
        or cfg.train.time_limit_minutes is not None
        or 0 < ck.interval < cfg.train.steps
    )
    if not saves or not root.is_dir():
        return  # it never saves, or saves into a new folder
    label = f"checkpoint.dir={str(root)!r}" if ck.dir else f"train.run_dir={cfg.train.run_dir!r}"
    prefix = "" if ck.dir else f"{root.name}/"
    other = "an empty checkpoint.dir" if ck.dir else "another train.run_dir (or an empty checkpoint.dir)"
    if foreign := foreign_steps(root):
        names = ", ".join(repr(prefix + p.name) for p in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise ConfigError(
            f"{label} holds {names}, which {'is' if len(foreign) == 1 else 'are'} not a tpframe "
            f"checkpoint (no {META}): a save of that step would replace it; move it away or pick {other}"
        )
    published = published_steps(root)
    own = (root.resolve(), snapshot_root(root).resolve())  # a restart may resume from the launch's snapshot
    if not published or (resume_path is not None and Path(resume_path).resolve().parent in own):
        return
    newest = published[-1]
    if ck.load:
        why, resume = f"it loads checkpoint.load={ck.load!r}", f"checkpoint.load={newest}"
    elif not ck.auto_resume and (root / LATEST).is_file():
        why, resume = "checkpoint.auto_resume=false", "checkpoint.auto_resume=true"
    else:
        why = "checkpoint.auto_resume=false" if not ck.auto_resume else f"no '{LATEST}' file names one to resume"
        resume = f"checkpoint.load={newest}"
    raise ConfigError(
        f"{label} already holds checkpoints (newest {prefix}{newest.name}) that this run does not resume from "
        f"({why}); its saves would replace them: resume from them ({resume}), or pick {other}"
    )


# -- data -------------------------------------------------------------------------------------------


def check_snapshots(cfg, env) -> None:
    """checkpoint.snapshot_interval serves a restart of `python -m tpframe.launch --max-restarts K` on one node (a
    snapshot lives in that node's host memory); in a worker, from the env torchelastic gives it."""
    from tpframe.checkpoint.files import SNAPSHOTS

    every = cfg.checkpoint.snapshot_interval
    if not every:
        return
    key = f"checkpoint.snapshot_interval={every}"
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) < 1:
        raise ConfigError(
            f"{key} serves only a restart within the launch: launch with python -m tpframe.launch --max-restarts K, "
            "or set it to 0"
        )
    if env.local_world_size != env.world_size:
        raise ConfigError(
            f"{key} keeps snapshots in each node's host memory, which the other nodes cannot read: use it on one "
            "node, or set it to 0"
        )
    if not SNAPSHOTS.parent.is_dir():
        raise ConfigError(f"{key} writes to {SNAPSHOTS.parent}, which this machine lacks: set it to 0")


def max_token_id(tokens: np.ndarray, chunk: int = 1 << 26) -> int:
    return max(int(np.max(tokens[i : i + chunk])) for i in range(0, len(tokens), chunk))


def check_token_ids(cfg, *iterators) -> None:
    """Token files: every id below the vocabulary their sidecar declares (one pass over the files)."""
    if cfg.data.source != "tokens":
        return
    d = cfg.data
    train_files = [(d.path_key(i), p) for i, p in enumerate(d.paths)]
    valid_files = [("data.valid_path", d.valid_path)] if d.valid_path else train_files
    for it, files in zip(iterators, (train_files, valid_files)):
        for stream, (key, path) in zip(it.streams, files):
            top = max_token_id(stream.tokens)
            if top >= stream.vocab_size:
                raise ConfigError(
                    f"{key}={path!r} holds token id {top} but its sidecar declares vocab_size {stream.vocab_size}: "
                    "the token file and its sidecar disagree; re-run tools/prepare_data.py"
                )


def resolve_loss_mask(cfg, train_data) -> None:
    """Instruction data (token files with a loss mask, tpframe/data/instruct.py): its examples are packed into rows,
    so each must attend to itself alone (model.attention_mask=document), and the loss is the mean over the tokens
    that carry one in the global batch (data.eod_mask_loss, turned on: a packed row's first label carries none)."""
    if not train_data.loss_masked:
        return
    if cfg.model.attention_mask != "document":
        raise ConfigError(
            f"data.path={cfg.data.path!r} holds packed instruction examples (tools/prepare_data.py --seq-len): set "
            "model.attention_mask=document, so that no example attends to another"
        )
    eot = train_data.streams[0].eot_id
    if cfg.model.eod_id is not None and cfg.model.eod_id != eot:
        raise ConfigError(
            f"model.eod_id={cfg.model.eod_id}, but data.path={cfg.data.path!r} ends each packed example with token "
            f"{eot} (its sidecar's eot_id): the examples would not be told apart; leave model.eod_id out (it is taken "
            "from the data)"
        )
    cfg.data.eod_mask_loss = True
    from tpframe.parallel.graphed import cuda_graph_obstacle

    if cfg.train.cuda_graph is True and (why := cuda_graph_obstacle(cfg)):
        raise ConfigError(f"instruction data: {why}")


def resolve_end_of_document(cfg, train_data) -> None:
    """model.attention_mask=document, data.eod_mask_loss: model.eod_id, when not given, becomes the data's
    end-of-document token (the byte 0 of data.source=stdlib, a token file's `eot_id`); data without one needs it set."""
    m = cfg.model
    uses = [
        key
        for key, on in (
            ("model.attention_mask=document", m.attention_mask == "document"),
            ("data.eod_mask_loss=true", cfg.data.eod_mask_loss),
        )
        if on
    ]
    if not uses or m.eod_id is not None:
        return
    eot = train_data.streams[0].eot_id
    if eot is None:
        raise ConfigError(
            f"{' and '.join(uses)}: data.source={cfg.data.source} marks no document ends; set model.eod_id "
            "to the token that ends a document (e.g. model.eod_id=10 makes each line of the synthetic corpus one), "
            "or use data.source=stdlib or tokens"
        )
    m.eod_id = int(eot)


# -- resuming and initializing ----------------------------------------------------------------------


def check_resume(cfg, path: Path | None, meta: dict | None, train_data) -> None:
    """A checkpoint resumes only the run it belongs to: same data, sequence length and data position."""
    if meta is None:
        return
    from tpframe.checkpoint.files import CheckpointError, check_compatible
    from tpframe.checkpoint.init_from import check_base

    try:
        check_compatible(cfg, meta)
        saved = meta["config"]
        diffs = [d for d in differences(saved, cfg.to_dict(), "in the checkpoint") if not d.startswith("model.")]
    except (KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(
            f"{path}/meta.json is malformed ({type(e).__name__}: {e}); use an older step_* directory"
        ) from None
    if diffs:
        raise CheckpointError(
            f"checkpoint {str(path)!r} belongs to another run: {'; '.join(diffs)}; resume with "
            "the same settings, or start a new run (a new train.run_dir; checkpoint.init_from "
            "for the weights)"
        )
    if cfg.optim.lora_rank is not None and cfg.checkpoint.init_from:  # the adapters' base is loaded again
        check_base(cfg.checkpoint.init_from, meta.get("lora_base"), f"checkpoint {str(path)!r}")
    try:
        train_data.load_state_dict(meta["data"])  # the position is loaded again with the rest; this checks it
    except ValueError as e:
        raise CheckpointError(f"checkpoint {str(path)!r}: {e}") from None


def check_checkpoint_files(cfg, path: Path | None, meta: dict | None, *, world_size: int, rank: int) -> None:
    """checkpoint.verify=size compares sizes only, so a flipped byte reaches loading: read now what is small and read
    by every rank, DCP's index (.metadata), and on rank 0 the RNG files this layout restores. The shards are read
    when loading; a corrupt one is named there (Checkpointer.load), before the run writes anything."""
    if path is None or cfg.checkpoint.verify == "crc" or meta.get("snapshot"):  # CRC32s checked (files.verify)
        return
    from tpframe.checkpoint.dcp_io import read_index
    from tpframe.checkpoint.files import read_cause, restores_rng, unreadable

    read_index(path)
    p = cfg.parallel
    layout = {"world": world_size, "tp": p.tp, "cp": p.cp, "dp": world_size // (p.tp * p.cp * p.pp), "pp": p.pp}
    if rank != 0 or not restores_rng(meta["layout"], layout):
        return
    for r in range(world_size):
        try:
            torch.load(path / f"rng_{r}.pt", map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001 - unpickling a damaged file raises many types
            raise unreadable(path, f"rng_{r}.pt", read_cause(e)) from None


def check_init_from(cfg, model: nn.Module | None, resuming: bool) -> None:
    """checkpoint.init_from can become this model (tpframe/checkpoint/init_from.py); a safetensors file holds exactly
    this model's tensors and shapes, all finite."""
    file = cfg.checkpoint.init_from
    if not file or resuming:
        return
    from tpframe.checkpoint.init_from import check_init_from as can_become_this_model

    can_become_this_model(cfg)
    if Path(file).is_dir():  # a Hugging Face directory or a checkpoint: checked whole above
        return
    key = f"checkpoint.init_from={file!r}"
    try:
        from safetensors import safe_open
    except ImportError:
        raise ConfigError(f"{key} needs the safetensors package: pip install safetensors") from None
    try:
        with safe_open(file, framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise ConfigError(
            f"{key} is not a safetensors file ({str(e).splitlines()[0][:120]}); export one with "
            "python tools/checkpoint.py export"
        ) from None
    if model is not None:
        from tpframe.parallel.sharding import param_shards

        want = {
            s.name: tuple(s.global_shape)
            for n, p in model.named_parameters()
            if not p.lora  # LoRA's adapters start afresh; the file is their base
            for s in param_shards(n, p, 0, cfg.parallel.tp, trim_vocab=True)
        }
        missing, extra = sorted(set(want) - set(shapes)), sorted(set(shapes) - set(want))
        wrong = [
            f"{k} {shapes[k]} (the model's is {want[k]})"
            for k in sorted(set(want) & set(shapes))
            if shapes[k] != want[k]
        ]
        if missing or extra or wrong:
            what = (
                f"lacks {missing[:3]}"
                if missing
                else f"has tensors this model does not: {extra[:3]}"
                if extra
                else f"has other shapes: {'; '.join(wrong[:3])}"
            )
            raise ConfigError(f"{key} {what}; was it exported from a model with this config's architecture?")
    from tpframe.checkpoint.finite import check_finite_weights, safetensors_items

    check_finite_weights(safetensors_items([Path(file)]), key)
