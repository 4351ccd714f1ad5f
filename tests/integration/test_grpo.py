"""ringseq.GRPOTrainer, in the warm pools as ``accelerate launch`` and ``deepspeed`` start it,
against trl.GRPOTrainer on the same prompts (grpo_step.py: completions token for token, per-token
log-probs, logged metrics, reward calls and parameter updates, every rank asserting): one sequence
group against one plain TRL process, and two replicas of two ranks (under DeepSpeed ZeRO-2 and 3)
against TRL's two data-parallel processes; text models and a VLM (TRL's multimodal GRPO)."""
import pytest

from .test_clients import ENV, HERE, each_ok

# bf16 under DDP and FSDP2, compile and checkpointing: the GPU user's matrix (test_matrix.py, its GRPO rows)
SCENARIOS = ["grpo", "bnpo_ref", "dr_grpo", "dapo_iterations", "peft", "vlm"]
ACCELERATE = ("accelerate", "--multi_gpu")


def run(pool, *argv, scenarios, launcher):
    text = each_ok(pool.run_script(HERE / "grpo_step.py", "ringseq", *argv, *scenarios, launcher=launcher, env=ENV),
                   scenarios, pool.world_size)
    assert text.count("group refusals ok") == pool.world_size, text[-3000:]


@pytest.fixture(scope="module")
def reference(pools, tmp_path_factory):
    path = tmp_path_factory.mktemp("grpo") / "reference.pt"
    out = pools(1, group=False).run_script(HERE / "grpo_step.py", "reference", "--refusals", "--out", path,
                                           *SCENARIOS, launcher=None, env=ENV)
    assert "refusals ok" in out, out[-5000:]
    return str(path)


@pytest.mark.parametrize("nproc", [2, 4])
def test_grpo_one_group_equals_one_trl_process(pools, reference, nproc):
    """Under Accelerate's DDP: every loss type at world 2 (PEFT and the VLM under DDP: the SFT clients' cases;
    GRPO's PEFT under FSDP2 and its VLM under FSDP2 and ZeRO-3 below), the iterations at world 4."""
    scenarios = [s for s in SCENARIOS if s not in ("peft", "vlm")] if nproc == 2 else ["dapo_iterations"]
    run(pools(nproc), "--reference", reference, scenarios=scenarios, launcher=ACCELERATE)


def test_grpo_under_fsdp2_equals_one_trl_process(pool2, reference):
    """GRPOConfig(fsdp=True, fsdp_config={"version": 2}): generation, evaluation, the reference model (the
    adapter off) and the policy's steps under Accelerate's FSDP2, text and VLM."""
    run(pool2, "--reference", reference, scenarios=["grpo@fsdp", "peft@fsdp", "vlm@fsdp"], launcher="torchrun")


# the second pair repeats the first's glue under ZeRO-2 and with two iterations: behind -m slow (the budget)
@pytest.mark.parametrize("scenarios", [["bnpo_ref@3", "vlm@3"], pytest.param(["grpo@2", "dapo_iterations@3"],
                                                                      marks=pytest.mark.slow)])
def test_grpo_replicas_under_deepspeed_zero_equal_trl_data_parallel(pools, tmp_path, scenarios):
    path = str(tmp_path / "replicas.pt")
    pools(2).run_script(HERE / "grpo_step.py", "reference", "--out", path, *(s.partition("@")[0] for s in scenarios),
                        launcher=ACCELERATE, env=ENV)
    run(pools(4), "--sp-size", "2", "--reference", path + ".replica{replica}", scenarios=scenarios,
        launcher="deepspeed")
