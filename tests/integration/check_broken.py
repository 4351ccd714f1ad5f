"""A model for ``ringseq check`` whose patched loss is deliberately 0.1% off: the checker must
say MISMATCH and exit 1 (proof that it can fail)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import ringseq.patches.forward as patched  # noqa: E402
from check_model import make_batches, make_model  # noqa: E402,F401

if not getattr(patched.chunked_cross_entropy, "broken", False):  # once, however often this file is loaded
    _loss = patched.chunked_cross_entropy

    def _broken(*args, **kwargs):
        return _loss(*args, **kwargs) * 1.001

    _broken.broken = True
    patched.chunked_cross_entropy = _broken


def checked(*argv) -> tuple[int, str]:
    """``check_job.main`` (what ``ringseq check`` starts under torchrun) on this file, run on this rank
    of a pool: its exit status and what it printed. The broken loss stays in the process: give it a
    pool of its own."""
    import contextlib
    import io

    from ringseq.launch import check_job

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = check_job.main([__file__, *argv])
    return status, printed.getvalue()
