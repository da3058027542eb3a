import os
import sys

import pytest

# Worker functions live in test modules and are pickled by reference: make `tests` importable
# the same way in the forkserver children.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs; skipped on CPU")
    config.addinivalue_line(
        "markers", "slow: the slow tier (multi-launch drills, layout sweeps): deselected by default, `-m slow` runs it"
    )


def pytest_collection_finish(session):
    """The modules imported by collection live for the session: in-process training runs' full garbage collections
    (train.gc_interval's, at each run's start) skip them (~0.15 s each)."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    import torch

    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        need = marker.kwargs.get("count", 1)
        if n_gpus < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPU(s), found {n_gpus}: run on the GPU device"))
        elif need < int(os.environ.get("TPFRAME_GPU_TESTS_FROM", "1")):  # a multi-GPU call runs only what needs it
            item.add_marker(pytest.mark.skip(reason=f"needs {need} GPU(s); TPFRAME_GPU_TESTS_FROM asks for more"))


LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _launch_env_restored():
    """train.main and generate.main called in this process set a world of one in os.environ (as a launched run
    needs): put the launcher's variables back after each test, so no later test or subprocess takes itself for a
    worker of that world."""
    before = {k: os.environ.get(k) for k in LAUNCH_ENV}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
