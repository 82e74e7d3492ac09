"""Tokenizers of GGUF vocabularies, matching llama.cpp's ids and pieces.

- ``vocab.py``: the ``Tokenizer`` (tables, special tokens, encode/decode) and ``StreamDecoder``;
- ``pretokenize.py``: the byte-level BPE split rules of every ``tokenizer.ggml.pre`` llama.cpp knows;
- ``bpe.py``: GPT-2's byte alphabet and the BPE merges;
- ``spm.py``: SentencePiece (``tokenizer.ggml.model = llama``) with byte fallback.
"""
from .vocab import StreamDecoder, Tokenizer

__all__ = ["Tokenizer", "StreamDecoder"]
