"""Backends the user owns, and stages that mean what they say (issue 48, item 4): a backend
registered by name in the user's own module, an inductor pass set globally, a CustomGraphPass
instance. The offline tools import nothing because a dump names it (``--backend``, ``--import``
name what to import, and their errors name the option); a stage that could not run is never
named as the one that fails; the stock stages compile under inductor's stock config; the next
line of a failing report names the command that finds the stage."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tarfile

import pytest
import torch
import torch.nn as nn

from dynaprobe import _C, PrecisionChecker
from dynaprobe.bisect import STAGES
from dynaprobe.repro import write_repro

HERE = os.path.dirname(os.path.abspath(__file__))

# A module of the user's own that registers an aot_autograd backend by name: its forward
# compiler makes every aten.rsqrt 5% too large. Written into a folder that is on sys.path in
# this process and on PYTHONPATH (or not) for the tools.
USER_MODULE = '''
import torch
from functorch.compile import make_boxed_func
from torch._dynamo import register_backend
from torch._dynamo.backends.common import aot_autograd


def _scaled_rsqrt(gm, example_inputs):
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target == torch.ops.aten.rsqrt.default:
            with gm.graph.inserting_after(node):
                scaled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (node, 1.05))
            node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
    gm.recompile()
    return make_boxed_func(gm.forward)


@register_backend
def rsqrt_fault_aot(gm, example_inputs):
    return aot_autograd(fw_compiler=_scaled_rsqrt)(gm, example_inputs)
'''


class RMSNorm(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


@pytest.fixture(scope="module")
def user_dump(tmp_path_factory):
    """A step checked with the user's registered backend: module "0" (the RMSNorm) FAILs."""
    root = tmp_path_factory.mktemp("user_backend")
    (root / "user_backends.py").write_text(USER_MODULE)
    sys.path.insert(0, str(root))
    try:
        import user_backends  # noqa: F401 - registers rsqrt_fault_aot
    finally:
        sys.path.remove(str(root))
    torch.manual_seed(0)
    model = nn.Sequential(RMSNorm(), nn.Linear(16, 16))
    x = torch.randn(4, 16) * 30.0
    checker = PrecisionChecker(backend="rsqrt_fault_aot", dump_dir=str(root / "dump"))
    checker.wrap(model[0])
    result = checker.compare(lambda m: m(x).square().sum() * 1e-3, model)
    assert not result.all_pass
    return root, checker, result


def tool(name, *args, pythonpath=None):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, "-m", f"dynaprobe.{name}", *map(str, args)],
                          capture_output=True, text=True, env=env)


def test_a_registered_backend_is_recorded_with_the_module_that_registers_it(user_dump):
    _, _, result = user_dump
    replay = json.loads(dict(_C.read_step(result.dump_file)["modules"])["0"]["replay"])
    assert replay["backend"] == {"name": "rsqrt_fault_aot",
                                 "defined": "user_backends:rsqrt_fault_aot"}


def test_bisect_names_the_option_for_a_backend_it_cannot_find_and_never_blames_that_stage(
        user_dump):
    root, checker, _ = user_dump
    dump = checker.dump_dir
    # Not registered in a fresh process: the recorded stage could not run, the stock stages did.
    run = tool("bisect", dump, "--module", "0", "--stages", "eager,recorded",
               pythonpath=root)
    assert run.returncode == 2, run.stdout + run.stderr
    said = ("the recorded backend 'rsqrt_fault_aot' is not registered here: it was registered "
            "by user_backends:rsqrt_fault_aot; pass --import user_backends (or --backend "
            "user_backends:rsqrt_fault_aot), with its folder on PYTHONPATH")
    assert f"recorded                     could not run: {said}" in run.stdout
    assert "  stages run: eager; could not run: recorded" in run.stdout
    assert ("forward  first changes at: no stage; first fails against the float64 reference at: "
            "no stage") in run.stdout
    assert run.stderr.splitlines() == [f"dynaprobe bisect: stage recorded could not run: {said}"]

    # Named by the user, it runs, and its stage is the one that fails: exit 1.
    for option in (["--backend", "user_backends:rsqrt_fault_aot"], ["--import", "user_backends"]):
        run = tool("bisect", dump, "--module", "0", "--stages", "eager,recorded", *option,
                   pythonpath=root)
        assert run.returncode == 1, run.stdout + run.stderr
        assert ("forward  first changes at: recorded; first fails against the float64 reference "
                "at: recorded") in run.stdout
        assert "  stages run: eager, recorded\n" in run.stdout

    # A name that cannot be found: one line naming it and the option, exit 2.
    for option, message in (
            (["--backend", "nowhere:backend"], "dynaprobe bisect: --backend nowhere:backend: "
             "cannot import it (ModuleNotFoundError: No module named 'nowhere'); make its module "
             "importable (install its package or put its folder on PYTHONPATH)"),
            (["--backend", "no_such_backend"], "dynaprobe bisect: --backend no_such_backend: "
             "not a registered backend here; expected module:attribute, or a registered "
             "backend's name (e.g. inductor)"),
            (["--import", "nowhere"], "dynaprobe bisect: --import nowhere: cannot import it "
             "(ModuleNotFoundError: No module named 'nowhere'); install its package or put its "
             "folder on PYTHONPATH")):
        run = tool("bisect", dump, "--module", "0", *option, pythonpath=root)
        assert run.returncode == 2 and run.stderr.splitlines() == [message], run.stderr
        assert run.stdout == ""


def test_the_repro_imports_the_module_that_registers_the_backend_and_exits_2_without_it(
        user_dump, tmp_path):
    root, checker, _ = user_dump
    written = tool("repro", checker.dump_dir, "--module", "0", "-o", tmp_path / "repro")
    assert written.returncode == 0, written.stderr
    script = (tmp_path / "repro" / "repro.py").read_text()
    assert ("try:  # the module that registers the recorded backend\n"
            "    import user_backends  # noqa: E402\n"
            "    BACKEND = 'rsqrt_fault_aot'\n") in script
    assert "needs torch and user_backends, which defines its backend or inductor pass" in script
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    replayed = subprocess.run([sys.executable, str(tmp_path / "repro" / "repro.py")],
                              capture_output=True, text=True, env={**env, "PYTHONPATH": root})
    assert replayed.returncode == 1, replayed.stdout + replayed.stderr  # it reproduces
    assert "DIFF fwd_output[0]" in replayed.stdout
    # Elsewhere, without the user's module: exit 2 and what to do, never exit 1 ("reproduces").
    missing = subprocess.run([sys.executable, str(tmp_path / "repro" / "repro.py")],
                             capture_output=True, text=True, env=env)
    assert missing.returncode == 2 and missing.stderr.splitlines() == [
        "repro.py: the recorded backend cannot be imported here (No module named "
        "'user_backends'): put its module's folder on PYTHONPATH, set BACKEND in repro.py, or "
        "pass a registered one: python repro.py --backend inductor"], missing.stderr
    # --backend writes the one the user names.
    written = tool("repro", checker.dump_dir, "--module", "0", "-o", tmp_path / "stock",
                   "--backend", "aot_eager")
    assert written.returncode == 0, written.stderr
    stock = (tmp_path / "stock" / "repro.py").read_text()
    assert "BACKEND = 'aot_eager'  # the backend chosen with --backend" in stock
    assert "needs only torch" in stock
    replayed = subprocess.run([sys.executable, str(tmp_path / "stock" / "repro.py")],
                              capture_output=True, text=True, env=env)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    # A name the user's module registers (here, in this process) imports that module.
    write_repro(checker.dump_dir, "0", str(tmp_path / "named"), backend="rsqrt_fault_aot")
    named = (tmp_path / "named" / "repro.py").read_text()
    assert ("try:  # the module that registers the backend chosen with --backend\n"
            "    import user_backends  # noqa: E402\n"
            "    BACKEND = 'rsqrt_fault_aot'\n") in named
    assert "needs torch and user_backends, which defines its backend" in named
    bad = tool("repro", checker.dump_dir, "--module", "0", "-o", tmp_path / "bad", "--backend",
               "nowhere:backend")
    assert bad.returncode == 2 and bad.stderr.startswith(
        "dynaprobe repro: --backend nowhere:backend: cannot import it"), bad.stderr


def test_the_bundle_says_what_each_repro_needs(user_dump, tmp_path):
    _, checker, _ = user_dump
    run = tool("bundle", checker.dump_dir, "-o", tmp_path / "b.tar.gz")
    assert run.returncode == 0, run.stderr
    with tarfile.open(tmp_path / "b.tar.gz") as tar:
        readme = tar.extractfile("dynaprobe_bundle/README.md").read().decode()
    assert "python repros/0.step0/repro.py   # needs torch and user_backends, which defines " \
           "its backend or inductor pass" in readme, readme
    run = tool("bundle", checker.dump_dir, "-o", tmp_path / "c.tar.gz", "--backend", "nowhere:x")
    assert run.returncode == 2 and not (tmp_path / "c.tar.gz").exists(), run.stderr


def test_stock_stages_compile_under_stock_config_whatever_the_process_set(tmp_path):
    """The user's pass set globally, as inductor compiles the backward lazily: in the training
    process, bisect's inductor stage still runs stock inductor and passes; only the recorded
    stage carries the pass. Set as a CustomGraphPass instance at module level, which the dump
    records by its name."""
    from models import RSQRT_PASS, rmsnorm_under_inductor

    checker, model, x = rmsnorm_under_inductor(str(tmp_path / "dump"))
    before = torch._inductor.config.post_grad_custom_post_pass
    torch._inductor.config.post_grad_custom_post_pass = RSQRT_PASS
    try:
        result = checker.compare(lambda m: m(x).square().sum(), model)
        assert not result.all_pass
        torch._dynamo.reset()
        bisected = checker.bisect("0", stages=[s for s in STAGES if s.name == "inductor"] +
                                  ["recorded"])
    finally:
        torch._inductor.config.post_grad_custom_post_pass = before
    assert [s.name for s in bisected.stages] == ["inductor", "recorded"]
    assert not bisected.stages[0].failed(True), bisected.text()
    assert bisected.first_failing(True) == "recorded", bisected.text()
    replay = json.loads(dict(_C.read_step(result.dump_file)["modules"])["0"]["replay"])
    assert replay["inductor_config"]["post_grad_custom_post_pass"] == {
        "import": "models:RSQRT_PASS"}
    # From a shell, the pass's module is imported only when named.
    run = tool("bisect", checker.dump_dir, "--module", "0", "--stages", "eager,recorded",
               pythonpath=HERE)
    assert run.returncode == 2 and "pass --import models" in run.stdout, run.stdout
    run = tool("bisect", checker.dump_dir, "--module", "0", "--stages", "eager,recorded",
               "--import", "models", pythonpath=HERE)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "first fails against the float64 reference at: recorded" in run.stdout


def test_the_next_line_of_a_failing_report_is_a_command_that_runs(user_dump, dynaprobe_cli):
    root, checker, result = user_dump
    next_line = result.root_cause["next"]
    # It imports the module that registers the backend: the commands run as printed.
    command = f"dynaprobe bisect {checker.dump_dir} --module 0 --ops --import user_backends"
    remedy = f"dynaprobe remedy {checker.dump_dir} --module 0 --import user_backends"
    assert next_line.endswith(f"find the compile stage and op that change it: {command}; "
                              f"then a change that fixes it: {remedy}"), next_line
    env = {**os.environ, "DYNAPROBE_PYTHON": sys.executable, "PYTHONPATH": str(root)}
    run = subprocess.run([dynaprobe_cli, *shlex.split(command)[1:], "--stages", "eager,recorded"],
                         capture_output=True, text=True, env=env)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "first fails against the float64 reference at: recorded" in run.stdout
    # The remedy command, as printed (timed once, not 5 times): a change passes, exit 0.
    run = subprocess.run([dynaprobe_cli, *shlex.split(remedy)[1:], "--repeats", "1"],
                         capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert 'backend="inductor"' in run.stdout, run.stdout


def test_remedy_of_a_registered_backend_replaces_it(user_dump):
    """Remedies of a call captured with the user's registered aot_autograd backend: inductor's
    switches cannot reach it (they FAIL on replay), stock inductor in its place passes, and
    the remedy is the cheapest passing change."""
    _, checker, _ = user_dump
    [module] = checker.remedy(repeats=1).modules
    by_name = {t.change.name: t for t in module.trials}
    assert module.reproduces and by_name['backend="inductor"'].passes, module.text()
    assert by_name["fallback_random=True"].verdict == "FAIL", module.text()
    assert module.remedy is module.passing()[0] and module.remedy.passes
    assert "torch._inductor.config.fallback_random = True" in \
        by_name["fallback_random=True"].change.code("0", module.recorded_backend)
