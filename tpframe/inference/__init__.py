"""Generation from a trained model, tensor-parallel: KV cache, vocab-parallel sampling, CUDA-graphed decode.

    kv_cache.py   the preallocated cache, sharded by TP heads (left-padded batches, device-side state)
    sampling.py   greedy / temperature / top-k / top-p on vocab-parallel logits
    graph.py      the decode step captured as a CUDA graph
    generate.py   `Generator`: prefill, then one decode step per token
    loading.py    weights from a training checkpoint (any layout) or a safetensors export
    text.py       the run's tokenizer, prompts from the command line or a file
The command line is generate.py at the repository root.
"""

from tpframe.inference.generate import Generation, Generator
from tpframe.inference.kv_cache import KVCache
from tpframe.inference.sampling import SamplingConfig, VocabParallelSampler

__all__ = ["Generation", "Generator", "KVCache", "SamplingConfig", "VocabParallelSampler"]
