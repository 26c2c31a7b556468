"""dynaprobe's pytest plugin (dynaprobe/pytest_plugin.py), loaded through its pytest11 entry
point: a test suite of its own is run in a subprocess with pytester."""

import os
import re

pytest_plugins = ["pytester"]

USER_TESTS = '''
import torch
import torch.nn as nn
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd


def _perturb_gelu(gm, example_inputs):
    """aot_eager, but GELU comes out 1% larger: a fake compiler bug."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.gelu.default:
            with gm.graph.inserting_after(node):
                scaled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (node, 1.01))
            node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
    gm.recompile()
    return make_boxed_func(gm.forward)


faulty = aot_autograd(fw_compiler=_perturb_gelu, bw_compiler=make_boxed_func)


def check(checker):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    checker.wrap(model)
    x = torch.randn(2, 4)
    return checker.compare(lambda m: m(x).sum(), model)


def test_aot_eager(precision_checker, assert_precision, tmp_path):
    checker = precision_checker(backend="aot_eager")
    assert checker.dump_dir.startswith(str(tmp_path))
    assert_precision(check(checker))


def test_faulty_backend(precision_checker):
    from dynaprobe import assert_precision
    assert_precision(check(precision_checker(backend=faulty)))
'''


def test_plugin_loads_through_its_entry_point(pytester):
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:logging")
    result.assert_outcomes(passed=1, failed=1)
    output = result.stdout.str()
    assert "test_faulty_backend" in output
    assert "_results/assertions.py" not in output  # __tracebackhide__: the test's own line is shown
    assert "RESULT: FAILED" in output
    assert "ROOT CAUSE" in output and "forward   Sequential fwd_output[0]" in output
    assert re.search(r"FAIL  Sequential call=0 fwd_output\[0\] max_abs=\d\.\d{3}e-0\d", output)
    html = re.search(r"HTML report: (\S+\.html)", output)
    assert html, output
    assert os.path.isfile(html.group(1))
    assert html.group(1).startswith(str(pytester.path))  # under the test's tmp_path
    with open(html.group(1), encoding="utf-8") as file:
        assert file.read().lstrip().lower().startswith("<!doctype html")


def test_plugin_can_be_turned_off(pytester):
    pytester.makepyfile(test_user="def test_uses_it(precision_checker):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:dynaprobe", "-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'precision_checker' not found*"])
