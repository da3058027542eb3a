"""tpframe: tensor-parallel GPT training on PyTorch."""

from tpframe.version import __version__

__all__ = ["__version__"]
