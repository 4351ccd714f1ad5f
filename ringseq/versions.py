"""The releases ringseq supports, in one place: ``setup.cfg`` states the same ranges (a unit test
holds them equal) and ``constraints.txt`` pins the versions CI tests.

Where ringseq overrides a library's private hook (Accelerate's ``_prepare_deepspeed`` and
shared state, DeepSpeed's ZeRO-3 partitioning and its CPU comm buffers, TRL's fused LM head,
transformers' attention and mask registries), the code that does it calls ``require`` first, so
a release outside the tested range is refused with the fix instead of half-working.
"""
from __future__ import annotations

import importlib.metadata

from packaging.version import Version

from .errors import RingSeqError

RANGES = {
    "torch": ("2.9", "3"),  # FlexAttention's AuxRequest (2.9); groups in node order need 2.13 (topology)
    "transformers": ("5.0", "6"),  # its AttentionInterface / AttentionMaskInterface and decoder signatures
    "deepspeed": ("0.19.8", "0.20"),  # zero.Init(module=...) and the reductions measured in deepspeed_glue
    "accelerate": ("1.15", "2"),  # Accelerator._prepare_deepspeed, PartialState._shared_state
    "trl": ("1.16", "2"),  # the fused LM head on every device (1.15 has it for Triton devices only)
    "peft": ("0.18", "1"),  # PEFT before 0.18 does not import under transformers 5
}
"""package -> (lowest supported release, first release not supported)."""

FEATURES = {"generation": ("transformers", "5.23"), "vision": ("transformers", "5.23")}
"""feature -> (package, lowest release it is tested on, within that package's range): generate
on a patched model relies on transformers' layered caches (linear-attention layers, generation
without cache_position), which earlier 5.x releases do not have; vision-language models rely on
the VLMs' precomputed encoder outputs (``mm_encoder_outputs``) and token-type arguments of 5.23."""

EXTRAS = {"trl": ("trl", "peft")}
"""setup.cfg's extras and the packages they bring."""


def problem(package: str, version: str | None = None) -> str | None:
    """Why the installed (or given) version of ``package`` is not supported, or None."""
    low, high = RANGES[package]
    if version is None:
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            extra = next((e for e, members in EXTRAS.items() if package in members), None)
            how = f'pip install "ringseq[{extra}]"' if extra else f"pip install '{package}>={low},<{high}'"
            return f"{package} is not installed: {how}"
    if not Version(low) <= Version(version) < Version(high):
        return (f"{package} {version} is outside the range ringseq supports (>= {low}, < {high}): "
                f"pip install '{package}>={low},<{high}'")
    return None


def require_feature(feature: str, what: str) -> None:
    """Refuse ``what`` when the installed package is older than the feature needs."""
    package, low = FEATURES[feature]
    require(package, what)
    version = importlib.metadata.version(package)
    if Version(version) < Version(low):
        raise RingSeqError(f"{what} needs {package} >= {low} (found {version}): pip install '{package}>={low},"
                           f"<{RANGES[package][1]}'")


def require(package: str, what: str) -> None:
    """Refuse ``what`` (a sentence naming the feature) on an unsupported release of ``package``."""
    found = problem(package)
    if found:
        raise RingSeqError(f"{what} needs a supported {package}: {found}")


def bindable(fn):
    """``fn``, a ``torch.compiler.disable(recursive=False)`` wrapper, made fit to be bound as a model's
    forward that ``torch.compile(model.forward)`` keeps bound: torch before 2.10 unwraps a bound method
    through the wrapper's ``_torchdynamo_orig_callable`` to the plain function and calls it without
    ``self`` (later releases unwrap only the wrapper itself). Dynamo still skips the wrapper's frame:
    it knows it by its code."""
    vars(fn).pop("_torchdynamo_orig_callable", None)
    return fn
