"""Which block backend each call gets (``ringseq.attention.kernels.select``), decided from
device / dtype / head-dim descriptors, so the CUDA choices are checked on the CPU too."""
import pytest
import torch

from ringseq import RingSeqError
from ringseq.attention.kernels import BlockSpec, Need, select
from ringseq.attention.kernels.flex import Flex
from ringseq.attention.kernels.select import need
from ringseq.attention.masks import RowMask, TokenInfo
from ringseq.attention.schedule import rank_schedule

bf16, fp32 = torch.bfloat16, torch.float32
MASK, NOT_RUNS, CAP = Need(masked=True), Need(masked=True, runs=False), Need(softcap=True)


@pytest.mark.parametrize("device, dtype, D, call, backend", [
    ("cpu", fp32, 64, Need(), "cpu_flash"), ("cpu", bf16, 64, MASK, "cpu_flash"),
    ("cpu", bf16, 64, CAP, "torch"), ("cpu", torch.float64, 64, MASK, "cpu_flash"),
    ("cuda", bf16, 128, Need(), "cuda_flash"), ("cuda", torch.float16, 256, Need(), "cuda_flash"),
    ("cuda", bf16, 128, MASK, "cuda_varlen"), ("cuda", bf16, 128, NOT_RUNS, "flex"),
    ("cuda", bf16, 128, CAP, "flex"), ("cuda", bf16, 128, Need(masked=True, softcap=True), "flex"),
    ("cuda", bf16, 512, MASK, "flex"), ("cuda", fp32, 64, MASK, "flex"), ("cuda", fp32, 64, Need(), "flex"),
    ("cuda", torch.float64, 64, Need(), "torch"),
])
def test_the_fastest_backend_that_applies(device, dtype, D, call, backend):
    assert select(device, dtype, D, call=call).name == backend


def test_no_half_precision_feature_falls_to_plain_matmuls_on_cuda():
    for dtype in (bf16, torch.float16):
        for masked in (False, True):
            for softcap in (False, True):
                for runs in (False, True):
                    call = Need(masked=masked, softcap=softcap, runs=runs)
                    assert select("cuda", dtype, 128, call=call).name != "torch", call


def test_a_forced_kernel_is_refused_only_for_a_call_it_cannot_apply():
    assert select("cuda", bf16, 64, "cuda_flash", call=Need()).name == "cuda_flash"
    with pytest.raises(RingSeqError, match="cannot apply a mask"):
        select("cuda", bf16, 64, "cuda_flash", call=MASK)
    assert select("cuda", bf16, 64, "cuda_varlen", call=Need()).name == "cuda_varlen"
    assert select("cuda", bf16, 64, "cuda_varlen", call=MASK).name == "cuda_varlen"
    with pytest.raises(RingSeqError, match="not variable-length runs"):
        select("cuda", bf16, 64, "cuda_varlen", call=NOT_RUNS)
    with pytest.raises(RingSeqError, match="cannot apply a softcap"):
        select("cuda", bf16, 64, "cuda_varlen", call=CAP)
    # the message names what is wrong: the device, the dtype, the head dim
    with pytest.raises(RingSeqError, match=r"cannot apply inputs on cpu \(it runs on cuda only\); use"):
        select("cpu", bf16, 64, "cuda_flash", call=Need())
    with pytest.raises(RingSeqError, match=r"cuda only\) and float32 inputs \(it takes float16 or bfloat16\)"):
        select("cpu", fp32, 64, "cuda_flash", call=Need())
    with pytest.raises(RingSeqError, match=r"cannot apply head dim 512 \(too large for it\)"):
        select("cuda", bf16, 512, "cuda_flash", call=Need())
    assert select("cpu", fp32, 64, "flex", call=Need(masked=True, softcap=True)).name == "flex"
    with pytest.raises(RingSeqError, match="unknown kernel"):
        select("cpu", fp32, 64, "triton")


def _spec(info, window=None, layout="contiguous", S=16, P=1):
    (pc,) = [pc for step in rank_schedule(layout, S, P, 0, True, info, window).calls for pc in step if pc.masked]
    return BlockSpec(causal=True, scale=0.1, mask=RowMask(pc.q, pc.k, info, window, True, 1)), pc.q.n, pc.k.n


def test_need_finds_out_whether_a_mask_is_runs_only_for_cuda():
    docs = TokenInfo(doc=torch.tensor([[0] * 5 + [1] * 11]))
    spec, n, m = _spec(docs)
    assert need(spec, "cuda", 1, n, m) == Need(masked=True, runs=True)
    hole = torch.ones(1, 16, dtype=torch.bool)
    hole[0, 7] = False
    spec, n, m = _spec(TokenInfo(valid=hole))
    assert need(spec, "cuda", 1, n, m) == Need(masked=True, runs=False)
    assert select("cuda", bf16, 64, call=need(spec, "cuda", 1, n, m)).name == "flex"
    assert need(spec, "cpu", 1, n, m).runs  # not worked out off CUDA: no varlen there


def test_flex_refuses_a_backward_on_the_cpu():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(RingSeqError, match="no backward on the CPU"):
        Flex.backward(q, q, q, q, q, q[..., 0], None, BlockSpec(causal=True, scale=1.0))
