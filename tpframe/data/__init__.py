"""Token data: the embedded corpora, tokenizers and token files, and the resumable batch iterator.

Needs nothing of training: `tools/prepare_data.py` imports only this package.
"""

from tpframe.data.config import DataConfig
from tpframe.data.corpus import TokenStream, stdlib_corpus, synthetic_corpus
from tpframe.data.loader import BatchIterator, build_data

__all__ = ["BatchIterator", "DataConfig", "TokenStream", "build_data", "stdlib_corpus", "synthetic_corpus"]
