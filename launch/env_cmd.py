"""``ringseq env``: versions, communication backends, the block kernel each device gets and which
flash implementation (torch's FA2 or FA3) the GPU's flash ops run."""
from __future__ import annotations

import importlib.metadata
import platform

PACKAGES = ("ringseq", "torch", "deepspeed", "transformers", "accelerate")


def _features():
    from ringseq.attention.kernels import Need

    runs = Need(masked=True)
    return {
        "dense (causal, GQA, sinks)": Need(),
        "documents": runs, "padding": runs, "window": runs,
        "mask not runs": Need(masked=True, runs=False),
        "softcap": Need(softcap=True),
        "softcap + mask": Need(masked=True, softcap=True),
    }


def add_parser(sub) -> None:
    p = sub.add_parser("env", help="print versions, backends and kernel choices",
                       description="Print the versions of Python, ringseq, torch, DeepSpeed, transformers and "
                                   "Accelerate, the communication backends (gloo, nccl), the devices and CPU threads, "
                                   "and the block kernel ringseq picks for each device, dtype and attention feature "
                                   "(the CUDA choices are shown on every machine). Takes no arguments.")
    p.set_defaults(run=run)


def report() -> dict:
    import torch
    import torch.distributed as dist

    from ringseq.attention.kernels import flash_impl, select

    FEATURES = _features()

    info = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info[name] = "not installed"
    info["gloo"] = dist.is_gloo_available()
    info["nccl"] = dist.is_nccl_available()
    info["cuda devices"] = torch.cuda.device_count()
    info["cpu threads"] = torch.get_num_threads()
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        for dtype in (torch.float32, torch.bfloat16):
            info[f"kernel {device} {str(dtype).removeprefix('torch.')}"] = select(device, dtype, 64).name
    # what each feature gets on a GPU (the choice needs no GPU: it is shown on every machine)
    for feature, call in FEATURES.items():
        info[f"cuda bf16 {feature}"] = select("cuda", torch.bfloat16, 128, call=call).name
    flash = flash_impl.describe()
    info["cuda flash kernels"] = f"{flash['impl']} ({flash['why']}; RINGSEQ_FLASH={flash_impl.wanted()})"
    return info


def run(args) -> int:
    for key, value in report().items():
        print(f"{key:>30}: {value}")
    return 0
