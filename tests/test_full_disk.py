"""A full disk under the tools: one line naming the path and the free space, exit 2, nothing half-written, the
earlier output intact. The disk fills up through RLIMIT_FSIZE (no file may grow past a few KiB: the kernel refuses
the write, EFBIG, as a full disk refuses it with ENOSPC; raised back after the call), so no loop device or tmpfs.
The tools' main functions run in this process, as their command lines do."""

import contextlib
import importlib.util
import os
import resource
import signal
from pathlib import Path

import pytest

from tests.training_utils import REPO

LIMIT = 16 << 10  # bytes any file may reach: the tiny checkpoint's tensors need more


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(REPO) / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@contextlib.contextmanager
def _full_disk():
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails (EFBIG) instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def _files(folder: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A one-step checkpoint of a tiny model, trained in this process (the launch variables it sets are undone)."""
    import train
    from tests.conftest import LAUNCH_ENV

    run, saved = tmp_path_factory.mktemp("run"), {k: os.environ.get(k) for k in LAUNCH_ENV}
    args = ["--config", f"{REPO}/configs/tiny_cpu.yaml", "parallel.tp=1", "model.hidden=64", "model.layers=1"]
    args += ["model.heads=4", "model.vocab_size=256", "train.seq_len=16", "train.steps=1", "train.eval_interval=0"]
    try:
        assert train.main([*args, f"train.run_dir={run}"]) == 0
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    return run / "checkpoints"


@pytest.mark.parametrize("fmt, out", [("safetensors", "m.safetensors"), ("hf", "hf_model")])
def test_an_export_on_a_full_disk_is_one_line_exit_2_and_the_earlier_export_stays(
    tmp_path, checkpoint, fmt, out, capsys
):
    main, args = _tool("checkpoint"), ["export", str(checkpoint), "--format", fmt, "--out", str(tmp_path / out)]
    assert main(args) == 0
    before, _ = _files(tmp_path), capsys.readouterr()
    with _full_disk():
        code = main(args)
    got = capsys.readouterr()
    lines = got.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and got.out == "", got
    assert lines[0].startswith(f"tpframe: cannot write --out: {str(tmp_path / out)!r} (File too large; "), lines
    assert " free there); free space or write elsewhere (an earlier export there is intact)" in lines[0], lines
    assert _files(tmp_path) == before, "the earlier export is intact, and nothing else was left there"


def test_prepare_data_on_a_full_disk_is_one_line_exit_2_and_the_earlier_file_stays(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("small\n")
    (tmp_path / "big.txt").write_text("The quick brown fox jumps over the lazy dog.\n" * 1000)
    main, out = _tool("prepare_data"), str(tmp_path / "d.bin")
    assert main([str(tmp_path / "a.txt"), "--out", out]) == 0
    before, _ = _files(tmp_path), capsys.readouterr()
    with _full_disk():
        code = main([str(tmp_path / "big.txt"), "--out", out])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"prepare_data.py: error: cannot write --out: {out!r} (File too large; "), lines
    assert _files(tmp_path) == before


def test_plot_loss_on_a_full_disk_is_one_line_exit_2_and_the_earlier_plot_stays(tmp_path, checkpoint, capsys):
    pytest.importorskip("matplotlib", reason="plot_loss.py draws with matplotlib (dev extras)")
    main, out = _tool("plot_loss"), tmp_path / "loss.png"
    assert main([str(checkpoint.parent), "--out", str(out)]) == 0
    before, _ = _files(tmp_path), capsys.readouterr()
    with _full_disk():
        code = main([str(checkpoint.parent), "--out", str(out)])
    got = capsys.readouterr()
    lines = got.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and got.out == "", got
    assert lines[0].startswith(f"plot_loss.py: error: cannot write --out: {str(out)!r} (File too large; "), lines
    assert lines[0].endswith("free space or write elsewhere (an earlier plot there is intact)"), lines
    assert _files(tmp_path) == before, "the earlier plot is intact, and nothing else was left there"
