"""Hybrid models (recurrent layers beside attention): patched against the unpatched model, every
layer on its shard, a lost state seen, the router loss of the whole sequence."""
import copy

import torch
import torch.distributed as dist

import ringseq
from ringseq import recurrent
from ringseq.testing import shared_init

from .hf_models import check_against, loss_and_grads, make_batch, references, tiny_model


def every_layer_runs_on_its_shard(family: str, S_per_rank: int = 64):
    """Hooks on every module of a patched hybrid: no tensor entering or leaving any module spans
    more tokens than this rank holds (S/P), so no layer runs on the whole sequence behind the
    user's back; and the loss is exact."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    B, S = 3, S_per_rank * world
    batch = make_batch(B, S, "plain")
    base, refs = references(family, batch)
    model = ringseq.patch(copy.deepcopy(base), sp=sp)
    seen, wrong = set(), []

    def hook(module, args, output):
        tensors = [t for t in (*args, *(output if isinstance(output, tuple) else (output,))) if torch.is_tensor(t)]
        for t in tensors:  # [B, s, ...] activations, [B, C, s] convolution inputs (B = 3: never a head count)
            if t.dim() >= 3 and t.size(0) == B and S in t.shape[1:3] and world > 1:
                wrong.append(f"{type(module).__name__} {tuple(t.shape)}")
        seen.add(type(module).__name__)

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    loss, grads = loss_and_grads(model, batch)
    for h in handles:
        h.remove()
    assert not wrong, f"{family}: modules saw the whole sequence: {sorted(set(wrong))[:8]}"
    mixers = {name for name in seen if name in ringseq.patches.mixers.MIXERS}
    assert mixers, (family, sorted(seen))
    check_against(refs, loss, grads, sp, f"{family} hooks rank {sp.rank}/{world}")


def a_lost_state_is_seen(family: str, part: str):
    """The parity check is sharp enough to see a state dropped at a shard edge (the fold made to
    forget what came before, or the convolution's halo zeroed): it must fail."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    batch = make_batch(2, 64 * world, "plain")
    base, refs = references(family, batch)
    model = ringseq.patch(copy.deepcopy(base), sp=sp)
    kind = {"delta rule": recurrent.DeltaRule, "mamba2": recurrent.Mamba2}.get(part)
    saved = (kind.fold if kind else None), recurrent.conv_halo
    if kind is not None:
        fold = kind.fold
        kind.fold = staticmethod(lambda S, summary, rows: fold(None, summary, rows))
    else:
        def no_halo(x, width, batch):
            halos = saved[1](x, width, batch)
            return recurrent._Halos([torch.zeros_like(h) for h in halos], halos.gathered)

        recurrent.conv_halo = no_halo
    try:
        loss, grads = loss_and_grads(model, batch)
    finally:
        if kind is not None:
            kind.fold = staticmethod(saved[0])
        recurrent.conv_halo = saved[1]
    try:
        check_against(refs, loss, grads, sp, f"{family} lost {part}")
    except AssertionError:
        return
    raise AssertionError(f"{family}: a lost {part} state went unseen by the parity check")


def router_loss_of_the_whole_sequence(family: str, kind: str = "padded", short: int = 0):
    """output_router_logits=True: the loss includes the router's auxiliary loss of the whole
    sequence (padding weighted out as the unpatched model does; ``short`` tokens fewer than the
    layout splits: its own padding is never counted), exact by the 2x rule, and ``aux_loss`` is
    the unpatched model's on every rank."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    batch = make_batch(2, 32 * world - short, kind, left_pad=False)

    def model_of(dtype):
        model = tiny_model(family, dtype)
        model.config.output_router_logits = True
        return model

    exact = model_of(torch.float64)  # transformers' loss upcasts to float32 only: the float64 loss by hand
    out = exact(**{k: v for k, v in batch.items() if k != "labels"})
    targets = torch.cat([batch["labels"][:, 1:], torch.full_like(batch["labels"][:, :1], -100)], 1)
    ref = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    ref = ref + exact.router_aux_loss_coef * out.aux_loss
    ref.backward()
    ref_loss, ref_grads = ref.detach(), {n: p.grad.clone() for n, p in exact.named_parameters() if p.grad is not None}
    base = model_of(torch.float32)
    base.zero_grad()
    plain = base(**batch)
    plain.loss.backward()
    plain_grads = {n: p.grad.clone() for n, p in base.named_parameters() if p.grad is not None}
    model = ringseq.patch(model_of(torch.float32), sp=sp)
    model.zero_grad()
    got = model(**batch)
    got.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert abs(got.aux_loss.item() - plain.aux_loss.item()) <= 1e-5 * abs(plain.aux_loss.item()), \
        (got.aux_loss, plain.aux_loss)
    check_against((plain.loss.detach(), plain_grads, ref_loss, ref_grads), got.loss.detach(), grads, sp,
                  f"{family} router loss {kind} rank {sp.rank}/{world}")


def hybrid_refusals():
    """What ringseq cannot do exactly with recurrent layers is refused with the fix: the striped
    layout (no rank holds a run), cu_seq_lens (states that restart at each document), a recurrent
    mixer it does not know (by name), and a cache."""
    import pytest

    world = dist.get_world_size()
    striped = shared_init(sp_size=world, layout="striped")
    sp = shared_init(sp_size=world)
    batch = make_batch(2, 32 * world, "packed")
    model = tiny_model("qwen3_5")
    with pytest.raises(ringseq.RingSeqError, match="striped layout gives every rank every P-th token"):
        ringseq.patch(model, sp=striped)
    assert not hasattr(model, "_ringseq_patch")
    ringseq.patch(model, sp=sp)
    with pytest.raises(ringseq.RingSeqError, match="striped layout"):
        ringseq.patch(model, sp=striped)  # re-patching onto a striped group: refused too
    cu = torch.tensor([0, 7, 32 * world], dtype=torch.int32)
    with pytest.raises(ringseq.RingSeqError, match="restart their states at every packed document"):
        model(**batch, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=32 * world, max_length_k=32 * world)
    model(**batch).loss.backward()  # the refusals left the group in step

    class SomeNewMixer(torch.nn.Module):  # a recurrent layer ringseq does not know
        def forward(self, x):
            return x

    other = tiny_model("bamba")
    other.model.layers[0].extra = SomeNewMixer()
    with pytest.raises(ringseq.RingSeqError, match=r"sequence-mixing layers ringseq cannot shard \(SomeNewMixer\)"):
        ringseq.patch(other, sp=sp)
    assert not hasattr(other, "_ringseq_patch")
