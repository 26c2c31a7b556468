"""dynaprobe's pytest plugin, loaded through the ``pytest11`` entry point when dynaprobe is
installed (``-p no:dynaprobe`` turns it off).

Fixtures:
    precision_checker: a factory, ``precision_checker(**kwargs)`` -> ``PrecisionChecker``, whose
        ``dump_dir`` is a fresh folder under the test's ``tmp_path`` (``dynaprobe/0``,
        ``dynaprobe/1``, ...) unless ``dump_dir=`` is given; the other keywords go to the
        constructor unchanged.
    assert_precision: ``dynaprobe.assert_precision`` (see ``dynaprobe._results.assertions``).

dynaprobe itself (and torch) is imported when a fixture is first used, not at start-up.
"""

from __future__ import annotations

import pytest


@pytest.fixture
def precision_checker(tmp_path):
    """A factory of PrecisionCheckers that dump under this test's ``tmp_path``."""
    from dynaprobe import PrecisionChecker

    made = []

    def make(**kwargs):
        kwargs.setdefault("dump_dir", str(tmp_path / "dynaprobe" / str(len(made))))
        checker = PrecisionChecker(**kwargs)
        made.append(checker)
        return checker

    yield make
    for checker in made:
        checker.uninstall()  # a test that failed between install() and collect()


@pytest.fixture
def assert_precision():
    """``dynaprobe.assert_precision``: fails the test when a CompareResult does not pass."""
    from dynaprobe import assert_precision as check

    return check
