"""The command line as a first-time user meets it: the version, help, and usage errors that name
the mistake, say what was expected and suggest the fix (docs/cli.md)."""

import os
import re

import pytest
from analyze_dumps import Rec, randn, run_cli, same, write_dump
from conftest import REPO

import dynaprobe


@pytest.fixture
def dump(tmp_path):
    write_dump(tmp_path / "dump", [Rec("m", "fwd_output", **same(randn(2)))])
    return tmp_path / "dump"


@pytest.mark.parametrize("args", [["--version"], ["-V"], ["version"]])
def test_version_names_the_release_and_the_dump_format(dynaprobe_cli, args):
    proc = run_cli(dynaprobe_cli, *args)
    assert proc.returncode == 0, proc.stderr
    format_version = dynaprobe.format_version()
    assert proc.stdout.splitlines() == [
        f"dynaprobe {dynaprobe.__version__}",
        f"dump format {format_version}: writes {format_version}; reads 1.0 to {format_version}, "
        f"and a newer {format_version.split('.')[0]}.x with a warning (what it adds is skipped)"]


def test_package_cli_and_build_agree_on_the_version():
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        pyproject = re.search(r'^version = "([^"]+)"', f.read(), re.M).group(1)
    with open(os.path.join(REPO, "CMakeLists.txt")) as f:
        cmake = re.search(r"project\(dynaprobe VERSION (\S+)", f.read()).group(1)
    assert dynaprobe.__version__ == pyproject == cmake


@pytest.mark.parametrize("args, first_line", [
    (["help"], "dynaprobe: find where torch.compile changes a PyTorch model's numbers."),
    (["help", "compare"], "Compare the eager and the compiled side of a dump and print the report"),
    (["help", "graphs"], "Write the Dynamo and AOTAutograd graphs stored in a dump as .py files"),
])
def test_help_command_is_the_help_option(dynaprobe_cli, args, first_line):
    proc = run_cli(dynaprobe_cli, *args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == first_line
    assert proc.stdout == run_cli(dynaprobe_cli, *args[1:], "--help").stdout


@pytest.mark.parametrize("args, message", [
    (["comapre", "DUMP"],
     "unknown command 'comapre'; did you mean 'compare'? the commands are compare, merge, ls, graphs, "
     "runs, repro, bisect, remedy and bundle (dynaprobe --help says what each does)"),
    (["frobnicate"],
     "unknown command 'frobnicate'; the commands are compare, merge, ls, graphs, runs, repro, bisect, "
     "remedy and bundle (dynaprobe --help says what each does)"),
    ([], "a command is required: compare, ls or graphs (e.g. dynaprobe compare DUMP); run "
         "'dynaprobe --help' for what each does"),
    (["compare", "DUMP", "--atoll", "1e-3"],
     "compare: unknown option --atoll; did you mean '--atol'? ('dynaprobe compare --help' lists "
     "the options)"),
    (["graphs", "DUMP", "--ouput", "x"],
     "graphs: unknown option --ouput; did you mean '--output'? ('dynaprobe graphs --help' lists "
     "the options)"),
    (["compare", "DUMP", "--atol", "abc"],
     "compare: --atol: expected a finite number >= 0 (such as 1e-4), but received 'abc' "
     "('dynaprobe compare --help' lists the options)"),
    (["compare", "DUMP", "--rtol", "inf"],
     "compare: --rtol: expected a finite number >= 0 (such as 1e-3), but received 'inf' "
     "('dynaprobe compare --help' lists the options)"),
    (["compare", "DUMP", "--step", "1.5"],
     "compare: --steps: expected N, N-M or a list of them (such as 0-3,8), but received '1.5' "
     "('dynaprobe compare --help' lists the options)"),
    # Suggestions from meaning: words other tools use, options another command has.
    (["report", "DUMP"],
     "unknown command 'report'; did you mean 'compare'? the commands are compare, merge, ls, graphs, "
     "runs, repro, bisect, remedy and bundle (dynaprobe --help says what each does)"),
    (["list", "DUMP"],
     "unknown command 'list'; did you mean 'ls'? the commands are compare, merge, ls, graphs, runs, "
     "repro, bisect, remedy and bundle (dynaprobe --help says what each does)"),
    (["compare", "DUMP", "-o", "out.csv"],
     "compare: unknown option -o; did you mean --csv PATH, --json PATH or --html PATH (a file per "
     "format)? ('dynaprobe compare --help' lists the options)"),
    (["compare", "DUMP", "--output", "out.csv"],
     "compare: unknown option --output; did you mean --csv PATH, --json PATH or --html PATH (a "
     "file per format)? ('dynaprobe compare --help' lists the options)"),
    (["compare", "DUMP", "--threshold", "1e-3"],
     "compare: unknown option --threshold; did you mean --atol X (and --rtol X)? ('dynaprobe "
     "compare --help' lists the options)"),
    (["compare", "DUMP", "-j", "4"],
     "compare: unknown option -j; did you mean --threads N? ('dynaprobe compare --help' lists the "
     "options)"),
    (["compare", "DUMP", "--rank", "3"],
     "compare: unknown option --rank; did you mean '--ranks'? ('dynaprobe compare --help' lists "
     "the options)"),
    (["ls", "DUMP", "--module", "layers.*"],
     "ls: unknown option --module; --module is an option of 'dynaprobe compare' ('dynaprobe ls "
     "--help' lists the options)"),
    (["ls", "DUMP", "--csv", "x.csv"],
     "ls: unknown option --csv; --csv is an option of 'dynaprobe compare' ('dynaprobe ls --help' "
     "lists the options)"),
    (["graphs", "DUMP", "--out", "x"],
     "graphs: unknown option --out; did you mean --output DIR (-o DIR)? ('dynaprobe graphs "
     "--help' lists the options)"),
    (["compare"],
     "compare: DUMP is required: give a run folder, a dump folder or a step file, e.g. dynaprobe "
     "compare dynaprobe_runs/<run> ('dynaprobe compare --help' says more)"),
])
def test_usage_errors_name_the_mistake_and_the_fix(dynaprobe_cli, dump, args, message):
    proc = run_cli(dynaprobe_cli, *[dump if a == "DUMP" else a for a in args])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == f"dynaprobe: error: {message}\n"
    assert proc.stdout == ""


def test_several_steps_open_with_a_summary_naming_the_failed_ones(tmp_path, dynaprobe_cli):
    eager = randn(4)
    write_dump(tmp_path / "dump", [Rec("m", "fwd_output", **same(eager))], step=0)
    write_dump(tmp_path / "dump", [Rec("m", "fwd_output", eager=eager, compiled=eager + 1)], step=1)
    write_dump(tmp_path / "dump", [Rec("m", "fwd_output", **same(eager))], step=2)
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "dump")
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.startswith(
        "Summary: 3 steps, 2 ALL PASS, 1 FAILED (1 FAIL row, 0 WARN rows)\n"
        "Failing modules, root cause first:\n"
        "   step  module  FAIL  WARN  first failing row\n"
        "      1  m          1     0  fwd_output[0] max_abs=1.000e+00  <- forward root cause, local\n"
        "Root cause first seen in step 1: forward m fwd_output[0] (max_abs=1.000e+00): local, "
        "it has no tensor inputs\n"
        "Full reports: --html PATH, --json PATH or --junit PATH write every rank and step\n"
        "\n"
        "The report of each failing step follows (--all-steps prints every step's).\n"
        "\n"
        "Step 1\n")
    assert proc.stdout.count("RESULT:") == 1  # passing steps' reports are left out
    one_step = run_cli(dynaprobe_cli, "compare", tmp_path / "dump", "--step", "1")
    assert "Summary" not in one_step.stdout  # a single step's RESULT line says it all


def test_several_passing_steps_summary(tmp_path, dynaprobe_cli):
    for step in range(2):
        write_dump(tmp_path / "dump", [Rec("m", "fwd_output", **same(randn(3)))], step=step)
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "dump")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ("Summary: 2 steps, 2 ALL PASS\n"
                           "Full reports: --html PATH, --json PATH or --junit PATH write every "
                           "rank and step\n")


def test_a_step_that_is_not_there_is_named_with_the_steps_that_are(tmp_path, dynaprobe_cli):
    for step in (0, 3):
        write_dump(tmp_path / "dump", [Rec("m", "fwd_output", **same(randn(3)))], step=step)
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "dump", "--step", "7")
    assert proc.returncode == 2
    assert proc.stderr == (
        f"dynaprobe: error: --steps 7 matches no step of {tmp_path / 'dump'}; its steps are 0,3: "
        "give some of them, or leave --steps out to compare every step\n")


def test_a_folder_of_runs_stands_for_its_newest_run(tmp_path, dynaprobe_cli):
    """dynaprobe_runs/, the folder a user sees: every command reads the newest run and says
    which, naming the others and how to pick one."""
    runs = tmp_path / "dynaprobe_runs"
    eager = randn(4)
    write_dump(runs / "20261201-090000-11-0" / "rank0", [Rec("m", "fwd_output", **same(eager))])
    write_dump(runs / "20261201-100000-12-0" / "rank0",
               [Rec("m", "fwd_output", eager=eager, compiled=eager + 1)])
    older, newer = runs / "20261201-090000-11-0", runs / "20261201-100000-12-0"
    os.utime(older / "rank0" / "step_00000000.h5", (1_000_000, 1_000_000))
    said = (f"dynaprobe: {runs} holds 2 run(s); compare reads the newest, {newer}; the others: "
            f"{older.name} (name one to read it: dynaprobe compare {older})\n")
    proc = run_cli(dynaprobe_cli, "compare", runs)
    assert proc.returncode == 1, proc.stderr  # the newest run fails
    assert proc.stderr == said
    assert "FAIL  m " in proc.stdout
    proc = run_cli(dynaprobe_cli, "compare", older)
    assert proc.returncode == 0 and proc.stderr == ""
    proc = run_cli(dynaprobe_cli, "ls", runs)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == said.replace("compare", "ls")
    assert str(newer / "rank0" / "step_00000000.h5") in proc.stdout


def test_runs_lists_the_runs_newest_first_and_keep_removes_the_older(tmp_path, dynaprobe_cli):
    import fcntl

    runs = tmp_path / "dynaprobe_runs"
    eager = randn(4)
    names = ["20261201-080000-10-0", "20261201-090000-11-0", "20261201-100000-12-0"]
    write_dump(runs / names[0] / "rank0", [Rec("m", "fwd_output", **same(eager))])
    write_dump(runs / names[1] / "rank0", [Rec("m", "fwd_output", **same(eager))], step=0)
    write_dump(runs / names[1] / "rank0", [Rec("m", "fwd_output", **same(eager))], step=1)
    write_dump(runs / names[2] / "rank0",
               [Rec("m", "fwd_output", eager=eager, compiled=eager + 1)])
    # Another process is writing the oldest run: it holds its dump's lock.
    lock = open(runs / names[0] / "rank0" / ".dynaprobe.lock", "a")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    for age, name in enumerate(reversed(names)):  # the newest is the last written
        for path in [runs / name, *(runs / name).rglob("*")]:
            os.utime(path, (2_000_000 - age * 1000, 2_000_000 - age * 1000))
    try:
        listed = run_cli(dynaprobe_cli, "runs", runs)
        assert listed.returncode == 0, listed.stderr
        lines = listed.stdout.splitlines()
        assert lines[0].split() == ["run", "written", "ranks", "steps", "size", "verdict"]
        pattern = r"(\S+) +\d{4}-\d\d-\d\d \d\d:\d\d:\d\d +(\d+) +(\d+) +[\d.]+ KiB  (.+)"
        rows = [re.fullmatch(pattern, line).groups() for line in lines[1:]]
        assert rows == [(names[2], "1", "1", "FAILED"), (names[1], "1", "2", "ALL PASS"),
                        (names[0], "1", "1", "ALL PASS")]
        kept = run_cli(dynaprobe_cli, "runs", runs, "--keep", "1")
    finally:
        lock.close()
    assert kept.returncode == 0, kept.stderr
    assert re.search(rf"^{names[1]} +removed \(8\.\d KiB\)$", kept.stdout, re.M), kept.stdout
    assert re.search(rf"^{names[0]} +kept: being written \(", kept.stdout, re.M), kept.stdout
    assert kept.stdout.endswith("removed 1 run(s), " + kept.stdout.split("removed (")[1]
                                .split(")")[0] + "\n")
    assert sorted(p.name for p in runs.iterdir()) == [names[0], names[2]]
    empty = tmp_path / "empty"
    empty.mkdir()
    nothing = run_cli(dynaprobe_cli, "runs", empty)
    assert nothing.returncode == 2 and "no runs in it" in nothing.stderr, nothing.stderr
