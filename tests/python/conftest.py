"""Shared pytest fixtures."""

import os
import sys

import pytest

# Tests import the installed package (scripts/setup.sh installs it into .venv); fail clearly if not.
try:
    import dynaprobe  # noqa: F401
except ImportError as error:  # pragma: no cover - set-up problem, not a test result
    sys.exit(f"cannot import dynaprobe ({error}); run `bash scripts/test.sh` to build and install it")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _find_cli():
    """The `dynaprobe` CLI: $DYNAPROBE_CLI, else the one installed next to this Python, else the
    one in a build folder."""
    explicit = os.environ.get("DYNAPROBE_CLI")
    if explicit:
        return explicit if os.path.isfile(explicit) and os.access(explicit, os.X_OK) else None
    candidates = [
        os.path.join(os.path.dirname(sys.executable), "dynaprobe"),
        os.path.join(REPO, "build", "analyze", "dynaprobe"),
    ]
    return next((path for path in candidates if os.path.isfile(path) and os.access(path, os.X_OK)), None)


@pytest.fixture(scope="session")
def dynaprobe_cli():
    """Path of the `dynaprobe` command-line program. Fails (never skips) when it is missing."""
    cli = _find_cli()
    if cli is None:
        pytest.fail(
            "the dynaprobe CLI was not found: set DYNAPROBE_CLI, install it next to "
            f"{sys.executable}, or build it in {REPO}/build (`bash scripts/setup.sh`)"
        )
    return cli


def zero_eager_sums_behind_torchs_back(checker) -> None:
    """Single-pass, after the step's backward: once the recorder has judged what was queued,
    zeros the eager side's parameter gradient sums without a version change torch would see.
    A report that still shows their metrics took the ones judged during the backward
    (Step.judge_ahead), from the sums as they were then, and did not read them again."""
    from dynaprobe._C.vocabulary import SIDE_EAGER

    step = checker._installation.session.step
    step.recorder.failing_calls()  # returns once the background thread has judged the queue
    for grad in step.param_grads[SIDE_EAGER].values():
        grad.data.zero_()  # .data has a version counter of its own: the sum's stays


@pytest.fixture
def fresh_inductor():
    """Dynamo reset before and after the test, and no inductor post-grad pass left behind: for
    tests that compile with inductor and put a fault into its passes."""
    import torch
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    yield
    inductor_config.post_grad_custom_post_pass = None
    torch._dynamo.reset()


# The files that take a minute or more on two cores, longest first (scripts/test.sh prints the
# slowest tests). pytest-xdist's --dist loadfile hands files out in collection order: starting
# with these, the two workers end together instead of one running a long file alone at the end.
LONGEST_FILES = ("test_docs.py", "test_scale.py", "test_real_models.py", "test_diffusion_models.py", "test_replay.py", "test_dump_failures.py",
                 "test_low_precision.py", "test_fsdp.py", "test_graph_replay.py",
                 "test_user_backends.py", "test_upstream_bundle.py", "test_examples.py",
                 "test_ops.py", "test_remedy.py", "test_run_scale.py")


def pytest_collection_modifyitems(items):
    rank = {name: index for index, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within each file
