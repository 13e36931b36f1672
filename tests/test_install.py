"""fzero installs into anyone's project: its wheel holds the one top-level package ``fzero``
(``transforms/`` and ``models/`` install as ``fzero.transforms`` and ``fzero.models``), and,
installed (not editable) into a fresh venv beside a project with its own ``models`` package and
``transforms.py``, runs the README's complete example."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile

import pytest

from helpers import REPO, run_script


def readme_example() -> str:
    """The Python block under the README's "A complete example" heading."""
    section = (REPO / "README.md").read_text().split("## A complete example", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.e2e
def test_the_wheel_runs_the_readme_example_beside_a_project_with_its_own_models_and_transforms(tmp_path):
    # Built from a copy: setuptools writes build/ and *.egg-info/ beside the sources.
    source, dist = tmp_path / "source", tmp_path / "dist"
    shutil.copytree(REPO, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "runs", "__pycache__", ".pytest_cache", ".hypothesis"))
    run_script([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                str(source)], check=True, capture_output=True)
    wheel, = dist.glob("fzero-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/", 1)[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"fzero"}, top
    assert "fzero/native.cpp" in names, "the CPU kernels' source is not in the wheel"

    # A fresh venv: fzero from the wheel; torch, optree, ... of this environment (a .pth line,
    # so its editable fzero, activated by a .pth file of its own, stays out).
    env = tmp_path / "venv"
    venv.create(env, with_pip=False, symlinks=True)
    python = env / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "dependencies.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    run_script([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                str(wheel)], check=True, capture_output=True)

    project = tmp_path / "project"
    (project / "models").mkdir(parents=True)
    (project / "models" / "__init__.py").write_text('"""The project\'s own models."""\nOWN = True\n')
    (project / "transforms.py").write_text('"""The project\'s own data transforms."""\n\ndef flip(x):\n    return x\n')
    (project / "train_min.py").write_text(readme_example())
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FZERO_TEST_TIER")}
    where = subprocess.run([python, "-c", "import fzero, models, transforms; print(fzero.__file__, models.OWN, "
                                          "transforms.flip(1))"],
                           cwd=project, env=clean, capture_output=True, text=True, check=True).stdout.split()
    assert where[0].startswith(str(env)) and where[1:] == ["True", "1"], where
    proc = run_script([python, "train_min.py"], cwd=project, env={**clean, "OMP_NUM_THREADS": "1"},
                      capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "step 80 loss" in proc.stdout and (project / "ckpt").is_dir(), proc.stdout
    assert "could not be built" not in proc.stderr, proc.stderr[-3000:]  # the kernels, built from the wheel's source
