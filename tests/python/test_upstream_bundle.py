"""Bug reports in the form PyTorch's compiler team acts on (issue 48, item 3): the bundle's repro
exposes test_fn() -> bool (same() against a float64 replay) and prints that verdict, and the
bundle carries collect_env's output and a suggested issue title and labels."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _failing_dump(tmp_path):
    """The checker of a dump whose module "0" FAILs: inductor with a custom post-grad pass that
    makes aten.rsqrt 5% too large, set globally as the user would."""
    import models

    checker, model, x = models.rmsnorm_under_inductor(str(tmp_path / "dump"))

    def step(m):
        m.zero_grad()
        loss = m(x).square().sum() * 1e-3
        loss.backward()
        return loss

    with torch._inductor.config.patch(post_grad_custom_post_pass=models.RSQRT_PASS):
        assert not checker.compare(step, model).all_pass
    return checker


def test_the_bundles_repro_exposes_test_fn_and_the_bundle_a_title_labels_and_collect_env(
        tmp_path):
    """Inductor with a custom post-grad pass that makes aten.rsqrt 5% too large: the repro's
    test_fn() is False, True once the remedy (the pass put back) is set, or under aot_eager;
    the script prints same()'s verdict; the README suggests a title naming the module and the
    labels; collect_env.txt is torch's own; CompilerBisector names the post-grad pass, and its
    replay line differs at its application count and matches one below it."""
    checker = _failing_dump(tmp_path)
    env = {**os.environ, "PYTHONPATH": HERE}  # where the pass's module is, as for the user
    archive = tmp_path / "report.tar.gz"
    made = subprocess.run([sys.executable, "-m", "dynaprobe.bundle", checker.dump_dir, "-o",
                           str(archive), "--bisect"], capture_output=True, text=True, env=env)
    assert made.returncode == 0, made.stderr
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "issue", filter="data")
    bundle = tmp_path / "issue" / "dynaprobe_bundle"
    readme = (bundle / "README.md").read_text()
    assert 'Suggested issue title: torch.compile(backend="inductor") changes the forward output ' \
           "of 0 (max_rel " in readme, readme
    assert "Labels: `module: pt2 accuracy`, `oncall: pt2`, `module: inductor`" in readme
    assert f"PyTorch version: {torch.__version__}" in (bundle / "collect_env.txt").read_text()

    # CompilerBisector on the repro's test_fn names the pass, and its replay line replays it.
    assert "first to differ: backend inductor, subsystem post_grad_passes, application " in readme
    [line] = [line for line in readme.splitlines() if line.startswith("replay: ")]
    assert "post_grad_custom_post_pass" in (bundle / "repros" / "0.step0" /
                                            "compiler_bisector.txt").read_text()
    bisect_env = dict(word.split("=") for word in line.split()[1:4])
    assert bisect_env["TORCH_BISECT_BACKEND"] == "inductor"
    assert bisect_env["TORCH_BISECT_SUBSYSTEM"] == "post_grad_passes"
    folder = bundle / "repros" / "0.step0"
    last_good = str(int(bisect_env["TORCH_BISECT_MAX"]) - 1)
    runs = {}
    for limit, code in ((bisect_env["TORCH_BISECT_MAX"], 1), (last_good, 0)):
        runs[code] = subprocess.run([sys.executable, "repro.py"], capture_output=True,
                                    text=True, cwd=folder,
                                    env={**env, **bisect_env, "TORCH_BISECT_MAX": limit})
        assert runs[code].returncode == code, (limit, runs[code].stdout + runs[code].stderr)
    # The script prints same()'s verdict: False where the pass runs (up to its count), as
    # without TORCH_BISECT_* set, and True below it.
    for code, verdict in ((1, False), (0, True)):
        assert "same() against float64 (torch._dynamo.utils.same, tol=0.0001): " \
            f"{verdict} (test_fn())" in runs[code].stdout, runs[code].stdout

    probe = ("import repro; print(repro.test_fn()); "
             "repro.INDUCTOR_CONFIG = {'post_grad_custom_post_pass': None}; "
             "print(repro.test_fn()); print(repro.test_fn('aot_eager'))")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                         cwd=folder)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False", "True", "True"], run.stdout + run.stderr


def test_the_repro_rebuilding_the_module_from_its_class_exposes_test_fn_and_bisects(tmp_path):
    """The --from-class repro (the module rebuilt from its class, for a dump whose graph cannot
    be replayed): test_fn() False under the recorded inductor with its 5% rsqrt pass, True under
    aot_eager; the script prints same()'s verdict; --bisect runs CompilerBisector on test_fn()
    and names the post-grad pass."""
    checker = _failing_dump(tmp_path)
    env = {**os.environ, "PYTHONPATH": HERE}  # the model's and the pass's module, as the user's
    folder = tmp_path / "repro"
    made = subprocess.run([sys.executable, "-m", "dynaprobe.repro", checker.dump_dir, "--module",
                           "0", "-o", str(folder), "--from-class"], capture_output=True,
                          text=True, env=env)
    assert made.returncode == 0, made.stderr

    probe = "import repro; print(repro.test_fn()); print(repro.test_fn('aot_eager'))"
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                         cwd=folder)
    assert run.stdout.split() == ["False", "True"], run.stdout + run.stderr
    run = subprocess.run([sys.executable, "repro.py"], capture_output=True, text=True, env=env,
                         cwd=folder)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "same() against float64 (torch._dynamo.utils.same, tol=0.0001): False (test_fn())" \
        in run.stdout, run.stdout
    run = subprocess.run([sys.executable, "repro.py", "--bisect"], capture_output=True,
                         text=True, env=env, cwd=folder)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "first to differ: backend inductor, subsystem post_grad_passes, application " \
        in run.stdout, run.stdout
