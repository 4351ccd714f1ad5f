"""The GPU user's configurations on the CPU (matrix.py: engine x precision x compile x checkpointing x entry
point, as a pairwise covering set): every row's step against the unpatched model in the same arithmetic, in the
warm pools (HSDP at 4 ranks, the rest at 2). The rows of the user's own loop, Accelerate and the Trainer:
cases_matrix.py; of SFTTrainer and GRPOTrainer: client_step.py and grpo_step.py against stock TRL."""
import pytest

from . import cases_matrix, matrix
from .test_clients import ENV, HERE, each_ok

IN_POOL = [r for e in ("raw", "accelerate", "trainer") for r in matrix.rows_for(e)]


def test_the_rows_cover_every_feasible_pair_and_the_forced_rows():
    rows = matrix.ROWS
    needed = set().union(*map(matrix.pairs, matrix.feasible()))
    covered = set().union(*map(matrix.pairs, rows))
    assert needed <= covered, sorted(needed - covered)[:5]
    assert all(matrix.why_not(r) is None for r in rows), [matrix.name(r) for r in rows if matrix.why_not(r)]
    for forced in matrix.FORCED:
        assert any(all(r[k] == v for k, v in forced.items()) for r in rows), forced
    assert len(rows) < len(matrix.feasible()) / 10, f"{len(rows)} rows: not a covering set"


@pytest.mark.parametrize("row", IN_POOL)
def test_a_row_steps_as_the_unpatched_model(pools, row):
    pools(4 if row.startswith("hsdp-") else 2).run(cases_matrix.cell, row)


def test_a_checkpoint_wrapper_around_compiled_layers_is_refused_before_any_work(pool2):
    """FSDP's activation checkpointing (Accelerate's, the Trainer's fsdp_config) applied to layers the user
    compiled already: refused at the first forward, naming torchtitan's order."""
    pool2.run(cases_matrix.refused_compiled_inside)


@pytest.fixture(scope="module")
def trl_reference(pools, tmp_path_factory):
    """``trl_reference(entry, script)``: stock TRL in one plain process, once per arithmetic the entry's rows
    need (``matrix.reference_of``; each in fp32 or its row's dtype, and in float64)."""
    made = {}

    def reference(entry: str, script: str) -> str:
        if entry not in made:
            names = sorted({matrix.reference_of(matrix.parse(r)) for r in matrix.rows_for(entry)})
            made[entry] = str(tmp_path_factory.mktemp("matrix") / f"{entry}.pt")
            pools(1, group=False).run_script(HERE / script, "reference", "--out", made[entry], *names, launcher=None,
                                             env=ENV)
        return made[entry]

    return reference


@pytest.mark.parametrize("entry,script", [("sft", "client_step.py"), ("grpo", "grpo_step.py")])
def test_the_trl_rows_step_as_stock_trl(pool2, trl_reference, entry, script):
    rows = [f"matrix:{r}" for r in matrix.rows_for(entry)]
    each_ok(pool2.run_script(HERE / script, "ringseq", "--reference", trl_reference(entry, script), *rows,
                             launcher="deepspeed", env=ENV), rows, 2)
