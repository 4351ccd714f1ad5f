"""The examples that train, generate and learn by RL, in the warm pools as ``ringseq launch --sp 2
--nproc 2`` starts them (torchrun with the RINGSEQ_* variables it exports): each checks its own
result against the unpatched model. ``ringseq launch`` itself runs the torchrun and Accelerate
loops in test_launch.py."""
import json
import os

from ringseq.config import RingSeqConfig
from ringseq.launch.launch_cmd import environment
from tests.launched import ROOT


def ringseq_launch(pool, example, *args, launcher="torchrun"):
    """What ``ringseq launch --sp N --nproc N examples/EXAMPLE ARGS`` runs, on ``pool``'s ranks."""
    env = {k: v for k, v in environment(RingSeqConfig(sp_size=pool.world_size)).items() if os.environ.get(k) != v}
    return pool.run_script(ROOT / "examples" / example, *args, launcher=launcher, env=env, cwd=ROOT)


def relative_difference(text):
    line = next(x for x in text.splitlines() if x.startswith("held-out loss"))
    return float(line.rsplit("relative difference ", 1)[1].rstrip(")"))


def test_needle_example_answers_as_the_unpatched_model(pool2):
    out = ringseq_launch(pool2, "needle_generate.py", "--steps", "10", "--train-len", "128", "--lengths", "128", "300",
                         "--depths", "0.2", "0.8", "--batch", "4")
    assert "every answer equals the unpatched model's" in out and "depth 0.8" in out, out[-3000:]


def test_the_hybrid_example_trains_and_matches_unpatched(pool2, tmp_path):
    out = ringseq_launch(pool2, "hybrid_trainer.py", "--steps", "3", "--out", tmp_path)
    assert "training losses over 3 steps (sp 2, 1 replica(s))" in out, out[-2000:]
    assert relative_difference(out) <= 1e-5, out[-2000:]


def test_the_vlm_example_trains_and_matches_unpatched(pool2):
    out = ringseq_launch(pool2, "vlm_finetune.py", "--steps", "2", "--seq-len", "512", "--images", "8", "--split-vision")
    assert relative_difference(out) <= 1e-5, out[-2000:]
    assert "kinds named right: " in out, out[-2000:]


def test_the_vlm_generate_example_answers_as_the_unpatched_model(pool2):
    out = ringseq_launch(pool2, "vlm_generate.py", "--steps", "3", "--train-len", "256", "--seq-len", "512",
                         "--images", "8", "--depths", "0.2", "0.9", "--batch", "2", "--split-vision")
    assert "every answer equals the unpatched model's" in out and "depth 0.9" in out, out[-3000:]


def test_the_grpo_example_trains_and_draws_its_rewards(pool2, tmp_path):
    out, plot = tmp_path / "rewards.json", tmp_path / "rewards.png"
    text = ringseq_launch(pool2, "grpo_retrieval.py", "--steps", "2", "--prompt-len", "96", "--mentions", "2",
                          "--out", out, "--plot", plot)
    rewards = json.loads(out.read_text())
    assert len(rewards) == 2 and all(0 <= r <= 1 for r in rewards) and plot.exists(), text[-2000:]
    assert "sequences of 98 tokens over 2 ranks" in text, text[-2000:]


# the example's ZeRO-3 route is the Accelerate step's in test_trainer.py; with --multi_gpu ringseq launch runs it
def test_the_accelerate_example_with_deepspeed_zero_3(pool2):
    out = ringseq_launch(pool2, "accelerate_loop.py", launcher=("accelerate", "--use_deepspeed", "--zero_stage", "3"))
    assert out.count("step 3: loss") == 1, out[-3000:]
