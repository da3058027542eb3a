"""Sharded checkpoints with torch.distributed.checkpoint: atomic, verified, resumable on any layout and strategy.

files.py finds and checks checkpoint directories (no process group: runs in pre-flight);
dcp_io.py writes and reads pieces of global logical tensors through DCP; checkpointer.py is the
component the trainer uses; export.py turns a checkpoint into one safetensors file and back; hf.py reads a
Hugging Face directory (the families are tpframe/models/hf's) and hf_export.py writes one; init_from.py starts a
run's weights from any of them. Each imports only those before it: files, dcp_io, export, hf; hf_export and
init_from last.
"""

from tpframe.checkpoint.files import CheckpointError, checkpoint_root, preflight, resolve, verify

__all__ = ["CheckpointError", "checkpoint_root", "preflight", "resolve", "verify"]
