"""Arguments are checked up front: a wrong one is refused by name with what was expected,
before any step runs (a truthy "no" or an unsupported autocast dtype used to be accepted, and
the report then claimed a check that never happened)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from dynaprobe import PrecisionChecker


@pytest.mark.parametrize("kwargs, error, words", [
    ({"threshold": -1}, ValueError, "threshold must be a finite non-negative number"),
    ({"threshold": math.nan}, ValueError, "threshold"),
    ({"threshold": "1e-4"}, TypeError, "threshold must be a non-negative number"),
    ({"rtol": -1}, ValueError, "rtol must be a finite non-negative number"),
    ({"rtol": math.inf}, ValueError, "rtol"),
    ({"single_pass": "no"}, TypeError, "single_pass must be True or False, but received 'no'"),
    ({"capture_input": 1}, TypeError, "capture_input must be True or False"),
    ({"dump_graphs": None}, TypeError, "dump_graphs must be True or False"),
    ({"cast_dtype": "bf16"}, TypeError, "cast_dtype must be None or a torch.dtype"),
    ({"cast_dtype": torch.int8}, ValueError, "cast_dtype must be a floating dtype"),
    ({"backend": 3}, TypeError, "backend must be a torch.compile backend name"),
    ({"memory_budget_bytes": 0}, ValueError, "memory_budget_bytes must be a positive integer"),
    ({"graph_dir": 5}, TypeError, "graph_dir must be a path"),
])
def test_bad_constructor_arguments_are_refused_by_name(kwargs, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        PrecisionChecker(**kwargs)


def test_good_arguments_are_kept():
    checker = PrecisionChecker(threshold=0, rtol=1, cast_dtype=torch.bfloat16, single_pass=False)
    assert checker.threshold == 0.0 and checker.rtol == 1.0 and checker.single_pass is False


def test_an_autocast_dtype_the_device_does_not_support_is_refused_before_running(tmp_path):
    """float64 is floating, but CPU autocast drops it with a warning: the run would be checked
    in fp32 while the report said float64."""
    model = nn.Sequential(nn.Linear(4, 4))
    checker = PrecisionChecker(cast_dtype=torch.float64, dump_dir=str(tmp_path / "d"))
    checker.wrap(model[0])
    with pytest.raises(ValueError, match="cast_dtype=torch.float64 is not supported by "
                                         "torch.autocast on device type 'cpu'"):
        checker.install(model)
    assert "forward" not in model[0].__dict__  # nothing was installed


def test_wrap_by_policy_takes_a_bare_class_and_refuses_other_values():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    checker = PrecisionChecker()
    checker.wrap_by_policy(model, nn.Linear)
    assert checker._wrapped == [model[0], model[2]]
    checker.ignore_by_policy(model, nn.ReLU)
    assert checker._ignored == [model[1]]
    with pytest.raises(TypeError, match="module_types must be a module class or a tuple"):
        checker.wrap_by_policy(model, "Linear")
    with pytest.raises(TypeError, match="module_types"):
        checker.wrap_by_policy(model, ())


def test_a_negative_depth_is_refused():
    with pytest.raises(ValueError, match="depth must be an integer >= 0"):
        PrecisionChecker().wrap_all_children(nn.Sequential(nn.Linear(2, 2)), depth=-1)


def _step(m):
    return m(torch.randn(2, 4)).sum()


@pytest.mark.parametrize("call, error, says", [
    (lambda c, m: c.compare(m, _step), TypeError,
     "the arguments are swapped: the step function comes first, then the model"),
    (lambda c, m: c.compare(_step, "model"), TypeError,
     "model must be a torch.nn.Module, but received 'model' (str)"),
    (lambda c, m: c.compare(42, m), TypeError, "fn must be a function running one step"),
    (lambda c, m: c.capture(m, _step, side="eager"), TypeError, "the arguments are swapped"),
    (lambda c, m: c.install(_step), TypeError,
     "model must be a torch.nn.Module, but received the function _step: call it as "
     "checker.install(model)"),
    (lambda c, m: c.wrap("layers.0"), TypeError, "call it as checker.wrap(model.layers[0])"),
    (lambda c, m: c.wrap_by_policy(nn.Linear, m), TypeError,
     "call it as checker.wrap_by_policy(model, (DecoderLayer,))"),
    (lambda c, m: c.wrap_all_children(None), TypeError, "model must be a torch.nn.Module"),
    (lambda c, m: c.ignore([m]), TypeError, "call it as checker.ignore(model.lm_head)"),
    (lambda c, m: c.ignore_by_policy(nn.Dropout, m), TypeError, "model must be a torch.nn"),
    (lambda c, m: c.collect(), RuntimeError,
     "collect() needs install(model) first (single-pass), then a training or inference step: "
     "checker.install(model); loss = step(model); checker.collect(loss)"),
    (lambda c, m: c.record_loss("1.5"), TypeError, "loss must be the step's loss"),
    (lambda c, m: c.record_loss(torch.ones(3)), ValueError, "a tensor of shape (3,)"),
    (lambda c, m: c.report("ALL PASS"), TypeError,
     "result must be what collect() or compare() returned"),
    (lambda c, m: c.bisect(m), TypeError, "module must be the module's path as the report names "
                                          "it (a str)"),
])
def test_every_entry_point_checks_its_arguments_and_shows_the_call(call, error, says, tmp_path):
    """Mistakes outside the constructor are named with the correct call, before anything runs."""
    checker = PrecisionChecker(dump_dir=str(tmp_path / "dump"))
    model = nn.Linear(4, 4)
    with pytest.raises(error) as raised:
        call(checker, model)
    assert says in str(raised.value)
    assert not (tmp_path / "dump").exists()  # refused before any step began
