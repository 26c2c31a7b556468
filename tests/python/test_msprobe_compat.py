"""Code written against msProbe's PrecisionChecker runs on dynaprobe (issue 20).

Two public integrations are replayed as they use msProbe, from their description: PyTorch's dynamo
benchmark runner (root module wrapped, compare() under autocast and a grad scaler, result.diffs
walked, losses and verdict written to a CSV) and a torchtitan integration (several model parts,
each with its own checker, per-part CSVs merged by header). The msProbe values TensorDiff,
ModuleDiff and CompareResult are checked against the semantics of msProbe's source
(msprobe/pytorch/compile_accuracy_checker/precision_checker.py, mindstudio-probe 26.2.0).
"""

import csv
import dataclasses
import math
import re

import pytest
import torch
import torch.nn as nn
from models import MLP, TiedTwice, perturbed_gelu_backend

from dynaprobe import _C, CompareResult, ModuleDiff, PrecisionChecker, TensorDiff


@pytest.fixture(autouse=True)
def _fresh_dynamo(tmp_path, monkeypatch):
    torch._dynamo.reset()
    monkeypatch.chdir(tmp_path)  # default dump folders land in the test's tmp dir
    torch.manual_seed(0)


KINDS = ("fwd_input", "fwd_output", "grad_input", "grad_output")
CSV_HEADER = [
    "module_name",
    "check_type",
    "tensor_index",
    "status",
    "max_abs_diff",
    "mean_abs_diff",
    "max_rel_diff",
    "shape",
    "note",
]
BACKENDS = {"aot_eager": "aot_eager", "perturbed": perturbed_gelu_backend}


def tensor_diffs(result):
    """Every TensorDiff of a result's diffs, param_grad included."""
    return [
        t for d in result.diffs for kind in (*KINDS, "param_grad") for t in getattr(d, kind) or ()
    ]


def assert_view_of_the_report(result):
    """result.diffs is a view of the report's rows: same modules in the same order, and each
    TensorDiff prints as its row does in the stdout report."""
    assert [d.name for d in result.diffs] == list(dict.fromkeys(row.module for row in result))
    text = result.text()
    for tensor in tensor_diffs(result):
        assert str(tensor) in text


# ------------------------------------------------------------------------- dynamo benchmark runner
def runner_diff_passed(diff):
    """The runner's own test of a module, as it walks msProbe's result.diffs."""
    if diff.note:
        return diff.note.startswith("SKIP") or diff.note == "IGNORED"
    return all(
        vals is None or all(item.allclose for item in vals)
        for vals in (diff.fwd_input, diff.fwd_output, diff.grad_input, diff.grad_output)
    )


@pytest.mark.parametrize(
    "single_pass, backend, cast_dtype",
    [
        (True, "aot_eager", None),
        (False, "aot_eager", torch.bfloat16),
        (True, "perturbed", torch.bfloat16),
        (False, "perturbed", None),
    ],
)
def test_benchmark_runner_pattern(single_pass, backend, cast_dtype, tmp_path, capsys):
    model = MLP(8)
    example_inputs = (torch.randn(4, 8),)
    grad_scaler = torch.amp.GradScaler("cpu")

    checker = PrecisionChecker(
        backend=BACKENDS[backend],
        dump_graphs=False,
        graph_dir=str(tmp_path / "graphs"),
        cast_dtype=cast_dtype,
        capture_input=True,
        single_pass=single_pass,
        # The runner steps under bf16 autocast; msProbe judges bf16 with its fixed tolerances, and
        # so does this replay (dynaprobe's default floor would let the 1% fault pass in bf16:
        # docs/moving-from-msprobe.md).
        dtype_aware_tolerances=False,
    )
    checker.wrap(model)

    def run_step(mod):
        cloned_inputs = [t.clone() for t in example_inputs]
        mod.zero_grad(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output = mod(*cloned_inputs)
            loss = output.float().mean()
        if loss.requires_grad:
            grad_scaler.scale(loss).backward()
        return loss

    with torch.enable_grad():
        result = checker.compare(run_step, model)
    checker.report(result)
    status = "pass_precision_checker" if result.all_pass else "fail_precision_checker"
    failed_modules = sum(1 for diff in result.diffs if not runner_diff_passed(diff))
    headers = [
        "name",
        "precision_checker",
        "loss_eager",
        "loss_compiled",
        "loss_diff",
        "failed_modules",
    ]
    fields = [
        "MLP",
        status,
        result.loss_eager,
        result.loss_compiled,
        result.loss_diff,
        failed_modules,
    ]
    with open(tmp_path / "runner.csv", "w", newline="") as f:
        csv.writer(f).writerows([headers, fields])

    # The root module is one module, named by its class; the report says the same.
    assert [d.name for d in result.diffs] == ["MLP"] and result.diffs[0].note == ""
    root = result.diffs[0]
    assert root.fwd_input and root.fwd_output and root.grad_output and root.param_grad
    assert root.grad_input is None  # the inputs need no gradient
    assert_view_of_the_report(result)
    assert failed_modules == (0 if backend == "aot_eager" else 1)
    assert result.all_pass == (backend == "aot_eager")
    assert ("RESULT: ALL PASS" in capsys.readouterr().out) == result.all_pass
    assert result.cast_dtype is cast_dtype
    if single_pass:  # no whole-network eager loss
        assert math.isnan(result.loss_eager) and math.isnan(result.loss_diff)
    else:
        assert result.loss_diff == abs(result.loss_eager - result.loss_compiled)
    assert not math.isnan(result.loss_compiled)  # the step returned its loss

    with open(tmp_path / "runner.csv", newline="") as f:
        (written,) = csv.DictReader(f)
    assert written["precision_checker"] == status
    assert int(written["failed_modules"]) == failed_modules
    assert float(written["loss_compiled"]) == result.loss_compiled
    assert math.isnan(float(written["loss_eager"])) == single_pass


# --------------------------------------------------------------------------- torchtitan
class Layer(nn.Module):
    """Stands for a transformer block: a norm and an MLP, with a residual."""

    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = MLP(width)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class FirstPart(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.layers = nn.ModuleList([Layer(width), Layer(width)])

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x


class LastPart(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.layers = nn.ModuleList([Layer(width)])
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def merge_part_reports(checker_reports, destination):
    """The integration's merge: identical headers required, module_name prefixed with the part
    except for LOSS rows."""
    header = None
    with open(destination, "w", encoding="utf-8", newline="") as output:
        writer = csv.writer(output)
        for part_index, source_path in checker_reports:
            with open(source_path, encoding="utf-8-sig", newline="") as source:
                reader = csv.reader(source)
                current_header = next(reader, None)
                if current_header is None:
                    continue
                if header is None:
                    header = current_header
                    writer.writerow(header)
                elif header != current_header:
                    raise RuntimeError(f"PrecisionChecker report headers differ: {source_path}")
                module_column = current_header.index("module_name")
                for row in reader:
                    if row[module_column] != "LOSS":
                        row[module_column] = f"part{part_index}.{row[module_column]}"
                    writer.writerow(row)


def module_of(csv_name):
    return re.sub(r" \(call \d+\)$", "", csv_name)


@pytest.mark.parametrize("policy", ["block", "children"])
@pytest.mark.parametrize("single_pass", [True, False])
def test_torchtitan_pattern(single_pass, policy, tmp_path):
    parts = [FirstPart(), LastPart()]
    optimizer = torch.optim.SGD([p for part in parts for p in part.parameters()], lr=0.1)
    x, target = torch.randn(3, 4), torch.randn(3, 1)

    checkers = []
    for part_index, part in enumerate(parts):
        # The last part's compiler has a bug: only its modules may fail.
        checker = PrecisionChecker(
            backend=perturbed_gelu_backend if part_index else "aot_eager",
            capture_input=True,
            single_pass=single_pass,
        )
        if policy == "block":
            checker.wrap_by_policy(part, (Layer,))
        else:
            checker.wrap_all_children(part, depth=1)
        if single_pass:
            checker.install(part)
        checkers.append((part_index, checker))

    if single_pass:  # the trainer's own step, then one collect per part
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(parts[1](parts[0](x)), target)
        loss.backward()
        optimizer.step()
        comparisons = [checker.collect(loss) for _, checker in checkers]
    else:  # two-pass compares each part on its own
        inputs = [x, parts[0](x).detach()]
        comparisons = [
            checker.compare(lambda part, i=i: part(inputs[i]).square().mean(), parts[i])
            for i, checker in checkers
        ]

    part_reports = []
    for (part_index, checker), comparison in zip(checkers, comparisons, strict=True):
        part_path = tmp_path / f"precision_rank0_part{part_index}.csv"
        checker.report(comparison, csv_path=str(part_path))
        part_reports.append((part_index, part_path))
        assert_view_of_the_report(comparison)
        with open(part_path, newline="") as f:
            modules = {module_of(row["module_name"]) for row in csv.DictReader(f)} - {"LOSS"}
        assert modules == {d.name for d in comparison.diffs}
    merge_part_reports(part_reports, tmp_path / "precision_rank0.csv")

    first, last = comparisons
    if policy == "block":
        assert [d.name for d in first.diffs] == ["layers.0", "layers.1"]
        assert [d.name for d in last.diffs] == ["layers.0"]
        broken = ["layers.0"]  # the block holding the GELU
    else:
        assert [d.name for d in first.diffs] == [
            "embed",
            "layers.0.norm",
            "layers.0.mlp",
            "layers.1.norm",
            "layers.1.mlp",
        ]
        assert [d.name for d in last.diffs] == ["layers.0.norm", "layers.0.mlp", "head"]
        broken = ["layers.0.mlp"] + ([] if single_pass else ["head"])  # head: its input differs
    assert all(runner_diff_passed(d) for d in first.diffs) and first.all_pass
    assert [d.name for d in last.diffs if not runner_diff_passed(d)] == broken
    assert not last.all_pass

    with open(tmp_path / "precision_rank0.csv", newline="") as f:
        merged = list(csv.reader(f))
    assert merged[0] == CSV_HEADER
    rows = merged[1:]
    assert [r[0] for r in rows if r[1] == "loss"] == ["LOSS", "LOSS"]
    assert len(rows) == sum(len(p.read_text().splitlines()) - 1 for _, p in part_reports)
    for row in rows:
        if row[0] != "LOSS":
            part, module = re.match(r"part(\d)\.(.*)$", row[0]).groups()
            assert module_of(module) in {d.name for d in comparisons[int(part)].diffs}
    assert {r[0].split(".")[0] for r in rows if r[3] == "FAIL"} == {"part1"}


# ------------------------------------------------------------------------- how rows map onto diffs
def test_every_call_of_a_module_is_listed_call_by_call():
    model = TiedTwice(4)
    checker = PrecisionChecker(single_pass=False)
    checker.wrap(model.shared)
    result = checker.compare(lambda m: m(torch.randn(2, 4)).sum().backward(), model)
    (diff,) = result.diffs
    assert diff.name == "shared"
    assert len(diff.fwd_output) == 2 and len(diff.fwd_input) == 2  # call 0, then call 1
    assert [row.call for row in diff.rows if row.check_type == "fwd_output"] == [0, 1]
    assert [t.shape for t in diff.param_grad] == [(4, 4), (4,)]  # summed over calls, once
    assert_view_of_the_report(result)


def test_param_grad_is_its_own_list_and_counts_for_all_pass():
    model = MLP(4)
    checker = PrecisionChecker(single_pass=False)
    checker.wrap(model.up)
    result = checker.compare(lambda m: m(torch.randn(2, 4)).sum().backward(), model)
    (diff,) = result.diffs
    assert [t.shape for t in diff.param_grad] == [(8, 4), (8,)]
    assert [t.shape for t in diff.grad_output] == [(2, 8)]
    assert diff.grad_input is None  # the model's input needs no gradient
    failing = dataclasses.replace(diff, param_grad=[TensorDiff(1.0, 1.0, 1.0, False, (8,))])
    assert runner_diff_passed(failing) and not failing.passed  # msProbe's four lists miss it


def test_module_notes_map_onto_the_module_diff():
    class PassThrough(nn.Module):
        def forward(self, x):
            return x

    class OnlyCompiles(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            if not torch.compiler.is_compiling():
                raise RuntimeError("eager path is broken")
            return self.linear(x)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = MLP(4)
            self.noop = PassThrough()
            self.broken = OnlyCompiles()
            self.drop = nn.Dropout(0.0)
            self.unused = nn.Linear(4, 4)

        def forward(self, x):
            return self.drop(self.broken(self.noop(self.body(x))))

    model = Model()
    checker = PrecisionChecker()
    checker.wrap_all_children(model, depth=0)
    checker.wrap(model.body.up)  # inside body, which is compiled as a whole
    checker.ignore(model.drop)
    checker.install(model)
    model(torch.randn(2, 4)).sum().backward()
    result = checker.collect()
    checker.uninstall()

    notes = {d.name: d.note for d in result.diffs}
    assert notes == {
        "body": "",
        "body.up": "SKIP_inside_compiled",
        "noop": "NOT_COMPILED",
        "broken": "HOOK_ERROR",
        "drop": "IGNORED",
        "unused": "NOT_RUN",
    }
    passed = {d.name: d.passed for d in result.diffs}
    assert passed == {
        "body": True,
        "body.up": True,
        "noop": False,
        "broken": False,
        "drop": True,
        "unused": False,
    }
    assert passed == {d.name: runner_diff_passed(d) for d in result.diffs}
    by_name = {d.name: d for d in result.diffs}
    assert by_name["noop"].fwd_output  # compared, eager against eager: the note says so
    assert [r.reason for r in by_name["unused"].rows if r.note] == [
        "the wrapped module was not called in this step"
    ]
    assert not result.all_pass
    assert_view_of_the_report(result)


def capture_side(side, keep, dump_dir):
    class Slicer(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            return self.linear(x)[:, :keep]

    torch.manual_seed(0)
    model = nn.Sequential(Slicer(), nn.Linear(keep, 2))
    checker = PrecisionChecker(dump_dir=str(dump_dir))
    checker.wrap(model[0])
    if side == "eager":
        checker.wrap(model[1])  # recorded on the eager side only
    with torch.no_grad():
        checker.capture(lambda m: m(torch.ones(2, 4)).sum(), model, side=side)


def test_shape_mismatch_and_one_sided_tensors(tmp_path):
    capture_side("eager", 4, tmp_path / "eager")
    torch._dynamo.reset()
    capture_side("compiled", 3, tmp_path / "compiled")
    comparison = _C.compare(str(tmp_path / "eager"), str(tmp_path / "compiled"))
    result = CompareResult.from_report(
        comparison.steps[0], str(tmp_path / "compiled"), "", comparison
    )
    sliced, extra = result.diffs
    assert sliced.fwd_output == [TensorDiff(math.inf, math.inf, math.inf, False, ((2, 4), (2, 3)))]
    assert (
        str(sliced.fwd_output[0])
        == "[!!] max_abs=inf  mean_abs=inf  max_rel=inf  shape=((2, 4), (2, 3))"
    )
    assert extra.name == "1" and extra.fwd_output is None and extra.note.startswith("MISSING_")
    assert not extra.passed and not result.all_pass


# --------------------------------------------------------------------------- built by hand
OK = TensorDiff(max_abs=0.0, mean_abs=0.0, max_rel=0.0, allclose=True, shape=(2,))
BAD = TensorDiff(max_abs=1.0, mean_abs=0.5, max_rel=0.8, allclose=False, shape=(2,))


def test_tensor_diff_fields_and_text_are_msprobes():
    assert [f.name for f in dataclasses.fields(TensorDiff)] == [
        "max_abs",
        "mean_abs",
        "max_rel",
        "allclose",
        "shape",
    ]
    assert TensorDiff(1e-3, 2e-4, 3e-2, True, (2, 3)) == TensorDiff(
        max_abs=1e-3, mean_abs=2e-4, max_rel=3e-2, allclose=True, shape=(2, 3)
    )
    assert (
        str(TensorDiff(0.0, 0.0, 0.0, True, (2, 3)))
        == "[OK] max_abs=0.000e+00  mean_abs=0.000e+00  max_rel=0.000e+00  shape=(2, 3)"
    )
    assert (
        str(TensorDiff(1.0, 0.5, 0.8, False, (4,)))
        == "[!!] max_abs=1.000e+00  mean_abs=5.000e-01  max_rel=8.000e-01  shape=(4,)"
    )
    assert str(TensorDiff(2.3e-7, 1.2e-8, 5.1e-6, True, (2, 128, 4096))) == (
        "[OK] max_abs=2.300e-07  mean_abs=1.200e-08  max_rel=5.100e-06  shape=(2, 128, 4096)"
    )


def test_module_diff_fields_and_defaults_are_msprobes():
    names = [f.name for f in dataclasses.fields(ModuleDiff)]
    assert names[:6] == ["name", "fwd_input", "fwd_output", "grad_input", "grad_output", "note"]
    diff = ModuleDiff(name="m1")
    assert (diff.fwd_input, diff.fwd_output, diff.grad_input, diff.grad_output, diff.note) == (
        None,
        None,
        None,
        None,
        "",
    )
    assert ModuleDiff("m1", None, [OK]).fwd_output == [OK]


def test_compare_result_built_from_msprobes_fields():
    result = CompareResult(
        loss_eager=1.0, loss_compiled=1.5, diffs=[ModuleDiff(name="m1", fwd_output=[OK])]
    )
    assert result.loss_diff == 0.5 and result.all_pass and result  # no loss check, as msProbe
    assert result.cast_dtype is None and result.rows == [] and result.dump_dir is None
    assert math.isnan(CompareResult(loss_eager=float("nan"), loss_compiled=1.5).loss_diff)
    empty = CompareResult(1.0, 1.0)
    assert empty.diffs == [] and empty.diffs is not CompareResult(1.0, 1.0).diffs
    assert CompareResult(1.0, 1.0, [], torch.float16).cast_dtype is torch.float16
    assert repr(result) == "<CompareResult loss_eager=1.0 loss_compiled=1.5 ALL PASS diffs=1>"
    for member in ("text", "csv"):
        with pytest.raises(ValueError, match="built from values"):
            getattr(result, member)()
    with pytest.raises(ValueError, match="built from values"):
        result.step  # noqa: B018


@pytest.mark.parametrize(
    "diffs, expected",
    [
        ([ModuleDiff(name="m1", fwd_output=[OK])], True),
        ([ModuleDiff(name="m1", fwd_output=[BAD])], False),
        ([ModuleDiff(name="m1", note="SKIP_inside_compiled")], True),
        ([ModuleDiff(name="m1", note="IGNORED")], True),
        ([ModuleDiff(name="m1")], True),
        ([ModuleDiff(name="m1", fwd_output=[OK]), ModuleDiff(name="m2", fwd_output=[BAD])], False),
        ([ModuleDiff(name="m1", note="SKIP_compiled_wrapper", grad_input=[BAD])], True),
        ([], True),
    ],
    ids=["ok", "fail", "skip-note", "ignored", "nothing", "mixed", "skip-hides", "no-modules"],
)
def test_all_pass_of_built_results_is_msprobes(diffs, expected):
    assert CompareResult(loss_eager=1.0, loss_compiled=1.0, diffs=diffs).all_pass is expected


@pytest.mark.parametrize(
    "diff",
    [
        ModuleDiff(name="m1", note="MISSING_fwd_in_compiled"),
        ModuleDiff(name="m1", note="NOT_COMPILED", fwd_output=[OK]),
        ModuleDiff(name="m1", fwd_output=[OK], param_grad=[BAD]),
    ],
    ids=["warning-note", "dynaprobe-note", "param_grad"],
)
def test_all_pass_of_built_results_is_stricter_where_dynaprobe_is(diff):
    # msProbe's all_pass passes the first two (a warning note with nothing failing) and has no
    # param_grad; dynaprobe fails a module that could not be compared.
    assert not CompareResult(1.0, 1.0, [diff]).all_pass


@pytest.mark.parametrize("backend", ["aot_eager", "perturbed"])
def test_values_of_a_result_rebuild_its_verdict(backend):
    model = MLP(4)
    checker = PrecisionChecker(backend=BACKENDS[backend])
    checker.wrap_by_policy(model, (nn.Linear, nn.GELU))
    result = checker.compare(lambda m: m(torch.randn(2, 4)).sum().backward(), model)
    rebuilt = CompareResult(
        result.loss_eager, result.loss_compiled, result.diffs, result.cast_dtype
    )
    assert rebuilt.all_pass == result.all_pass == (backend == "aot_eager")


# --------------------------------------------------------------------------- record_loss


def checked_step(model, x):
    loss = model(x).square().mean()
    loss.backward()
    return loss


@pytest.mark.parametrize("as_number", [False, True])
def test_record_loss_gives_collect_its_loss(as_number):
    model = MLP(4)
    checker = PrecisionChecker()
    checker.wrap(model.up)
    checker.install(model)
    loss = checked_step(model, torch.randn(2, 4))
    checker.record_loss(loss.item() if as_number else loss)
    result = checker.collect()
    assert result.loss_compiled == pytest.approx(loss.item())
    assert f"compiled={loss.item():.6f}" in result.csv()
    # The loss belongs to its step: the next one has none unless recorded again.
    checked_step(model, torch.randn(2, 4))
    assert math.isnan(checker.collect().loss_compiled)
    checker.uninstall()


def test_a_loss_given_to_collect_wins_over_the_recorded_one():
    model = MLP(4)
    checker = PrecisionChecker()
    checker.wrap(model.up)
    checker.install(model)
    loss = checked_step(model, torch.randn(2, 4))
    checker.record_loss(123.0)
    assert checker.collect(loss).loss_compiled == pytest.approx(loss.item())
    checker.uninstall()
