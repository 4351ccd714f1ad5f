"""Checkpoints resume exactly, at the split they were saved at and at another (cases_state.py): FSDP2
through torch.distributed.checkpoint, world 4. DeepSpeed's (ZeRO partitions over every rank whatever the
split): tests/integration/test_deepspeed.py; the Trainer's and Accelerate's FSDP2 save and resume:
test_trainer.py and test_trainer.py's Accelerate steps."""
import pytest

from . import cases_state


@pytest.mark.parametrize("saved,resumed", [("sp2", "sp2"), ("sp2", "sp4"), ("sp4", "sp2"), ("hsdp", "sp4"),
                                           ("sp4", "hsdp")])
def test_an_fsdp2_checkpoint_resumes_at_any_split(pool4, saved, resumed):
    pool4.run(cases_state.resume_at, saved, resumed)
