"""The attention engine: ``ring_attention`` and ``token_info`` (``api``), argument checks, the
ring schedule, masks, the ring autograd function and its communication, Ulysses, and the block
kernels (``kernels``)."""
from .api import ring_attention, token_info
from .masks import TokenInfo

__all__ = ["TokenInfo", "ring_attention", "token_info"]
