"""Data: the sentencepiece tokenizer, document sources (built-in corpus, local files,
Hugging Face datasets) and the packing loader that shards windows by data-parallel rank."""

from titanlite.data.loader import TokenWindowLoader, build_dataloader
from titanlite.data.sources import build_source
from titanlite.data.tokenizer import Tokenizer

__all__ = ["Tokenizer", "TokenWindowLoader", "build_dataloader", "build_source"]
