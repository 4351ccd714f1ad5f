"""ringseq's configuration: one frozen dataclass, read from code, the environment or a ds_config.

This is the one place where settings are validated (``RingSeqConfig.__post_init__`` and, once
the world size is known, ``check_world``) and where environment variables are read
(``from_env``): ``RINGSEQ_SP_SIZE``, ``RINGSEQ_ULYSSES_SIZE``, ``RINGSEQ_LAYOUT``,
``RINGSEQ_TIMEOUT``, ``RINGSEQ_STATS``. ``ringseq launch`` sets them for the processes it starts.
A DeepSpeed config may carry the same settings in a ``"ringseq"`` section (``from_ds_config``).
A leaf: ``ringseq.init(config=...)`` consumes a config; nothing here builds process groups.
"""
from __future__ import annotations

import dataclasses
import math
import os

from .errors import RingSeqError
from .lengths import check_layout

ENV = {"sp_size": "RINGSEQ_SP_SIZE", "ulysses_size": "RINGSEQ_ULYSSES_SIZE", "layout": "RINGSEQ_LAYOUT",
       "timeout": "RINGSEQ_TIMEOUT", "stats": "RINGSEQ_STATS"}
DEFAULT_TIMEOUT = 600.0  # seconds; a ring step of a healthy job takes far less than this
MIN_TIMEOUT = 0.001  # gloo counts waits in whole milliseconds; less would round to 0, which it reads as no bound


@dataclasses.dataclass(frozen=True, kw_only=True)
class RingSeqConfig:
    sp_size: int | None = None
    """Ranks that hold one sequence (ring x Ulysses); must divide the world size. None: the
    whole world (no data parallelism)."""
    ulysses_size: int = 1
    """Ranks inside each sequence group that split heads by all-to-all; must divide sp_size."""
    layout: str = "zigzag"
    """Token layout over the ring: zigzag (balanced causal work), striped or contiguous."""
    timeout: float | None = None
    """Seconds any ringseq wait (a ring transfer, its all-gathers) may take before it raises
    RingSeqError. None: RINGSEQ_TIMEOUT, else 600."""
    stats: bool | None = None
    """Whether ringseq times its waits and block computes for ``ringseq.stats``. None:
    RINGSEQ_STATS (0 turns it off), else on."""

    def __post_init__(self):
        for name in ("sp_size", "ulysses_size"):
            value = getattr(self, name)
            if value is None and name == "sp_size":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RingSeqError(f"ringseq {name} must be a positive integer, got {value!r}")
        if self.sp_size is not None and self.sp_size % self.ulysses_size:
            raise RingSeqError(f"sequence group {self.sp_size} is not ring N x ulysses {self.ulysses_size} for any "
                               f"whole N: ulysses_size {self.ulysses_size} must divide sp_size {self.sp_size}")
        check_layout(self.layout)
        if self.timeout is not None and (isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float))
                                         or not MIN_TIMEOUT <= self.timeout < math.inf):
            raise RingSeqError(f"ringseq timeout must be a finite number of seconds, at least {MIN_TIMEOUT:g} (gloo "
                               f"counts milliseconds), got {self.timeout!r}; for a very long bound give one, e.g. "
                               f"86400")
        if self.stats is not None and not isinstance(self.stats, bool):
            raise RingSeqError(f"ringseq stats must be True or False, got {self.stats!r}")

    def check_world(self, world: int, environ=None) -> None:
        """Refuse a world that is not data x ring x ulysses, with the whole equation (and, for a
        world of one process, how the launchers start more)."""
        sp, uly = self.sp_size or world, self.ulysses_size
        if sp % uly:
            raise RingSeqError(f"sequence group {sp} is not ring N x ulysses {uly} for any whole N: ulysses_size {uly} "
                               f"must divide sp_size {sp} (the whole world of {world} when sp_size is not given)")
        if world % sp:
            hint = f" (or choose an sp_size that divides {world})" if world > 1 else single_process_hint(environ)
            raise RingSeqError(f"world {world} is not data N x ring {sp // uly} x ulysses {uly} for any whole N: "
                               f"sp_size {sp} must divide the world size; launch a multiple of {sp} processes{hint}")

    def resolved_timeout(self) -> float:
        return float(self.timeout) if self.timeout is not None else (from_env().timeout or DEFAULT_TIMEOUT)

    def resolved_stats(self) -> bool:
        return self.stats if self.stats is not None else from_env().stats is not False

    def check_matches(self, sp) -> None:
        """Refuse a ``SequenceParallel`` that these settings (a ds_config section) contradict."""
        if self.sp_size not in (None, sp.size) or self.ulysses_size != sp.ulysses_size or self.layout != sp.layout:
            raise RingSeqError(f'the ds_config "ringseq" section {self} disagrees with sp= (sp_size {sp.size}, '
                               f"ulysses_size {sp.ulysses_size}, layout {sp.layout!r}); give one of them")


def single_process_hint(environ=None) -> str:
    """Why only one process may be running, from the launcher's environment."""
    environ = os.environ if environ is None else environ
    if "ACCELERATE_MIXED_PRECISION" in environ and "WORLD_SIZE" not in environ:
        return (". Only one process is running: on a machine without GPUs `accelerate launch` starts one process "
                "unless given --multi_gpu (accelerate launch --multi_gpu --num_processes 2 train.py)")
    return (". Only one process is running: start several with torchrun --nproc_per_node N, deepspeed --num_gpus N "
            "or accelerate launch --multi_gpu --num_processes N")


def from_env(environ=None) -> RingSeqConfig:
    """Settings from ``RINGSEQ_*`` variables; unset ones keep their defaults."""
    environ = os.environ if environ is None else environ
    values = {}
    for field, var in ENV.items():
        if var in environ:
            raw = environ[var]
            if field == "layout":
                values[field] = raw
                continue
            if field == "stats":
                if raw not in ("0", "1"):
                    raise RingSeqError(f"{var}={raw!r} must be 0 (timings off) or 1 (on)")
                values[field] = raw == "1"
                continue
            try:
                values[field] = float(raw) if field == "timeout" else int(raw)
            except ValueError:
                kind = "a number" if field == "timeout" else "an integer"
                raise RingSeqError(f"{var}={raw!r} is not {kind}") from None
    return RingSeqConfig(**values)


def from_ds_config(ds_config: dict) -> tuple[RingSeqConfig | None, dict]:
    """Split a DeepSpeed config into (ringseq settings or None, the config without them).

    DeepSpeed 0.19 keeps unknown top-level keys without complaint and ignores them, so a
    misspelt ringseq key would silently do nothing: the section is removed before DeepSpeed
    sees it, and unknown keys inside it are refused.
    """
    if "ringseq" not in ds_config:
        return None, ds_config
    rest = {k: v for k, v in ds_config.items() if k != "ringseq"}
    section = ds_config["ringseq"]
    if not isinstance(section, dict):
        raise RingSeqError(f'the ds_config "ringseq" section must be an object, got {section!r}')
    unknown = set(section) - {f.name for f in dataclasses.fields(RingSeqConfig)}
    if unknown:
        raise RingSeqError(f'unknown keys {sorted(unknown)} in the ds_config "ringseq" section; '
                           f"allowed: {[f.name for f in dataclasses.fields(RingSeqConfig)]}")
    return RingSeqConfig(**section), rest
