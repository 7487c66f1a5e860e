"""bertpipe installs one import name and carries its recipes: a decoy ``training`` package in
the user's folder changes nothing, and a non-editable wheel works from outside the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DECOY = "raise SystemExit('DECOY {} imported instead of bertpipe')\n"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "MASTER_", "SLURM"))}
    env.pop("PYTHONPATH", None)
    env.update(extra)
    return env


def _decoys(folder: Path) -> None:
    for name in ("training", "preprocessing", "finetuning", "configs"):
        (folder / name).mkdir()
        (folder / name / "__init__.py").write_text(DECOY.format(name))
        (folder / name / "cli.py").write_text(DECOY.format(name + ".cli"))


@pytest.mark.integration
def test_cli_ignores_decoy_packages_in_the_working_folder(tmp_path: Path) -> None:
    _decoys(tmp_path)
    # the folder is first on sys.path twice over: as the cwd of `python -m` and on PYTHONPATH
    for cmd in (
        [sys.executable, "-m", "bertpipe.app.cli", "plan", "--config", "bert-base-adamw"],
        [str(Path(sys.executable).parent / "bertpipe"), "plan", "--config", "bert-base-adamw"],
    ):
        proc = subprocess.run(
            cmd, cwd=tmp_path, env=_env(PYTHONPATH=str(tmp_path)), capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "DECOY" not in proc.stdout + proc.stderr
        assert "BERT" in proc.stdout or "bert" in proc.stdout


def test_bertpipe_modules_import_beside_a_decoy_on_sys_path(tmp_path: Path) -> None:
    _decoys(tmp_path)
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "import bertpipe.training.pretrain.trainer, bertpipe.preprocessing.pipeline, "
        "bertpipe.finetuning.run\n"
        "assert 'training' not in sys.modules and 'preprocessing' not in sys.modules\n"
        "print(bertpipe.training.pretrain.trainer.__name__)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "bertpipe.training.pretrain.trainer"


@pytest.mark.integration
@pytest.mark.slow
def test_wheel_installs_non_editable_and_runs_from_outside_the_checkout(tmp_path: Path) -> None:
    """Build the wheel, install it (no dependencies) into a fresh venv that borrows this
    environment's third-party packages, and run it from a folder that is not the checkout."""
    # from a copy: setuptools leaves build/ and *.egg-info in the tree it builds
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "runs", ".cache", "build", "*.egg-info", ".gpu-wheels", "__pycache__",
        ".pytest_cache", ".ruff_cache", ".mypy_cache",
    ))  # fmt: skip
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--quiet", "-w", str(dist), str(src)],
        check=True, env=_env(PIP_DISABLE_PIP_VERSION_CHECK="1"), cwd=tmp_path,
    )  # fmt: skip
    wheels = list(dist.glob("bertpipe-*.whl"))
    assert len(wheels) == 1, wheels
    with zipfile.ZipFile(wheels[0]) as whl:
        names = whl.namelist()
    top = {n.split("/")[0] for n in names if ".dist-info/" not in n}
    assert top == {"bertpipe"}, top  # one import name
    assert "bertpipe/configs/pretrain-bert-large-lamb.yaml" in names
    assert "bertpipe/training/pretrain/trainer.py" in names
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--quiet", "--no-deps",
         "--no-index", str(wheels[0])],
        check=True, env=_env(PIP_DISABLE_PIP_VERSION_CHECK="1"),
    )  # fmt: skip
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    # third-party packages from this environment, after the venv's own site-packages (a path
    # line in a .pth is not itself a site folder, so this env's editable hook stays out)
    Path(site, "borrowed-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    _decoys(outside)
    env = _env(DS_ACCELERATOR="cpu")

    def run(*args: str) -> str:
        proc = subprocess.run(
            [str(venv / "bin" / "bertpipe"), *args], cwd=outside, env=env,
            capture_output=True, text=True,
        )  # fmt: skip
        assert proc.returncode == 0, (args, proc.stderr[-2000:])
        return proc.stdout

    where = subprocess.run(
        [str(py), "-c", "import bertpipe.training, bertpipe.configs as c; "
         "print(bertpipe.training.__file__); print(c.__file__)"],
        cwd=outside, env=env, check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    assert all(Path(w).is_relative_to(venv) for w in where), where
    assert "--out" in run("demo", "--help")
    listed = run("configs", "list")
    assert "bert-large-lamb" in listed and "demo" in listed
    assert "ZeRO" in run("configs", "show", "bert-large-lamb")
    plan = run("plan", "--config", "bert-large-lamb", "--nodes", "4", "--gpus-per-node", "8")
    assert "DECOY" not in plan and "phase" in plan.lower()
