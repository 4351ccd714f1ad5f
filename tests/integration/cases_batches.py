"""Batches into a patched model: the manual path (shard_batch), batches that differ between ranks,
ranks that fall out of step and resync at the next batch, labels without a target, copies."""
import copy

import torch
import torch.distributed as dist

import ringseq
from ringseq.layouts import Runs
from ringseq.testing import shared_init

from .hf_models import VOCAB, check_against, loss_and_grads, make_batch, references, tiny_model


def manual_path(family="llama", S_per_rank=16):
    """shard_batch + patched model on local inputs + loss.cross_entropy == unpatched loss."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    batch = make_batch(2, S_per_rank * world, "packed")
    base, refs = references(family, batch)
    model = ringseq.patch(copy.deepcopy(base), sp=sp)
    local = ringseq.shard_batch(batch, sp=sp)
    facts = local["ringseq"]  # packed documents: laid out by work (ringseq.balance), not where ringseq.shard puts them
    assert isinstance(facts.order, Runs), f"a packed batch balances as {facts.order!r}: zigzag already even"
    labels = local.pop("labels")
    model.zero_grad(set_to_none=True)
    logits = model(**local).logits
    assert logits.shape == (2, S_per_rank, VOCAB)
    loss = ringseq.loss.cross_entropy(logits, labels, sp=sp)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    check_against(refs, loss.detach(), grads, sp, f"manual path rank {sp.rank}/{world}")
    # the labels came back shifted on the full sequence, then sharded
    shifted = torch.cat([batch["labels"][:, 1:], torch.full((2, 1), -100)], 1)
    assert torch.equal(labels, facts.shard(shifted, 1))
    assert torch.equal(facts.gather(labels), shifted)
    # the whole shard_batch output, labels included, straight into the patched model; 16 * world - 3
    # tokens: shard_batch pads them to a length the layout splits
    for kind in ("packed", "padded"):
        batch = make_batch(2, S_per_rank * world - 3, kind)
        _, refs = references(family, batch)
        loss, grads = loss_and_grads(model, ringseq.shard_batch(batch, sp=sp))
        check_against(refs, loss, grads, sp, f"shard_batch {kind} rank {sp.rank}/{world}")


def different_batches_are_refused():
    """A patched model (and shard_batch) handed a different full batch on one rank of the group
    refuses on every rank instead of computing a mix of two batches."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    model = ringseq.patch(tiny_model("llama"), sp=sp)
    batch = make_batch(2, 16 * world, "plain")
    if sp.rank == world - 1:
        batch = {k: v.flip(1) for k, v in batch.items()}  # same tokens, another order
    try:
        model(**batch)
    except ringseq.RingSeqError as err:
        text = str(err)
        assert "out of step" in text and f"group rank {world - 1}" in text and "input_ids content" in text, err
        assert "same full batch" in text and "ringseq.Trainer" in text, err
    else:
        raise AssertionError("a different batch on one rank was not refused")


def out_of_step_ranks_resync_at_the_next_batch(case: str, steps: int = 6):
    """The probes' loop on a patched model that swallows errors. ``"backward"``: at step 1 the
    last rank raises between its forward and backward (a user error); its next batch meets the
    others' step-1 backward, it waits there while they raise, and all go on from batch 2.
    ``"skipped batch"``: at step 1 the last rank raises before its forward and goes on to batch 2
    while the others are at batch 1: all raise there, and the last rank is now a batch ahead. At
    its batch 3 the others bring batch 2, which it had already: they raise and skip to batch 3,
    where it waits for them. No rank gets a loss while they are apart, none of it needs a call of
    the user's, and every later loss is the unpatched model's."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    odd = sp.rank == world - 1
    batches = [make_batch(2, 16 * world, "plain", seed=s) for s in range(steps)]
    base = tiny_model("llama")
    model = ringseq.patch(copy.deepcopy(base), sp=sp)
    outcome = {}
    for step, batch in enumerate(batches):
        try:
            model.zero_grad(set_to_none=True)
            if odd and step == 1 and case == "skipped batch":
                raise ValueError("a user error before the forward")
            loss = model(**batch).loss
            if odd and step == 1 and case == "backward":
                raise ValueError("a user error between the forward and the backward")
            loss.backward()
            outcome[step] = loss.detach()
        except (ringseq.RingSeqError, ValueError) as exc:
            outcome[step] = str(exc)
    good = [s for s, o in outcome.items() if torch.is_tensor(o)]
    lost = {"backward": [1], "skipped batch": [1, 2]}[case]
    assert good == [s for s in range(steps) if s not in lost], (sp.rank, outcome)
    if case == "skipped batch" and not odd:
        assert "behind the others" in outcome[2], outcome[2]
    for s in good:
        ref = loss_and_grads(copy.deepcopy(base), batches[s])[0]
        assert abs(outcome[s].item() - ref.item()) <= 1e-5 * abs(ref.item()), (sp.rank, s, outcome[s], ref)


def labels_without_a_target_give_nan():
    """Every label -100: the unpatched model's mean over no tokens is NaN, and so is the patched
    model's (it used to be 0.0); a shard with no target on one rank only is fine; token ids and labels
    outside the vocabulary are refused by name (value and place), the group in step after."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    base = tiny_model("llama")
    model = ringseq.patch(copy.deepcopy(base), sp=sp)
    batch = make_batch(2, 16 * world, "plain")
    batch["labels"] = torch.full_like(batch["labels"], -100)
    assert torch.isnan(base(**batch).loss) and torch.isnan(model(**batch).loss)
    batch = make_batch(2, 16 * world, "plain")
    batch["labels"][:, : 16 * world - 4] = -100  # targets on the last rank's tokens only (zigzag: rank 0 too)
    _, refs = references("llama", batch)
    check_against(refs, *loss_and_grads(model, batch), sp, f"few targets rank {sp.rank}/{world}")
    # a token id or a label outside the vocabulary: named with its place on every rank, before any kernel
    from ringseq.testing import assert_refused

    for key, value, place in (("input_ids", VOCAB, (1, 3)), ("input_ids", -1, (0, 0)), ("labels", VOCAB + 5, (0, 7))):
        bad = make_batch(2, 16 * world, "plain")
        bad[key] = bad[key].clone()
        bad[key][place] = value
        assert_refused(lambda: model(**bad), f"{key} holds {value} at {list(place)} (row, position)")
    check_against(refs, *loss_and_grads(model, batch), sp, f"after the refusals rank {sp.rank}/{world}")


def copies_of_a_patched_model():
    """``copy.deepcopy`` of a patched model (an EMA or a reference model): the copy is patched
    over the same sequence group and computes the same exact loss; unpatching one leaves the
    other patched."""
    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    batch = make_batch(2, 16 * world, "packed")
    base, refs = references("llama", batch)
    model = ringseq.patch(copy.deepcopy(base), sp=sp, tiled_mlp=2)
    twin = copy.deepcopy(model)
    assert twin._ringseq_patch.sp is sp and twin._ringseq_patch is not model._ringseq_patch
    check_against(refs, *loss_and_grads(twin, batch), sp, f"copy rank {sp.rank}/{world}")
    ringseq.unpatch(twin)
    assert hasattr(model, "_ringseq_patch") and "forward" not in vars(twin)
    check_against(refs, *loss_and_grads(model, batch), sp, f"original rank {sp.rank}/{world}")


def a_failure_after_the_last_transfer_reaches_every_rank_in_its_step(backward: bool = False, steps: int = 4,
                                                                     compiled: bool = False):
    """A training loop that catches errors and skips the step, on a patched model: at step 1 the last
    rank's block kernel runs out of memory in its very last compute of the step (the forward's last
    layer's last ring step, after its last transfer: its peers finish that layer; or the backward's).
    Every rank raises in step 1 (the failing rank its own MemoryError, its peers a RingSeqError naming
    it, the forward's at the loss's agreement), and every other step is the unpatched model's, with no
    resync call. ``compiled``: the model under ``torch.compile`` (aot_eager), the ring in its op."""
    from ringseq.attention import ring

    world = dist.get_world_size()
    sp = shared_init(sp_size=world)
    base = tiny_model("llama")
    model = ringseq.patch(copy.deepcopy(base), sp=sp)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    victim = sp.rank == world - 1
    original, computes, armed = ring._Schedule.compute, [], [False]

    def compute(self, t, work):
        if self.opts.label.startswith("the backward") == backward:
            computes.append(t)
            if victim and armed[0] and len(computes) == armed[1]:
                def failing(w):
                    raise MemoryError("injected: the block kernel ran out of memory")
                return original(self, t, failing)
        return original(self, t, work)

    ring._Schedule.compute = compute
    outcome = {}
    try:
        for step in range(steps):
            batch = make_batch(2, 16 * world, "plain", seed=step)
            computes.clear()
            armed[:] = [step == 1, outcome.get("computes", 0)]
            try:
                model.zero_grad(set_to_none=True)
                loss = run(**batch).loss
                loss.backward()
                outcome[step] = loss.detach()
            except (ringseq.RingSeqError, MemoryError) as exc:
                outcome[step] = exc
            outcome.setdefault("computes", len(computes))  # the step's computes of that direction, step 0's
    finally:
        ring._Schedule.compute = original
    raised = outcome[1]
    assert isinstance(raised, MemoryError if victim else ringseq.RingSeqError), (sp.rank, raised)
    assert victim or f"global rank {sp.ranks[-1]} raised" in str(raised), str(raised)
    for s in (0, 2, 3):
        ref = loss_and_grads(copy.deepcopy(base), make_batch(2, 16 * world, "plain", seed=s))[0]
        assert torch.is_tensor(outcome[s]) and abs(outcome[s].item() - ref.item()) <= 1e-5 * abs(ref.item()), \
            (sp.rank, s, outcome[s], ref)
