"""TRL's SFTTrainer and transformers' run_clm metrics with ringseq, in the warm pools as
``accelerate launch --multi_gpu`` and ``deepspeed`` start them, against the same clients without
ringseq in one plain process on the same data (client_step.py: logged metrics, token counts and
parameter updates, every rank asserting)."""
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# bf16 autocast under DDP (TRL's "bf16" scenario): the GPU user's matrix (test_matrix.py, ddp-autocast-off-off-sft)
SFT = ["packing", "padded", "padding_free", "completion", "assistant", "dft", "peft", "model_id",
       "vlm", "vlm_peft", "vlm_bf16"]
ENV = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def each_ok(text, scenarios, nproc):
    for name in scenarios:
        assert text.count(f": {name} ok:") == nproc, f"{name}:\n" + text[-5000:]
    return text


@pytest.fixture(scope="module")
def reference(pools, tmp_path_factory):
    path = tmp_path_factory.mktemp("clients") / "reference.pt"
    pools(1, group=False).run_script(HERE / "client_step.py", "reference", "--out", path, *SFT, "clm", "vlm_trainer",
                                     launcher=None, env=ENV)
    return str(path)


def test_sft_and_run_clm_metrics_under_accelerate(pool2, reference):
    scenarios = [*SFT, "clm", "vlm_trainer"]
    each_ok(pool2.run_script(HERE / "client_step.py", "ringseq", "--reference", reference, *scenarios,
                             launcher=("accelerate", "--multi_gpu"), env=ENV), scenarios, 2)


def test_sft_and_run_clm_metrics_under_fsdp2(pool2, reference):
    """TrainingArguments(fsdp=True, fsdp_config={"version": 2}): Accelerate's FSDP2 (on gloo,
    ringseq.launch.accelerate_fsdp), TRL's fused head reading a head FSDP2 shards apart. In fp32: FSDP2's
    own mixed precision is its arithmetic, not autocast's (bf16 beside FSDP2: tests/integration/test_engines.py)."""
    scenarios = ["packing@fsdp", "peft@fsdp", "clm@fsdp", "vlm@fsdp"]
    each_ok(pool2.run_script(HERE / "client_step.py", "ringseq", "--reference", reference, *scenarios,
                             launcher="torchrun", env=ENV), scenarios, 2)


def test_sft_and_run_clm_metrics_under_deepspeed_zero_2_and_3(pool2, reference):
    # NAME@STAGE, one process group
    scenarios = ["packing@2", "peft@2", "padded@3", "completion@3", "clm@3", "vlm@3"]
    each_ok(pool2.run_script(HERE / "client_step.py", "ringseq", "--reference", reference, *scenarios,
                             launcher="deepspeed", env=ENV), scenarios, 2)
