"""The benchmark of real torch.compile bugs (bench/real_bugs.py, issue 48 item 5), one case of it:
a historical inductor bug (index_add's alpha dropped, pytorch#108963) reintroduced by a post-grad
pass inside real inductor kernels, found at every level, and a negative control that is not."""

from __future__ import annotations

import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
sys.path.insert(0, BENCH)
from real_bug_cases import CASES  # noqa: E402
from real_bugs import LEVELS, run_case, scores  # noqa: E402

BY_NAME = {case.name: case for case in CASES}


@pytest.mark.slow
def test_a_real_inductor_bug_is_named_remedied_and_confirmed_and_a_control_is_not(tmp_path):
    bug, control = BY_NAME["index_add_alpha"], BY_NAME["neutral_doubling"]
    found = run_case(bug, str(tmp_path / "bug"))
    assert not found.error, found
    assert found.failed and found.module == "1" and found.stage == "recorded", found
    assert found.op == bug.op == "aten.index_put.default", found
    assert found.remedy is not None and found.confirmed, found
    assert found.right(bug) == {level: True for level in LEVELS}
    clean = run_case(control, str(tmp_path / "control"))
    assert not clean.failed and not clean.error, clean
    assert clean.right(control) == {level: None for level in LEVELS}
    assert scores([bug, control], [found, clean]) == {level: (1.0, 1.0) for level in LEVELS}
