"""What an installed commbench holds: setup.cfg's ``packages = find:`` takes a directory only
when it has an ``__init__.py``, so a subpackage without one is missing from the wheel (an
editable install still imports it from the source tree, which hides the gap)."""

import configparser
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _config() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return cfg


def test_every_directory_of_modules_is_a_package_the_wheel_takes():
    assert _config()["options"]["packages"].strip() == "find:"
    dirs = {p.parent for p in (ROOT / "commbench").rglob("*.py") if "__pycache__" not in p.parts}
    missing = sorted(str(d.relative_to(ROOT)) for d in dirs if not (d / "__init__.py").is_file())
    assert missing == []


def test_the_console_script_lives_in_a_package():
    target = _config()["options.entry_points"]["console_scripts"].split("=", 1)[1].strip()
    module = target.split(":", 1)[0]
    parts = module.split(".")
    for i in range(1, len(parts)):
        assert (ROOT.joinpath(*parts[:i]) / "__init__.py").is_file(), ".".join(parts[:i])
    assert ROOT.joinpath(*parts).with_suffix(".py").is_file()


def _tracked_package_files() -> list[str]:
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "commbench").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    )


def test_a_wheel_built_from_the_tree_holds_every_file_and_finds_its_studies(tmp_path):
    """The study presets lived in ``studies/`` beside the package: a wheel left them out, so an
    installed commbench listed no studies. The wheel is built from a copy (the build writes its
    own directories), unpacked away from the checkout and asked for its studies from there."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "commbench", src / "commbench", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["--no-index", "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("commbench-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        held = set(zf.namelist())
        zf.extractall(tmp_path / "installed")
    assert [f for f in _tracked_package_files() if f not in held] == []
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    listed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import commbench; from commbench.bench import study; "
            "print(commbench.__file__); print(' '.join(study.known_studies()))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=elsewhere,
        env={**os.environ, "PYTHONPATH": str(tmp_path / "installed")},
    )
    assert listed.returncode == 0, listed.stderr
    where, names = listed.stdout.splitlines()
    assert Path(where).is_relative_to(tmp_path / "installed")
    assert names.split() == sorted(p.stem for p in (ROOT / "commbench" / "studies").glob("*.toml"))
    assert len(names.split()) == 5
