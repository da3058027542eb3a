"""The first-step check that weights replicated over TP get the same gradient on every TP rank
(tpframe/training/replicas.py): a layer that sees rank-dependent activations without its sequence_parallel tag is
found (in a hand-built block, and in train.py with a plug-in model, exit code 2 before the first update), while
correct layers pass at TP 2 and 4, with and without sequence parallelism."""

import sys
import textwrap

import pytest
import torch

from tests.dist_utils import run_distributed


def _block_spreads(tp: int, sequence_parallel: bool, tag_norm: bool) -> list[tuple[str, float]]:
    """A norm -> column -> row block (the norm built with or without its SP tag), two micro-batches through the
    check; the (name, spread) list, after verify's error or None."""
    from tests.reference import scatter_to_sp
    from tpframe.errors import ConfigError
    from tpframe.layers import ColumnParallelLinear, LayerNorm, RowParallelLinear
    from tpframe.parallel import initialize_parallel
    from tpframe.training.replicas import ReplicaGradCheck

    state = initialize_parallel(tp=tp)
    comm, h = state.tp_comm, 16
    torch.manual_seed(0)  # the same weights on every rank (replicas start equal)
    model = torch.nn.Sequential(
        LayerNorm(h, sequence_parallel=sequence_parallel and tag_norm),
        ColumnParallelLinear(h, 4 * h, sequence_parallel=sequence_parallel, comm=comm),
        RowParallelLinear(4 * h, h, sequence_parallel=sequence_parallel, comm=comm),
    )
    check = ReplicaGradCheck(model, comm)
    with check:
        for micro_batch in range(2):
            torch.manual_seed(100 + micro_batch)  # the same data on every TP rank
            x = torch.randn(8 * tp, 2, h)  # [s, b, h]
            x = scatter_to_sp(x, comm) if sequence_parallel else x
            model(x).square().sum().backward()
    spreads = check.spreads()
    with pytest.raises(ConfigError) if sequence_parallel and not tag_norm else _nothing():
        check.verify()
    assert not check._hooks and not check.grads  # hooks removed on exit, records dropped after verify
    return spreads


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("tp", [2, 4])
def test_an_untagged_weight_under_sequence_parallelism_is_found_and_correct_layers_pass(tp):
    for sp, tag in ((True, True), (False, False), (True, False)):
        spreads = dict(run_distributed(_block_spreads, tp, tp, sp, tag)[0])
        # watched: the norm unless it is tagged, and the row layer's bias unless SP tags it
        expected = ({"0.weight", "0.bias"} if not (sp and tag) else set()) | ({"2.bias"} if not sp else set())
        assert set(spreads) == expected, (sp, tag, spreads)
        if sp and not tag:  # each rank's norm saw its own sequence slice: partial gradients, far beyond 1e-3
            assert min(spreads.values()) > 0.1, spreads
        else:
            assert max(spreads.values(), default=0.0) == 0.0, (sp, tag, spreads)  # bit-identical on every rank


PLUGIN = textwrap.dedent('''
    from tpframe.layers import LayerNorm
    from tpframe.models import BUILTIN


    def build(cfg, ctx):
        """tpframe's GPT with its norms' sequence_parallel tags dropped: the mistake a plug-in model can make."""
        model = BUILTIN["gpt"](cfg, ctx)
        for m in model.modules():
            if isinstance(m, LayerNorm):
                for p in m.parameters():
                    p.sequence_parallel = False
        return model


    def build_last_stage(cfg, ctx):
        """The same mistake in the final norm only: on a pipeline, only the last stage holds it."""
        model = BUILTIN["gpt"](cfg, ctx)
        if model.final_norm is not None:
            for p in model.final_norm.parameters():
                p.sequence_parallel = False
        return model


    build_last_stage.supports_pipeline = True
''')


def _train_untagged(plugin_dir: str, run_dir: str, check: bool, strategy: str = "ddp", more=()):
    from tests.training_utils import train_in_process
    from tpframe.errors import ConfigError

    sys.path.insert(0, plugin_dir)
    overrides = [
        "model.name=untagged_gpt:build",
        *more,
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "train.steps=3",
        f"train.run_dir={run_dir}",
        "checkpoint.save_at_end=true",
        f"train.check_replicas={str(check).lower()}",
        f"parallel.dp_strategy={strategy}",
        "train.global_batch_size=16",
    ]
    try:
        return [r["loss"] for r in train_in_process(overrides)]
    except ConfigError as e:
        return str(e)


@pytest.mark.parametrize("strategy, world", [("ddp", 2), ("fsdp", 4)])  # fsdp: TP=2 x DP=2, grads read from .grad
def test_train_stops_before_the_first_update_when_a_plugin_model_drops_its_sequence_parallel_tags(
    tmp_path, strategy, world
):
    (tmp_path / "untagged_gpt.py").write_text(PLUGIN)
    errors = run_distributed(_train_untagged, world, str(tmp_path), str(tmp_path / "run"), True, strategy)
    assert all(isinstance(e, str) for e in errors), errors  # every rank stops before its first update
    assert all(errors[r] == errors[r + 1] for r in range(0, world, 2)), errors  # one message per TP group (TP=2)
    assert "blocks.0.norm1.weight" in errors[0] and "sequence_parallel=ctx.sequence_parallel" in errors[0], errors[0]
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing saved from the drifting model
    if strategy == "ddp":  # the escape hatch trains (and drifts): what the check exists to prevent
        losses = run_distributed(_train_untagged, world, str(tmp_path), str(tmp_path / "unchecked"), False)
        assert len(losses[0]) == 3, losses


def test_every_stage_stops_when_one_pipeline_stages_replicas_disagree(tmp_path):
    """PP=2 x TP=2: only the last stage's TP group finds its untagged final norm; the first stage's ranks stop too
    (a world-wide agreement), rather than wait for activations that never come."""
    (tmp_path / "untagged_gpt.py").write_text(PLUGIN)
    errors = run_distributed(
        _train_untagged,
        4,
        str(tmp_path),
        str(tmp_path / "run"),
        True,
        "ddp",
        ["model.name=untagged_gpt:build_last_stage", "parallel.pp=2"],
    )
    assert all(e == errors[0] for e in errors), errors  # one line everywhere: rank 0 (stage 0) names them too
    assert "final_norm.weight" in errors[0] and "blocks." not in errors[0], errors[0]
