"""What an installed commbench holds: setup.cfg's ``packages = find:`` takes a directory only
when it has an ``__init__.py``, so a subpackage without one is missing from the wheel (an
editable install still imports it from the source tree, which hides the gap)."""

import configparser
import os
import shutil
import subprocess
import sys
import tarfile
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


def _files_under(top: str) -> list[str]:
    """The files below ``top`` in the checkout (less compiled ones), relative to it."""
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / top).rglob("*")
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
    import commbench

    # the version is written once (setup.cfg reads commbench.__version__, which --version says)
    (wheel,) = (tmp_path / "dist").glob(f"commbench-{commbench.__version__}-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        held = set(zf.namelist())
        zf.extractall(tmp_path / "installed")
    assert [f for f in _files_under("commbench") if f not in held] == []
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


def test_an_sdist_holds_the_tests_and_what_readme_sends_a_reader_to(tmp_path):
    """The sdist had only setuptools' default picks: tests/test_*.py without tests/__init__.py or
    the helpers they import, so its tests could not be collected, and no Makefile or pins for
    README's first two commands."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("commbench", "tests", "docs/example-report"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.cfg", "pyproject.toml", "README.md", "MANIFEST.in", "Makefile", "constraints.txt"):
        shutil.copy(ROOT / name, src / name)
    shutil.copy(ROOT / "docs" / "PERFORMANCE.md", src / "docs" / "PERFORMANCE.md")
    code = "from setuptools import build_meta; print(build_meta.build_sdist('dist'))"
    built = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True, timeout=240)
    assert built.returncode == 0, built.stderr
    with tarfile.open(src / "dist" / built.stdout.split()[-1]) as tf:
        held = {name.split("/", 1)[1] for name in tf.getnames() if "/" in name}
    wanted = [f for top in ("tests", "commbench", "docs/example-report") for f in _files_under(top)]
    wanted += [
        "Makefile",
        "constraints.txt",
        "docs/PERFORMANCE.md",
        "README.md",
        "setup.cfg",
        "pyproject.toml",
    ]
    assert [f for f in wanted if f not in held] == []
    assert not [f for f in held if f.startswith("docs/perf/")]
