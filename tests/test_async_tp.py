"""Async TP on CPU (gloo) (tpframe/layers/async_tp.py; its GPU tests: tests/test_async_tp_ce_gpu.py).

- Without copy engines (CPU) the layers built with async TP take the plain path, bit for bit.
- Asked for on a machine without CUDA: one line, exit 2, nothing written; parallel.async_tp=ring (removed) is one
  line naming the choices.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.test_perf_paths import GPT_CFG, B, S


def _gpu_modes_fall_back_on_cpu():
    from tpframe.layers.async_tp import async_tp_available
    from tpframe.layers.linear import ColumnParallelLinear
    from tpframe.layers.mode import LayerMode
    from tpframe.models import BuildContext, build_model
    from tpframe.parallel import initialize_parallel, seed_parallel_rng

    state = initialize_parallel(tp=torch.distributed.get_world_size())
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, GPT_CFG.vocab_size, (B, S), generator=g)
    out = []
    for mode in (None, "copy_engine"):
        tracker = seed_parallel_rng(0)
        ctx = BuildContext(
            state.tp_comm, sequence_parallel=True, rng_tracker=tracker, seed=3, mode=LayerMode(async_tp=mode)
        )
        model = build_model(GPT_CFG, ctx)
        linears = [m for m in model.modules() if isinstance(m, ColumnParallelLinear)]
        assert all(m.async_tp == mode for m in linears)
        loss = model(ids, ids)
        loss.mean().backward()
        out.append((loss.detach(), [p.grad for p in model.parameters()]))
    assert not async_tp_available(state.tp_comm, torch.zeros(1)), "CPU has no copy engines"
    assert state.tp_comm.peer_exchange() is None
    for other in out[1:]:
        assert torch.equal(out[0][0], other[0])
        assert all(torch.equal(a, b) for a, b in zip(out[0][1], other[1]))
    return True


def test_gpu_async_tp_modes_fall_back_to_the_plain_path_on_cpu():
    """copy_engine without copy engines: the plain path, bit for bit."""
    run_distributed(_gpu_modes_fall_back_on_cpu, 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
@pytest.mark.parametrize("mode", ["copy_engine", "true"])
def test_gpu_async_tp_modes_are_one_line_and_exit_2_without_cuda(mode, capsys, tmp_path, monkeypatch):
    from tests.training_utils import REPO, torchrun_env

    monkeypatch.syspath_prepend(REPO)
    import train

    for key, value in torchrun_env(2).items():  # as torchrun sets it for the tp=2 config
        monkeypatch.setenv(key, value)
    code = train.main(
        [
            "--config",
            f"{REPO}/configs/tiny_cpu.yaml",
            f"train.run_dir={tmp_path}/run",
            "parallel.sequence_parallel=true",
            f"parallel.async_tp={mode}",
        ]
    )
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1, lines
    assert f"parallel.async_tp={mode} moves data between GPUs and no CUDA device is visible" in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_the_removed_ring_mode_is_one_line_naming_the_choices():
    from tpframe.training.config import ConfigError, load_config, validate

    with pytest.raises(ConfigError, match=r"parallel.async_tp='ring' is not allowed; choose true, false or one of 'co"):
        validate(load_config(None, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.async_tp=ring"]), 2)


def test_auto_is_on_only_where_the_table_measured_a_gain(monkeypatch, tmp_path):
    """parallel.async_tp=auto (the default): on for a measured (GPU, TP, hidden) that was faster than off at no more
    tokens per micro-batch, off for everything else; `record` replaces a row and keeps the others."""
    from types import SimpleNamespace

    from tpframe.layers import async_tp
    from tpframe.training.config import load_config

    assert load_config(None, []).parallel.async_tp == "auto"
    table = tmp_path / "auto.json"
    table.write_text("[]\n")
    monkeypatch.setattr(async_tp, "AUTO_TABLE", table)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU X")
    async_tp.record(dict(gpu="GPU X", tp=2, hidden=256, tokens=4096, speedup=0.9, section="first"))
    async_tp.record(dict(gpu="GPU X", tp=4, hidden=256, tokens=4096, speedup=0.8, section="tp4"))
    async_tp.record(dict(gpu="GPU X", tp=2, hidden=256, tokens=4096, speedup=1.05, section="again"))
    assert [r["section"] for r in __import__("json").loads(table.read_text())] == ["again", "tp4"]

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")

    def mode(value="auto", *, tp=2, sp=True, recompute="none", hidden=256, tokens=4096, device=cuda, fp8=False):
        p = SimpleNamespace(async_tp=value, tp=tp, sequence_parallel=sp, recompute=recompute)
        return async_tp.resolve_auto(p, hidden=hidden, tokens=tokens, device=device, fp8=fp8)

    assert mode() == "copy_engine" and mode(tokens=8192) == "copy_engine"
    off = dict(tp=4, hidden=512, tokens=2048, sp=False, device=cpu, fp8=True, recompute="selective")
    for key, value in off.items():
        assert mode(**{key: value}) is None, f"auto must stay off with {key}={value}"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU Y")
    assert mode() is None, "a GPU model the table has not measured: off"
    assert mode(True) == mode("copy_engine") == "copy_engine" and mode(False) is None, "explicit values stay"


def test_the_shipped_table_turns_async_tp_on_only_for_a_measured_gain():
    import json

    from tpframe.layers.async_tp import AUTO_TABLE

    rows = json.loads(AUTO_TABLE.read_text())
    assert rows and all({"gpu", "tp", "hidden", "tokens", "speedup", "section"} <= set(r) for r in rows)
    on = {(r["tp"], r["hidden"]) for r in rows if r["speedup"] > 1.0}
    assert (2, 2048) in on and (2, 4096) in on and (4, 2048) not in on and (4, 4096) not in on, on
