"""What an installed commbench holds: setup.cfg's ``packages = find:`` takes a directory only
when it has an ``__init__.py``, so a subpackage without one is missing from the wheel (an
editable install still imports it from the source tree, which hides the gap)."""

import configparser
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
