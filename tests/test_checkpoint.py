"""Sharded checkpoints: bit-exact resume, resharding to other layouts, atomicity, export/import."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.training_utils import REPO, TINY, merge_overrides, torchrun_env, train_in_process

STEPS = ["train.steps=20"]


def _run(overrides):
    return [r["loss"] for r in train_in_process(overrides)]


def _final_weights(overrides):
    from tests.reference import gather_full_tensors

    trainer = train_in_process(overrides, keep_trainer=True)
    return [r["loss"] for r in trainer.history], {
        k: v for k, v in gather_full_tensors(trainer.model, trainer.parallel.tp_comm).items()
    }


def _final_weights_after_run(overrides, then):
    """_final_weights(overrides), then _run(then) in the same world."""
    out = _final_weights(overrides)
    _run(then)
    return out


def test_resume_continues_bit_for_bit_at_tp2(tmp_path):
    # the straight run, and the same run checkpointing every 10 steps (one world); then a new job resumes from step
    # 10 and finishes
    straight, w_straight = run_distributed(
        _final_weights_after_run,
        2,
        [*STEPS, "parallel.tp=2", "model.dropout=0.1", f"train.run_dir={tmp_path}/a"],
        [*STEPS, "parallel.tp=2", "model.dropout=0.1", "checkpoint.interval=10", f"train.run_dir={tmp_path}/b"],
    )[0]
    step10 = tmp_path / "b" / "checkpoints" / "step_00000010"
    assert step10.exists()
    resumed, w_resumed = run_distributed(
        _final_weights,
        2,
        [*STEPS, "parallel.tp=2", "model.dropout=0.1", f"checkpoint.load={step10}", f"train.run_dir={tmp_path}/c"],
    )[0]
    assert len(resumed) == 10
    assert resumed == straight[10:], "resumed losses must equal the uninterrupted run's, to the bit"
    for name in w_straight:
        assert torch.equal(w_resumed[name], w_straight[name]), name


def test_only_the_last_k_checkpoints_are_kept(tmp_path):
    run_distributed(
        _run,
        2,
        [
            "train.steps=8",
            "parallel.tp=2",
            "checkpoint.interval=2",
            "checkpoint.keep_last=2",
            "checkpoint.save_at_end=true",
            f"train.run_dir={tmp_path}",
        ],
    )
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["latest", "step_00000006", "step_00000008"]


def test_auto_resume_from_latest(tmp_path):
    run_distributed(
        _run, 2, [*STEPS, "train.steps=10", "parallel.tp=2", "checkpoint.save_at_end=true", f"train.run_dir={tmp_path}"]
    )
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000010"
    more = run_distributed(
        _run, 2, [*STEPS, "parallel.tp=2", "checkpoint.auto_resume=true", f"train.run_dir={tmp_path}"]
    )[0]
    assert len(more) == 10  # steps 11..20


def _loss_and_next_step(overrides):
    """Loss of the loaded model on a fixed batch, then one training step; full weights after it."""
    from tests.reference import gather_full_tensors

    trainer = train_in_process([*overrides, "train.steps=11"], keep_trainer=True)
    batch_loss = trainer.history[0]["loss"]
    return batch_loss, gather_full_tensors(trainer.model, trainer.parallel.tp_comm)


@pytest.fixture(scope="module")
def tp2_checkpoint(tmp_path_factory):
    """A TP=2 run's step-10 checkpoint, and the loss and weights of one more step loaded from it at TP=2 (in a new
    world, as a later job would): what every layout of test_reshard_tp2_checkpoint_to_another_layout must give.
    Built once for the module; the tests only read the checkpoint."""
    root = tmp_path_factory.mktemp("reshard")
    saved = root / "saved"
    run_distributed(
        _run, 2, ["train.steps=10", "parallel.tp=2", "checkpoint.save_at_end=true", f"train.run_dir={saved}"]
    )
    ckpt = saved / "checkpoints" / "step_00000010"
    reference = run_distributed(
        _loss_and_next_step, 2, ["parallel.tp=2", f"checkpoint.load={ckpt}", f"train.run_dir={root}/r"]
    )[0]
    return ckpt, reference


@pytest.mark.parametrize(
    "world,layout",
    [
        (1, ["parallel.tp=1", "train.micro_batch_size=8"]),
        (4, ["parallel.tp=4"]),
        (4, ["parallel.tp=2", "train.micro_batch_size=2"]),
    ],
    ids=["tp1", "tp4", "tp2-dp2"],
)
def test_reshard_tp2_checkpoint_to_another_layout(tmp_path, tp2_checkpoint, world, layout):
    ckpt, reference = tp2_checkpoint
    moved = run_distributed(
        _loss_and_next_step, world, [*layout, f"checkpoint.load={ckpt}", f"train.run_dir={tmp_path}/m"]
    )[0]
    assert abs(moved[0] - reference[0]) <= 1e-5 * abs(reference[0]), (moved[0], reference[0])
    for name, w in reference[1].items():
        if name.endswith("attn.qkv.k.bias"):
            # its gradient is zero in exact arithmetic (softmax is shift-invariant): Adam normalizes
            # rounding noise there, which differs with the reduction order of each layout
            continue
        err = (moved[1][name] - w).norm() / w.norm().clamp_min(1e-12)
        assert err < 1e-5, f"{name} after the next step differs by {err:.2e} (optimizer state lost?)"


def test_async_save_equals_sync_save(tmp_path):
    run_distributed(_run, 2, ["train.steps=6", "parallel.tp=2", "checkpoint.interval=3", f"train.run_dir={tmp_path}/s"])
    run_distributed(
        _run,
        2,
        [
            "train.steps=6",
            "parallel.tp=2",
            "checkpoint.interval=3",
            "checkpoint.async_save=true",
            f"train.run_dir={tmp_path}/a",
        ],
    )
    from tpframe.checkpoint.export import read_model_tensors

    for step in ("step_00000003",):
        sync, asyn = (
            read_model_tensors(tmp_path / "s/checkpoints" / step),
            read_model_tensors(tmp_path / "a/checkpoints" / step),
        )
        assert sync.keys() == asyn.keys()
        assert all(torch.equal(sync[k], asyn[k]) for k in sync)
    assert json.loads((tmp_path / "a/checkpoints/step_00000003/meta.json").read_text())["step"] == 3


def _signal_at_step_5(overrides):
    from tpframe.training.trainer import Trainer

    original = Trainer.train_step

    def train_step(self):
        out = original(self)
        if self.step == 5 and self.parallel.rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # preemption reaches one rank first
        return out

    Trainer.train_step = train_step
    return _run(overrides)


def test_preemption_signal_saves_and_stops_cleanly(tmp_path):
    losses = run_distributed(_signal_at_step_5, 2, [*STEPS, "parallel.tp=2", f"train.run_dir={tmp_path}"])
    assert [len(x) for x in losses] == [5, 5], "every rank stops after the same step"
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000005"


def _checkpoint_tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("tools_checkpoint", os.path.join(REPO, "tools", "checkpoint.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_export_then_import_gives_identical_tensors(tmp_path):
    run_distributed(
        _run,
        2,
        [
            "train.steps=4",
            "parallel.tp=2",
            "model.tie_embeddings=false",
            "model.activation=swiglu",
            "checkpoint.save_at_end=true",
            f"train.run_dir={tmp_path}/a",
        ],
    )
    out = subprocess.run(
        [
            sys.executable,
            "tools/checkpoint.py",
            "export",
            str(tmp_path / "a/checkpoints"),
            "--out",
            str(tmp_path / "m.safetensors"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "m.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask  # not safetensors' own 0600
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "m.safetensors"))
    assert exported["embedding.weight"].shape == (256, 32)  # no padding rows, plain names
    assert "blocks.0.mlp.fc1.gate.weight" in exported and "blocks.0.attn.qkv.q.weight" in exported
    imported = run_distributed(
        _final_weights,
        4,
        [
            "train.steps=0",
            "parallel.tp=4",
            "model.tie_embeddings=false",
            "model.activation=swiglu",
            f"checkpoint.init_from={tmp_path / 'm.safetensors'}",
            f"train.run_dir={tmp_path}/b",
        ],
    )[0][1]
    assert exported.keys() == imported.keys()
    for k in exported:
        assert torch.equal(exported[k], imported[k]), k
    # the checkpoint itself (its root: latest) starts a run at TP=1 x DP=2 with the same weights, at step 0
    history, weights = run_distributed(
        _final_weights,
        2,
        [
            "train.steps=1",
            "parallel.tp=1",
            "model.tie_embeddings=false",
            "model.activation=swiglu",
            f"checkpoint.init_from={tmp_path / 'a/checkpoints'}",
            f"train.run_dir={tmp_path}/c",
        ],
    )[0]
    fresh = run_distributed(
        _final_weights,
        2,
        [
            "train.steps=1",
            "parallel.tp=1",
            "model.tie_embeddings=false",
            "model.activation=swiglu",
            f"checkpoint.init_from={tmp_path / 'm.safetensors'}",
            f"train.run_dir={tmp_path}/d",
        ],
    )[0]
    assert history == fresh[0] and len(history) == 1  # step 1 of a new run, from the same weights
    for k in exported:
        assert torch.equal(weights[k], fresh[1][k]), k
    # train.eval_only: the saved weights evaluated at TP=2 and at TP=1 x DP=2 (the same 4 sequences), nothing saved
    evals = []
    for name, layout in (
        ("e", ["parallel.tp=2", "train.micro_batch_size=4"]),
        ("f", ["parallel.tp=1", "train.micro_batch_size=2"]),
    ):
        run_distributed(
            _run,
            2,
            [
                "train.eval_only=true",
                "train.eval_steps=1",
                "model.tie_embeddings=false",
                "model.activation=swiglu",
                *layout,
                f"checkpoint.load={tmp_path / 'a/checkpoints'}",
                f"train.run_dir={tmp_path}/{name}",
            ],
        )
        records = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["kind"] for r in records if r["kind"] != "start"] == ["eval"] and records[-1]["step"] == 4, records
        evals.append(records[-1]["loss"])
        assert not (tmp_path / name / "checkpoints").exists()
    assert evals[0] == pytest.approx(evals[1], rel=1e-6) and 0 < evals[0] < 6
    text = subprocess.run(
        [sys.executable, "tools/checkpoint.py", "inspect", str(tmp_path / "a/checkpoints")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "step        4" in text and "model/blocks.0.attn.qkv.k.weight" in text and "tp=2" in text
    tool = _checkpoint_tool()
    assert tool.inspected(str(tmp_path / "a")) == text.rstrip("\n")  # a run directory: its checkpoints
    export = tool.inspected(str(tmp_path / "m.safetensors"))
    assert export.startswith(f"export      {tmp_path / 'm.safetensors'}\nstep        4")
    assert "model       name=gpt vocab_size=256 hidden=32" in export and "blocks.0.attn.qkv.k.weight" in export


def test_a_model_mismatch_names_each_sides_configured_values():
    """A key only one side's architecture holds (max_seq_len sizes a tensor with learned positions only) is shown
    with the other side's configured value: neither 'config None' nor listed at all when both configs agree."""
    import dataclasses

    from tpframe.checkpoint.files import CheckpointError, check_compatible
    from tpframe.models.config import architecture
    from tpframe.training.config import from_dict

    def meta_of(model):
        m = from_dict({"model": model}).model
        return {"architecture": architecture(m), "config": {"model": dataclasses.asdict(m)}, "vocab": {"padded": 256}}

    learned = {"max_seq_len": 128, "position": "learned"}
    rotary = from_dict({"model": {"max_seq_len": 128, "position": "rotary"}})
    with pytest.raises(CheckpointError) as e:
        check_compatible(rotary, meta_of(learned))
    assert "model.position: checkpoint 'learned', config 'rotary'" in str(e.value)
    assert "max_seq_len" not in str(e.value), "both sides have max_seq_len 128"
    with pytest.raises(CheckpointError, match="model.qk_norm: checkpoint false, config true"):  # YAML's words
        check_compatible(from_dict({"model": {**learned, "qk_norm": True}}), meta_of(learned))
    with pytest.raises(CheckpointError, match="model.max_seq_len: checkpoint 128, config 64$"):
        check_compatible(from_dict({"model": {"max_seq_len": 64, "position": "learned"}}), meta_of(learned))
    with pytest.raises(CheckpointError, match="model.max_seq_len: checkpoint 64, config 128;"):
        check_compatible(
            from_dict({"model": {"max_seq_len": 128, "position": "learned"}}),
            meta_of({"max_seq_len": 64, "position": "rotary"}),
        )


def test_an_init_from_file_of_another_model_names_each_sides_configured_values(tmp_path):
    import dataclasses

    from safetensors.torch import save_file

    from tpframe.checkpoint.files import CheckpointError
    from tpframe.checkpoint.init_from import check_init_from
    from tpframe.training.config import from_dict

    exported = from_dict({"model": {"max_seq_len": 128, "position": "learned"}}).model
    save_file(
        {"x": torch.zeros(1)},
        str(tmp_path / "m.safetensors"),
        metadata={"format": "tpframe", "model_config": json.dumps(dataclasses.asdict(exported))},
    )
    cfg = from_dict(
        {
            "model": {"max_seq_len": 128, "position": "rotary"},
            "checkpoint": {"init_from": str(tmp_path / "m.safetensors")},
        }
    )
    with pytest.raises(CheckpointError) as e:
        check_init_from(cfg)
    assert "model.position='rotary' but the file has 'learned'" in str(e.value)
    assert "max_seq_len" not in str(e.value), "both sides have max_seq_len 128"


def _torchrun(nproc, args, env):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "train.py",
        *merge_overrides(args),
    ]
    return subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1", **env)
    )


@pytest.mark.slow
def test_rank_killed_during_save_leaves_previous_checkpoint_loadable(tmp_path):
    args = [
        "--config",
        "configs/tiny_cpu.yaml",
        *TINY,
        *STEPS,
        "parallel.tp=2",
        "checkpoint.interval=10",
        "checkpoint.save_at_end=true",
        f"train.run_dir={tmp_path}",
    ]
    killed = _torchrun(2, args, {"TPFRAME_FAULT_KILL_DURING_SAVE": "20", "TPFRAME_FAULT_RANK": "1"})
    assert killed.returncode != 0
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text() == "step_00000010"
    assert (root / "step_00000020.partial").exists() and not (root / "step_00000020").exists()
    # the half-written directory is refused by name, and resume picks `latest`
    refused = _torchrun(2, [*args, f"checkpoint.load={root / 'step_00000020.partial'}"], {})
    assert refused.returncode != 0 and "incomplete" in refused.stderr
    resumed = _torchrun(2, [*args, "checkpoint.auto_resume=true"], {})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed at step 10" in resumed.stdout + resumed.stderr
    assert (root / "latest").read_text() == "step_00000020" and not (root / "step_00000020.partial").exists()


VOCAB = ["model.vocab_size=258", "model.vocab_multiple=1"]  # padded to 258 at tp=2, to 260 at tp=4


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory):
    """A finished 2-step TP=2 run with its checkpoint (left as it is: a test that damages it copies it first)."""
    root = tmp_path_factory.mktemp("tp2")
    run_distributed(
        _run, 2, [*VOCAB, "train.steps=2", "parallel.tp=2", "checkpoint.save_at_end=true", f"train.run_dir={root}"]
    )
    return root


def _preflight(monkeypatch, capsys, world: int, overrides: list[str]) -> tuple[int, str]:
    """train.main in this process as a rank of a `world`-process launch would run it: (exit code, stderr)."""
    import train

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(train, "run", lambda *a, **k: pytest.fail("pre-flight passed a bad checkpoint"))
    for key, value in torchrun_env(world).items():
        monkeypatch.setenv(key, value)
    code = train.main(merge_overrides(["--config", "configs/tiny_cpu.yaml"], TINY, VOCAB, overrides))
    return code, capsys.readouterr().err


def test_truncated_shard_is_refused_with_a_clear_error(tmp_path, tp2_run, monkeypatch, capsys):
    step = tmp_path / "step_00000002"
    shutil.copytree(tp2_run / "checkpoints" / "step_00000002", step)
    shard = sorted(step.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    code, err = _preflight(monkeypatch, capsys, 2, [f"checkpoint.load={step}", f"train.run_dir={tmp_path}/run"])
    assert code == 2 and "truncated" in err and shard.name in err and "Traceback" not in err, err


def test_incompatible_layout_is_refused_before_loading(tp2_run, monkeypatch, capsys):
    step = tp2_run / "checkpoints" / "step_00000002"
    for overrides, message in (
        (["model.hidden=64"], "model.hidden: checkpoint 32, config 64"),
        (["parallel.tp=4"], "the vocabulary was padded to 258 rows when saved but pads to 260 at parallel.tp=4"),
    ):
        code, err = _preflight(monkeypatch, capsys, 4, [*overrides, f"checkpoint.load={step}"])
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def _snapshot_round_trip(folder: str):
    import torch.distributed as dist

    from tpframe.checkpoint.files import SNAPSHOT_LATEST, CheckpointError
    from tpframe.checkpoint.snapshot import Snapshots
    from tpframe.parallel.sharding import LogicalChunks

    rank = dist.get_rank()
    flat = torch.arange(30, dtype=torch.float32) + 100 * rank
    moments = torch.randn(5, dtype=torch.bfloat16)

    def state():  # views into live storage, as a strategy hands them: a strided rectangle among them
        rect = flat.view(5, 6)[:, 1:4]
        return {"model/w": LogicalChunks((10, 3), [((5 * rank, 0), rect)]), "optim/m": moments, "optim/step": 7}

    snaps = Snapshots(Path(folder), rank=rank, group=dist.group.WORLD, job="launch-1")
    snaps.save(state(), {"rng": torch.tensor([rank])}, {"step": 4, "job": "launch-1"})
    first = json.loads((Path(folder) / SNAPSHOT_LATEST).read_text())
    saved = flat.clone(), moments.clone()
    flat.mul_(-1)
    moments.add_(1)
    snaps.save(state(), {"rng": torch.tensor([rank])}, {"step": 5, "job": "launch-1"})  # the other slot
    second = json.loads((Path(folder) / SNAPSHOT_LATEST).read_text())
    flat.zero_()
    target = state() | {"optim/step": None}
    rng = Snapshots(Path(folder), rank=rank, group=dist.group.WORLD, job="launch-1").load(target, first)
    back = (flat.view(5, 6)[:, 1:4].clone(), moments.clone(), target["optim/step"], int(rng["rng"]))
    wrong = {"model/w": LogicalChunks((10, 4), [((0, 0), torch.zeros(5, 4))])}
    try:
        snaps.load(wrong, first)
        mismatch = None
    except CheckpointError as e:
        mismatch = str(e)
    original = os.posix_fallocate
    if rank == 1:  # a full /dev/shm on one rank: every rank raises, `latest` stays the second snapshot
        os.posix_fallocate = lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device"))
    try:
        snaps.maps.clear()
        snaps.save(state(), {}, {"step": 6, "job": "launch-1"})
        full = None
    except OSError as e:
        full = str(e)
    finally:
        os.posix_fallocate = original
    after = json.loads((Path(folder) / SNAPSHOT_LATEST).read_text())
    return first, second, saved, back, mismatch, full, after


def test_a_snapshot_copies_each_rank_s_pieces_back_bit_for_bit_and_a_full_dev_shm_fails_on_every_rank(tmp_path):
    """Two slots written in turn; a load copies the older one back into the live views (a strided rectangle
    included), the non-tensor entries and the RNG state; pieces of another shape are one line; a rank that cannot
    reserve its file makes every rank raise, and `latest` stays the last whole snapshot."""
    for rank, out in enumerate(run_distributed(_snapshot_round_trip, 2, str(tmp_path / "snap"))):
        first, second, (flat, moments), (rect, moments_back, step, rng), mismatch, full, after = out
        assert (first["step"], first["slot"], second["step"], second["slot"]) == (4, 0, 5, 1)
        assert first["snapshot"] is True and first["job"] == "launch-1"
        assert torch.equal(rect, flat.view(5, 6)[:, 1:4]) and torch.equal(moments_back, moments)
        assert step == 7 and rng == rank
        assert "does not hold this run's pieces" in mismatch, mismatch
        assert "rank 1: OSError: [Errno 28] No space left on device" in full, full
        assert after == second
