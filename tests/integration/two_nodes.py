"""Run by two torchrun "nodes" on this machine (``--nnodes 2 --node_rank 0/1``, 2 processes each):
the groups ``ringseq.init`` builds keep Ulysses groups and sequence groups that fit a node on it
and run rings across nodes, and a Ulysses x ring hybrid training step of a tiny Llama is exact
against the unpatched model (every rank asserts)."""
import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import ringseq  # noqa: E402
from ringseq.processes import exit_now  # noqa: E402
from tests.integration.hf_models import check_against, loss_and_grads, make_batch, references  # noqa: E402

torch.set_num_threads(1)
node, me = int(os.environ["GROUP_RANK"]), int(os.environ["RANK"])
hybrid = ringseq.init(sp_size=4, ulysses_size=2)
here = {r for r in range(4) if r // 2 == node}
assert hybrid.ranks == (0, 1, 2, 3), hybrid.ranks
assert set(dist.get_process_group_ranks(hybrid.ulysses_group)) <= here, "a Ulysses group left its node"
assert len({r // 2 for r in hybrid.ring_ranks}) == 2, f"the ring {hybrid.ring_ranks} should cross the two nodes"
replicas = ringseq.init(sp_size=2)  # two sequence groups of 2: one per node, never split
assert set(replicas.ranks) == here and replicas.dp_size == 2, replicas.ranks

batch = make_batch(2, 32, "packed")
base, refs = references("llama", batch)
model = ringseq.patch(copy.deepcopy(base), sp=hybrid)
loss, grads = loss_and_grads(model, batch)
check_against(refs, loss, grads, hybrid, f"two nodes, ring 2 x ulysses 2, rank {me}")
print(f"rank {me} on node {node}: ulysses {sorted(dist.get_process_group_ranks(hybrid.ulysses_group))}, "
      f"ring {list(hybrid.ring_ranks)}: exact", flush=True)
exit_now(0)
