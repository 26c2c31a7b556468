"""PrecisionChecker as users run it: the spec's examples, real torch.compile, real training steps."""

import copy
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from models import MLP, Block, ConvBN, TiedTwice, perturbed_gelu_backend

from dynaprobe import CompareResult, PrecisionChecker


@pytest.fixture(autouse=True)
def _fresh_dynamo(tmp_path, monkeypatch):
    torch._dynamo.reset()
    monkeypatch.chdir(tmp_path)  # default dump and graph folders land in the test's tmp dir
    torch.manual_seed(0)


def rows_of(result, check_type=None, module=None):
    return [r for r in result if (check_type is None or r.check_type == check_type)
            and (module is None or r.module == module)]


# --------------------------------------------------------------------------- the spec's examples
class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(8, 16),
            nn.ReLU(),
            nn.Linear(16, 4),
        )

    def forward(self, x):
        return self.layers(x)


def test_spec_training_quickstart(capsys):
    model = ToyModel()
    x = torch.randn(2, 8)
    target = torch.randn(2, 4)
    loss_fn = nn.MSELoss()

    def run_step(model):
        model.zero_grad()
        output = model(x)
        loss = loss_fn(output, target)
        loss.backward()
        return loss

    checker = PrecisionChecker()                 # single_pass=True 为默认值
    checker.wrap_by_policy(model, (nn.Linear,))  # 标记参与对比的模块
    checker.install(model)                       # 原地替换被标记模块为 compiled 版本

    loss = run_step(model)
    result = checker.collect(loss)
    checker.report(result, csv_path="precision_report.csv")

    out = capsys.readouterr().out
    assert out.startswith("=" * 72 + "\n  Loss  eager=nan  compiled=")
    assert "diff=nan  (single-pass: no whole-model eager run)\n" in out
    for section in ("FORWARD INPUT", "FORWARD OUTPUT", "BACKWARD"):
        assert f"\n  {section}\n  {'-' * 68}\n" in out
    for name in ("layers.0", "layers.2"):
        assert f"  pass  {name:<51}  [OK] max_abs=" in out
        assert f"  pass  {name + '.grad_output':<51}  [OK]" in out
        assert f"  pass  {name + '.param_grad':<51}  [OK]" in out
    # x does not require grad: only layers.2 has an input gradient.
    assert f"  pass  {'layers.2.grad_input':<51}  [OK]" in out
    assert "layers.0.grad_input" not in out
    assert "  RESULT: ALL PASS  (atol=1e-4 rtol=1e-3)\n" in out
    assert out.rstrip().endswith("CSV report saved to: precision_report.csv")
    csv = pathlib.Path("precision_report.csv").read_text().splitlines()
    assert csv[0] == ("module_name,check_type,tensor_index,status,max_abs_diff,mean_abs_diff,"
                      "max_rel_diff,shape,note")
    assert csv[1] == f"LOSS,loss,0,PASS,N/A,N/A,N/A,compiled={loss.item():.6f},single_pass mode"
    assert 'layers.0,fwd_output,0,PASS,' in "\n".join(csv)
    assert result.all_pass and bool(result)
    assert math.isnan(result.loss_eager) and result.loss_compiled == pytest.approx(loss.item())


def test_spec_inference_quickstart_two_pass(capsys):
    def build_model():
        return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 50))

    def make_input():
        return torch.randint(0, 50, (2, 7))

    model = build_model()          # 推理模型
    input_ids = make_input()       # 推理输入

    def infer_step(model):
        model.eval()
        with torch.no_grad():
            logits = model(input_ids)
            # two-pass 需要一个标量作为对比锚点。推理无 loss，
            # 可使用输出的某个统计量（如 mean），其不参与反向。
            return logits.mean()

    checker = PrecisionChecker(single_pass=False)   # 推理使用 two-pass
    checker.wrap_by_policy(model, (nn.Linear,))

    result = checker.compare(infer_step, model)     # 内部执行 eager 与 compiled 两条链路
    checker.report(result, csv_path="precision_report.csv")

    out = capsys.readouterr().out
    expected = model(input_ids).mean().item()
    assert result.loss_eager == pytest.approx(expected, abs=1e-6)
    assert result.loss_compiled == pytest.approx(expected, abs=1e-5)
    assert f"  Loss  eager={result.loss_eager:.6f}  compiled={result.loss_compiled:.6f}" in out
    assert "BACKWARD" not in out  # inference: no gradients
    assert "  pass  1    " in out and "  pass  3    " in out
    assert result.all_pass
    csv = pathlib.Path("precision_report.csv").read_text()
    assert csv.splitlines()[1].startswith("LOSS,loss,0,PASS,") and "eager=" in csv


def test_spec_inference_single_pass(capsys):
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    input_ids = torch.randn(4, 8)
    checker = PrecisionChecker()
    checker.wrap_all_children(model)
    checker.install(model)

    model.eval()
    with torch.no_grad():
        logits = model(input_ids)
        pseudo_loss = logits.mean()

    result = checker.collect(pseudo_loss)
    checker.report(result)
    out = capsys.readouterr().out
    assert "FORWARD INPUT" in out and "FORWARD OUTPUT" in out and "BACKWARD" not in out
    assert {r.module for r in result} == {"0", "1", "2"}
    assert result.all_pass


# --------------------------------------------------------------------------- wrap and ignore
class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([MLP(8), MLP(8)])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def train_step(model, x):
    model.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss


@pytest.mark.parametrize("depth, expected", [
    (0, {"embed", "blocks.0", "blocks.1", "head"}),
    (1, {"embed", "blocks.0.up", "blocks.0.act", "blocks.0.down", "blocks.1.up", "blocks.1.act",
         "blocks.1.down", "head"}),
])
def test_wrap_all_children_depth(depth, expected):
    model = Nested()
    checker = PrecisionChecker()
    checker.wrap_all_children(model, depth=depth)
    result = checker.compare(lambda m: train_step(m, torch.randn(3, 4)), model)
    assert {r.module for r in result} == expected
    assert result.all_pass


def test_wrap_single_module_and_nested_wrap_is_not_a_separate_target(capsys):
    model = Nested()
    checker = PrecisionChecker()
    checker.wrap(model.blocks[0])
    checker.wrap(model.blocks[0].up)  # inside a wrapped module: not compiled separately
    result = checker.compare(lambda m: train_step(m, torch.randn(3, 4)), model)
    checker.report(result)
    out = capsys.readouterr().out
    assert "  skip  blocks.0.up" in out and "SKIP_inside_compiled" in out
    assert {r.module for r in result if r.check_type != "note"} == {"blocks.0"}
    assert result.all_pass


def test_wrap_root_model_is_compiled_in_place():
    model = Nested()
    checker = PrecisionChecker()
    checker.wrap(model)
    checker.install(model)
    loss = train_step(model, torch.randn(3, 4))
    result = checker.collect(loss)
    assert {r.module for r in result} == {"Nested"}
    assert rows_of(result, "fwd_output")[0].status == "PASS"
    assert rows_of(result, "param_grad")  # every parameter of the model
    assert result.all_pass


def test_ignore_and_ignore_by_policy(capsys):
    model = nn.Sequential(MLP(8), nn.Dropout(0.5), MLP(8))
    checker = PrecisionChecker()
    checker.wrap_all_children(model, depth=0)
    checker.ignore(model[0])
    checker.ignore_by_policy(model, (torch.nn.Dropout,))
    result = checker.compare(lambda m: train_step(m, torch.randn(3, 8)), model)
    checker.report(result, csv_path="r.csv")
    out = capsys.readouterr().out
    assert "  skip  0      " in out and "  skip  1      " in out and "IGNORED" in out
    assert {r.module for r in result if r.check_type != "note"} == {"2"}
    assert "0,note,0,SKIP,,,,,IGNORED" in pathlib.Path("r.csv").read_text()
    assert result.all_pass


def test_nothing_wrapped_is_a_clear_error():
    with pytest.raises(ValueError, match="no module is wrapped"):
        PrecisionChecker().install(MLP(4))


def test_install_requires_single_pass():
    with pytest.raises(RuntimeError, match="install\\(\\) only supports single_pass=True"):
        PrecisionChecker(single_pass=False).install(MLP(4))


# --------------------------------------------------------------------------- models
def test_transformer_block_with_keyword_mask_and_tuple_output():
    model = nn.Sequential(Block(16), Block(16))
    x = torch.randn(2, 5, 16, requires_grad=True)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()

    def step(m):
        out = x
        for block in m:
            out, _ = block(out, attn_mask=mask)
        loss = out.square().mean()
        loss.backward()
        return loss

    checker = PrecisionChecker()
    checker.wrap_by_policy(model, (Block,))
    result = checker.compare(step, model)
    outputs = rows_of(result, "fwd_output", "0")
    assert len(outputs) == 2  # (hidden, attention weights)
    inputs = rows_of(result, "fwd_input", "0")
    assert [r.label for r in inputs] == ["[0][0]", "[1]['attn_mask']"]
    assert rows_of(result, "grad_input", "0") and rows_of(result, "grad_output", "1")
    assert result.all_pass


def test_module_called_twice_gets_a_record_per_call():
    model = TiedTwice(8)
    checker = PrecisionChecker()
    checker.wrap(model.shared)
    x = torch.randn(3, 8, requires_grad=True)
    result = checker.compare(lambda m: train_step(m, x), model)
    calls = {r.call for r in rows_of(result, "fwd_output", "shared")}
    assert calls == {0, 1}
    assert len(rows_of(result, "grad_input", "shared")) == 2
    # Both calls' parameter gradients add up, on each side.
    assert rows_of(result, "param_grad", "shared")[0].status == "PASS"
    assert result.all_pass


def test_conv_batchnorm_training_state_is_untouched_by_the_checker():
    torch.manual_seed(1)
    base = ConvBN()
    x = torch.randn(4, 3, 8, 8)
    plain = copy.deepcopy(base)
    checked = copy.deepcopy(base)

    torch.manual_seed(5)
    loss_plain = train_step(plain, x)
    rng_plain = torch.get_rng_state()

    checker = PrecisionChecker()
    checker.wrap_all_children(checked, depth=0)
    checker.install(checked)
    torch.manual_seed(5)
    loss_checked = train_step(checked, x)
    rng_checked = torch.get_rng_state()
    result = checker.collect(loss_checked)

    assert torch.equal(rng_plain, rng_checked)  # RNG streams as without the checker
    for (name, a), (_, b) in zip(plain.named_buffers(), checked.named_buffers()):
        assert torch.equal(a, b), f"buffer {name} changed by the eager re-run"
    for (name, a), (_, b) in zip(plain.named_parameters(), checked.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), f".grad of {name} changed"
    assert loss_plain.item() == pytest.approx(loss_checked.item(), abs=1e-6)
    assert result.all_pass


def test_dropout_in_train_mode_sees_the_same_mask_on_both_sides():
    model = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5), nn.Linear(64, 8))
    checker = PrecisionChecker()
    checker.wrap_all_children(model, depth=0)
    result = checker.compare(lambda m: train_step(m, torch.randn(16, 8)), model)
    assert rows_of(result, "fwd_output", "1")[0].status == "PASS"
    assert result.all_pass


def test_optimizer_state_and_input_mutation():
    class MutatesInput(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            x.mul_(2)  # in place on the caller's tensor
            return self.linear(x)

    model = nn.Sequential(MutatesInput())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    checker = PrecisionChecker()
    checker.wrap(model[0])
    checker.install(model)
    x = torch.ones(2, 4)
    optimizer.zero_grad()
    loss = model(x).sum()
    loss.backward()
    optimizer.step()
    result = checker.collect(loss)
    assert torch.equal(x, torch.full((2, 4), 2.0))  # mutated exactly once
    assert rows_of(result, "fwd_output")[0].status == "PASS"  # eager saw the original input
    state = optimizer.state[model[0].linear.weight]
    assert state["step"].item() == 1


def test_inductor_on_cpu_passes_for_an_fp32_mlp():
    model = nn.Sequential(MLP(16), MLP(16))
    checker = PrecisionChecker(backend="inductor")
    checker.wrap_all_children(model, depth=0)
    result = checker.compare(lambda m: train_step(m, torch.randn(8, 16)), model)
    assert result.all_pass, result.text()


# --------------------------------------------------------------------------- fault localisation
class Chain(nn.Module):
    """norm -> mlp (has GELU) -> proj: only mlp contains the perturbed op."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.mlp = MLP(16)
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        return self.proj(self.mlp(self.norm(x)))


def test_single_pass_fails_exactly_the_module_with_the_perturbed_op():
    model = Chain()
    checker = PrecisionChecker(backend=perturbed_gelu_backend)
    checker.wrap_all_children(model, depth=0)
    checker.install(model)
    x = torch.randn(8, 16, requires_grad=True)
    loss = model(x).square().sum()  # gradients well above atol
    loss.backward()
    result = checker.collect(loss)
    failing = {(r.module, r.check_type) for r in result.failures}
    assert ("mlp", "fwd_output") in failing and ("mlp", "grad_input") in failing
    assert {module for module, _ in failing} == {"mlp"}
    assert not result.all_pass


def test_two_pass_localises_the_first_differing_module():
    model = Chain()
    checker = PrecisionChecker(backend=perturbed_gelu_backend, single_pass=False)
    checker.wrap_all_children(model, depth=0)
    result = checker.compare(lambda m: train_step(m, torch.randn(8, 16)), model)
    status = {(r.module, r.check_type): r.status for r in result if r.tensor_index == 0}
    assert status[("norm", "fwd_output")] == "PASS"
    assert status[("mlp", "fwd_input")] == "PASS" and status[("mlp", "fwd_output")] == "FAIL"
    assert status[("proj", "fwd_input")] == "FAIL"  # its input already differed
    assert result.loss_eager != result.loss_compiled


# --------------------------------------------------------------------------- no silent pass
def test_a_wrapped_module_that_never_ran_is_a_warning(capsys):
    model = Nested()
    checker = PrecisionChecker()
    checker.wrap(model.blocks[1])
    checker.wrap(model.head)
    checker.install(model)
    # Run only part of the model: head never runs.
    loss = model.blocks[1](model.embed(torch.randn(2, 4))).sum()
    loss.backward()
    result = checker.collect(loss)
    checker.report(result)
    out = capsys.readouterr().out
    assert "  WARN  head" in out and "NOT_RUN" in out
    assert not result.all_pass and "RESULT: FAILED" in out


def test_results_are_values_and_the_cli_gives_the_same_report(dynaprobe_cli):
    model = Nested()
    checker = PrecisionChecker(dump_dir="dump")
    checker.wrap_all_children(model, depth=0)
    checker.install(model)
    results = []
    for _ in range(2):
        loss = train_step(model, torch.randn(3, 4))
        results.append(checker.collect(loss))
    assert [r.step for r in results] == [0, 1]
    assert isinstance(results[0], CompareResult) and len(results[0]) == len(list(results[0]))
    checker.wait_committed()  # step 1's file is committed while training goes on
    cli = subprocess.run([dynaprobe_cli, "compare", "dump", "--step", "1"], capture_output=True,
                         text=True)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == results[1].text()


def test_one_checker_captures_both_sides_and_the_cli_compares_them(dynaprobe_cli):
    # Each side's file says its own side, and the side captured second gets a dump of its own,
    # numbered from 0 like the first, so that `dynaprobe compare` pairs the two steps.
    model = Nested()
    x = torch.randn(3, 4)
    checker = PrecisionChecker(dump_dir="dump")
    checker.wrap_all_children(model, depth=0)
    eager = checker.capture(lambda m: train_step(m, x), model, side="eager")
    compiled = checker.capture(lambda m: train_step(m, x), model, side="compiled")
    assert eager == os.path.join("dump", "step_00000000.h5")
    assert compiled == os.path.join("dump", "compiled", "step_00000000.h5")
    cli = subprocess.run([dynaprobe_cli, "compare", eager, compiled], capture_output=True,
                         text=True)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    lines = cli.stdout.splitlines()
    assert " mode=eager_only" in lines[0] and " mode=compiled_only" in lines[1]
    assert "RESULT: ALL PASS" in cli.stdout and "nothing compared" not in cli.stdout
    assert "  pass  blocks.1.grad_input" in cli.stdout and cli.stderr == ""
    # Further captures of each side go on in its own dump: steps 1 pair up too.
    assert checker.capture(lambda m: train_step(m, x), model, side="eager") == \
        os.path.join("dump", "step_00000001.h5")
    assert checker.capture(lambda m: train_step(m, x), model, side="compiled") == \
        os.path.join("dump", "compiled", "step_00000001.h5")
    cli = subprocess.run([dynaprobe_cli, "compare", "dump", os.path.join("dump", "compiled")],
                         capture_output=True, text=True)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "Summary: 2 steps, 2 ALL PASS" in cli.stdout


def test_an_unwritable_dump_folder_costs_the_dump_not_training(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    model = MLP(4)
    checker = PrecisionChecker(dump_dir=str(blocker / "dump"))
    checker.wrap(model)
    checker.install(model)
    result = checker.collect(train_step(model, torch.randn(2, 4)))
    checker.uninstall()
    assert result.all_pass and not result.stored and result.dump_file is None
    assert "file/dump" in result.not_stored_reason
    assert "NOT STORED" in result.text()
    assert "step 0 was not stored" in capsys.readouterr().err
    # capture() exists for its file: losing it raises, whatever strict_io says.
    checker = PrecisionChecker(dump_dir=str(blocker / "dump"))
    checker.wrap(model)
    with pytest.raises(OSError, match="file/dump"):
        checker.capture(lambda m: train_step(m, torch.randn(2, 4)), model, side="eager")
    # strict_io=True: the error reaches collect(), as it always did.
    checker = PrecisionChecker(dump_dir=str(blocker / "dump"), strict_io=True)
    checker.wrap(model)
    with pytest.raises(OSError, match="file/dump"):
        checker.install(model)
        loss = train_step(model, torch.randn(2, 4))
        checker.collect(loss)


def test_a_failing_eager_rerun_is_a_warning_and_training_goes_on(capsys):
    class OnlyCompiles(nn.Module):
        """Works when compiled, raises when run eagerly: the checker's re-run fails."""

        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            if not torch.compiler.is_compiling():
                raise RuntimeError("eager path is broken")
            return self.linear(x)

    model = nn.Sequential(OnlyCompiles(), nn.Linear(4, 2))
    checker = PrecisionChecker()
    checker.wrap(model[0])
    checker.install(model)
    loss = train_step(model, torch.randn(3, 4))  # the training step itself succeeds
    assert model[1].weight.grad is not None
    result = checker.collect(loss)
    checker.report(result)
    out = capsys.readouterr().out
    assert "  WARN  0 " in out and "HOOK_ERROR" in out and "eager path is broken" in out
    assert not result.all_pass


def test_a_step_that_compared_nothing_is_not_a_pass(tmp_path):
    """Every wrapped module ignored: the report has rows (IGNORED) but compares nothing, and must
    not read as ALL PASS, in the result nor in its text."""
    model = nn.Sequential(nn.Linear(2, 2))
    checker = PrecisionChecker(dump_dir=str(tmp_path / "dump"))
    checker.wrap(model[0])
    checker.ignore(model[0])
    checker.install(model)
    model(torch.randn(1, 2)).sum().backward()
    result = checker.collect()
    assert not result.all_pass and not result
    assert "RESULT: FAILED" in result.text() and "nothing compared" in result.text()


@pytest.mark.parametrize("single_pass", [True, False])
def test_compare_says_where_its_dump_is_once(single_pass, tmp_path, capfd):
    """compare() names its dump and the command that reads it again, on the first step of a
    checker; result.dump_dir names it too."""
    model = nn.Linear(4, 4)
    checker = PrecisionChecker(single_pass=single_pass, dump_dir=str(tmp_path / "dump"))
    checker.wrap(model)
    results = [checker.compare(lambda m: m(torch.randn(2, 4)).sum(), model) for _ in range(2)]
    err = capfd.readouterr().err
    said = f"dynaprobe: step 0 written to {tmp_path / 'dump'} (dynaprobe compare {tmp_path / 'dump'})"
    assert err.count("written to") == 1 and said in err, err
    assert all(r.dump_dir == str(tmp_path / "dump") for r in results)


def test_dict_and_dataclass_outputs_are_labelled_by_key_in_the_text_report(tmp_path):
    from test_isolation import DictAndDataclassOutputs

    torch.manual_seed(0)
    model = nn.Sequential(DictAndDataclassOutputs())
    x, r = torch.randn(2, 6), torch.randn(2, 6)
    checker = PrecisionChecker(dump_dir=str(tmp_path / "dump"))
    checker.wrap(model[0])
    result = checker.compare(lambda m: m[0](x, r)["out"].sum(), model)
    outputs = [line for line in result.text().splitlines() if "shape=(2, 6)" in line
               and ("FORWARD OUTPUT" in line or "output=" in line)]
    labels = [line.split("output=")[1] for line in outputs]
    assert sorted(labels) == ["['nested'].first", "['nested'].second", "['out']"], outputs


def test_importing_dynaprobe_imports_no_dynamo():
    """Offline analysis (analyze_run on a Dask worker, the CLI's Python tools) imports dynaprobe
    without compiling anything: Dynamo, which doubles the import time, comes with the first
    install."""
    code = "import sys, dynaprobe; print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


class UpBeforeMid(nn.Module):
    """Modules registered in another order than they run (a UNet's up_blocks before mid_block)."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(4, 4)
        self.mid = nn.Linear(4, 4)

    def forward(self, x):
        return self.up(self.mid(x))


@pytest.mark.parametrize("single_pass", [True, False], ids=["single_pass", "two_pass"])
def test_every_report_lists_the_modules_in_execution_order(single_pass, tmp_path, capsys):
    """Readers look for the first module that fails from the top: every format lists the modules
    in the order they ran, not the order the model registered them."""
    checker = PrecisionChecker(single_pass=single_pass, dump_dir=str(tmp_path / "dump"))
    checker.wrap_by_policy(model := UpBeforeMid(), (nn.Linear,))
    result = checker.compare(lambda m: train_step(m, torch.randn(3, 4)), model)
    checker.report(result, csv_path=str(tmp_path / "r.csv"), json_path=str(tmp_path / "r.json"))
    out = capsys.readouterr().out

    def in_order(modules):
        seen = [m for m in modules if m in ("mid", "up")]
        return seen.index("mid") < seen.index("up")

    assert in_order([r.module for r in result.rows])
    assert in_order([line.split()[1] for line in out.splitlines()
                     if line.strip().startswith("pass ")])
    assert in_order([line.split(",")[0] for line in
                     (tmp_path / "r.csv").read_text().splitlines()[1:]])
    rows = json.loads((tmp_path / "r.json").read_text())["ranks"][0]["steps"][0]["rows"]
    assert in_order([row["module"] for row in rows])
