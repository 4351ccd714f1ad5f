"""One process: what ringseq.Trainer and prepare_accelerator refuse, each with a RingSeqError, and a
model_init model that comes out patched."""
import tempfile

from accelerate import Accelerator
from transformers import TrainingArguments

import ringseq
from ringseq.testing import assert_refused as refused
from trainer_step import samples, tiny_llama


def main():
    sp = ringseq.init(sp_size=1)
    out = tempfile.mkdtemp()

    def trainer(**kw):
        args = {k: kw.pop(k) for k in list(kw) if k in ("label_smoothing_factor", "train_sampling_strategy",
                                                         "deepspeed")}
        return ringseq.Trainer(model=tiny_llama(), args=TrainingArguments(output_dir=out, report_to=[], **args),
                               train_dataset=samples(2, 1), **kw)

    refused(lambda: trainer(sp=sp, label_smoothing_factor=0.1), "label smoothing")
    refused(lambda: trainer(sp=sp, compute_metrics=lambda p: {}), "pass preprocess_logits_for_metrics too")
    refused(lambda: ringseq.Trainer(model="some/model", args=TrainingArguments(output_dir=out, report_to=[]), sp=sp),
            "takes a model object")
    refused(lambda: trainer(sp=sp, compute_loss_func=lambda *a, **k: 0), "does not take compute_loss_func")
    refused(lambda: trainer(sp=sp, train_sampling_strategy="batch_rebalance"), "batch_rebalance")
    refused(lambda: trainer(sp=sp, deepspeed={"ringseq": {"sp_size": 2}, "zero_optimization": {"stage": 2}}),
            "disagrees with sp=")
    refused(lambda: trainer(deepspeed={"ringseq": {"sp_sise": 1}, "zero_optimization": {"stage": 2}}),
            "unknown keys ['sp_sise']")
    refused(lambda: ringseq.prepare_accelerator(Accelerator(), sp=sp, gradient_accumulation_steps=2),
            "this one is already made")
    built = ringseq.Trainer(args=TrainingArguments(output_dir=out, report_to=[]), model_init=tiny_llama,
                            train_dataset=samples(2, 1), sp=sp)
    assert built.model._ringseq_patch.sp is sp, "model_init's model was not patched"
    print("refusals ok", flush=True)


if __name__ == "__main__":
    main()
