"""Where does it start? Fault-injection backends perturb GELU (forward, backward, or both) in the
one stage that has a GELU; the root-cause summary must name that stage, say the difference is
local to it, and not blame the stages downstream that merely receive it."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from models import BACKWARD_FAULT, FORWARD_FAULT, Chain

from dynaprobe import PrecisionChecker


def _check(backend, single_pass: bool, tmp_path):
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(4, 8)
    checker = PrecisionChecker(backend=backend, single_pass=single_pass,
                               dump_dir=str(tmp_path / "dump"))
    checker.wrap_all_children(model, depth=0)

    def step(m):
        m.zero_grad()
        loss = m(x)
        loss.backward()
        return loss

    return checker.compare(step, model)


@pytest.mark.parametrize("single_pass", [True, False])
def test_a_forward_fault_is_named_where_it_is_made(single_pass, tmp_path):
    result = _check(FORWARD_FAULT, single_pass, tmp_path)
    assert not result.all_pass
    cause = result.root_cause
    assert cause["forward"]["module"] == "stage1"
    assert cause["forward"]["check_type"] == "fwd_output"
    assert cause["forward"]["origin"] == "local", cause
    failing = {row.module for row in result.rows if row.status == "FAIL"}
    if single_pass:
        # Each stage gets the same inputs on both sides: only stage1 differs at all.
        assert failing == {"stage1"}, failing
        assert cause["backward"] is None
    else:
        # Two-pass: the difference flows on; downstream stages differ too, but received it.
        assert {"stage2", "stage3"} <= failing
        assert cause["backward"]["origin"] == "carried"
        # What it received differed already: its forward inputs, or (the last stage, whose
        # gradients are beyond fp32 noise now that the loss differs) its grad_output.
        assert "already differed" in cause["backward"]["evidence"], cause
    text = result.text()
    assert "\n  ROOT CAUSE\n" in text
    assert "  forward   stage1 fwd_output[0] (max_abs=" in text
    assert "local, " in text.split("ROOT CAUSE")[1]


@pytest.mark.parametrize("single_pass", [True, False])
def test_a_backward_fault_is_named_in_backward_order(single_pass, tmp_path):
    result = _check(BACKWARD_FAULT, single_pass, tmp_path)
    assert not result.all_pass
    cause = result.root_cause
    assert cause["forward"] is None  # every forward output matched
    assert cause["backward"]["module"] == "stage1"
    assert cause["backward"]["check_type"] in ("grad_input", "param_grad")
    assert cause["backward"]["origin"] == "local", cause
    # What stage1 received from outside matched: the gradient went wrong inside it.
    received = [row for row in result.rows
                if row.module == "stage1" and row.check_type == "grad_output"]
    assert received and all(row.status == "PASS" for row in received)


def test_a_passing_report_has_no_summary_and_the_cli_agrees(tmp_path, dynaprobe_cli):
    result = _check("aot_eager", False, tmp_path)
    assert result.all_pass and result.root_cause is None
    assert "ROOT CAUSE" not in result.text()

    failing = _check(FORWARD_FAULT, False, tmp_path / "faulty")
    json_path = tmp_path / "report.json"
    proc = subprocess.run([dynaprobe_cli, "compare", failing.dump_dir, "--json", str(json_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert failing.text() in proc.stdout  # the CLI prints the in-process report, summary included
    step = json.loads(json_path.read_text())["ranks"][0]["steps"][0]
    assert step["root_cause"] == failing.root_cause


class WithUnused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def test_a_step_failed_by_warnings_alone_ends_with_what_to_do(tmp_path, dynaprobe_cli):
    """No row FAILs, one module was not compared: the RESULT is FAILED, and the report still ends
    with a next line about that module, in every format."""
    torch.manual_seed(0)
    model = WithUnused()
    checker = PrecisionChecker(single_pass=False, dump_dir=str(tmp_path / "dump"))
    checker.wrap(model.used)
    checker.wrap(model.unused)
    result = checker.compare(lambda m: m(torch.randn(2, 4)).sum(), model)

    assert not result.all_pass
    assert {row.status for row in result.rows} == {"PASS", "WARN"}
    next_line = ("no row FAILs, but 1 row in 1 module could not be compared; the first, unused "
                 "NOT_RUN: the step did not call it: wrap modules that run, or check the step")
    assert result.root_cause == {"forward": None, "backward": None, "next": next_line}
    assert result.text().rstrip().endswith("  ROOT CAUSE\n" + "  " + "-" * 68 + "\n"
                                           "  next      " + next_line), result.text()
    json_path = tmp_path / "report.json"
    proc = subprocess.run([dynaprobe_cli, "compare", result.dump_dir, "--json", str(json_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert result.text() in proc.stdout
    step = json.loads(json_path.read_text())["ranks"][0]["steps"][0]
    assert step["root_cause"] == result.root_cause
