"""Which flash attention implementation aten's flash ops run on a GPU: torch's own (FA2) or FA3.

``cuda_flash`` and ``cuda_varlen`` call aten's flash ops, forward and backward. torch can route
those ops to FlashAttention-3 on Hopper (``torch.nn.attention.activate_flash_attention_impl("FA3")``,
torch >= 2.10, with FA3's ``flash_attn_interface`` package installed); the backward ops must then
follow the forward ones, since the ring calls each backward op with the forward's outputs. ringseq
decides once per process, at the first ring call on a GPU (``ensure``), by ``RINGSEQ_FLASH``:

``auto`` (default)  FA3 where torch offers it, the package imports and the device is sm90, and a
                    small forward + backward through both op pairs ringseq calls (dense and varlen,
                    bf16) matches a float32 reference on the device; otherwise torch's default
                    (the reason is kept: ``describe``, ``ringseq env``, ``ringseq.stats``).
``fa2``             torch's default, untouched.
``fa3``             FA3, or ``RingSeqError`` saying what is missing.

The choice is process-wide (torch's dispatcher), so other SDPA flash calls of the process run it
too. Which kernel each call gets is decided per call as before (``select``).
"""
from __future__ import annotations

import os
import threading

import torch

from ringseq.errors import RingSeqError

CHOICES = ("auto", "fa2", "fa3")
_lock = threading.Lock()
_state: dict = {}
"""``impl`` ("FA2"/"FA3") and ``why`` once decided."""


def wanted() -> str:
    value = os.environ.get("RINGSEQ_FLASH", "auto").lower()
    if value not in CHOICES:
        raise RingSeqError(f"RINGSEQ_FLASH must be one of {', '.join(CHOICES)}; got {value!r}")
    return value


def unavailable(device) -> str | None:
    """Why FA3 cannot run on ``device`` here, or None."""
    attention = torch.nn.attention
    if not hasattr(attention, "activate_flash_attention_impl"):
        return f"torch {torch.__version__} cannot route its flash ops to FA3 (torch >= 2.10 can)"
    if "FA3" not in attention.list_flash_attention_impls():
        return f"torch {torch.__version__} offers no FA3 implementation"
    if torch.device(device).type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return "FA3 runs on Hopper (compute capability 9.0) GPUs only"
    try:
        import flash_attn_interface  # noqa: F401 - FA3's Hopper build
    except ImportError:
        return "FA3's package (flash_attn_interface, FlashAttention's hopper/ build) is not installed"
    return None


def _checked(device) -> str | None:
    """Run both op pairs ringseq calls under the active implementation against float32 math; why
    they fail, or None."""
    g = torch.Generator(device=device).manual_seed(0)
    B, H, S, D = 1, 2, 256, 128
    q, k, v, dout = (torch.randn(B, H, S, D, device=device, generator=g, dtype=torch.bfloat16) for _ in range(4))
    ref = [t.float().requires_grad_(True) for t in (q, k, v)]
    out_ref = torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=True)
    out_ref.backward(dout.float())
    out, lse, *aux = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)
    grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, aux[0], aux[1], S, S, 0.0, True, aux[4], aux[5])[:3]
    pack = lambda t: t.transpose(1, 2).reshape(B * S, H, D)  # noqa: E731
    cu = torch.tensor([0, S], dtype=torch.int32, device=device)
    out_v, lse_v, *_ = torch.ops.aten._flash_attention_forward(pack(q), pack(k), pack(v), cu, cu, S, S, 0.0, True,
                                                               False)
    rng = torch.zeros(2, dtype=torch.uint64, device=device)
    grads_v = torch.ops.aten._flash_attention_backward(pack(dout), pack(q), pack(k), pack(v), out_v, lse_v, cu, cu, S,
                                                       S, 0.0, True, rng, torch.empty(0, device=device))
    for name, got, want in [("out", out, out_ref), *zip(("dq", "dk", "dv"), grads, (t.grad for t in ref)),
                            ("varlen out", out_v, pack(out_ref)),
                            *zip(("varlen dq", "varlen dk", "varlen dv"), grads_v, (pack(t.grad) for t in ref))]:
        err = float((got.float() - want).abs().max() / want.abs().max().clamp(min=1e-6))
        if not err < 2e-2:  # bf16 inputs: a kernel that works is within ~4e-3
            return f"its {name} is off by {err:.3g} (relative to the largest value) against float32"
    return None


def ensure(device) -> dict:
    """Decide (once per process) which implementation the flash ops run; returns ``describe()``."""
    with _lock:
        if _state:
            return dict(_state)
        want = wanted()
        impl, why = "FA2", "torch's default flash kernels"
        if want == "fa2":
            why = "RINGSEQ_FLASH=fa2"
        else:
            missing = unavailable(device)
            if missing is None:
                torch.nn.attention.activate_flash_attention_impl("FA3")
                try:
                    missing = _checked(device)
                except RuntimeError as exc:  # an op FA3 does not take
                    missing = f"it raised {str(exc).splitlines()[0][:200]}"
                if missing is None:
                    impl, why = "FA3", "activated: its forward and backward ops passed the check on this device"
                else:
                    torch.nn.attention.restore_flash_attention_impl()
                    missing = f"FA3 failed ringseq's check ({missing}); kept torch's default"
            if missing is not None:
                if want == "fa3":
                    raise RingSeqError(f"RINGSEQ_FLASH=fa3 but {missing}; unset it to use torch's default kernels")
                why = missing
        _state.update(impl=impl, why=why)
        return dict(_state)


def describe() -> dict:
    """The decision (``impl``, ``why``), or what it would be before any ring call on a GPU."""
    if _state:
        return dict(_state)
    if not torch.cuda.is_available():
        return {"impl": "none", "why": "no CUDA device (flash kernels run on GPUs)"}
    missing = unavailable(torch.device("cuda", torch.cuda.current_device()))
    return {"impl": "undecided", "why": "decided at the first ring call on a GPU" + (f"; {missing}" if missing else
                                                                                      ": FA3 if its check passes")}
