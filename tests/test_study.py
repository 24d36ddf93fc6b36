"""Every preset in commbench/studies/ parses and validates at every scale, and runs at the tiny scale; an
interrupted run stops the study, and an output directory that cannot be made is bad input."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from commbench.bench import cluster, study
from commbench.bench.cli import build_parser, main

NAMES = study.known_studies()


def test_five_presets_one_per_reference_study():
    assert len(NAMES) == 5
    refs = [study.load_study(n).reference for n in NAMES]
    # cited by its authors and title: the report named a file outside the project
    assert len(set(refs)) == 5 and not any(".txt" in r or "/reference/" in r for r in refs)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("scale", study.SCALES)
def test_preset_plans_and_validates(name, scale, tmp_path):
    s = study.load_study(name)
    planned = study.plan(s, scale, tmp_path, cluster_ok=True)
    assert planned
    study.validate(planned)  # every command line parses and builds its config
    if scale == "tiny":
        assert len(planned) == 1 and planned[0].argv[0] != "cluster"
    assert len({p.json_path for p in planned}) == len(planned)


def test_grid_is_the_product_and_full_changes_sizes(tmp_path):
    s = study.load_study("004_batch_scaling")
    default = study.plan(s, "default", tmp_path)
    scaling = [p for p in default if p.group.startswith("strong scaling")]
    assert [dict(p.point) for p in scaling] == [
        {"batch-size": b, "world-size": w} for b in (16, 64) for w in (1, 2)
    ]
    full = study.plan(s, "full", tmp_path)
    assert any("cuda" in p.argv for p in full) and len(full) > len(default)
    assert not any("cuda" in p.argv for p in default)


def test_cluster_group_falls_back_to_local_ranks(tmp_path):
    s = study.load_study("001_sync_strategies")
    with_cluster = study.plan(s, "default", tmp_path, cluster_ok=True)
    assert all(p.argv[0] == "cluster" and p.local_argv and p.local_argv[0] == "compare" for p in with_cluster)
    local = study.plan(s, "default", tmp_path, cluster_ok=False)
    assert all(p.argv[0] == "compare" and "--world-size" in p.argv and p.note for p in local)


@pytest.mark.parametrize(
    "text, needle",
    [
        (
            'title = "t"\nreference = "r"\nabout = "a"\n[[group]]\ncommand = "dance"\n',
            "command must be one of",
        ),
        ('title = "t"\nreference = "r"\nabout = "a"\nbogus = 1\n', "unknown keys"),
        ('title = "t"\nreference = "r"\nabout = "a"\nmetrics = ["speed"]\n[[group]]\n', "unknown metric"),
        (
            'title = "t"\nreference = "r"\nabout = "a"\n[[group]]\ngrid = { batch-size = [] }\n',
            "non-empty list",
        ),
        ("title = [\n", "bad.toml"),
    ],
)
def test_bad_preset_names_the_problem(tmp_path, text, needle):
    (tmp_path / "bad.toml").write_text(text)
    with pytest.raises(ValueError, match=needle):
        study.load_study("bad", tmp_path)


SCALED = """title = "t"
reference = "r"
about = "a"
[defaults]
options = { strategies = "ddp", model = "mlp", world-size = 2 }
full = { options = { world-size = 4, samples = 512 } }
[[group]]
label = "one process"
options = { strategies = "none", world-size = 1 }
grid = { batch-size = [16] }
[[group]]
label = "ranks"
grid = { batch-size = [16] }
"""


HEAD = 'title = "t"\nreference = "r"\nabout = "a"\n'


@pytest.mark.parametrize(
    "text, message",
    [
        ("defaults = 1\n[[group]]\n", "[defaults] must be a table, got an integer (1)"),
        ("group = 1\n", "group must be a list, got an integer (1)"),
        ("group = [1]\n", "group 1 must be a table, got an integer (1)"),
        ('[[group]]\noptions = "x"\n', "group 1: options must be a table, got a string ('x')"),
        ("[[group]]\ngrid = [1, 2]\n", "group 1: grid must be a table, got a list"),
        ("[[group]]\nfull = 3\n", "group 1: [full] must be a table, got an integer (3)"),
        ('[[group]]\ntiny = "small"\n', "group 1: [tiny] must be a table, got a string ('small')"),
        (
            "[[group]]\nfull = { options = 1 }\n",
            "group 1: [full] options must be a table, got an integer (1)",
        ),
        (
            "[[group]]\nfull = { grid = { batch-size = [] } }\n",
            "group 1: [full] grid 'batch-size' must be a non-empty list",
        ),
        (
            '[[group]]\ntiny = { grid = { batch-size = "64" } }\n',
            "group 1: [tiny] grid 'batch-size' must be a non-empty list",
        ),
        (
            "[[group]]\ntiny = { grid = { batch-size = 64 } }\n",
            "group 1: [tiny] grid 'batch-size' must be a non-empty list",
        ),
        (
            "[[group]]\nfull = { option = {} }\n",
            "group 1: [full] has unknown keys ['option']; it takes grid, options",
        ),
        (
            "[defaults]\noption = { epochs = 1 }\n[[group]]\n",
            "[defaults] has unknown keys ['option']; it takes command, full, options, tiny",
        ),
        ("[defaults]\noptions = 1\n[[group]]\n", "[defaults] options must be a table, got an integer (1)"),
        (
            "[defaults]\nfull = { option = { epochs = 1 } }\n[[group]]\n",
            "[defaults.full] has unknown keys ['option']; it takes grid, options",
        ),
        (
            "[defaults]\ntiny = { grid = { batch-size = 16 } }\n[[group]]\n",
            "[defaults.tiny] grid 'batch-size' must be a non-empty list",
        ),
        (
            "[[group]]\noptions = { model-opt = 5 }\n",
            "model-opt must be a table, KEY=VALUE or a list of those, got 5",
        ),
    ],
)
def test_a_table_of_the_wrong_type_is_one_line_not_a_traceback(tmp_path, monkeypatch, capsys, text, message):
    """Each of these raised AttributeError or TypeError from inside load_study: a traceback, exit 1
    (or a one-line "'int' object is not iterable"); a typo in [defaults] or its scale tables, and a
    grid in a group's [full] or [tiny], were not checked at all."""
    (tmp_path / "bad.toml").write_text(HEAD + text)
    monkeypatch.setattr(study, "studies_dir", lambda: tmp_path)
    assert main(["study", "bad", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.endswith(f"{message}\n") and err.count("\n") == 1


@pytest.mark.parametrize(
    "text, message",
    [
        ("[[group]]\nnote = 5\n", "group 1: note must be a string, got an integer (5)"),
        ("[[group]]\nlabel = 1\n", "group 1: label must be a string, got an integer (1)"),
        ("[[group]]\ncommand = 1\n", "group 1: command must be a string, got an integer (1)"),
        ('[defaults]\ncommand = ["train"]\n[[group]]\n', "[defaults] command must be a string, got a list"),
        ('[[group]]\ncluster = "false"\n', "group 1: cluster must be a boolean, got a string ('false')"),
        ("[[group]]\ntimelines = 1\n", "group 1: timelines must be a boolean, got an integer (1)"),
        ('[[group]]\ninherit = "no"\n', "group 1: inherit must be a boolean, got a string ('no')"),
        ('[[group]]\nscales = "full"\n', "group 1: scales must be a list, got a string ('full')"),
        ("[[group]]\nscales = [1]\n", "group 1: scales must be a list of strings, got 1 in it"),
        ("cluster_rate = 1\n[[group]]\n", "cluster_rate must be a string, got an integer (1)"),
        ('metrics = "comm_ms"\n[[group]]\n', "metrics must be a list, got a string ('comm_ms')"),
        ('plot = [["comm_ms"]]\n[[group]]\n', "plot must be a list of strings, got ['comm_ms'] in it"),
        (
            '[[group]]\nlabel = "a"\n[[group]]\nlabel = "a"\n',
            "study bad: two groups are labelled 'a' (the report gives each group its own table)",
        ),
        (
            'metrics = ["comm_ms"]\nplot = ["step_time_ms"]\n[[group]]\n',
            "study bad: plot 'step_time_ms' is not in metrics (a plot draws a metric's column)",
        ),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_before_any_run(tmp_path, monkeypatch, capsys, text, message):
    """These passed --dry-run: note = 5 ran every run and then failed the report, cluster = "false"
    was read as true, a repeated label merged two groups' tables, and a metric plotted but not in
    metrics drew an empty plot."""
    (tmp_path / "bad.toml").write_text(HEAD + text)
    monkeypatch.setattr(study, "studies_dir", lambda: tmp_path)
    assert main(["study", "bad", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.endswith(f"{message}\n") and err.count("\n") == 1


def test_a_group_s_own_options_outrank_the_study_s_full_scale_defaults(tmp_path):
    """000_backbones' DataParallel group set one rank and the full-scale defaults four: its four
    runs at --full planned --world-size 4, and each would have failed on its own."""
    (tmp_path / "scaled.toml").write_text(SCALED)
    runs = study.plan(study.load_study("scaled", tmp_path), "full", tmp_path / "out")
    words = [list(r.argv) for r in runs]
    assert [w[w.index("--world-size") + 1] for w in words] == ["1", "4"]
    assert all(w[w.index("--samples") + 1] == "512" for w in words)
    study.validate(runs)


def test_a_run_the_launch_would_refuse_is_refused_before_any_runs(tmp_path):
    (tmp_path / "scaled.toml").write_text(
        SCALED.replace('strategies = "none", world-size = 1', 'strategies = "none", world-size = 2')
    )
    runs = study.plan(study.load_study("scaled", tmp_path), "default", tmp_path / "out")
    with pytest.raises(ValueError, match="run 1 .*strategy none runs in one process"):
        study.validate(runs)


def test_a_one_process_run_without_a_world_size_is_one_rank_as_the_cli_runs_it(tmp_path):
    solo = 'title = "t"\nreference = "r"\nabout = "a"\n'
    solo += '[[group]]\noptions = { strategies = "none", model = "mlp" }\n'
    (tmp_path / "solo.toml").write_text(solo)
    study.validate(study.plan(study.load_study("solo", tmp_path), "default", tmp_path / "out")[:1])


def test_a_one_process_run_under_an_outer_launcher_of_one_is_checked_against_its_world(tmp_path, monkeypatch):
    """Under torchrun with one process, the runs join its world of 1 (commbench train --strategy
    none runs there); the check took the default world of 2 and refused the study. A world of 2
    is refused, named as the launcher's."""
    solo = 'title = "t"\nreference = "r"\nabout = "a"\n'
    solo += '[[group]]\noptions = { strategies = "none", model = "mlp" }\n'
    (tmp_path / "solo.toml").write_text(solo)
    runs = study.plan(study.load_study("solo", tmp_path), "default", tmp_path / "out")[:1]
    outer = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9"}
    for key, value in outer.items():
        monkeypatch.setenv(key, value)
    study.validate(runs)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="runs in one process, not on 3 ranks: start one process"):
        study.validate(runs)


def _outer_launcher(monkeypatch, rank: int, world: int) -> None:
    outer = {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9"}
    for key, value in outer.items():
        monkeypatch.setenv(key, value)


def test_under_an_outer_launcher_a_run_of_another_world_is_refused_before_any_runs(tmp_path, monkeypatch):
    """Study 004's run at --world-size 1 under torchrun's 2 processes passed the check, then failed
    in the run ('disagrees with the launcher's world'), and both ranks wrote a report of it."""
    runs = study.plan(study.load_study("004_batch_scaling"), "tiny", tmp_path / "out")
    _outer_launcher(monkeypatch, 0, 2)
    with pytest.raises(ValueError, match="run 1 .*--world-size 1 disagrees with the launcher's world of 2"):
        study.validate(runs)


def test_under_an_outer_launcher_rank_0_alone_writes_the_study(tmp_path, monkeypatch, capsys):
    """Every rank of torchrun's wrote report.md, report.html, the plots and progress.jsonl, over
    one another; the others run the runs (they are ranks of each) and write nothing of their own."""
    started, execute = _counting({})
    _outer_launcher(monkeypatch, 1, 2)
    config = study.StudyConfig(
        name="001_sync_strategies", scale="tiny", out_dir=str(tmp_path / "s"), quiet=True
    )
    result = study.run_study(config, execute=execute)
    assert len(started) == 1 and [o.returncode for o in result.outcomes] == [0] and result.report is None
    assert not (tmp_path / "s").exists()
    with pytest.raises(ValueError, match="--resume under torchrun or SLURM"):
        study.run_study(dataclasses.replace(config, resume=True), execute=execute)
    assert len(started) == 1
    args = build_parser().parse_args(["study", "001_sync_strategies", "--tiny", "-o", str(tmp_path / "s")])
    monkeypatch.setattr(study, "run_study", lambda *a, **k: result)
    assert study.run(args) == 0
    assert capsys.readouterr().out == "rank 0 writes the report (this is rank 1)\n"


def test_unknown_study_lists_the_known_ones(capsys):
    assert main(["study", "no-such-study"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(n in err for n in NAMES)


@pytest.mark.parametrize("form", ["absolute", "relative", "suffix"])
def test_a_study_is_named_by_its_stem_not_by_a_path(tmp_path, capsys, form):
    """A path read the TOML file it named outside studies/, and wrote to study-/tmp/...; it is an
    unknown study now, as a stem with .toml is."""
    (tmp_path / "mine.toml").write_text((study.studies_dir() / f"{NAMES[0]}.toml").read_text())
    name = {
        "absolute": str(tmp_path / "mine"),
        "relative": os.path.relpath(tmp_path / "mine", study.studies_dir()),
        "suffix": f"{NAMES[0]}.toml",
    }[form]
    assert main(["study", name, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"unknown study {name!r}" in err, err


def test_list(capsys):
    assert main(["study", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(n in out for n in NAMES)


def test_list_names_a_study_file_it_cannot_load_and_lists_the_others(tmp_path, monkeypatch, capsys):
    """One malformed file in studies/ ended --list in a traceback (or a lone error), listing none."""
    (tmp_path / "a_good.toml").write_text(HEAD + "[[group]]\n")
    (tmp_path / "b_bad.toml").write_text(HEAD + "defaults = 1\n[[group]]\n")
    (tmp_path / "c_good.toml").write_text(HEAD + "[[group]]\n")
    monkeypatch.setattr(study, "studies_dir", lambda: tmp_path)
    assert main(["study", "--list"]) == 2
    captured = capsys.readouterr()
    assert [line.split()[0] for line in captured.out.splitlines()] == ["a_good", "c_good"]
    assert (
        captured.err
        == f"commbench: error: {tmp_path / 'b_bad.toml'}: [defaults] must be a table, got an integer (1)\n"
    )


# The sync-strategy and batch-scaling studies' runs in `make test`, the other three in `make test-slow`
# (about 15 s here: CI's ten minutes); their configurations are loaded and checked above in both.
TINY_IN_MAKE_TEST = ("001_sync_strategies", "004_batch_scaling")


@pytest.mark.parametrize(
    "name", [n if n in TINY_IN_MAKE_TEST else pytest.param(n, marks=pytest.mark.slow) for n in NAMES]
)
def test_tiny_run_writes_the_report(name, tmp_path):
    config = study.StudyConfig(name=name, scale="tiny", out_dir=str(tmp_path / name), quiet=True)
    result = study.run_study(config)
    outcomes, md = result.outcomes, result.report
    assert [o.returncode for o in outcomes] == [0] and result.stopped is None
    # Each run's records name its own command, not the study's (the runs share this process).
    header = json.loads(Path(outcomes[0].planned.json_path).read_text().splitlines()[0])
    assert header["command"] == shlex.join(["commbench", *outcomes[0].argv])
    text = md.read_text()
    assert f"# Study {name}" in text and "## Results" in text and "FAILED" not in text
    assert f"Reference: {study.load_study(name).reference}. Scale: tiny." in text
    group = outcomes[0].planned.group
    assert f"### {group}" in text
    section = text[text.index(f"### {group}") :]
    section = section[: section.index("\n## ")] if "\n## " in section else section  # to the next part
    assert "|---|" in section  # the group's table
    assert (md.parent / "report.html").exists()
    for line in text.splitlines():
        if line.startswith("!["):
            assert (md.parent / line[line.index("](") + 2 : -1]).exists()


def _counting(codes: dict[int, int]):
    """An execute that records each command line and returns ``codes[call]`` (0 for the others)."""
    started: list[list[str]] = []

    def execute(argv: list[str]) -> int:
        started.append(argv)
        return codes.get(len(started), 0)

    return started, execute


def test_a_directory_where_the_report_goes_is_refused_before_any_run(tmp_path):
    """The study ran every run, then ended with exit 1 where it wrote the report."""
    config = study.StudyConfig(name="000_backbones", out_dir=str(tmp_path / "st"), quiet=True)
    (tmp_path / "st" / "report.html").mkdir(parents=True)
    started, execute = _counting({})
    with pytest.raises(ValueError, match="report.html is a directory, where the study's report would be"):
        study.run_study(config, execute=execute)
    assert started == []


@pytest.mark.parametrize("code", [130, 143, 129])  # Ctrl-C, SIGTERM, a closed terminal (SIGHUP)
def test_an_interrupted_run_stops_the_study(tmp_path, code):
    config = study.StudyConfig(name="000_backbones", out_dir=str(tmp_path / "st"), quiet=True)
    started, execute = _counting({2: code})
    result = study.run_study(config, execute=execute)
    assert len(started) == 2  # the third run never started
    assert [o.returncode for o in result.outcomes] == [0] and result.stopped == code
    assert result.report == tmp_path / "st" / "report.md"


@pytest.mark.parametrize("code", [143, 129])
def test_an_interrupted_cluster_run_is_not_retried_on_local_ranks(tmp_path, monkeypatch, code):
    monkeypatch.setattr(study, "cluster_available", lambda: None)
    config = study.StudyConfig(name="001_sync_strategies", out_dir=str(tmp_path / "st"))
    started, execute = _counting({1: code})
    result = study.run_study(config, execute=execute)
    assert [a[0] for a in started] == ["cluster"] and result.stopped == code and not result.outcomes


def test_a_cluster_that_could_not_be_built_runs_on_local_ranks_beside_what_it_wrote(tmp_path, monkeypatch):
    """The run on local ranks wrote to the same file, and what the cluster had written was lost."""
    monkeypatch.setattr(study, "cluster_available", lambda: None)
    config = study.StudyConfig(name="001_sync_strategies", out_dir=str(tmp_path / "st"), quiet=True)
    started: list[list[str]] = []

    def execute(argv: list[str]) -> int:
        started.append(argv)
        if len(started) == 3:
            return 130
        path = Path(argv[argv.index("--json") + 1])
        path.write_text(json.dumps({"type": "probe", "by": argv[0]}) + "\n")
        if argv[0] == "cluster":
            print("commbench: cluster: tc qdisc add: RTNETLINK answers: No such device", file=sys.stderr)
            return cluster.NOT_BUILT
        return 0

    result = study.run_study(config, execute=execute)
    assert [a[0] for a in started] == ["cluster", "compare", "cluster"]
    (outcome,) = result.outcomes
    records = Path(outcome.planned.json_path)
    aside = records.with_name(records.stem + ".cluster-failed.jsonl")
    assert (
        json.loads(records.read_text())["by"] == "compare"
        and json.loads(aside.read_text())["by"] == "cluster"
    )
    assert outcome.note == (
        "local ranks: the emulated cluster could not be built (commbench: cluster: tc qdisc add: RTNETLINK "
        f"answers: No such device); its records are in runs/{aside.name}"
    )


def test_records_an_earlier_start_left_are_not_taken_for_a_failed_cluster_s(tmp_path, monkeypatch):
    monkeypatch.setattr(study, "cluster_available", lambda: None)
    config = study.StudyConfig(name="001_sync_strategies", out_dir=str(tmp_path / "st"), quiet=True)
    _, execute = _writing({2: 130})
    (done,) = study.run_study(config, execute=execute).outcomes  # start 1: the cluster ran it
    started: list[list[str]] = []

    def execute(argv: list[str]) -> int:
        started.append(argv)
        return cluster.NOT_BUILT if argv[0] == "cluster" else 130

    assert study.run_study(config, execute=execute).stopped == 130
    assert [a[0] for a in started] == ["cluster", "compare"]
    assert list(Path(done.planned.json_path).parent.glob("*.cluster-failed.jsonl")) == []


def test_a_cluster_run_that_failed_is_a_failure_not_a_local_rerun(tmp_path, monkeypatch):
    """A rank that died on the cluster (or ended in SIGABRT after its work) was re-run on local
    ranks, whose loopback figures then stood in the cluster's group, and the study exited 0."""
    monkeypatch.setattr(study, "cluster_available", lambda: None)
    config = study.StudyConfig(name="001_sync_strategies", out_dir=str(tmp_path / "st"), quiet=True)
    started: list[list[str]] = []

    def execute(argv: list[str]) -> int:
        started.append(argv)
        if len(started) == 2:
            return 130
        print("commbench: rank 1 failed: killed by SIGKILL", file=sys.stderr)
        return 1

    result = study.run_study(config, execute=execute)
    assert [a[0] for a in started] == ["cluster", "cluster"]
    (outcome,) = result.outcomes
    assert outcome.returncode == 1 and outcome.error == "commbench: rank 1 failed: killed by SIGKILL"
    assert "FAILED: run 1 exited with 1 (commbench: rank 1 failed: killed by SIGKILL): cluster --hosts" in (
        result.report.read_text()
    )


def test_a_quiet_study_makes_its_cluster_runs_quiet_too(tmp_path, monkeypatch):
    """-q went to every run but the cluster's, whose command then printed its tables."""
    monkeypatch.setattr(study, "cluster_available", lambda: None)
    config = study.StudyConfig(name="001_sync_strategies", out_dir=str(tmp_path / "st"), quiet=True)
    started, execute = _counting({1: 130})
    study.run_study(config, execute=execute)
    (argv,) = started
    assert argv[0] == "cluster" and argv[-1] == "-q" and argv.index("--") < len(argv) - 1


def test_study_command_returns_the_interrupted_code(tmp_path, monkeypatch, capsys):
    started, execute = _counting({1: 130})
    monkeypatch.setattr("commbench.bench.cli.main", execute)  # the runs; study.run is called directly
    args = build_parser().parse_args(["study", "000_backbones", "-q", "-o", str(tmp_path / "st")])
    assert study.run(args) == 130 and len(started) == 1
    captured = capsys.readouterr()
    assert "report:" not in captured.out
    # the run's own line named only its own file: now the partial report, and how to go on
    total = len(study.plan(study.load_study("000_backbones"), "default", tmp_path / "st"))
    assert captured.err.strip().endswith(
        f"stopped with 0 of {total} run(s) finished; partial report: {tmp_path / 'st' / 'report.md'}; "
        "--resume runs the rest"
    )


def _writing(codes: dict[int, int]):
    """An execute that records each command line, returns ``codes[call]`` (0 for the others) and,
    for 0, leaves a small but valid record file at the run's --json path."""
    started: list[list[str]] = []

    def execute(argv: list[str]) -> int:
        started.append(argv)
        code = codes.get(len(started), 0)
        if code == 0:
            record = {"type": "bandwidth", "name": "copy", "size_bytes": 8, "time_s": 1.0, "gbps": 8e-9}
            Path(argv[argv.index("--json") + 1]).write_text(json.dumps(record) + "\n")
        return code

    return started, execute


def _runs_table(text: str) -> list[list[str]]:
    section = text[text.index("## Runs") :].splitlines()
    return [[c.strip() for c in line.strip("|").split("|")] for line in section if line.startswith("| ")][1:]


def test_an_interrupted_study_writes_a_partial_report_and_resume_runs_only_the_rest(tmp_path):
    config = study.StudyConfig(name="000_backbones", out_dir=str(tmp_path / "st"), quiet=True)
    started, execute = _writing({3: 130})
    first = study.run_study(config, execute=execute)
    total = len(first.planned)
    assert first.stopped == 130 and [o.planned.index for o in first.outcomes] == [1, 2] and total > 3
    text = first.report.read_text()
    assert text.startswith("# Study 000_backbones: ") and "(partial)" in text.splitlines()[0]
    assert f"stopped (SIGINT) with 2 of {total} runs done" in text and "--resume` runs the other" in text
    rows = _runs_table(text)
    assert [r[3] for r in rows] == ["0", "0"] + ["not run"] * (total - 2)

    again_started, again_execute = _writing({})
    again = study.run_study(dataclasses.replace(config, resume=True), execute=again_execute)
    assert again_started == [[*p.argv, "-q"] for p in first.planned[2:]]  # the interrupted one, and on
    assert again.stopped is None and [o.resumed for o in again.outcomes] == [True, True] + [False] * (
        total - 2
    )
    text = again.report.read_text()
    assert "(partial)" not in text and "not run" not in text and "Resumed: 2 of these runs" in text

    once_more, execute = _writing({})
    study.run_study(config, execute=execute)  # without --resume every run starts again
    assert len(once_more) == total


def test_resume_runs_again_what_failed_changed_or_lost_its_records(tmp_path):
    config = study.StudyConfig(name="000_backbones", out_dir=str(tmp_path / "st"), quiet=True)
    _, execute = _writing({2: 1, 6: 130})
    first = study.run_study(config, execute=execute)
    assert [o.returncode for o in first.outcomes] == [0, 1, 0, 0, 0]
    progress = tmp_path / "st" / "runs" / study.PROGRESS
    lines = progress.read_text().splitlines()
    assert len(lines) == 5
    entry = json.loads(lines[2])
    entry["planned"] = [*entry["planned"], "--epochs", "9"]  # run 3 was planned otherwise then
    lines[2] = json.dumps(entry)
    lines[4] = lines[4][: len(lines[4]) // 2]  # run 5's line, cut short by a crash
    progress.write_text("\n".join(lines))
    Path(first.outcomes[0].planned.json_path).unlink()  # run 1's records are gone
    started, execute = _writing({6: 130})
    result = study.run_study(dataclasses.replace(config, resume=True), execute=execute)
    ran = [a[a.index("--json") + 1] for a in started]
    assert ran == [first.planned[i].json_path for i in (0, 1, 2, 4, 5, 6)]  # run 4 alone is kept
    assert [(o.planned.index, o.resumed) for o in result.outcomes] == [
        (1, False),
        (2, False),
        (3, False),
        (4, True),
        (5, False),
        (6, False),
    ]


def test_resume_runs_again_a_run_whose_records_are_not_the_ones_it_wrote(tmp_path):
    """Records that still loaded were kept: a file cut short (its run's summary gone), or another
    run's copied over it, went into the report as that run's."""
    config = study.StudyConfig(name="000_backbones", out_dir=str(tmp_path / "st"), quiet=True)
    _, execute = _writing({})
    first = study.run_study(config, execute=execute)
    second = Path(first.planned[1].json_path)
    extra = {"type": "bandwidth", "name": "copy", "size_bytes": 16, "time_s": 1.0, "gbps": 1.6e-8}
    second.write_text(second.read_text() + json.dumps(extra) + "\n")  # still loads, not the run's
    started, execute = _writing({})
    study.run_study(dataclasses.replace(config, resume=True), execute=execute)
    assert [a[a.index("--json") + 1] for a in started] == [str(second)]


def test_resume_at_another_scale_keeps_the_first_scale_s_runs_for_its_own_resume(tmp_path):
    """Only the lines of the plan being resumed were written back: a --tiny --resume in the same
    directory dropped the default scale's, and its next --resume ran every run again."""
    config = study.StudyConfig(name="000_backbones", out_dir=str(tmp_path / "st"), quiet=True)

    def writing_its_own() -> tuple[list[list[str]], Callable[[list[str]], int]]:
        started, execute = _writing({})

        def execute_own(argv: list[str]) -> int:  # records that differ with the command line
            code = execute(argv)
            path = Path(argv[argv.index("--json") + 1])
            record = json.loads(path.read_text())
            path.write_text(json.dumps({**record, "size_bytes": len(shlex.join(argv))}) + "\n")
            return code

        return started, execute_own

    _, execute = writing_its_own()
    first = study.run_study(config, execute=execute)
    tiny_started, execute = writing_its_own()
    study.run_study(dataclasses.replace(config, scale="tiny"), execute=execute)  # not even --resume
    assert [Path(a[a.index("--json") + 1]).name[:8] for a in tiny_started] == ["tiny-01-"]
    started, execute = writing_its_own()
    again = study.run_study(dataclasses.replace(config, resume=True), execute=execute)
    assert started == [] and all(o.resumed for o in again.outcomes)
    assert len(again.outcomes) == len(first.planned)


def _grid_of(axes: int, points: int) -> str:
    return "[[group]]\ngrid = { " + ", ".join(f"a{i} = {list(range(points))}" for i in range(axes)) + " }\n"


@pytest.mark.parametrize(
    "text, needle",
    [
        (
            "[[group]]\noptions = { help = true }\n",
            "it prints the command's help (or version) and runs nothing",
        ),
        ('[[group]]\noptions = { plot = "../out.png" }\n', "--plot is the study's to set"),
        ('[[group]]\ncommand = "sweep"\noptions = { csv = "/tmp/x.csv" }\n', "--csv is the study's to set"),
        (
            _grid_of(4, 100),
            "study bad plans more than 10000 runs (group 'group 1''s grid alone has 100000000)",
        ),
        (  # the second group's grid is below the limit: it is the sum that passes it
            _grid_of(1, 6000) + _grid_of(1, 5000),
            "study bad plans more than 10000 runs (group 'group 2''s grid adds 5000 to the 6000 before it)",
        ),
    ],
)
def test_options_that_run_nothing_write_elsewhere_or_never_end_are_refused(
    tmp_path, monkeypatch, capsys, text, needle
):
    """help printed its text and the study ended with exit 0; plot and csv sent every run to one
    file outside the study's directory; a grid of 10^8 points was planned for ever."""
    (tmp_path / "bad.toml").write_text(HEAD + text)
    monkeypatch.setattr(study, "studies_dir", lambda: tmp_path)
    assert main(["study", "bad", "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert needle in captured.err and captured.err.count("\n") == 1 and captured.out == ""


def test_study_resume_on_the_command_line_says_what_it_kept(tmp_path, monkeypatch, capsys):
    argv = ["study", "000_backbones", "-q", "-o", str(tmp_path / "st")]
    started, execute = _writing({2: 130})
    monkeypatch.setattr("commbench.bench.cli.main", execute)
    assert study.run(build_parser().parse_args(argv)) == 130
    capsys.readouterr()
    started, execute = _writing({2: 143})
    monkeypatch.setattr("commbench.bench.cli.main", execute)
    assert study.run(build_parser().parse_args([*argv, "--resume"])) == 143
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("== study 000_backbones [1/") and out[0].endswith(": kept from an earlier start")
    assert [line.split("]")[0] for line in out[1:]] == [
        "== study 000_backbones [2/11",
        "== study 000_backbones [3/11",
    ]
    assert [Path(a[a.index("--json") + 1]).name for a in started] == [
        "02-backbone.jsonl",
        "03-backbone.jsonl",
    ]


def test_a_resumed_start_that_is_stopped_again_keeps_what_the_first_finished(tmp_path):
    """progress.jsonl was written anew by each start, and a kept run only as the loop reached it:
    stopped at its second run, a resumed start left one line of ten, and the next re-ran nine."""
    config = study.StudyConfig(name="000_backbones", out_dir=str(tmp_path / "st"), quiet=True)
    _, execute = _writing({2: 1})
    first = study.run_study(config, execute=execute)
    total = len(first.planned)
    assert [o.returncode for o in first.outcomes] == [0, 1] + [0] * (total - 2)
    resume = dataclasses.replace(config, resume=True)
    _, execute = _writing({1: 130})  # run 2, run again, is stopped
    second = study.run_study(resume, execute=execute)
    assert second.stopped == 130 and len(second.outcomes) == total - 1
    assert f"with {total - 1} of {total} runs done" in second.report.read_text()
    started, execute = _writing({})
    study.run_study(resume, execute=execute)
    assert [Path(a[a.index("--json") + 1]).name for a in started] == [Path(first.planned[1].json_path).name]


def test_resume_keeps_the_runs_of_a_directory_however_it_is_spelled(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, execute = _writing({3: 130})
    study.run_study(study.StudyConfig(name="000_backbones", out_dir="st", quiet=True), execute=execute)
    started, execute = _writing({1: 130})
    again = study.StudyConfig(name="000_backbones", out_dir=str(tmp_path / "st"), quiet=True, resume=True)
    result = study.run_study(again, execute=execute)
    assert [o.planned.index for o in result.outcomes] == [1, 2] and len(started) == 1


def test_a_resumed_study_with_nothing_left_to_run_stops_cleanly_while_it_reports(tmp_path, monkeypatch):
    """With every run kept no run's handlers were ever set: a SIGTERM while the report was
    written killed the study outright, and a Ctrl-C gave a traceback."""
    config = study.StudyConfig(
        name="004_batch_scaling", scale="tiny", out_dir=str(tmp_path / "st"), quiet=True
    )
    _, execute = _writing({})
    assert study.run_study(config, execute=execute).stopped is None
    write = study.write_study_report

    def stopped_while_writing(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return write(*args, **kwargs)

    monkeypatch.setattr(study, "write_study_report", stopped_while_writing)
    started, execute = _writing({})
    result = study.run_study(dataclasses.replace(config, resume=True), execute=execute)
    assert started == [] and result.stopped == 128 + signal.SIGTERM and result.report is None
    assert [o.resumed for o in result.outcomes] == [True]


def test_resume_without_an_earlier_start_runs_everything(tmp_path):
    config = study.StudyConfig(name="000_backbones", out_dir=str(tmp_path / "st"), quiet=True, resume=True)
    started, execute = _writing({2: 130})
    assert study.run_study(config, execute=execute).stopped == 130 and len(started) == 2


def test_a_failed_run_s_error_line_is_in_the_report(tmp_path, capsys):
    def execute(argv: list[str]) -> int:
        print("a warning\ncommbench: error: world size must be >= 1, got 0", file=sys.stderr)
        print("later noise", file=sys.stderr, end="")
        return 2

    config = study.StudyConfig(name="004_batch_scaling", scale="tiny", out_dir=str(tmp_path / "st"))
    result = study.run_study(config, execute=execute)
    assert [o.error for o in result.outcomes] == ["commbench: error: world size must be >= 1, got 0"]
    text = result.report.read_text()
    assert "FAILED: run 1 exited with 2 (commbench: error: world size must be >= 1, got 0): " in text
    assert "commbench: error: world size" in capsys.readouterr().err  # still shown as it happened


def test_a_failed_run_without_a_commbench_line_gives_its_last_line(tmp_path):
    def execute(argv: list[str]) -> int:
        sys.stderr.write("progress 10%\rprogress 50%\rKilled\n\n")
        return 137

    config = study.StudyConfig(name="004_batch_scaling", scale="tiny", out_dir=str(tmp_path / "st"))
    (outcome,) = study.run_study(config, execute=execute).outcomes
    assert outcome.error == "Killed" and outcome.returncode == 137


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["term", "hup"])
@pytest.mark.parametrize("where", ["in a run", "between runs"])
def test_a_signal_between_runs_stops_the_study(tmp_path, where, signum):
    """A signal that no run's CLI turns into an exit code: inside a run that lets it through, or
    after one run ended and before the next began (``on_run`` is called there)."""

    def fail(got, frame):
        raise AssertionError(f"signal {got} reached the test's own handler")

    def execute(argv: list[str]) -> int:
        started.append(argv)
        if where == "in a run":
            os.kill(os.getpid(), signum)  # lands in the study's code, not in a run's CLI
        return 0

    def on_run(planned, total) -> None:
        if where == "between runs" and started:
            os.kill(os.getpid(), signum)

    started: list[list[str]] = []
    before = signal.signal(signum, fail)
    try:
        config = study.StudyConfig(name="000_backbones", out_dir=str(tmp_path / "st"))
        result = study.run_study(config, execute=execute, on_run=on_run)
        assert result.stopped == 128 + signum and len(started) == 1
        assert len(result.outcomes) == (1 if where == "between runs" else 0)
        assert "(partial)" in result.report.read_text()
        assert signal.getsignal(signum) is fail  # the old handler is back
    finally:
        signal.signal(signum, before)


@pytest.mark.parametrize("out", ["/proc/commbench-x", "/etc/passwd", "/dev/null"])
def test_unwritable_output_is_one_line_before_any_run(out, capsys):
    assert main(["study", "000_backbones", "--tiny", "-q", "-o", out]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "cannot create" in captured.err and out in captured.err
    assert "== study" not in captured.out


@pytest.mark.parametrize("out", ["/etc/passwd", "/dev/null", "/etc/passwd/deeper"])
def test_a_dry_run_refuses_the_output_the_run_would_refuse(out, capsys):
    """The plan printed, exit 0, for a directory the study could never make."""
    assert main(["study", "000_backbones", "--tiny", "--dry-run", "-o", out]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"commbench: error: cannot create {out}/runs: Not a directory\n"
    assert captured.out == ""


def test_a_dry_run_into_a_new_directory_makes_nothing(tmp_path, capsys):
    out = tmp_path / "new" / "deeper"
    assert main(["study", "000_backbones", "--tiny", "--dry-run", "-o", str(out)]) == 0
    assert f"--json {out}/runs/" in capsys.readouterr().out and not (tmp_path / "new").exists()


def test_list_takes_no_study_name(capsys):
    assert main(["study", "--list", "000_backbones"]) == 2
    captured = capsys.readouterr()
    assert (
        captured.err == "commbench: error: --list lists every study; it takes no name (got '000_backbones')\n"
    )
    assert captured.out == ""


@pytest.mark.parametrize("name", ["000_backbones", "002_memory_utilisation"])
def test_full_scale_on_cuda_without_cuda_is_refused_before_any_run(name, tmp_path, monkeypatch, capsys):
    """Each run used to fail alone with the same message (21 of them for 000_backbones)."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("commbench.bench.cli.main", lambda argv: pytest.fail(f"a run started: {argv}"))
    planned = study.plan(study.load_study(name), "full", tmp_path / "st")
    on_cuda = [p for p in planned if "--device" in p.argv and p.argv[p.argv.index("--device") + 1] == "cuda"]
    assert on_cuda
    assert main(["study", name, "--full", "-q", "-o", str(tmp_path / "st")]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"commbench: error: {len(on_cuda)} of the {len(planned)} runs of this study at --full use "
        "--device cuda, and CUDA is not available here (--dry-run lists the runs)\n"
    )
    assert not (tmp_path / "st").exists()


def test_full_scale_on_cuda_runs_where_cuda_is_seen(tmp_path, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    started, execute = _counting({1: 130})
    config = study.StudyConfig(name="000_backbones", scale="full", out_dir=str(tmp_path / "st"))
    result = study.run_study(config, execute=execute)
    assert len(started) == 1 and started[0][started[0].index("--device") + 1] == "cuda"
    assert result.stopped == 130


def test_a_cpu_study_at_full_scale_is_not_refused_without_cuda(tmp_path, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr(study, "cluster_available", lambda: "no emulated cluster in this test")
    started, execute = _counting({1: 130})
    config = study.StudyConfig(name="001_sync_strategies", scale="full", out_dir=str(tmp_path / "st"))
    result = study.run_study(config, execute=execute)
    assert len(started) == 1 and "--device" not in started[0] and result.stopped == 130


def test_bytes_per_epoch_are_for_a_whole_pass_over_the_training_set():
    """000_backbones runs four steps an epoch: as run, every batch size showed the same bytes."""
    gradient, wire = study.METRICS["grad_mb_per_epoch"][2], study.METRICS["wire_mb_per_rank_per_epoch"][2]
    summary = {
        "syncs_per_epoch": 4,
        "samples": 1024,
        "grad_bytes_per_epoch": 4_000_000,
        "wire_bytes_per_rank_per_epoch": [8_000_000, 6_000_000],
    }
    small, large = {**summary, "global_batch": 32}, {**summary, "global_batch": 128}
    assert gradient(None, small) == pytest.approx(32.0) and gradient(None, large) == pytest.approx(8.0)
    assert wire(None, small) == pytest.approx(64.0)
    assert gradient(None, {k: v for k, v in small.items() if k != "samples"}) == pytest.approx(4.0)
    # A whole pass is the loader's steps: 1000 samples at a global batch of 128 make 7, not 8.
    assert gradient(None, {**large, "samples": 1000}) == pytest.approx(7.0)


def test_gradient_rate_is_not_shown_where_nothing_moved():
    rate = study.METRICS["grad_gbps"][2]
    one = {"wire_bytes_per_rank_per_epoch": [0], "comm_ms": 0.5, "syncs_per_epoch": 4}
    assert rate(None, one) is None  # was 0.000 at one rank
    two = {**one, "wire_bytes_per_rank_per_epoch": [4_000_000, 4_000_000]}
    assert rate(None, two) == pytest.approx(4_000_000 / 4 / 0.5e-3 / 1e9)


def _progress_indices(out: Path) -> list[int]:
    return [json.loads(line)["index"] for line in (out / "runs" / study.PROGRESS).read_text().splitlines()]


def test_a_stop_before_the_study_s_handlers_are_set_leaves_the_earlier_progress(tmp_path, monkeypatch):
    """progress.jsonl was emptied before the handlers were set (torch's elastic module is imported
    first): a signal there, on --resume, lost every finished run, and the next --resume re-ran them."""
    config = study.StudyConfig(name="000_backbones", out_dir=str(tmp_path / "st"), quiet=True)
    _, execute = _writing({3: 130})
    study.run_study(config, execute=execute)
    assert _progress_indices(tmp_path / "st") == [1, 2]
    handlers = study._signals_interrupt

    def stopped_first():
        os.kill(os.getpid(), signal.SIGINT)  # Python's own handler yet: KeyboardInterrupt
        return handlers()

    monkeypatch.setattr(study, "_signals_interrupt", stopped_first)
    started, execute = _writing({})
    with pytest.raises(KeyboardInterrupt):
        study.run_study(dataclasses.replace(config, resume=True), execute=execute)
    assert started == [] and _progress_indices(tmp_path / "st") == [1, 2]


def test_a_stop_while_progress_is_rewritten_is_a_stop_that_keeps_it(tmp_path, monkeypatch):
    """The kept runs' lines were written outside the loop's try: a SIGTERM there escaped run_study
    as an exception, with progress.jsonl emptied."""
    config = study.StudyConfig(name="000_backbones", out_dir=str(tmp_path / "st"), quiet=True)
    _, execute = _writing({3: 130})
    study.run_study(config, execute=execute)
    line = study._progress_line

    def stopped_while_rewriting(o, out):
        os.kill(os.getpid(), signal.SIGTERM)
        return line(o, out)

    monkeypatch.setattr(study, "_progress_line", stopped_while_rewriting)
    started, execute = _writing({})
    result = study.run_study(dataclasses.replace(config, resume=True), execute=execute)
    assert started == [] and result.stopped == 128 + signal.SIGTERM
    assert [o.planned.index for o in result.outcomes] == [1, 2] and "(partial)" in result.report.read_text()
    assert _progress_indices(tmp_path / "st") == [1, 2]
    assert sorted(p.name for p in (tmp_path / "st" / "runs").iterdir() if "progress" in p.name) == [
        study.PROGRESS
    ]


def test_a_stop_while_a_finished_run_is_recorded_waits_until_it_is_kept(tmp_path, monkeypatch):
    """A run was added to the report's runs before its progress line: a stop in between gave a
    partial report that kept it, and a --resume that ran it again. Then a stop there lost the run
    from both; now it waits until the run is in both."""
    line = study._progress_line

    def stopped_while_recording(o, out):
        if o.planned.index == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return line(o, out)

    monkeypatch.setattr(study, "_progress_line", stopped_while_recording)
    config = study.StudyConfig(name="000_backbones", out_dir=str(tmp_path / "st"), quiet=True)
    _, execute = _writing({})
    result = study.run_study(config, execute=execute)
    assert result.stopped == 128 + signal.SIGTERM
    assert [o.planned.index for o in result.outcomes] == _progress_indices(tmp_path / "st") == [1, 2]


@pytest.mark.parametrize("where", ["in a run", "between runs"])
def test_a_second_signal_does_not_cut_the_partial_report(tmp_path, monkeypatch, where):
    """Stopped by a run's exit code (130), the study kept its handlers: a second Ctrl-C while the
    partial report was written lost the report. Stopped between runs it was ignored already."""
    write = study.write_study_report

    def stopped_again_while_writing(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return write(*args, **kwargs)

    def on_run(planned, total) -> None:
        if where == "between runs" and planned.index == 2:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(study, "write_study_report", stopped_again_while_writing)
    config = study.StudyConfig(name="000_backbones", out_dir=str(tmp_path / "st"), quiet=True)
    _, execute = _writing({2: 130} if where == "in a run" else {})
    result = study.run_study(config, execute=execute, on_run=on_run)
    assert result.stopped == 130 and [o.planned.index for o in result.outcomes] == [1]
    assert result.report is not None and "(partial)" in result.report.read_text()


def test_a_handler_set_outside_python_is_left_as_it_cannot_be_put_back(tmp_path, monkeypatch):
    """signal.getsignal gives None for a handler that C code set; putting it back as None raised
    TypeError as the study ended, after every run (signals.handled skips it already)."""
    getsignal = signal.getsignal
    monkeypatch.setattr(signal, "getsignal", lambda s: None if s == signal.SIGHUP else getsignal(s))
    before = getsignal(signal.SIGHUP)
    try:
        config = study.StudyConfig(
            name="004_batch_scaling", scale="tiny", out_dir=str(tmp_path / "st"), quiet=True
        )
        _, execute = _writing({})
        result = study.run_study(config, execute=execute)
        assert result.stopped is None and result.report is not None
    finally:
        signal.signal(signal.SIGHUP, before)


PLOTTED = """title = "t"
reference = "r"
about = "a"
metrics = ["step_time_ms"]
plot = ["step_time_ms"]
[defaults]
options = { strategies = "ddp", model = "mlp", world-size = 2 }
[[group]]
label = "sizes"
grid = { batch-size = [16, 32] }
"""


def _summaries(**fields):
    """An execute that writes one train_summary record (with ``fields``) at each run's --json path."""

    def execute(argv: list[str]) -> int:
        record = {"type": "train_summary", "strategy": "ddp", "world_size": 2, "step_time_ms": 5.0}
        record |= {"images_per_s": 100.0, **fields}
        Path(argv[argv.index("--json") + 1]).write_text(json.dumps(record) + "\n")
        return 0

    return execute


def test_a_stop_while_the_report_draws_a_plot_stops_the_study(tmp_path, monkeypatch):
    """The report took the Interrupted a SIGTERM raised in a plot for a failed plot: the study
    exited 0 with a complete report and a note where the plot was."""
    from commbench.bench import report

    (tmp_path / "plotted.toml").write_text(PLOTTED)
    monkeypatch.setattr(study, "studies_dir", lambda: tmp_path)
    monkeypatch.setattr(report, "plot_grouped", lambda *a: os.kill(os.getpid(), signal.SIGTERM))
    config = study.StudyConfig(name="plotted", out_dir=str(tmp_path / "st"), quiet=True)
    result = study.run_study(config, execute=_summaries())
    assert result.stopped == 128 + signal.SIGTERM and result.report is None
    assert len(result.outcomes) == 2 and _progress_indices(tmp_path / "st") == [1, 2]


@pytest.mark.parametrize("flags", [["--dry-run"], ["-q"]])
def test_a_study_with_no_runs_at_its_scale_is_refused(tmp_path, monkeypatch, capsys, flags):
    """It printed nothing and exited 0, or wrote an empty report and exited 0."""
    (tmp_path / "gpu.toml").write_text(HEAD + '[[group]]\nscales = ["full"]\n')
    monkeypatch.setattr(study, "studies_dir", lambda: tmp_path)
    monkeypatch.setattr("commbench.bench.cli.main", lambda argv: pytest.fail(f"a run started: {argv}"))
    args = build_parser().parse_args(["study", "gpu", *flags, "-o", str(tmp_path / "st")])
    with pytest.raises(
        ValueError, match=r"^study gpu has no runs at the default scale \(its groups' scales: full\)$"
    ):
        study.run(args)
    assert main(["study", "gpu", "--tiny", *flags, "-o", str(tmp_path / "st")]) == 2
    err = capsys.readouterr().err
    assert err == "commbench: error: study gpu has no runs at --tiny (its groups' scales: full)\n"
    assert not (tmp_path / "st").exists()


def test_a_summary_from_an_older_commbench_shows_what_it_lacks_as_a_dash(tmp_path, monkeypatch):
    """--resume keeps records that hold only the fields load_run checks; every metric that read a
    later field by name ended the report in a KeyError traceback."""
    every = json.dumps([m for m in study.METRICS])
    (tmp_path / "old.toml").write_text(PLOTTED.replace('metrics = ["step_time_ms"]', f"metrics = {every}"))
    monkeypatch.setattr(study, "studies_dir", lambda: tmp_path)
    config = study.StudyConfig(name="old", out_dir=str(tmp_path / "st"), quiet=True)
    result = study.run_study(config, execute=_summaries())
    text = result.report.read_text()
    assert result.stopped is None and "FAILED" not in text
    section = text[text.index("### sizes") :].splitlines()
    header, *rows = [line for line in section if line.startswith("| ")][:3]
    names = [c.strip() for c in header.strip("|").split("|")]
    assert len(rows) == 2
    for row in rows:
        cells = dict(zip(names, (c.strip() for c in row.strip("|").split("|")), strict=True))
        assert cells["step ms"] == "5.00" and cells["images/s"] == "100"
        assert cells["forward ms"] == cells["lr"] == cells["1st epoch s"] == cells["epoch s"] == "-"
        assert (
            cells["gradient MB/pass over the data"]
            == cells["busiest rank's wire MB/pass over the data"]
            == "-"
        )


def test_a_partial_report_counts_a_failed_run_as_one_resume_runs_again(tmp_path, monkeypatch, capsys):
    """It said "3 of 11 runs done ... --resume runs the other 8" where one of the 3 had failed, and
    stderr said 2 finished: --resume ran 9."""
    argv = ["study", "000_backbones", "-q", "-o", str(tmp_path / "st")]
    _, execute = _writing({2: 1, 4: 130})
    monkeypatch.setattr("commbench.bench.cli.main", execute)
    assert study.run(build_parser().parse_args(argv)) == 130
    total = len(study.plan(study.load_study("000_backbones"), "default", tmp_path / "st"))
    assert f"stopped with 2 of {total} run(s) finished" in capsys.readouterr().err
    text = (tmp_path / "st" / "report.md").read_text()
    assert (
        f"with 2 of {total} runs done and 1 failed. `commbench study 000_backbones -o {tmp_path / 'st'} "
        f"--resume` runs the other {total - 2} (the failed one again) and keeps the 2 done." in text
    )
    started, execute = _writing({})
    monkeypatch.setattr("commbench.bench.cli.main", execute)
    assert study.run(build_parser().parse_args([*argv, "--resume"])) == 0
    assert len(started) == total - 2


def test_a_dry_run_shows_the_commands_where_no_cluster_can_be_built(monkeypatch, capsys):
    """It showed cluster groups as cluster commands even where the run would give them local ranks."""
    from commbench.bench.cli import main

    monkeypatch.setattr(study, "cluster_available", lambda: "no privileges here")
    assert main(["study", "001_sync_strategies", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "# cluster groups run on local ranks here: no privileges here"
    assert lines[1:] and all(line.startswith("commbench ") for line in lines[1:])
    assert not any(line.startswith("commbench cluster ") for line in lines)
    monkeypatch.setattr(study, "cluster_available", lambda: None)
    assert main(["study", "001_sync_strategies", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("commbench cluster --hosts") for line in lines) and lines[0][0] != "#"


def test_only_a_cluster_group_s_runs_say_they_ran_on_local_ranks(tmp_path, monkeypatch):
    """Where no emulated cluster could be built, every run of the study got the note."""
    (tmp_path / "mixed.toml").write_text(
        PLOTTED + '[[group]]\nlabel = "hosts"\ncluster = true\ngrid = { world-size = [2] }\n'
    )
    monkeypatch.setattr(study, "studies_dir", lambda: tmp_path)
    monkeypatch.setattr(study, "cluster_available", lambda: "no privileges here")
    config = study.StudyConfig(name="mixed", out_dir=str(tmp_path / "st"), quiet=True)
    result = study.run_study(config, execute=_summaries())
    assert [(o.planned.group, o.note) for o in result.outcomes] == [
        ("sizes", ""),
        ("sizes", ""),
        ("hosts", "local ranks: no privileges here"),
    ]


def test_a_group_s_own_options_and_grid_outrank_a_grid_in_the_study_s_full_scale_defaults(tmp_path):
    """As the module says of options: a batch-size grid in [defaults.full] replaced the one batch
    size a group set itself, and its own grid over batch sizes too."""
    text = SCALED.replace(
        "full = { options = { world-size = 4, samples = 512 } }",
        "full = { options = { world-size = 4, samples = 512 }, grid = { batch-size = [64, 128] } }",
    ).replace(
        'strategies = "none", world-size = 1 }\ngrid = { batch-size = [16] }',
        'strategies = "none", world-size = 1, batch-size = 8 }',
    )
    text += '[[group]]\nlabel = "defaults"\n'
    (tmp_path / "scaled.toml").write_text(text)
    runs = study.plan(study.load_study("scaled", tmp_path), "full", tmp_path / "out")
    sizes = [(r.group, r.argv[r.argv.index("--batch-size") + 1]) for r in runs]
    assert sizes == [("one process", "8"), ("ranks", "16"), ("defaults", "64"), ("defaults", "128")]


def test_a_tiny_run_is_labelled_with_what_it_ran(tmp_path):
    """The grid's batch size 64 ran as --batch-size 16 at --tiny, and its report row said 64."""
    (tmp_path / "big.toml").write_text(PLOTTED.replace("[16, 32]", "[64, 128]"))
    (run,) = study.plan(study.load_study("big", tmp_path), "tiny", tmp_path / "out")
    assert run.argv[run.argv.index("--batch-size") + 1] == "16" and run.point == (("batch-size", 16),)
    (default, _) = study.plan(study.load_study("big", tmp_path), "default", tmp_path / "out")
    assert default.point == (("batch-size", 64),)
    wide = PLOTTED.replace("batch-size = [16, 32]", "model-opt = [{ widths = 512 }]")
    (tmp_path / "wide.toml").write_text(
        wide.replace("[[group]]", "tiny = { options = { model-opt = { widths = 8 } } }\n[[group]]")
    )
    (run,) = study.plan(study.load_study("wide", tmp_path), "tiny", tmp_path / "out")
    assert "widths=8" in run.argv and run.point == (("model-opt", {"widths": 8}),)


@pytest.mark.parametrize("given, prefix", [(" tiny\n", "tiny-01-"), ("", "01-"), ("  ", "01-")])
def test_the_scale_variable_is_read_as_the_other_commbench_variables(
    monkeypatch, capsys, tmp_path, given, prefix
):
    """Spaces stripped and empty taken for unset: " tiny" and "" were "unknown scale", exit 2."""
    monkeypatch.setenv("COMMBENCH_STUDY_SCALE", given)
    assert main(["study", "000_backbones", "--dry-run", "-o", str(tmp_path / "s")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert f"/runs/{prefix}backbone.jsonl" in first, first


def test_a_hosts_cpu_share_over_too_few_steps_is_not_given():
    """Over 3 steps of 7.7 ms, a tick and a half of CPU a step read as 261% of one core on a
    machine of two; bytes a second are given either way."""
    from commbench.bench import reporting as rp
    from commbench.bench import study as st

    def run(steps: int) -> rp.Run:
        hosts = [{"rank": r, "tx_bytes": 1000, "cpu_user": 0.005, "cpu_system": 0.015} for r in (0, 1)]
        epoch = {"strategy": "ring", "epoch": 1, "steps": steps, "time_s": steps * 0.0077, "hosts": hosts}
        return rp.Run(
            path="r.jsonl",
            label="r",
            header={},
            sweeps=(),
            epochs=(epoch,),
            summaries=(),
            probes=(),
            clusters=(),
        )

    summary = {"strategy": "ring", "step_time_ms": 7.7}
    cpu, send = st.METRICS["host_cpu_sys_pct"][2], st.METRICS["host_tx_mbps"][2]
    assert cpu(run(3), summary) is None
    assert send(run(3), summary) == pytest.approx(1000 / 0.0077 / 1e6)
    assert cpu(run(100), summary) == pytest.approx(0.015 / 0.0077 * 100)  # 0.77 s of steps
    # the epoch's own time, every step in it: 5 steps whose median is 60 ms, the first slow
    slow_first = run(5)
    slow_first.epochs[0]["time_s"] = 0.84
    assert cpu(slow_first, {"strategy": "ring", "step_time_ms": 60.0}) == pytest.approx(0.015 / 0.06 * 100)
    text = rp.render_markdown(st._host_blocks([{"summary": summary, "run": run(3), "point": []}]))
    assert "| ring | 0 | - | 0.001 | - | 0.1 | - | - |" in text, text


def test_a_progress_line_the_disk_cannot_take_is_said_with_the_file(tmp_path, monkeypatch):
    """A full disk under progress.jsonl ended the study with a bare "[Errno 28] No space left on
    device" (the full-disk hunt): the error names the file now, and says the runs' records stay."""
    import errno

    started, execute = _counting({})
    monkeypatch.setattr(study, "_restart_progress", lambda *args: open("/dev/full", "w"))
    config = study.StudyConfig(
        name="001_sync_strategies", scale="tiny", out_dir=str(tmp_path / "s"), quiet=True
    )
    with pytest.raises(OSError) as full:
        study.run_study(config, execute=execute)
    assert len(started) == 1 and full.value.errno == errno.ENOSPC and full.value.filename == "/dev/full"
    assert "(the runs' records are kept)" in str(full.value)


LOOPBACK = [  # the one host a run on local ranks counts: this machine's loopback, both ranks on it
    {"rank": 0, "ranks": [0, 1], "address": "127.0.0.1", "nic": "lo", "tx_bytes": 1_600_000}
    | {"rx_bytes": 1_600_000, "computed_tx_bytes": 1_600_000, "computed_rx_bytes": 1_600_000}
    | {"cpu_user": 0.005, "cpu_system": 0.0}
]
EMULATED = [  # one host per rank, as commbench cluster counts them
    {**LOOPBACK[0], "rank": r, "ranks": [r], "address": f"198.18.0.{r + 1}", "nic": "eth0"} for r in (0, 1)
]


def _sync_records(model: str = "mlp", time_s: float = 0.036, hosts: list | None = LOOPBACK):
    """An execute that writes, for each strategy of the sync study, its counted epoch (with ``hosts``;
    none with None) and its summary, as a compare run of ``model`` on two ranks writes them."""

    def execute(argv: list[str]) -> int:
        lines = []
        for strategy in ("naive", "ring", "bucketed"):
            epoch = {
                "type": "epoch",
                "strategy": strategy,
                "epoch": 1,
                "step_losses": [2.3],
                "time_s": time_s,
            }
            lines.append(epoch | ({"hosts": hosts} if hosts is not None else {}))
            lines.append(
                {"type": "train_summary", "strategy": strategy, "world_size": 2, "step_time_ms": 5.0}
                | {"images_per_s": 100.0, "model": model, "dataset": "synthetic"}
            )
        Path(argv[argv.index("--json") + 1]).write_text("".join(json.dumps(r) + "\n" for r in lines))
        return 0

    return execute


def _sync_report(tmp_path: Path, execute: Callable[[list[str]], int], scale: str = "tiny") -> str:
    config = study.StudyConfig(
        name="001_sync_strategies", scale=scale, out_dir=str(tmp_path / "st"), quiet=True
    )
    result = study.run_study(config, execute=execute)
    assert result.stopped is None
    return result.report.read_text()


def _table_header(text: str, group: str) -> list[str]:
    section = text[text.index(f"### {group}") :].splitlines()
    return [c.strip() for c in next(line for line in section if line.startswith("| ")).strip("|").split("|")]


def test_a_tiny_report_says_what_the_scale_ran_beside_the_study_as_designed(tmp_path):
    """The preset's text (VGG-11, one rank per emulated host with 1 Gbit/s links, 2 and 4 workers) was
    printed as it stood at --tiny, which ran mlp on local ranks at 2 workers alone, and said "1 runs"."""
    text = _sync_report(tmp_path, _sync_records())
    assert (
        "The text above is the study as designed. The tiny scale runs 1 of the default scale's 2 runs "
        "(model mlp in place of vgg11). Each run it ran is shortened: at most 2 epochs of 2 steps, a batch "
        "of at most 16 a rank and 256 samples, no held-out pass. Each group below says what else it "
        "changed." in text
    )
    assert "Scale: tiny. 1 run, " in text and "1 runs" not in text
    assert "\nAs designed: One rank per emulated host, 1 Gbit/s links both ways;" in text
    assert (
        "\nAs run at the tiny scale: every rank on this machine, over loopback (no emulated hosts, no 1gbit "
        "links); model mlp in place of vgg11; world-size 2 only (4 left out); --model-opt widths=256 in "
        "place of input_shape=3,32,32.\n" in text
    )
    # read from the records, not the preset: a run that recorded the designed model is not said to swap it
    text = _sync_report(tmp_path / "vgg", _sync_records(model="vgg11"))
    assert "model mlp in place of" not in text and "world-size 2 only (4 left out)" in text


def test_a_tiny_report_names_the_groups_and_grid_points_the_scale_left_out(tmp_path):
    config = study.StudyConfig(name="000_backbones", scale="tiny", out_dir=str(tmp_path / "st"), quiet=True)
    text = study.run_study(config, execute=_summaries(model="resnet18")).report.read_text()
    assert (
        '; groups left out: "batch size", "ranks", "head width". Each run it ran is shortened: at most 2'
        in text
    )
    assert ". Each group below says what else it changed." in text
    assert "\nAs designed: Each backbone with the head the study gives it" in text
    # and the options the tiny scale set beside the grid: images of 32 pixels, not the design's 64
    assert (
        "\nAs run at the tiny scale: model resnet18 only (squeezenet1_0, alexnet left out); --model-opt "
        "image_size=32, hidden=0 in place of image_size=64.\n" in text
    )


def test_a_study_without_its_emulated_cluster_says_so_under_the_group_s_note(tmp_path, monkeypatch):
    """At the default scale the grid and model are the design's; only the missing cluster is said."""
    monkeypatch.setattr(study, "cluster_available", lambda: "no privileges here")
    text = _sync_report(tmp_path, _sync_records(model="vgg11"), scale="default")
    assert "The text above is the study as designed" not in text and "2 runs, " in text
    assert "\nAs designed: One rank per emulated host" in text
    assert (
        "\nAs run here: every rank on this machine, over loopback (no emulated hosts, no 1gbit links).\n"
        in text
    )


def test_host_columns_counted_on_loopback_are_named_all_ranks_not_busiest_host(tmp_path):
    """On local ranks the "busiest host" was the whole machine: 325 MB/s of every rank's loopback
    traffic under a heading a reader set beside the study's 1 Gbit/s links."""
    text = _sync_report(tmp_path, _sync_records())
    header = _table_header(text, "strategies x workers")
    assert {"loopback send MB/s, all ranks", "CPU user %, all ranks", "CPU sys %, all ranks"} <= set(header)
    assert not any(h.startswith("busiest host") for h in header)
    assert (
        "\nThe all-ranks columns: every rank ran on this machine, so its one host is the machine; the send "
        "rate is every rank's traffic over loopback together, which no network link carries (not to be set "
        "beside the 1gbit links of the study as designed), and the CPU is every rank's together, as % of "
        "one core.\n" in text
    )
    text = _sync_report(tmp_path / "hosts", _sync_records(hosts=EMULATED))  # one host per rank
    assert "busiest host send MB/s" in _table_header(text, "strategies x workers")
    assert "all ranks" not in text


def test_a_host_column_s_dash_says_why(tmp_path):
    """CPU read '-' with no word of why: the counted steps were too short for the CPU's clock ticks."""
    text = _sync_report(tmp_path, _sync_records(time_s=0.036))
    assert (
        "\nCPU '-': the counted epoch's steps took 0.036 s or less in all, under the 0.5 s that the CPU's "
        "10 ms clock ticks need to give a share (a longer run gives one).\n" in text
    )
    text = _sync_report(tmp_path / "long", _sync_records(time_s=0.8))  # a share is given: nothing to say
    assert "CPU '-'" not in text and "| 100 | 0 |" in text  # 5 ms of user CPU a 5 ms step
    text = _sync_report(tmp_path / "none", _sync_records(hosts=None))
    assert "\nHost columns '-': the records hold no per-host counts for that row.\n" in text


def test_study_bars_are_labelled_with_ranks_and_titled_with_model_and_scale(tmp_path, monkeypatch):
    """ "naive x2" read as "twice", and the plot did not say the tiny scale's mlp had drawn it."""
    from commbench.bench import report

    drawn = []
    monkeypatch.setattr(
        report, "plot_grouped", lambda labels, series, path, ylabel, title: drawn.append((labels, title))
    )
    _sync_report(tmp_path, _sync_records())
    assert drawn and all(
        labels == ["naive, 2 ranks", "ring, 2 ranks", "bucketed, 2 ranks"]
        and title == "strategies x workers (mlp, tiny scale)"
        for labels, title in drawn
    )


def test_a_run_on_loopback_among_emulated_hosts_is_named_under_the_table(tmp_path, monkeypatch):
    """A cluster that could not be built for one point left that point's machine-wide figures under
    the busiest host heading of the others."""
    monkeypatch.setattr(study, "cluster_available", lambda: None)
    writers = [_sync_records(hosts=EMULATED), _sync_records(hosts=LOOPBACK)]  # run 1, run 2

    def execute(argv: list[str]) -> int:
        return writers.pop(0)(argv)

    text = _sync_report(tmp_path, execute, "default")
    assert "busiest host send MB/s" in _table_header(text, "strategies x workers")
    assert (
        "\nIn run 2 every rank ran on this machine: the busiest host columns are every rank's sends over "
        "loopback and CPU together (not to be set beside the 1gbit links of the study as designed).\n" in text
    )


DDP_MLP = '[defaults]\noptions = { strategies = "ddp", model = "mlp", world-size = 2 }\n'


def _tiny_report(tmp_path, monkeypatch, name: str, text: str) -> str:
    """The tiny-scale report of a study file written here (HEAD, then ``text``), its runs faked."""
    (tmp_path / f"{name}.toml").write_text(HEAD + text)
    monkeypatch.setattr(study, "studies_dir", lambda: tmp_path)
    config = study.StudyConfig(name=name, scale="tiny", out_dir=str(tmp_path / f"st-{name}"), quiet=True)
    return study.run_study(config, execute=_summaries()).report.read_text()


def test_a_grid_value_the_tiny_scale_shrinks_is_said_run_as_not_left_out(tmp_path, monkeypatch):
    """The tiny run of batch size 32 runs as 16: the report said "batch-size 16 only (32, 64, 128 left
    out)", 32 among those left out though it ran."""
    text = _tiny_report(
        tmp_path,
        monkeypatch,
        "shrunk",
        DDP_MLP + '[[group]]\nlabel = "sizes"\ngrid = { batch-size = [32, 64, 128] }\n',
    )
    assert "\nAs run at the tiny scale: batch-size 32 run as 16 only (64, 128 left out).\n" in text
    # and the study's line ends there: no group says more than the grid
    text = _tiny_report(
        tmp_path, monkeypatch, "plain", DDP_MLP + '[[group]]\nlabel = "one"\ngrid = { batch-size = [8] }\n'
    )
    assert (
        "The tiny scale runs the default scale's 1 run. Each run it ran is shortened: at most 2 epochs of 2 "
        "steps, a batch of at most 16 a rank and 256 samples, no held-out pass.\n" in text
    )
    assert "As run at" not in text


def test_a_hosts_cpu_share_needs_its_own_counted_time_as_the_reports_per_host_table_does(tmp_path):
    """The study judged the epoch's time_s and the report the host's counted_s: near the floor one
    record gave a share in one table and '-' in the other."""
    host = {"rank": 0, "tx_bytes": 1, "rx_bytes": 1, "cpu_user": 0.01, "cpu_system": 0.0}
    epoch = {"type": "epoch", "strategy": "ring", "epoch": 0, "step_losses": [1.0], "time_s": 0.6}
    path = tmp_path / "r.jsonl"
    summary = {"strategy": "ring"}
    from commbench.bench import reporting as rp

    for counted, countable in ((0.4, False), (0.6, True), (None, True)):
        hosts = [host | ({} if counted is None else {"counted_s": counted})]
        path.write_text(json.dumps(epoch | {"hosts": hosts}) + "\n")
        assert study._cpu_countable(rp.load_run(path), summary) is countable, counted


def _probed_run(tmp_path, marks, samples):
    from commbench.bench import reporting as rp

    path = tmp_path / "probed.jsonl"
    markers = [{"t_s": t, "label": f"{i + 1}: ddp epoch {i}"} for i, t in enumerate(marks)]
    probe = {"type": "probe", "summary": {"gpus": []}, "markers": markers}
    path.write_text(json.dumps(probe | {"samples": samples}) + "\n")
    return rp.load_run(path)


def test_cpu_and_gpu_means_are_training_s_after_its_first_epoch(tmp_path):
    """Over the whole run the means were mostly imports, model building and waiting: a tiny run's
    two epochs were its last 50 ms of 2 s, and its 54% was start-up's."""
    samples = [{"t_s": t / 10, "process_cpu_pct": 100.0 if t < 10 else 40.0} for t in range(20)]
    for x in samples:
        x["gpus"] = [
            {"index": 0, "gpu_util_pct": 10.0},
            {"index": 1, "gpu_util_pct": 90.0 if x["t_s"] >= 1 else 0},
        ]
    run = _probed_run(tmp_path, [1.0, 1.5, 1.9], samples)
    assert study._training_mean(run, "process_cpu_pct") == pytest.approx(40.0)  # samples 1.0 to 1.9
    assert study._training_mean(run, "gpu_util_pct", gpu=True) == pytest.approx(90.0)  # the busiest GPU
    # two samples between the marks are no mean, and the table's note says why
    run = _probed_run(tmp_path, [1.0, 1.15], samples)
    assert study._training_mean(run, "process_cpu_pct") is None
    row = {
        "run": run,
        "summary": {"strategy": "ddp"},
        "values": {"process_cpu_mean": None, "gpu_util_mean": None},
    }
    notes = study._column_notes([row], ["process_cpu_mean", "gpu_util_mean"], None)
    assert notes == [
        f"Means over epochs 2+ '-': fewer than {study.MIN_TRAINING_SAMPLES} probe samples fell between the "
        "first epoch's end and the last's (more steps, or a shorter --probe-interval, gives them).",
        "GPU columns '-': the run sampled no GPU (it ran on CPU, or NVML is not available).",
    ]
    # a run of one epoch has none after it: more steps would not help
    row["run"] = _probed_run(tmp_path, [1.0], samples)
    assert study._column_notes([row], ["process_cpu_mean"], None) == [
        "Means over epochs 2+ '-': the run had fewer than two epochs, so none after the first."
    ]
    # a compare marks each strategy's epochs, in any order: the window runs from epoch 0's last end
    # to the last epoch's, not between two strategies' ends of one epoch
    markers = [
        (1.9, "4: ring epoch 1"),
        (0.95, "1: naive epoch 0"),
        (1.0, "2: ring epoch 0"),
        (1.85, "3: naive epoch 1"),
    ]
    run = _probed_run(tmp_path, [], samples)
    run.probes[0]["markers"] = [{"t_s": t, "label": label} for t, label in markers]
    assert [x["t_s"] for x in study._training_samples(run)] == pytest.approx(
        [1.0 + i / 10 for i in range(10)]
    )


def test_no_speedup_is_drawn_where_no_run_had_more_than_one_rank(tmp_path, monkeypatch):
    """A tiny run of 1 rank drew one bar of 1.00: the baseline against itself."""
    (tmp_path / "speed.toml").write_text(
        HEAD + 'metrics = ["images_per_s", "speedup"]\nplot = ["speedup"]\n'
        '[defaults]\noptions = { strategies = "ddp", model = "mlp" }\n'
        '[[group]]\nlabel = "workers"\ngrid = { world-size = [1, 2] }\n'
    )
    monkeypatch.setattr(study, "studies_dir", lambda: tmp_path)
    for scale, drawn in (("tiny", False), ("default", True)):
        config = study.StudyConfig(name="speed", scale=scale, out_dir=str(tmp_path / scale), quiet=True)

        def execute(argv):
            ranks = int(argv[argv.index("--world-size") + 1]) if "--world-size" in argv else 2
            return _summaries(world_size=ranks, first_epoch_time_s=1.0 / ranks)(argv)

        text = study.run_study(config, execute=execute).report.read_text()
        assert ("workers-speedup.png" in text) is drawn, scale


def test_a_dash_in_the_threshold_accuracy_or_rate_columns_says_why():
    """The console said "not within its 2 epoch(s)" and the report showed '-' alone."""
    metrics = ["epochs_to_threshold", "final_accuracy", "grad_gbps", "wire_ratio", "step_time_ms"]
    summary = {
        "strategy": "ddp",
        "world_size": 1,
        "loss_threshold": 2.25,
        "epochs": 2,
        "final_accuracy": None,
    }
    import types

    run = types.SimpleNamespace(probes=[], epochs=[])  # no probe or per-host counts: no notes of theirs
    row = {"run": run, "summary": summary, "values": dict.fromkeys(metrics)}
    row["values"]["step_time_ms"] = 5.0
    notes = study._column_notes([row], metrics, None)
    assert notes == [
        "epochs to loss threshold '-': the mean training loss did not fall below 2.25 within the run's 2 "
        "epoch(s).",
        "accuracy '-': the run made no held-out pass (--no-eval).",
        "gradient GB/s '-': at 1 rank nothing is sent.",
        "measured/computed bytes, last epoch '-': at 1 rank nothing is sent.",
    ]
    summary |= {"world_size": 2, "loss_threshold": None}
    del summary["final_accuracy"]
    assert study._column_notes([row], metrics[:2], None) == [
        "epochs to loss threshold '-': no --loss-threshold was given.",
        "accuracy '-': the run made no held-out pass (--no-eval), or its records hold no accuracy.",
    ]


def test_metrics_joined_by_a_plus_are_drawn_side_by_side_in_one_chart(tmp_path, monkeypatch):
    """000 drew compute and communication as two charts, each scaled to its own bar, so the split the
    study asks about could not be seen; 003's first epoch against its second was in the table alone."""
    from commbench.bench import report

    presets = study.studies_dir()
    drawn = []

    def kept(groups, series, path, ylabel, title):
        drawn.append((list(series), ylabel))

    monkeypatch.setattr(report, "plot_grouped", kept)
    (tmp_path / "split.toml").write_text(
        HEAD + 'metrics = ["compute_ms", "comm_ms"]\nplot = ["compute_ms+comm_ms"]\n'
        '[defaults]\noptions = { strategies = "ddp", model = "mlp", world-size = 2 }\n'
        '[[group]]\nlabel = "one"\ngrid = { batch-size = [8] }\n'
    )
    monkeypatch.setattr(study, "studies_dir", lambda: tmp_path)
    config = study.StudyConfig(name="split", out_dir=str(tmp_path / "st"), quiet=True)
    text = study.run_study(config, execute=_summaries(compute_ms=3.0, comm_ms=1.0)).report.read_text()
    assert drawn == [(["compute ms", "comm ms"], "compute ms and comm ms")]
    assert "one-compute-ms-comm-ms.png" in text
    (tmp_path / "bad.toml").write_text(
        HEAD + 'metrics = ["comm_ms"]\nplot = ["comm_ms+compute_ms"]\n[[group]]\n'
    )
    with pytest.raises(ValueError, match="plot 'compute_ms' is not in metrics"):
        study.load_study("bad")
    # the presets that use it load
    for name in ("000_backbones", "003_dataset_model_size"):
        assert any("+" in entry for entry in study.load_study(name, presets).plot), name


def test_epoch_seconds_keep_four_figures_and_the_byte_ratio_says_which_epoch():
    """At .3f a tiny run's epochs read 0.005 and 0.011 (one or two figures); the results table's
    ratio is the last epoch's where the bytes section gives the median of epochs."""
    for key in ("epoch_time_s", "first_epoch_time_s", "later_epoch_time_s"):
        assert study._metric_text(0.0051234, study.METRICS[key][1]) == "0.005123"
    assert study.METRICS["wire_ratio"][0] == "measured/computed bytes, last epoch"


def test_the_tiny_line_says_an_option_added_or_left_out_as_such(tmp_path, monkeypatch):
    """A flag the tiny scale added read "--no-probe left out", and a cluster group's design (its
    command after the cluster's own flags, without --world-size) read as "--world-size 2" changed."""
    monkeypatch.setattr(study, "cluster_available", lambda: None)
    text = _tiny_report(
        tmp_path,
        monkeypatch,
        "flags",
        '[defaults]\noptions = { strategies = "ddp", model = "mlp", world-size = 2, lr = 0.1 }\n'
        "tiny = { options = { no-probe = true, lr = false } }\n"
        '[[group]]\nlabel = "hosts"\ncluster = true\ngrid = { batch-size = [8] }\n',
    )
    (line,) = [x for x in text.splitlines() if x.startswith("As run at the tiny scale:")]
    assert line.endswith("; --lr left out (0.1); --no-probe added."), line
    assert "world-size" not in line


def test_left_out_group_names_are_quoted_as_written(tmp_path, monkeypatch):
    groups = "".join(
        f'[[group]]\nlabel = "{name}"\ngrid = {{ batch-size = [8] }}\n' for name in ("eins", "Größe")
    )
    text = _tiny_report(tmp_path, monkeypatch, "names", DDP_MLP + groups)
    assert '; groups left out: "Größe". ' in text


@pytest.mark.parametrize("entry", ["comm_ms+", "+", "comm_ms+comm_ms"])
def test_a_plot_entry_with_an_empty_or_repeated_part_is_refused(tmp_path, entry):
    (tmp_path / "bad.toml").write_text(HEAD + f'metrics = ["comm_ms"]\nplot = ["{entry}"]\n[[group]]\n')
    with pytest.raises(ValueError, match=f"plot entry '{re.escape(entry)}' needs metrics joined by"):
        study.load_study("bad", tmp_path)


def test_dashed_rates_above_one_rank_are_not_put_down_to_one_rank():
    """NCCL's traffic is not counted: a 4-rank row's '-' was said to be 'at 1 rank nothing is sent'."""
    assert study._nothing_sent([{"world_size": 1}]) == "at 1 rank nothing is sent"
    assert study._nothing_sent([{"world_size": 1}, {"world_size": 4}]).startswith(
        "the records hold no counted bytes for that row"
    )
    assert study._metric_text(12345.6, ".4g") == "12346"  # not 1.235e+04


@pytest.mark.parametrize(
    "probe, what",
    [
        ({"samples": [1, 2]}, "samples are not a list of objects"),
        ({"samples": [], "markers": [1]}, "markers are not a list of objects"),
        ({"samples": [{"t_s": 0, "gpus": {"a": 1}}]}, "samples' gpus are not a list of objects"),
    ],
)
def test_a_probe_record_of_the_wrong_shape_is_one_line(tmp_path, probe, what):
    """A study's means read the samples one by one: an AttributeError traceback on a hand-written file."""
    from commbench.bench import reporting as rp

    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"type": "probe", **probe}) + "\n")
    with pytest.raises(ValueError, match=f"has a probe record whose {re.escape(what)}"):
        rp.load_run(path)
