"""The run header's commit: HEAD of the checkout, and whether tracked files were changed from it."""

from __future__ import annotations

import subprocess
import sys

import psutil

import commbench
from commbench.bench import machine, reporting


def _git(root, *args: str) -> str:
    return subprocess.run(
        [
            "git",
            "-C",
            str(root),
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@t",
            "-c",
            "commit.gpgsign=false",
            *args,
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def _commit_one(root, *paths: str) -> str:
    """A checkout at ``root`` whose one commit holds ``paths``; returns the commit."""
    _git(root, "init", "-q")
    for path in paths:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text("x = 1\n")
    _git(root, "add", *paths)
    _git(root, "commit", "-qm", "one")
    return _git(root, "rev-parse", "HEAD")


def test_the_commit_and_whether_tracked_files_changed(tmp_path):
    assert machine.git_commit(tmp_path) == (None, None)  # not a checkout
    head = _commit_one(tmp_path, "commbench/__init__.py")
    assert machine.git_commit(tmp_path) == (head, False)
    (tmp_path / "new.py").write_text("")  # untracked: not part of what the commit names
    assert machine.git_commit(tmp_path) == (head, False)
    (tmp_path / "commbench" / "__init__.py").write_text("x = 2\n")
    assert machine.git_commit(tmp_path) == (head, True)


def test_an_installed_copy_inside_another_repository_has_no_commit(tmp_path):
    """pip install into a virtual environment inside the user's project: git, asked in
    site-packages, answered with the project's commit and its changes, reported as commbench's."""
    _commit_one(tmp_path, "project.py")
    site = tmp_path / ".venv" / "lib" / "python3" / "site-packages"
    (site / "commbench").mkdir(parents=True)
    (site / "commbench" / "__init__.py").write_text("")
    assert machine.git_commit(site) == (None, None)
    # the project's own top, which does not track commbench, has none either
    (tmp_path / "commbench").mkdir()
    (tmp_path / "commbench" / "__init__.py").write_text("")
    assert machine.git_commit(tmp_path) == (None, None)


def test_a_vendored_copy_inside_another_repository_has_no_commit(tmp_path):
    """A project that commits a copy of commbench (vendor/commbench) tracks the package, but its
    commit is the project's: commbench's commit is that of a checkout whose top holds the package."""
    _commit_one(tmp_path, "vendor/commbench/__init__.py")
    assert machine.git_commit(tmp_path / "vendor") == (None, None)


def test_the_command_line_reads_as_commbench_however_it_was_started(monkeypatch):
    """python -m commbench (argv[0] the package's __main__.py) and the installed script alike."""
    monkeypatch.setattr(sys, "argv", ["/x/commbench/__main__.py", "sweep", "-b", "1K"])
    assert machine.command_line() == "commbench sweep -b 1K"
    monkeypatch.setattr(sys, "argv", ["/usr/bin/commbench", "x"])
    assert machine.command_line() == "commbench x"
    monkeypatch.setattr(sys, "argv", ["/usr/bin/other", "a b"])
    assert machine.command_line() == "/usr/bin/other 'a b'"
    assert machine.command_line(["train", "a b"]) == "commbench train 'a b'"


def test_host_copies_that_never_happen_are_recorded_as_never(monkeypatch):
    """None from the setting means host copies are never made, which the header says in words."""
    from commbench import comm

    monkeypatch.setattr(comm, "stage_whole_from", lambda: None)
    assert machine.machine_info("gloo")["gloo_cuda_host_copies_from"] == comm.NEVER == "never"


def test_the_physical_cores_are_psutils_not_the_logical_count(monkeypatch):
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 64 if logical else 12)
    assert machine.machine_info("gloo")["cpu_physical_cores"] == 12


def test_the_header_and_the_report_say_when_the_code_was_modified():
    info = machine.machine_info("gloo")
    assert info["commbench"] == commbench.__version__  # what names the code where there is no commit
    assert (info["commit"], info["commit_modified"]) == machine.git_commit()
    if (machine.CHECKOUT / ".git").exists():  # the tests run from a checkout: its HEAD, not None
        assert info["commit"] == _git(machine.CHECKOUT, "rev-parse", "HEAD")
    runs = [
        reporting.Run(
            path=f"{modified}.jsonl",
            label=str(modified),
            header={
                "type": "header",
                "commbench": "9.9",
                "commit": "0123456789abcdef",
                "commit_modified": modified,
            },
            sweeps=(),
            epochs=(),
            summaries=(),
            probes=(),
            clusters=(),
        )
        for modified in (False, True)
    ]
    text = reporting.render_markdown(reporting.machine_section(runs))
    assert "| commit | 0123456789ab | 0123456789ab (modified) |" in text, text
    assert "| commbench | 9.9 | 9.9 |" in text, text


def _nvml(fail: str):
    """A pynvml whose ``fail`` call raises, as the library does for a GPU it cannot query."""
    import types

    class NVMLError(Exception):
        pass

    def call(name, value):
        def f(*args):
            if name == fail:
                raise NVMLError("Unknown Error")
            return value

        return f

    calls = {
        "nvmlInit": None,
        "nvmlShutdown": None,
        "nvmlDeviceGetCount": 1,
        "nvmlDeviceGetHandleByIndex": object(),
        "nvmlDeviceGetName": b"NVIDIA H100",
        "nvmlSystemGetDriverVersion": "570.1",
    }
    return types.SimpleNamespace(**{name: call(name, value) for name, value in calls.items()})


def test_gpu_information_nvml_cannot_give_is_left_out_not_an_error(monkeypatch):
    """A GPU NVML could not query failed rank 0 of every run, a CPU sweep's too, before any point."""
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", _nvml(fail="none"))
    assert machine._gpus() == {"driver": "570.1", "devices": ["NVIDIA H100"]}
    for fail in ("nvmlDeviceGetHandleByIndex", "nvmlSystemGetDriverVersion", "nvmlInit", "nvmlShutdown"):
        monkeypatch.setitem(sys.modules, "pynvml", _nvml(fail=fail))
        expected = {"driver": "570.1", "devices": ["NVIDIA H100"]} if fail == "nvmlShutdown" else None
        assert machine._gpus() == expected, fail
