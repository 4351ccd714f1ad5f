"""``ringseq.initialize``: ``deepspeed.initialize`` with sequence parallelism.

DeepSpeed gets an mpu built from ringseq's topology (``sp.mpu``). With it, DeepSpeed 0.19.8
ZeRO stages 0, 1 and 2 reduce gradients over the sequence x data group and divide by the
data-parallel size: exactly ringseq's rule (sum over the sequence group, mean over replicas),
checked against a single-process step by tests/integration/test_launch.py.

ZeRO-3 is refused. Its reduction alone would be easy to correct (it divides by the whole group,
``sp_size`` times too much), but measured here the gradients under ZeRO-3 with a sequence
group also point in a different direction (cosine ~0.7 to the true step) while the loss is
exact, and the cause is not found yet; ringseq refuses rather than train wrongly.
"""
from __future__ import annotations

import json

from ringseq.config import from_ds_config
from ringseq.errors import RingSeqError


def _load(config):
    if config is None:
        return {}
    if isinstance(config, dict):
        return config
    with open(config) as f:
        return json.load(f)


def initialize(*, sp=None, model=None, config=None, model_parameters=None, optimizer=None, **kwargs):
    """``deepspeed.initialize(model=..., config=..., ...)`` plus sequence parallelism.

    ``sp`` is a ``SequenceParallel`` from ``ringseq.init``; when omitted it is built from the
    ds_config's ``"ringseq"`` section (``{"sp_size": 2, "ulysses_size": 1, "layout": "zigzag"}``).
    The model is patched (``ringseq.patch``) if it is not yet. Returns DeepSpeed's
    ``(engine, optimizer, dataloader, lr_scheduler)``.
    """
    import deepspeed

    from ringseq import patch

    section, ds_config = from_ds_config(_load(config))
    if sp is None:
        if section is None:
            raise RingSeqError('ringseq.initialize needs sp= or a "ringseq" section in the ds_config')
        deepspeed.init_distributed(dist_backend=None)
        sp = section.init()
    elif section is not None and (section.sp_size not in (None, sp.size) or section.ulysses_size != sp.ulysses_size
                                  or section.layout != sp.layout):
        raise RingSeqError(f'the ds_config "ringseq" section {section} disagrees with sp= (sp_size {sp.size}, '
                           f"ulysses_size {sp.ulysses_size}, layout {sp.layout!r}); give one of them")
    if "mpu" in kwargs:
        raise RingSeqError("ringseq.initialize provides the mpu itself; do not pass mpu=")
    if model is not None and getattr(model, "_ringseq_patch", None) is None and hasattr(model, "config"):
        patch(model, sp=sp)
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    if stage == 3 and sp.size > 1:
        raise RingSeqError("ZeRO stage 3 with sequence parallelism does not yet give the single-device gradient "
                           "(see ringseq.launch.deepspeed_glue); use ZeRO stage 0, 1 or 2")
    engine, opt, loader, sched = deepspeed.initialize(model=model, config=ds_config, model_parameters=model_parameters,
                                                      optimizer=optimizer, mpu=sp.mpu, **kwargs)
    engine.ringseq = sp
    return engine, opt, loader, sched
