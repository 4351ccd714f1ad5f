"""ringseq: exact ring attention for fine-tuning Hugging Face models on long sequences.

Public API (see README.md): ``init``, ``SequenceParallel``, ``ring_attention``, ``shard``,
``gather``, ``token_info``, ``RingSeqError``.
"""
from .attention import ring_attention, token_info
from .errors import RingSeqError
from .layouts import LAYOUTS
from .sharding import gather, shard
from .topology import SequenceParallel, init

__version__ = "0.1.0"

__all__ = ["LAYOUTS", "RingSeqError", "SequenceParallel", "gather", "init", "ring_attention", "shard",
           "token_info"]
