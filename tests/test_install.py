"""fzero installs into anyone's project: its wheel holds the one top-level package ``fzero``
(``transforms/`` and ``models/`` install as ``fzero.transforms`` and ``fzero.models``), and,
installed (not editable) into a fresh venv beside a project with its own ``models`` package and
``transforms.py``, runs the README's complete example. From a checkout, the folders' own names
(``import transforms``) give the very modules of ``fzero.transforms``/``fzero.models``."""
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
    assert "fzero/cpu/native.cpp" in names, "the CPU kernels' source is not in the wheel"
    assert {"fzero/transforms/quantize.py", "fzero/models/gpt.py"} <= set(names), "the folders outside fzero/"

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


def test_pyproject_lists_every_package_folder_and_the_tree_has_no_links():
    tomllib = pytest.importorskip("tomllib")
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert tool["package-dir"] == {"fzero.transforms": "transforms", "fzero.models": "models"}
    folders = {".".join(init.parent.relative_to(REPO).parts) for init in (REPO / "fzero").rglob("__init__.py")}
    folders |= {f"fzero.{name}" for name in tool["package-dir"].values()}
    assert sorted(tool["packages"]) == sorted(folders), "pyproject's [tool.setuptools] packages"
    links = [str(p.relative_to(REPO)) for top in ("fzero", "transforms", "models") for p in (REPO / top).rglob("*")
             if p.is_symlink()]
    assert links == [], links


# In a fresh interpreter: the checkout on sys.path, one name imported first, then the other; an
# engine with 8-bit moments built through the first name checkpoints, and loads into an engine
# built through the second, bitwise.
ONE_MODULE = """
import importlib, sys, tempfile
import optree, torch
sys.path.insert(0, sys.argv[1])
prefix = {"short": ("", "fzero."), "fzero": ("fzero.", "")}[sys.argv[2]]  # the name imported first, then
a, b = (importlib.import_module(p + "transforms") for p in prefix)
assert a is b, (a, b)
assert importlib.import_module(prefix[0] + "models") is importlib.import_module(prefix[1] + "models")
import fzero, fzero.models, fzero.transforms, models, transforms
assert models is fzero.models and transforms is fzero.transforms
for name, module in list(sys.modules.items()):
    for short in ("transforms", "models"):
        if name.startswith("fzero." + short + "."):
            assert sys.modules[name[len("fzero."):]] is module, name
from transforms.quantize import Quantized
assert Quantized is fzero.transforms.quantize.Quantized

params = {"w": torch.randn(3, 300, generator=torch.Generator().manual_seed(0)), "b": torch.randn(7)}
def engine(tx):
    return fzero.zero1(tx.adamw(1e-2, mu_dtype=torch.int8, nu_dtype=torch.int8), param_dtype=torch.float32)
made = engine(a)
p, s, ss = made.init(params)
for step in range(2):
    grads = optree.tree_map(lambda x: torch.randn(x.shape, generator=torch.Generator().manual_seed(step)), params)
    p, s, ss, _ = made.step(p, grads, s, ss)
assert isinstance(s.tx_state[0].mu, b.quantize.Quantized)
with tempfile.TemporaryDirectory() as tmp:
    fzero.checkpoint.save(tmp + "/ck", p, s, ss, made)
    loads = engine(b)
    loads.init(params)
    _, loaded, _, _ = fzero.checkpoint.load(tmp + "/ck", loads)
assert optree.tree_structure(loaded) == optree.tree_structure(s)
assert all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(loaded), optree.tree_leaves(s)))
print("one module")
"""


@pytest.mark.parametrize("first", ["short", "fzero"])  # ``import transforms`` first, or ``import fzero.transforms``
def test_both_names_are_one_module_and_an_8bit_state_checkpoints_through_the_other(first):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-c", ONE_MODULE, str(REPO), first], cwd=REPO / "tests",
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["one", "module"], proc.stdout + proc.stderr[-3000:]


# A copy of the checkout that is only on sys.path (no pip install: a machine without pip's build
# tools, such as a GPU box the checkout is carried to), with the editable install's finder taken out.
BARE_CHECKOUT = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
root = sys.argv[1]
sys.path.insert(0, root)
import fzero, fzero.models, fzero.transforms, transforms
assert fzero.__file__.startswith(root) and fzero.transforms.__file__.startswith(root), fzero.transforms.__file__
assert transforms is fzero.transforms and fzero.models.gpt.__file__.startswith(root)
print("found")
"""


def test_a_checkout_only_on_sys_path_finds_transforms_and_models(tmp_path):
    root = tmp_path / "checkout"
    for folder in ("fzero", "transforms", "models"):
        shutil.copytree(REPO / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", BARE_CHECKOUT, str(root)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["found"], proc.stdout + proc.stderr[-3000:]
