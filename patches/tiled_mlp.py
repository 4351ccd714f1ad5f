"""``patch(model, sp=sp, tiled_mlp=...)``: each decoder layer's MLP runs in sequence tiles.

An MLP's intermediate activations ([B, s, intermediate] per projection) dominate memory at long
lengths. Through DeepSpeed's ``TiledMLP`` (``deepspeed.runtime.sequence_parallel.ulysses_sp``)
the MLP's forward runs tile by tile without keeping them, and its backward recomputes one tile at
a time (so only one tile's intermediates exist at once) and adds each tile's weight gradients to
``.grad``. Under ZeRO it marks the weights' gradients ready only after the last tile
(``ds_grad_is_ready``), so each weight is reduced once. Rows are independent in an MLP: the
result is the untiled one up to the order of the gradient sums.

What is patched, and why: the MLP module instances get an instance-level ``forward`` (their class
is untouched; ``unpatch`` deletes it). DeepSpeed's ``TiledMLP`` recomputes in its backward
without the autocast state of the forward, so the tile function re-enters the autocast state the
forward ran under: under ``torch.autocast`` the recomputed tiles are the forward's tiles.
Only dense MLPs (``down_proj`` over the hidden states) are tiled; mixture-of-experts blocks are
refused, since their routers return more than the hidden states.
"""
from __future__ import annotations

import math
import types

import torch

from ringseq.errors import RingSeqError


def mlps(model) -> list[torch.nn.Module]:
    """Every decoder layer's MLP, checked to be one ``TiledMLP`` can run."""
    found = []
    for layer in model.get_decoder().layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is None or not hasattr(mlp, "down_proj"):
            raise RingSeqError(f"tiled_mlp tiles dense MLPs (a down_proj over the hidden states); "
                               f"{type(layer).__name__}.mlp is {type(mlp).__name__}: patch with tiled_mlp=None")
        found.append(mlp)
    return found


def tiles_for(value, s: int, hidden: int) -> int:
    """Tiles for a shard of ``s`` tokens: ``value`` itself, or (True) one per ``hidden`` tokens,
    DeepSpeed ALST's choice (a tile's intermediates are then about hidden x intermediate)."""
    return max(1, math.ceil(s / hidden)) if value is True else int(value)


def check(value) -> None:
    if value is None or value is True:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RingSeqError(f"tiled_mlp must be None (off), True (one tile per hidden_size tokens) or a number of "
                           f"tiles per shard >= 1; got {value!r}")


def _tiled_forward(self, x: torch.Tensor) -> torch.Tensor:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    tiles = min(tiles_for(self._ringseq_tiles, x.size(-2), x.size(-1)), x.size(-2))
    if tiles <= 1:
        return type(self).forward(self, x)
    device = x.device.type
    autocast = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)

    def tile(module, part):
        with torch.autocast(device, dtype=autocast[1], enabled=autocast[0]):
            return type(module).forward(module, part)

    return TiledMLP.apply(tile, self, x, tiles, list(self.parameters()))


def install(model, tiles) -> None:
    for mlp in mlps(model):
        mlp._ringseq_tiles = tiles
        mlp.forward = types.MethodType(_tiled_forward, mlp)


def uninstall(model) -> None:
    for mlp in (m for m in model.modules() if "_ringseq_tiles" in vars(m)):
        del mlp.forward, mlp._ringseq_tiles
