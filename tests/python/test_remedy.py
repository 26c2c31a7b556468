"""Remedies, tried and proved (issue 48, item 1): each failing module's stored call replayed
under candidate changes, judged as the report judges, the passing ones timed, and the cheapest
printed as code that, pasted into a plain torch.compile script, gives eager's numbers."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from models import RSQRT_BF16_PASS, DropoutBlock, RMSNormMLP

from dynaprobe import PrecisionChecker
from dynaprobe.remedy import SWITCHES, Change, candidates, remedy_dump

HERE = os.path.dirname(os.path.abspath(__file__))


def pasted(code: str, model: nn.Module) -> None:
    """Runs a remedy's code as a user pastes it: ``model`` and ``torch`` in scope."""
    exec(code, {"torch": torch, "model": model})  # noqa: S102 - the code under test


def trials(found) -> dict:
    return {t.change.name: t for t in found.trials}


def test_remedy_puts_back_the_captures_own_pass_and_the_code_gives_eagers_numbers(
        tmp_path, dynaprobe_cli):
    """Inductor with a custom post-grad pass (set globally) that makes aten.rsqrt 5% too large:
    the stock switches leave it failing, putting the pass back to None passes, so do the stock
    backends and the module uncompiled; the cheapest passing change is the remedy, and every
    passing change's code, pasted into a plain torch.compile of the model while the pass is still
    set globally, gives eager's numbers."""
    from models import RSQRT_PASS, rmsnorm_under_inductor

    checker, model, x = rmsnorm_under_inductor(str(tmp_path / "dump"))

    def step(m):
        m.zero_grad()
        loss = m(x).square().sum() * 1e-3
        loss.backward()
        return loss

    with torch._inductor.config.patch(post_grad_custom_post_pass=RSQRT_PASS):
        assert not checker.compare(step, model).all_pass
        found = checker.remedy()
        assert found, found.text()
        [module] = found.modules
        assert module.module == "0" and module.reproduces
        by_name = trials(module)
        assert by_name["post_grad_custom_post_pass=None"].passes, module.text()
        for name in ("fallback_random=True", "max_fusion_size=1", "pattern_matcher=False"):
            assert by_name[name].verdict == "FAIL", module.text()  # the pass still runs
        for name in ('backend="aot_eager"', "uncompiled"):
            assert by_name[name].passes, module.text()
        passing = module.passing()
        assert module.remedy is passing[0]
        assert [t.seconds for t in passing] == sorted(t.seconds for t in passing)
        assert module.remedy.seconds > 0 and module.recorded.seconds > 0
        text = module.text()
        assert f"remedy: {module.remedy.change.name} (" in text
        assert module.code() in text.replace("\n      ", "\n")

        expected = model(x)
        for trial in passing:  # compiled per block, as pasted; compiled whole, as the comment
            for whole in (False, True):
                torch._dynamo.reset()
                fixed = copy.deepcopy(model)
                if not whole:
                    pasted(trial.change.code("0", "inductor"), fixed)
                elif trial.change.uncompiled:
                    pasted(trial.change.code("0", "inductor"), fixed)
                    fixed = torch.compile(fixed, backend="inductor")
                else:
                    fixed = eval(f"torch.compile(fixed, "  # noqa: S307 - the code under test
                                 f"{trial.change.compile_arguments('inductor')})")
                assert torch.allclose(fixed(x), expected, atol=1e-5, rtol=1e-5), \
                    (trial.change.name, whole)
        for whole in (False, True):  # the fault is real, either way
            torch._dynamo.reset()
            broken = copy.deepcopy(model)
            if whole:
                broken = torch.compile(broken, backend="inductor")
            else:
                broken[0].compile(backend="inductor")
            assert not torch.allclose(broken(x), expected, atol=1e-3, rtol=1e-3)
        torch._dynamo.reset()
        confirmed = checker.confirm(found, step, model, repeats=1)  # the cheapest, whichever
        assert confirmed, confirmed.text()
        assert f"  0: {module.remedy.change.name} (" in confirmed.text()
    assert 'options={"post_grad_custom_post_pass": None}' in \
        by_name["post_grad_custom_post_pass=None"].change.code("0", "inductor")

    # From a shell: the pass's module is imported only when named; the JSON holds the remedy.
    def remedy(*args):
        env = {**os.environ, "DYNAPROBE_PYTHON": sys.executable, "PYTHONPATH": HERE}
        return subprocess.run([dynaprobe_cli, "remedy", checker.dump_dir, *map(str, args)],
                              capture_output=True, text=True, env=env)

    run = remedy("--repeats", "1")
    assert run.returncode == 2 and "pass --import models" in run.stderr, run.stdout + run.stderr
    out = tmp_path / "remedy.json"
    run = remedy("--import", "models", "--repeats", "1", "--json", out)
    assert run.returncode == 0, run.stdout + run.stderr
    written = json.loads(out.read_text())
    [entry] = written["modules"]
    assert entry["module"] == "0" and entry["reproduces"] and entry["recorded"]["verdict"] == "FAIL"
    assert entry["remedy"]["verdict"] == "pass" and entry["remedy"]["code"] in run.stdout.replace(
        "\n      ", "\n")
    assert {t["change"]["name"]: t["verdict"] for t in entry["trials"]}[
        "post_grad_custom_post_pass=None"] == "pass"


def test_dropout_under_inductor_is_remedied_by_fallback_random_and_confirmed(tmp_path):
    """Single-pass, a dropout block under stock inductor FAILs (inductor draws its own masks):
    fallback_random is found and passes on the replay, the other switches do not; its code,
    pasted, draws eager's masks under torch.compile; confirmed on the next checked step (losses
    and gradient norms equal, the speed measured), it stays applied, and the following checked
    step passes. A change that does not fix it is not confirmed and not applied."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), DropoutBlock(), nn.Linear(8, 8))
    x = torch.randn(16, 8)

    def step(m):
        m.zero_grad()
        loss = m(x).square().mean() * 1e-3
        loss.backward()
        return loss

    checker = PrecisionChecker(backend="inductor", dump_dir=str(tmp_path / "dump"))
    checker.wrap(model[1])
    assert not checker.compare(step, model).all_pass
    [module] = checker.remedy(repeats=1).modules
    by_name = trials(module)
    assert module.reproduces and by_name["fallback_random=True"].passes, module.text()
    assert by_name["emulate_precision_casts=True"].verdict == "FAIL", module.text()
    assert module.remedy is not None and module.remedy.passes
    assert "passing, cheapest first: " in module.text()

    wrong = checker.confirm({"1": by_name["max_fusion_size=1"].change}, step, model, repeats=1)
    assert not wrong and wrong.text().startswith("not confirmed on step 0: "), wrong.text()
    assert not checker.compare(step, model).all_pass  # not applied

    fixed = checker.confirm({"1": by_name["fallback_random=True"].change}, step, model)
    assert fixed, fixed.text()
    assert fixed.text().startswith("confirmed on step 1: every row passes, loss eager="), \
        fixed.text()
    assert fixed.result.loss_eager == pytest.approx(fixed.result.loss_compiled, rel=1e-5)
    assert fixed.grad_norms[0] == pytest.approx(fixed.grad_norms[1], rel=1e-5)
    assert set(fixed.seconds) == {"eager", "compiled", "remedied"}
    assert all(seconds > 0 for seconds in fixed.seconds.values())
    assert "x the compiled step without it" in fixed.text()
    assert os.path.basename(os.path.dirname(fixed.result.dump_file)) == "two_pass"
    assert checker.compare(step, model).all_pass  # applied from now on

    block = model[1]
    torch.manual_seed(1)
    expected = block(x)
    pasted(by_name["fallback_random=True"].change.code("1", "inductor"), model)
    torch.manual_seed(1)
    assert torch.allclose(block(x), expected, atol=1e-6)
    torch._dynamo.reset()


@pytest.mark.parametrize("from_class", [False, True], ids=["graph", "class"])
def test_a_bf16_fault_only_the_reference_finds_is_judged_by_the_reference_on_replay(from_class,
                                                                                    tmp_path):
    """bfloat16, inductor with a post-grad pass that makes rsqrt 1% too large: within bf16's
    tolerances, so the report FAILs it against its reference (on by default in bf16). The
    replays judge as the report did, with the call replayed in float64 as the reference (from
    its captured graph, or through a float64 copy of the module rebuilt from its class): the
    recorded compile fails again (it passed the tolerances and "did not reproduce" before),
    putting the pass back is the remedy, and the stage bisection blames the recorded backend
    while stock inductor, whose bf16 rounding differs from eager's too, passes."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(RMSNormMLP(64)).to(torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)

    def step(m):
        m.zero_grad()
        loss = m(x).float().square().sum() * 1e-3
        loss.backward()
        return loss

    checker = PrecisionChecker(backend="inductor", dump_dir=str(tmp_path / "dump"))
    checker.wrap(model[0])
    put_back = Change("post_grad_custom_post_pass=None", "the pass put back",
                      {"post_grad_custom_post_pass": None})
    with torch._inductor.config.patch(post_grad_custom_post_pass=RSQRT_BF16_PASS):
        result = checker.compare(step, model)
        output = next(r for r in result.rows if r.check_type == "fwd_output")
        assert output.status == "FAIL", result.text()
        assert output.reference["tolerance_status"] == "PASS", output.reference
        [module] = remedy_dump(checker.dump_dir, changes=[put_back], repeats=1,
                               from_class=from_class).modules
        assert module.reproduces and module.recorded.verdict == "FAIL", module.text()
        assert module.remedy is not None and module.remedy.change is put_back, module.text()
        bisected = checker.bisect("0", from_class=from_class)
    assert bisected.first_failing(True) == bisected.first_failing(False) == "recorded", \
        bisected.text()
    assert "first fails against the float64 reference at: recorded" in bisected.text()
    stock = next(stage for stage in bisected.stages if stage.name == "inductor")
    assert stock.changed(True) and not stock.failed(True) and not stock.failed(False), \
        bisected.text()


def test_candidates_follow_the_recorded_compile():
    """Inductor switches only where inductor compiles, on the devices they matter on; a switch
    the capture set is put back; the recorded backend is never a candidate of its own."""
    names = [c.name for c in candidates("inductor", {}, "cpu")]
    assert "cpp.simdlen=1" in names and "comprehensive_padding=False" not in names
    assert 'backend="inductor"' not in names and names[-1] == "uncompiled"
    assert "comprehensive_padding=False" in [c.name for c in candidates("inductor", {}, "cuda:0")]
    plain = [c.name for c in candidates("aot_eager", {}, "cpu")]
    assert plain == ['backend="inductor"', 'backend="aot_eager_decomp_partition"',
                     'backend="eager"', "uncompiled"]
    own = [c for c in candidates("inductor", {"max_autotune": True}, "cpu")
           if c.config == {"max_autotune": False}]
    assert len(own) == 1 and own[0].name == "max_autotune=False"
    assert len(SWITCHES) == len({tuple(s[0]) for s in SWITCHES})
