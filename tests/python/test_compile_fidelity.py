"""Compile-side fidelity with real torch.compile: autocast on both sides, modules that end up not
compiled, graph breaks, backends (inductor on CPU included), the dropout RNG difference of
inductor, and one-sided captures made in separate processes compared with the CLI."""

import itertools
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn
from models import Block, DropoutBlock, TinyTransformer, compiled_copy

from dynaprobe import PrecisionChecker
from dynaprobe._mechanics.capture import autocast_context

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def _fresh_dynamo(tmp_path, monkeypatch):
    torch._dynamo.reset()
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)


def train_step(model, x):
    model.zero_grad()
    loss = model(x).float().pow(2).mean()
    loss.backward()
    return loss


def rows_of(result, check_type=None, module=None):
    return [r for r in result if (check_type is None or r.check_type == check_type)
            and (module is None or r.module == module)]


def compare_json(cli, *args):
    proc = subprocess.run([cli, "compare", *map(str, args), "--json", "report.json"],
                          capture_output=True, text=True)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    return proc, json.loads(pathlib.Path("report.json").read_text())


# --------------------------------------------------------------------------- autocast
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("single_pass", [True, False], ids=["single_pass", "two_pass"])
def test_autocast_bf16_on_cpu_runs_both_sides_in_bf16_and_really_compiles(backend, single_pass,
                                                                         dynaprobe_cli):
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    # Reduced precision, tolerances of the user's choosing (a few bfloat16 ulps).
    checker = PrecisionChecker(backend=backend, cast_dtype=torch.bfloat16, single_pass=single_pass,
                               threshold=1e-2, rtol=1e-2, dump_graphs=True, graph_dir="graphs",
                               dump_dir="dump")
    checker.wrap_all_children(model, depth=0)
    result = checker.compare(lambda m: train_step(m, torch.randn(8, 16)), model)
    assert result.all_pass, result.text()

    # Autocast ran on both sides: the linear layers' outputs are bfloat16 on each.
    for module in ("0", "2"):
        (row,) = rows_of(result, "fwd_output", module)
        assert (row.eager_dtype, row.compiled_dtype) == ("bfloat16", "bfloat16")
    (row,) = rows_of(result, "fwd_input", "0")
    assert (row.eager_dtype, row.compiled_dtype) == ("float32", "float32")  # the model's input
    assert all(r.eager_dtype == r.compiled_dtype == "float32"
               for r in rows_of(result, "param_grad"))  # fp32 parameters, fp32 gradients

    # The compiled side really is compiled: a function per module, graphs that cast to bf16.
    for module in ("0", "1", "2"):
        assert result.modules[module]["compiled_functions"], result.modules
        assert "note" not in result.modules[module]
    forward_graphs = [p for p in os.listdir("graphs") if ".Forward_Graph." in p]
    assert len(forward_graphs) == 3
    linear_graphs = [p for p in forward_graphs if "addmm" in pathlib.Path("graphs", p).read_text()]
    assert len(linear_graphs) == 2
    assert all("bf16[" in pathlib.Path("graphs", p).read_text() for p in linear_graphs)

    loss_line = result.text().splitlines()[1]
    assert loss_line.startswith("  Loss  ") and "  cast_dtype=torch.bfloat16" in loss_line
    # Every tensor's dtype, per side, in the JSON report.
    _, report = compare_json(dynaprobe_cli, "dump")
    step = report["ranks"][0]["steps"][0]
    assert step["cast_dtype"] == "torch.bfloat16"
    dtypes = {(r["module"], r["check_type"], r["tensor_index"]): (r["eager"]["dtype"],
                                                                   r["compiled"]["dtype"])
              for r in step["rows"] if r["eager"] and r["compiled"]}
    assert dtypes[("0", "fwd_output", 0)] == ("bfloat16", "bfloat16")
    assert dtypes[("2", "fwd_output", 0)] == ("bfloat16", "bfloat16")
    assert dtypes[("0", "fwd_input", 0)] == ("float32", "float32")
    assert {dtypes[k] for k in dtypes if k[1] == "param_grad"} == {("float32", "float32")}
    assert len(dtypes) == len([r for r in result if r.check_type != "note"])


def test_autocast_uses_the_device_type_of_the_module():
    assert autocast_context(None, {torch.device("cpu")}).__class__.__name__ == "nullcontext"
    assert autocast_context(torch.bfloat16, {torch.device("cpu")}).device == "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a CPU-only torch disables CUDA autocast with a warning
        context = autocast_context(torch.float16, {torch.device("cpu"), torch.device("cuda", 0)})
    assert (context.device, context.fast_dtype) == ("cuda", torch.float16)


# --------------------------------------------------------------------------- not compiled
class DisabledForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    @torch._dynamo.disable
    def forward(self, x):
        return torch.tanh(self.linear(x))


class Normal(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class Identity(nn.Module):
    def forward(self, x):
        return x  # no tensor operation: Dynamo has nothing to compile


class Constant(nn.Module):
    def forward(self, x):
        return 3.0  # a Python constant


class UsesConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.scale = Constant()

    def forward(self, x):
        return self.linear(x) * self.scale(x)


def _exploding_backend(gm, example_inputs):
    raise RuntimeError("backend exploded on purpose")


NOT_COMPILED_CASES = {
    # case: (model, wrapped module, backend, words the reason must contain)
    "dynamo_disable": (lambda: nn.Sequential(nn.Linear(8, 8), DisabledForward(), nn.Linear(8, 8)),
                       "1", "aot_eager", "torch.compiler.disable"),
    "backend_error_fallback": (lambda: nn.Sequential(nn.Linear(8, 8), Normal(), nn.Linear(8, 8)),
                               "1", _exploding_backend, "backend exploded on purpose"),
    "returns_its_input": (lambda: nn.Sequential(nn.Linear(8, 8), Identity(), nn.Linear(8, 8)),
                          "1", "aot_eager", "no tensor operations"),
    "returns_a_constant": (UsesConstant, "scale", "aot_eager", "no tensor operations"),
}


@pytest.mark.parametrize("case", sorted(NOT_COMPILED_CASES))
@pytest.mark.parametrize("single_pass", [True, False], ids=["single_pass", "two_pass"])
def test_a_module_that_runs_eagerly_on_the_compiled_side_is_not_a_pass(case, single_pass, capsys):
    build, wrapped, backend, reason_words = NOT_COMPILED_CASES[case]
    model = build()
    checker = PrecisionChecker(backend=backend, single_pass=single_pass)
    checker.wrap(dict(model.named_modules())[wrapped])
    # backend_error_fallback: Dynamo runs the frame eagerly instead of raising when the backend
    # fails.
    with torch._dynamo.config.patch(suppress_errors=case == "backend_error_fallback"):
        result = checker.compare(lambda m: train_step(m, torch.randn(4, 8)), model)
    checker.report(result)
    out = capsys.readouterr().out

    (note,) = [r for r in result if r.check_type == "note"]
    assert (note.module, note.status, note.note) == (wrapped, "WARN", "NOT_COMPILED")
    assert "eager was compared with eager" in note.reason and reason_words in note.reason
    # The row, then its reason on the lines below it (indented 8, wrapped at 120 columns).
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines)
              if re.fullmatch(rf"  WARN  {re.escape(wrapped)} +NOT_COMPILED", line))
    below = " ".join(line.strip() for line in itertools.takewhile(
        lambda line: line.startswith(" " * 8), lines[at + 1:]))
    assert reason_words in below, out
    assert "RESULT: FAILED" in out and not result.all_pass
    # Whatever was compared agrees (it was eager against eager): only the note fails the step.
    assert [r for r in result.failures] == [note]
    attrs = result.modules[wrapped]
    assert attrs["note"] == "NOT_COMPILED" and attrs["compiled_functions"] == ""
    if case == "backend_error_fallback":
        assert "backend exploded on purpose" in attrs["compile_errors"]


@pytest.mark.parametrize("single_pass", [True, False], ids=["single_pass", "two_pass"])
def test_a_normally_compiled_module_is_not_flagged(single_pass):
    model = nn.Sequential(nn.Linear(8, 8), Normal(), nn.Linear(8, 8))
    checker = PrecisionChecker(single_pass=single_pass)
    checker.wrap(model[1])
    result = checker.compare(lambda m: train_step(m, torch.randn(4, 8)), model)
    assert result.all_pass, result.text()
    assert not [r for r in result if r.note == "NOT_COMPILED"]
    assert "NOT_COMPILED" not in result.text()
    attrs = result.modules["1"]
    assert "note" not in attrs and attrs["compiled_functions"].startswith("__compiled_fn_")
    assert attrs["graph_breaks"] == "0" and "compile_errors" not in attrs


# --------------------------------------------------------------------------- graph breaks
class Breaks(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)

    def forward(self, x):
        x = torch.tanh(self.first(x))
        torch._dynamo.graph_break()
        return self.second(x)


@pytest.mark.parametrize("single_pass", [True, False], ids=["single_pass", "two_pass"])
def test_graph_breaks_are_counted_per_wrapped_module(single_pass, dynaprobe_cli):
    model = nn.Sequential(Breaks(), Normal())
    checker = PrecisionChecker(single_pass=single_pass, dump_dir="dump")
    checker.wrap_all_children(model, depth=0)
    result = checker.compare(lambda m: train_step(m, torch.randn(4, 8)), model)
    assert result.all_pass, result.text()  # both halves compiled, and they agree

    listing = subprocess.run([dynaprobe_cli, "ls", "dump"], capture_output=True, text=True)
    assert listing.returncode == 0, listing.stderr
    (line0,) = [l for l in listing.stdout.splitlines() if re.match(r"^    0 ", l)]
    (line1,) = [l for l in listing.stdout.splitlines() if re.match(r"^    1 ", l)]
    assert "graph_breaks=1" in line0 and "graph_break()" in line0, line0
    assert re.search(r"compiled_functions=__compiled_fn_\d+,__compiled_fn_\d+,", line0), line0
    assert "graph_breaks=0" in line1 and "graph_break_reasons" not in line1, line1

    attrs = result.modules["0"]
    assert attrs["graph_breaks"] == "1"
    assert attrs["graph_break_reasons"] == "Call to `torch._dynamo.graph_break()`"
    assert len(attrs["compiled_functions"].split(",")) == 2
    assert "NOT_COMPILED" not in result.text()


# --------------------------------------------------------------------------- backends
class GroupNormBlock(nn.Module):
    """A diffusion UNet's resnet block in small: GroupNorm, SiLU, convolution, residual."""

    def __init__(self, channels: int = 16):
        super().__init__()
        self.norm = nn.GroupNorm(4, channels)
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return x + self.conv(nn.functional.silu(self.norm(x)))


class ChannelMixer(nn.Module):
    """A UNet's attention block in small: GroupNorm, then a mix over the channels, residual."""

    def __init__(self, channels: int = 16):
        super().__init__()
        self.norm = nn.GroupNorm(4, channels)
        self.mix = nn.Linear(channels, channels)

    def forward(self, x):
        return x + self.mix(self.norm(x).transpose(1, 3)).transpose(1, 3)


class DownsamplingNet(nn.Module):
    """Blocks of one class at three resolutions, the lower two followed by a block of another
    class, as in a UNet's down path (attention at the lower resolutions only)."""

    def __init__(self, channels: int = 16):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList([GroupNormBlock(channels) for _ in range(3)])
        self.mixers = nn.ModuleList([ChannelMixer(channels) for _ in range(2)])

    def forward(self, x):
        h = self.blocks[0](self.stem(x))
        for block, mixer in zip(self.blocks[1:], self.mixers):
            h = mixer(block(nn.functional.avg_pool2d(h, 2)))
        return h.pow(2).mean()


def test_blocks_of_one_class_at_other_sizes_compile_to_the_program_the_user_trains(tmp_path):
    """Without the checker the second block, at half the first's resolution, makes Dynamo compile
    that class with symbolic sizes (automatic dynamic shapes), and inductor emits other kernels;
    its outputs carry the symbolic dimensions (AOTAutograd marks them) into the next compiled
    module, the mixer, which is compiled with symbolic sizes at its very first call. The checker's
    compilation must learn the same, or the step it checks is another program than the one
    trained (issue 47: a diffusers UNet's loss and gradients moved under it)."""
    model, x = DownsamplingNet(), torch.randn(2, 3, 16, 16)

    def step(m):
        m.zero_grad()
        loss = m(x)
        loss.backward()
        return loss

    def state(m, loss):
        return [loss.detach()] + [p.grad for p in m.parameters()]

    unchecked = compiled_copy(model, (GroupNormBlock, ChannelMixer), "inductor")
    expected = state(unchecked, step(unchecked))
    torch._dynamo.reset()

    checker = PrecisionChecker(backend="inductor", dump_dir=str(tmp_path / "dump"))
    checker.wrap_by_policy(model, (GroupNormBlock, ChannelMixer))
    checker.install(model)
    loss = step(model)
    result = checker.collect(loss)
    checker.uninstall()
    assert result.all_pass, result.text()
    for name, got, want in zip(["loss"] + [n for n, _ in model.named_parameters()],
                               state(model, loss), expected):
        assert torch.equal(got, want), name


def test_inductor_training_step_on_a_small_transformer_passes_in_fp32(capsys):
    model = TinyTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 50, (2, 12))
    targets = torch.randint(0, 50, (2, 12))
    checker = PrecisionChecker(backend="inductor")  # default tolerances
    checker.wrap_by_policy(model, (Block,))
    checker.install(model)
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
    loss.backward()
    optimizer.step()
    result = checker.collect(loss)
    checker.uninstall()
    with capsys.disabled():  # the measured differences, as they are
        print("\n" + result.text())
    assert result.all_pass, result.text()
    for block in ("blocks.0", "blocks.1"):
        assert result.modules[block]["compiled_functions"]
        assert result.modules[block]["graph_breaks"] == "0"
        for kind in ("fwd_output", "grad_input", "param_grad"):
            rows = rows_of(result, kind, block)
            assert rows and all(r.status == "PASS" and r.max_abs <= 1e-4 for r in rows)
    assert len(rows_of(result, "param_grad", "blocks.0")) == 12


@pytest.mark.parametrize("fallback_random", [False, True])
def test_dropout_under_inductor_needs_fallback_random(fallback_random, capsys):
    """Inductor draws dropout masks from its own RNG: eager and compiled masks differ unless
    torch._inductor.config.fallback_random makes it use eager's random ops."""
    assert torch._inductor.config.fallback_random is False  # PyTorch's default
    model = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5), nn.Linear(64, 8))
    checker = PrecisionChecker(backend="inductor")
    checker.wrap_all_children(model, depth=0)
    with torch._inductor.config.patch(fallback_random=fallback_random):
        result = checker.compare(lambda m: train_step(m, torch.randn(16, 8)), model)
    checker.report(result)
    out = capsys.readouterr().out
    if fallback_random:
        assert result.all_pass, out
    else:
        assert not result.all_pass
        assert {(r.module, r.check_type) for r in result.failures} == {("1", "fwd_output"),
                                                                     ("1", "grad_input")}
        assert re.search(r"^  FAIL  1 +\[!!\]", out, re.M), out
        assert "RESULT: FAILED" in out
    for module in ("0", "2"):  # the linear layers agree either way
        assert all(r.status == "PASS" for r in rows_of(result, module=module))


@pytest.mark.parametrize("mode,backend,fallback_random", [
    *[(mode, "inductor", fallback) for mode in ("single_pass", "two_pass", "whole_model")
      for fallback in (False, True)],
    ("single_pass", "aot_eager", False)])
def test_every_mode_names_random_draws_under_inductor_as_the_next_step(mode, backend,
                                                                       fallback_random, tmp_path):
    """A wrapped block with dropout under inductor FAILs (its eager run drew other numbers than
    inductor's kernels), in every mode, and the report's next line says why and what to set;
    with fallback_random, or under aot_eager (eager's random ops), the block passes and no draws
    are noted."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), DropoutBlock(), nn.Linear(8, 8))
    x = torch.randn(16, 8)
    torch._dynamo.reset()
    with torch._inductor.config.patch(fallback_random=fallback_random):
        checker = PrecisionChecker(backend=backend, single_pass=mode != "two_pass",
                                   dump_dir=str(tmp_path / "dump"))
        checker.wrap_by_policy(model, (DropoutBlock,))
        if mode == "whole_model":
            compiled = checker.install(torch.compile(model, backend=backend))
            result = checker.collect(train_step(compiled, x))
            checker.uninstall()
        else:
            result = checker.compare(lambda m: train_step(m, x), model)
    torch._dynamo.reset()
    if backend == "inductor" and not fallback_random:
        assert not result.all_pass
        assert result.root_cause["forward"]["module"] == "1", result.text()
        assert result.modules["1"]["random_draws"] == "cpu"
        assert ("1 draws random numbers (dropout, torch.rand; generator cpu) in its compiled "
                "call, and inductor draws its own: set torch._inductor.config.fallback_random "
                "= True") in result.root_cause["next"], result.text()
    else:
        assert result.all_pass, result.text()
        assert "random_draws" not in result.modules["1"]


# --------------------------------------------------------------------------- cross-machine
CAPTURE_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    sys.path.insert(0, {tests!r})
    from models import Block, TinyTransformer
    from dynaprobe import PrecisionChecker

    side, backend, dump_dir, scenario = sys.argv[1:5]
    torch.manual_seed(0)
    model = TinyTransformer()
    ids = torch.randint(0, 50, (2, 12))
    targets = torch.randint(0, 50, (2, 12))

    def step(model):
        model.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
        loss.backward()
        return loss

    checker = PrecisionChecker(backend=backend, dump_dir=dump_dir, scenario=scenario)
    checker.wrap_by_policy(model, (Block,))
    checker.wrap(model.head)
    print(checker.capture(step, model, side=side))
""")


def test_one_sided_captures_in_two_processes_compared_by_the_cli(tmp_path, dynaprobe_cli):
    script = tmp_path / "capture.py"
    script.write_text(CAPTURE_SCRIPT.format(tests=TESTS))
    runs = {"eager": ("aot_eager", "machine_a"), "compiled": ("inductor", "machine_b")}
    for side, (backend, scenario) in runs.items():
        proc = subprocess.run([sys.executable, str(script), side, backend, f"dump_{side}",
                               scenario], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == os.path.join(f"dump_{side}", "step_00000000.h5")

    proc, report = compare_json(dynaprobe_cli, "dump_eager", "dump_compiled")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    # Where each side was captured, then what differs between them, before the report.
    lines = out.splitlines()
    assert lines[0].startswith("Eager side:    host=") and " backend=aot_eager " in lines[0]
    assert " mode=eager_only" in lines[0] and " device=cpu " in lines[0]
    assert lines[1].startswith("Compiled side: host=") and " backend=inductor " in lines[1]
    assert " torch_version=" in lines[1] and " param_dtypes=float32 " in lines[1]
    assert lines[2] == "Provenance differs between the eager and the compiled dump:", out
    assert "  backend: eager=aot_eager  compiled=inductor\n" in out
    # Two one-sided captures differ in mode by design: not listed as a difference.
    assert "  mode: eager=eager_only" not in out
    assert "  scenario: eager=machine_a  compiled=machine_b\n" in out
    for same in ("host", "torch_version", "device", "param_dtypes"):
        assert f"  {same}: " not in out
    # Both real losses, every record paired, all within the default tolerances.
    match = re.search(r"  Loss  eager=(\S+)  compiled=(\S+)  diff=(\S+)", out)
    assert match and "nan" not in match.groups(), out
    assert "RESULT: ALL PASS  (atol=1e-4 rtol=1e-3)" in out
    assert "MISSING" not in out and "WARN" not in out

    rank = report["ranks"][0]
    for side, (backend, scenario) in runs.items():
        provenance = rank["provenance"][side]
        assert provenance["backend"] == backend and provenance["mode"] == f"{side}_only"
        assert provenance["scenario"] == scenario
        assert provenance["host"] and provenance["torch_version"] == torch.__version__
        assert provenance["device"] == "cpu" and provenance["param_dtypes"] == "float32"
    step = rank["steps"][0]
    assert not step["single_pass"] and step["loss"]["status"] == "PASS"
    rows = [r for r in step["rows"] if r["check_type"] != "note"]
    assert {r["module"] for r in rows} == {"blocks.0", "blocks.1", "head"}
    assert all(r["eager"] and r["compiled"] and r["status"] == "PASS" for r in rows)
    assert {r["check_type"] for r in rows} == {"fwd_input", "fwd_output", "grad_input",
                                               "grad_output", "param_grad"}
    # The compiled process says which functions each module became.
    for module in ("blocks.0", "blocks.1", "head"):
        assert step["modules"][module]["compiled_functions"].startswith("__compiled_fn_")
