"""ringseq.initialize under DeepSpeed (tests/integration/ds_step.py), in the warm pools as the
``deepspeed`` launcher starts it: each case one SGD step against the single-process reference,
every rank asserting; DeepSpeed's comm layer is made once per pool and serves every case."""
import glob
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def deepspeed_cases(pool, *cases):
    """Run ds_step.py's cases on ``pool``'s ranks as ``deepspeed --num_gpus N`` would; every rank must report each."""
    out = pool.run_script(ROOT / "tests/integration/ds_step.py", *cases, launcher="deepspeed", cwd=ROOT)
    # DeepSpeed's CPU comm layer leaves a ~69 MB /dev/shm buffer per rank; ringseq removes the names
    assert not glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{pool.port}_*"), "shared-memory buffers left behind"
    for n, case in enumerate(cases):
        assert out.count(f"case {n} [{case}] ok") == pool.world_size, f"case {case}:\n" + out[-4000:]


def test_deepspeed_steps_equal_single_process_and_misconfigurations_are_refused(pool2):
    """ZeRO 0-3 (two of them without clipping; ZeRO-1 and ZeRO-2 with clipping as the shipped configs give them), the
    ds_config section, the shipped configs, checkpointing
    with tiled MLPs under ZeRO-2 and ZeRO-3 (each weight's gradient reduced once, after the last tile), and
    ZeRO-3's reduce_scatter (its average over every rank is the gradient rule's), DeepSpeed's
    engine.compile() under ZeRO-3 (the patched module's model.compile(): docs/compile.md), and the
    refusals: an sp_size that does not divide the world, a misspelt key."""
    deepspeed_cases(pool2, "stage=0,clip=0", "stage=3,clip=0", "stage=2,clip=0,autocast",
                    "stage=2,section",
                    "stage=2,memory", "stage=3,clip=0,memory",
                    "config=launch/configs/ds_zero1.json", "config=launch/configs/ds_zero2.json",
                    "config=launch/configs/ds_zero3.json", "stage=3,reduce_scatter,clip=0", "stage=3,clip=0,compile",
                    "stage=2,section,sp=3,refuse=sp_size 3 must divide the world size",
                    "stage=2,section,extra=sp_szie:2,refuse=unknown keys ['sp_szie']")


def test_deepspeed_with_data_parallel_replicas_and_checkpoints(pool4):
    deepspeed_cases(pool4, "stage=3,sp=2,checkpoint,resume_sp=4")


def test_deepspeed_initialize_itself_and_its_batch_and_data(pool4):
    """The gradient rule wants DeepSpeed's plain data parallelism, so deepspeed.initialize on a
    patched model is exact without ringseq.initialize (no mpu, or sp.mpu), ZeRO-2 and ZeRO-3; an mpu
    that declares sequence parallelism is refused; train_batch_size counts sequences over the
    replicas; training_data is dealt over the replicas; ZeRO-0 and ZeRO-3 under bf16 autocast (2 x 2)."""
    deepspeed_cases(pool4, "stage=2,engine=plain", "stage=3,engine=plain", "stage=3,engine=mpu",
                    "stage=2,engine=sequence_mpu", "stage=2,batch=2", "stage=2,batch=4", "stage=1,engine=data",
                    "stage=0,autocast", "stage=3,autocast")


def test_deepspeed_checkpoints_resume_at_another_shape_and_back(pool4):
    """sp 2 -> sp 4 above (ZeRO-3); here ZeRO-1 sp 2 -> sp 4, and back: ZeRO-3 and ZeRO-2 sp 4 -> sp 2."""
    deepspeed_cases(pool4, "stage=1,sp=2,checkpoint,resume_sp=4", "stage=3,sp=4,resume_sp=2",
                    "stage=2,sp=4,resume_sp=2")
