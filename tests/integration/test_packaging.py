"""ringseq installs as one top-level package, editable and as a wheel.

``patches/`` and ``launch/`` must install as ``ringseq.patches`` and ``ringseq.launch``;
importing a bare ``patches`` or ``launch`` must fail. Each check runs in a subprocess from
an empty directory, so the repository root is not on the import path.
"""
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import importlib.util, sys
import ringseq, ringseq.patches, ringseq.launch, ringseq.launch.cli, ringseq.attention.kernels.select
assert {"h100", "cpu"} <= set(ringseq.planner.presets()), "the planner's presets are not installed"
assert importlib.util.find_spec("patches") is None, "a top-level 'patches' is importable"
assert importlib.util.find_spec("launch") is None, "a top-level 'launch' is importable"
print(ringseq.__file__); print(ringseq.patches.__file__)
"""


def probe(cwd, env=None):
    run = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stdout.split()


def test_editable_install_maps_the_folders(tmp_path):
    ringseq_file, patches_file = probe(tmp_path)
    assert Path(ringseq_file) == ROOT / "ringseq" / "__init__.py"
    assert Path(patches_file) == ROOT / "patches" / "__init__.py"


def test_wheel_install(tmp_path):
    build = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir",
                            str(tmp_path / "dist"), str(ROOT)], capture_output=True, text=True)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    wheel, = (tmp_path / "dist").glob("ringseq-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"ringseq", next(t for t in tops if t.endswith(".dist-info"))}, tops
    assert "ringseq/patches/__init__.py" in names and "ringseq/launch/cli.py" in names
    assert "ringseq/attention/ring.py" in names and "ringseq/attention/kernels/select.py" in names
    assert "ringseq/launch/configs/ds_zero2.json" in names and "ringseq/planner/presets.json" in names
    target = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                              str(target), str(wheel)], capture_output=True, text=True)
    assert install.returncode == 0, install.stderr
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    ringseq_file, patches_file = probe(tmp_path, env)
    assert Path(ringseq_file) == target / "ringseq" / "__init__.py"
    assert Path(patches_file) == target / "ringseq" / "patches" / "__init__.py"
