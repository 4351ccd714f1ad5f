"""A model for ``ringseq check`` whose patched loss is deliberately 0.1% off: the checker must
say MISMATCH and exit 1 (proof that it can fail)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import ringseq.patches.forward as patched  # noqa: E402
from check_model import make_batches, make_model  # noqa: E402,F401

_loss = patched.chunked_cross_entropy
patched.chunked_cross_entropy = lambda *a, **k: _loss(*a, **k) * 1.001
