"""The one tolerance rule: ringseq's error against a float64 reference may be at most twice the
error of the same computation done plainly in the same dtype, plus a floor of two roundings of
the reference in that dtype (flash-attn's rule).

The tests (``ringseq.testing``), ``ringseq check`` and the benchmarks' exactness checks all
apply it from here. Two forms:

* ``within`` on whole tensors by their max error (attention outputs and gradients);
* ``by_layer`` on named tensors (a model's gradients or updates) by the relative error norm of
  each decoder layer and top-level module, and of all of them together by max error: a norm over
  a layer's thousands of values is stable where the max over a 4-value router bias is not, and
  any real defect, even in one small tensor, moves it by orders of magnitude.
"""
from __future__ import annotations

import dataclasses
import re

import torch


def error(actual: torch.Tensor, ref64: torch.Tensor) -> float:
    return (actual.double() - ref64).abs().max().item()


def rounding(ref64: torch.Tensor, dtype: torch.dtype) -> float:
    """One rounding of the reference in ``dtype``: the largest of storing it in that dtype,
    flash-attn's measure (the error of adding and removing 0.3 in that dtype, so that values
    near 0 still get the rounding of ~0.3) and half a unit in the last place at 0.3 (the same
    measure where it cancels exactly: a reference of exact zeros, e.g. the query gradient of a
    window of one token, would otherwise allow no rounding at all)."""
    x = ref64.to(dtype)
    at_03 = torch.finfo(dtype).eps / 8  # half the spacing of dtype's numbers in [0.25, 0.5)
    return max(error(x, ref64), ((x + 0.3) - 0.3 - x).abs().max().item(), at_03)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One comparison: ``err`` against float64, the plain run's ``plain_err``, the ``floor``."""

    what: str
    err: float
    plain_err: float
    floor: float
    measure: str = "max error"

    @property
    def ok(self) -> bool:
        return self.err <= 2 * self.plain_err + self.floor

    def __str__(self) -> str:
        return (f"{self.what}: {self.measure} {self.err:.3e} {'<=' if self.ok else '>'} 2 x plain "
                f"{self.plain_err:.3e} + floor {self.floor:.1e}")


def within(actual: torch.Tensor, plain: torch.Tensor, ref64: torch.Tensor, what: str = "",
           floor: float | None = None) -> Verdict:
    """``actual`` vs the float64 ``ref64`` by max error, against ``plain`` (the same computation
    done plainly in actual's dtype). Compare whole tensors, not shards: a max over a few thousand
    values fluctuates by more than 2x between equally accurate fp32 algorithms."""
    floor = 2 * rounding(ref64, actual.dtype) if floor is None else floor
    return Verdict(what, error(actual, ref64), error(plain, ref64), floor)


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token losses (in at least fp32) of the tokens with a target, from a causal LM's full
    logits [B, S, V] and its unshifted labels [B, S]."""
    targets = labels[:, 1:].flatten()
    flat = logits[:, :-1].flatten(0, 1)
    flat = flat if flat.dtype == torch.float64 else flat.float()
    losses = torch.nn.functional.cross_entropy(flat, targets, reduction="none", ignore_index=-100)
    return losses[targets != -100]


def mean_within(got: torch.Tensor, plain_tokens: torch.Tensor, ref_tokens: torch.Tensor, ref_mean: torch.Tensor,
                what: str = "loss") -> Verdict:
    """A mean of per-token values (a loss) against the float64 ``ref_mean``. The yardstick is the
    plain run's mean absolute per-token error, which bounds the error of the plain run's mean:
    the realised error of one mean is a sum of roundings of either sign, and the ratio of two such
    errors exceeds 2 about a third of the time, so it cannot be the yardstick itself."""
    ref_mean = ref_mean.double()
    plain_err = (plain_tokens.double() - ref_tokens.double()).abs().mean().item()
    return Verdict(what, error(got, ref_mean), plain_err, 2 * rounding(ref_mean, got.dtype),
                   "error (vs the plain run's mean per-token error)")


def relative_norm_error(actual: torch.Tensor, ref64: torch.Tensor) -> float:
    return ((actual.double() - ref64).norm() / ref64.norm().clamp_min(1e-300)).item()


def layer_of(name: str) -> str:
    """Group a parameter name by decoder layer (``layers.3``) or top-level module (``lm_head``)."""
    found = re.search(r"layers\.(\d+)\.", name)
    if found:
        return f"layers.{found.group(1)}"
    parts = [p for p in name.split(".") if p not in ("model", "weight", "bias")]
    return parts[0] if parts else name


def by_layer(got: dict, plain: dict, ref64: dict, rounded: dict | None = None,
             dtype: torch.dtype | None = None) -> list[Verdict]:
    """Named tensors against the same run done plainly in the same dtype and in float64: one
    ``Verdict`` per layer (relative error norm) and one for all of them together (max error).
    The floor is two roundings in ``dtype`` (default: got's) of the reference, or of ``rounded``
    (float64 tensors of the same names) when the compared values are differences of numbers
    held in that dtype, such as parameter updates."""
    if not got.keys() == ref64.keys() == plain.keys():
        raise ValueError(f"the tensors differ: {sorted(got)} vs {sorted(ref64)} vs {sorted(plain)}")
    dtype = dtype or next(iter(got.values())).dtype
    rounded = ref64 if rounded is None else rounded
    names = sorted(ref64)
    layers: dict[str, list[str]] = {}
    for name in names:
        layers.setdefault(layer_of(name), []).append(name)
    verdicts = []
    for layer, members in layers.items():
        g, p, r, x = (torch.cat([d[n].flatten() for n in members]) for d in (got, plain, ref64, rounded))
        r, x = r.double(), x.double()
        floor = 2 * (x.to(dtype).double() - x).norm().item() / r.norm().clamp_min(1e-300).item()
        verdicts.append(Verdict(layer, relative_norm_error(g, r), relative_norm_error(p, r), floor,
                                "relative error"))
    flat = [torch.cat([d[n].flatten() for n in names]) for d in (got, plain)]
    every = [torch.cat([d[n].double().flatten() for n in names]) for d in (ref64, rounded)]
    verdicts.append(within(*flat, every[0], "all of them", floor=2 * rounding(every[1], dtype)))
    return verdicts
