"""``split_vision=True``: each rank of the sequence group encodes a share of the images (and of
a video's frames), and the features are all-gathered before the merge.

Without it every rank runs the whole vision tower on every image: P times the work of one
device. The shares are contiguous runs of *units*, balanced by patches: an image of Gemma 3 or
LLaVA is one unit; a Qwen image or video is one unit per temporal patch (``grid_thw`` (t, h, w)
-> t units of (1, h, w)), exact because Qwen's vision towers attend within a temporal patch
only and place each one by (h, w) alone. Each rank encodes its units with the model's own
``get_image_features`` / ``get_video_features`` and the model gets the gathered features as
its precomputed encoder outputs (``mm_encoder_outputs``), so the merge and the positions are
the model's own code.

The gather is exact in backward too: rank r's loss reaches every image's features, but only
through its own tokens; the features' gradient is summed over the group (one all-reduce of the
image features' size) and each rank takes its units' rows, so the vision tower's gradient
shares add up over the group to the single-device ones.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ringseq import lockstep
from ringseq.errors import RingSeqError

# (modality, pixels, grid, the model's encoder method)
MODALITIES = (("image", "pixel_values", "image_grid_thw", "get_image_features"),
              ("video", "pixel_values_videos", "video_grid_thw", "get_video_features"))
PASSED_ON = ("vision_feature_layer", "vision_feature_select_strategy")  # LLaVA's encoder options


def units(pixels: torch.Tensor, grid: torch.Tensor | None) -> list[tuple[int, int, tuple | None]]:
    """(first pixel row, rows, grid row of the unit or None) of every unit, in sequence order."""
    if grid is None:
        if pixels.dim() != 4:
            raise RingSeqError(f"split_vision shares images given as [images, channels, height, width] (Gemma 3, "
                               f"LLaVA) or as patches with their grid (Qwen); these pixels are "
                               f"{tuple(pixels.shape)}: patch without split_vision")
        return [(i, 1, None) for i in range(pixels.size(0))]
    out, at = [], 0
    for t, h, w in grid.tolist():
        for _ in range(t):
            out.append((at, h * w, (1, h, w)))
            at += h * w
    if at != pixels.size(0):
        raise RingSeqError(f"the grid ({grid.tolist()}) covers {at} patch rows but the pixels have {pixels.size(0)}: "
                           f"pass the pixels and the grid the processor made together")
    return out


def shares(costs: list[int], P: int) -> list[tuple[int, int]]:
    """Contiguous [first, end) runs of units for P ranks (P <= units), none empty, each cut at
    the unit boundary nearest to k/P of the total cost."""
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    n, cuts = len(costs), [0]
    for k in range(1, P):
        mark = k * prefix[-1] / P
        cuts.append(min(range(cuts[-1] + 1, n - (P - k) + 1), key=lambda i: abs(prefix[i] - mark)))
    cuts.append(n)
    return [(cuts[r], cuts[r + 1]) for r in range(P)]


class _ShareGather(torch.autograd.Function):
    """Forward: this rank's rows -> every rank's rows in rank order. Backward: the gradient
    summed over the group, this rank's rows of it."""

    @staticmethod
    def forward(ctx, mine, counts, sp):
        ctx.meta = (counts, sp)
        width = max(counts)
        padded = mine.new_zeros(width, *mine.shape[1:])
        padded[:mine.size(0)] = mine
        pieces = [torch.empty_like(padded) for _ in counts]
        work = dist.all_gather(pieces, padded.contiguous(), group=sp.group, async_op=True)
        lockstep.wait(work, sp, f"the all-gather of the vision features ({tuple(mine.shape)} here)", peer=None)
        return torch.cat([p[:n] for p, n in zip(pieces, counts)])

    @staticmethod
    def backward(ctx, grad):
        counts, sp = ctx.meta
        grad = grad.contiguous().clone()
        work = dist.all_reduce(grad, group=sp.group, async_op=True)
        lockstep.wait(work, sp, f"the all-reduce of the vision features' gradient {tuple(grad.shape)}", peer=None)
        start = sum(counts[:sp.rank])
        return grad[start:start + counts[sp.rank]], None, None


def _gather(mine: torch.Tensor, sp) -> torch.Tensor:
    """Every rank's rows of one feature tensor, in rank order (one all-gather of the row counts)."""
    count = torch.tensor([mine.size(0)])
    counts = [torch.empty_like(count) for _ in range(sp.size)]
    work = dist.all_gather(counts, count, group=sp.group, async_op=True)
    lockstep.wait(work, sp, "the all-gather of the vision feature counts", peer=None)
    return _ShareGather.apply(mine, [int(c) for c in counts], sp)


def _flat(x):
    """A feature field as one tensor (rows first) and how to rebuild it."""
    if torch.is_tensor(x):
        return x, lambda full: full
    return torch.cat(list(x), 0), lambda full: (full,)  # the models concatenate the sequence anyway


def encoder_outputs(base, kwargs: dict, sp) -> None:
    """Encode this rank's share of the batch's images and videos and gather the features: the
    pixels in ``kwargs`` are replaced by ``mm_encoder_outputs``. A modality with fewer units than
    ranks is left to the model (every rank encodes it: too little to share)."""
    if kwargs.get("image_sizes") is not None:
        raise RingSeqError("split_vision with per-image sizes (image_sizes: LLaVA-NeXT-style tiling) is not "
                           "supported; patch without split_vision")
    outputs = {}
    for modality, pixels_key, grid_key, method in MODALITIES:
        pixels, grid = kwargs.get(pixels_key), kwargs.get(grid_key)
        if pixels is None:
            continue
        parts = units(pixels, grid)
        if len(parts) < sp.size:
            continue
        first, end = shares([n for _, n, _ in parts], sp.size)[sp.rank]
        rows = slice(parts[first][0], parts[end - 1][0] + parts[end - 1][1])
        extra = {k: kwargs[k] for k in PASSED_ON if kwargs.get(k) is not None}
        if grid is not None:
            extra[grid_key] = torch.tensor([g for _, _, g in parts[first:end]], dtype=grid.dtype, device=grid.device)
        out = getattr(base, method)(pixels[rows], return_dict=True, **extra)
        kwargs.pop(pixels_key)
        outputs[modality] = _gathered(out, sp)
    if outputs:
        kwargs["mm_encoder_outputs"] = outputs


def _gathered(out, sp):
    """The model's output for this rank's units -> the same kind of output for all of them."""
    pooled, rebuild = _flat(out.pooler_output)
    fields = {"pooler_output": rebuild(_gather(pooled, sp))}
    if getattr(out, "deepstack_features", None) is not None:  # Qwen3-VL: per-layer features of the same tokens
        fields["deepstack_features"] = [(_gather(_flat(f)[0], sp),) for f in out.deepstack_features]
    return type(out)(**fields)
