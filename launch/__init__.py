"""ringseq.launch: the ``ringseq`` command and the glue for DeepSpeed, Accelerate and the HF Trainer."""
