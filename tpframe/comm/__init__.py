"""One communication interface, two backends (torch.distributed and symmetric-memory kernels)."""

from tpframe.comm.communicator import BACKENDS, ENV_VAR, Communicator, resolve_backend_name

__all__ = ["BACKENDS", "ENV_VAR", "Communicator", "resolve_backend_name"]
