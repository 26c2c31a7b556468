"""Isolation of the single-pass eager re-run: it sees what the training call saw, and leaves
nothing behind that the training run could see.

The compiled call is the training path. The eager re-run of the same module must start from the
same state and change nothing the user's code can observe afterwards. By mechanism, never by a list
of known classes:

- Arguments are copied before the compiled call. Tensors that ``torch.utils._pytree`` reaches
  (tuples, lists, dicts, registered dataclasses) are cloned one by one, as the recorded inputs;
  every other object (a KV cache, a user dataclass, any object holding tensors) is deep-copied,
  with every tensor inside it detached and cloned (parameters and modules stay shared: the re-run
  must use the real weights). A cache that the compiled call appends to is thus never appended to
  a second time, and the re-run never reaches into the training graph through it.
- The module and its submodules: buffers (BatchNorm statistics) and Python attributes a forward
  sets on its module (``self.cached = ...``), including the contents of list, dict and set
  attributes, are set back to what they were before the compiled call for the re-run, then to what
  the compiled call left.

- Inputs the module writes in place (``ReLU(inplace=True)``, ``x += y``, a write through a view
  of an input): the training call writes the caller's tensors, once, as without the checker; the
  re-runs write fresh copies of their own (``InputWrites``, ``rerun_input``).
- Module-level names of the code the module runs (``global CALLS; CALLS += 1`` in a forward) that
  the re-run rebinds are put back, and the checker warns: the forward has a global side effect.

What cannot be isolated: other global side effects of a forward (files, I/O, in-place changes to
module-level objects or to objects reached from an attribute more than one level deep). An
argument that cannot be deep-copied is shared with the re-run, and the checker warns about it.
"""

from __future__ import annotations

import copy
import enum
import types
from typing import Callable, Dict, FrozenSet, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

# Values a call can pass that need no copy: immutable, or code.
_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, range, slice, torch.dtype,
              torch.device, torch.layout, torch.memory_format, enum.Enum, type,
              types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType)


def copy_arguments(args: tuple, kwargs: dict,
                   copy_tensor: Callable[[int, torch.Tensor], torch.Tensor],
                   convert: Callable[[torch.Tensor], torch.Tensor] = lambda t: t):
    """A copy of a call's arguments for the eager re-run: ``(args, kwargs, shared)``.

    ``copy_tensor(index, tensor)`` copies each tensor reached by pytree, indexed as
    ``_capture.input_leaves`` indexes them; the same tensor reached again inside another object
    gets the same copy. Tensors inside other objects are detached, cloned and passed through
    ``convert`` (the fp64 reference upcasts them). ``shared`` names the arguments that could not
    be copied (their type and why): the re-run gets them as they are.
    """
    leaves, spec = pytree.tree_flatten((args, kwargs))
    memo: dict = {}
    index = 0
    objects = []
    for position, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            if id(leaf) not in memo:
                memo[id(leaf)] = copy_tensor(index, leaf)
            index += 1
        elif not isinstance(leaf, _IMMUTABLE):
            objects.append(position)
    if not objects:
        return (*pytree.tree_unflatten([memo.get(id(x), x) for x in leaves], spec), [])
    copied = [memo.get(id(x), x) if isinstance(x, torch.Tensor) else x for x in leaves]
    shared = []
    for position in objects:
        leaf = leaves[position]
        _share_modules_and_clone_tensors(leaf, memo, convert)
        try:
            copied[position] = copy.deepcopy(leaf, memo)
        except Exception as error:  # uncopyable (locks, handles, C objects): shared
            shared.append(f"{type(leaf).__qualname__} ({type(error).__name__}: {error})")
    return (*pytree.tree_unflatten(copied, spec), shared)


def _share_modules_and_clone_tensors(value, memo: dict,
                                     convert: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Seeds deepcopy's memo: modules and parameters map to themselves (the re-run uses the real
    ones), every other tensor reachable from ``value`` to a detached clone (deepcopy of a tensor
    inside an autograd graph fails, and a copy must not reach into that graph)."""
    stack, seen = [value], set()
    while stack:
        item = stack.pop()
        if id(item) in seen or isinstance(item, _IMMUTABLE):
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            if id(item) not in memo:
                memo[id(item)] = (item if isinstance(item, nn.Parameter)
                                  else convert(item.detach().clone()))
        elif isinstance(item, nn.Module):
            memo[id(item)] = item
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        else:
            attributes = getattr(item, "__dict__", None)
            if isinstance(attributes, dict):
                stack.extend(attributes.values())
            for cls in type(item).__mro__:
                for slot in getattr(cls, "__slots__", ()):
                    if isinstance(slot, str) and hasattr(item, slot):
                        stack.append(getattr(item, slot))


_CONTAINERS = (list, dict, set)


def _items_of(container):
    """A plain shallow copy of a list, dict or set (subclasses included)."""
    if isinstance(container, dict):
        return dict(container)
    return list(container) if isinstance(container, list) else set(container)


class ModuleState:
    """What a forward may change on a module and its submodules besides parameter values: the
    Python attributes (rebinding), the contents of list/dict/set attributes (the registries of
    parameters, buffers, submodules and hooks among them) and, when ``clone_buffers``, the
    buffers' values.

    ``apply()`` puts the module back into this state. Buffers captured with ``clone_buffers`` are
    applied as fresh tensors holding the captured values: the tensors the training call used are
    never written to, so graphs that saved them (batch norm's backward) stay valid.
    """

    def __init__(self, module: nn.Module, clone_buffers: bool = False):
        self.entries: List[Tuple[nn.Module, dict, dict]] = []
        for owner in module.modules():
            attributes = dict(owner.__dict__)
            # Plain copies of the items: apply() only puts them back into the original container
            # (copy.copy goes through __reduce_ex__ for the OrderedDicts nn.Module keeps hooks in:
            # capturing and applying the state of a GPT2Block took 383 us with it, 143 us now).
            contents = {name: _items_of(value) for name, value in attributes.items()
                        if isinstance(value, _CONTAINERS)}
            if clone_buffers and "_buffers" in contents:
                contents["_buffers"] = {name: None if buffer is None else buffer.detach().clone()
                                        for name, buffer in contents["_buffers"].items()}
            self.entries.append((owner, attributes, contents))

    def saved_buffers(self, module: nn.Module) -> Dict[str, torch.Tensor]:
        """The buffers' values captured with ``clone_buffers``, by name as
        ``module.named_buffers()`` names them."""
        saved = {id(owner): contents.get("_buffers", {}) for owner, _, contents in self.entries}
        return {f"{prefix}.{name}" if prefix else name: buffer
                for prefix, owner in module.named_modules()
                for name, buffer in saved.get(id(owner), {}).items() if buffer is not None}

    def apply(self) -> None:
        for owner, attributes, contents in self.entries:
            state = owner.__dict__
            for name in [n for n in state if n not in attributes]:
                del state[name]
            state.update(attributes)
            for name, saved in contents.items():
                target = attributes[name]
                target.clear()
                if isinstance(target, dict):
                    target.update(saved)
                elif isinstance(target, list):
                    target.extend(saved)
                else:
                    target.update(saved)


_ABSENT = object()


class ModuleGlobals:
    """The module-level namespaces of the code a module runs (the Python modules defining the
    classes of it and its submodules), to find and undo names a forward rebinds.

    Names starting with ``__`` are left alone: Dynamo installs its compiled functions there.
    """

    def __init__(self, module: nn.Module):
        spaces = (getattr(type(m).forward, "__globals__", None) for m in module.modules())
        self.saved = {id(space): (space, dict(space)) for space in spaces
                      if isinstance(space, dict)}

    def restore(self) -> List[str]:
        """Puts back the names rebound, added or removed since; returns them as
        ``module.name``."""
        changed = []
        for space, before in self.saved.values():
            if space.keys() == before.keys() and all(space[k] is v for k, v in before.items()):
                continue
            for name in space.keys() | before.keys():
                if name.startswith("__") or space.get(name, _ABSENT) is before.get(name, _ABSENT):
                    continue
                changed.append(f"{space.get('__name__', '?')}.{name}")
                if name in before:
                    space[name] = before[name]
                else:
                    del space[name]
        return sorted(changed)


def reachable_tensors(value) -> Dict[tuple, torch.Tensor]:
    """Every tensor reachable from ``value`` through tuples, lists, dicts and object attributes,
    by its path there (indices, keys, attribute names), the first path to each; parameters and
    modules are not looked into. A deep copy of ``value`` has its copies at the same paths."""
    found: Dict[tuple, torch.Tensor] = {}
    seen: set = set()
    stack = [((), value)]
    while stack:
        path, item = stack.pop()
        if id(item) in seen or isinstance(item, (_IMMUTABLE, nn.Module, nn.Parameter)):
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            found[path] = item
        elif isinstance(item, dict):
            stack.extend(((*path, key), sub) for key, sub in reversed(item.items())
                         if isinstance(key, (str, int)))
        elif isinstance(item, (list, tuple)):
            stack.extend(((*path, index), sub) for index, sub in reversed(list(enumerate(item))))
        else:
            members = dict(getattr(item, "__dict__", None) or {})
            for cls in type(item).__mro__:
                for slot in getattr(cls, "__slots__", ()):
                    if isinstance(slot, str) and slot not in members and hasattr(item, slot):
                        members[slot] = getattr(item, slot)
            stack.extend(((*path, f".{name}"), sub) for name, sub in reversed(members.items()))
    return found


class LeftInArguments:
    """The tensors a call leaves in the objects it was given, for later calls to read: the keys
    and values a KV cache appends, an entry set in a dict argument. They are outputs of the call
    as much as what it returns: a later call that reads them (a layer run twice in a step with
    one cache) sends gradient back into this call's graph through them. Found by mechanism:
    tensors reachable from the arguments after the call, requiring grad, that were not there
    before (or were written in place), other than the call's own inputs and return values."""

    def __init__(self, args: tuple, kwargs: dict):
        self._before = {id(t): (t, t._version)
                        for t in reachable_tensors((args, kwargs)).values()}

    def find(self, args: tuple, kwargs: dict, returned: List[torch.Tensor],
             inputs: List[torch.Tensor]) -> List[Tuple[tuple, torch.Tensor]]:
        """(path, tensor) of what the call left in ``args``/``kwargs`` (as passed to it)."""
        own = {id(t) for t in returned} | {id(t) for t in inputs}
        left = []
        for path, tensor in reachable_tensors((args, kwargs)).items():
            if not tensor.requires_grad or tensor.grad_fn is None or id(tensor) in own:
                continue
            before = self._before.get(id(tensor))
            if before is None or before[0]._version != before[1]:
                left.append((path, tensor))
        self._before = {}
        return left


def counterparts(left: List[Tuple[tuple, torch.Tensor]], args: tuple,
                 kwargs: dict) -> List[Tuple[int, torch.Tensor]]:
    """(position in ``left``, tensor) for what a re-run on copies of the arguments left at the
    same paths, where it is a tensor of the same shape in a graph (the re-run's twin)."""
    reached = reachable_tensors((args, kwargs))
    twins = []
    for position, (path, tensor) in enumerate(left):
        twin = reached.get(path)
        if twin is not None and twin.requires_grad and twin.shape == tensor.shape:
            twins.append((position, twin))
    return twins


def _version(tensor: torch.Tensor) -> Optional[int]:
    """The tensor's version counter; None for an inference tensor, which has none (and cannot
    require grad)."""
    return None if tensor.is_inference() else tensor._version


class InputWrites:
    """Which inputs of a call the call writes in place (``x.mul_(2)``, ``ReLU(inplace=True)``,
    ``x += y``, a write through a view of an input), found by mechanism: every in-place op on a
    tensor or on any view of it advances the version counter they share. Taken before the
    training call and read after it, it tells the re-runs of the same module which inputs they
    will write."""

    def __init__(self, tensors: List[torch.Tensor]):
        self._before = [_version(t) for t in tensors]

    def written(self, tensors: List[torch.Tensor]) -> FrozenSet[int]:
        """The indices of ``tensors`` (the call's inputs, as given to __init__) written since."""
        return frozenset(index for index, (tensor, before) in enumerate(zip(tensors, self._before))
                         if before is not None and _version(tensor) != before)


def rerun_input(grad_mode: bool, requires_grad: Callable[[int], bool],
                written: FrozenSet[int], leaves: list) -> Callable[[int, torch.Tensor],
                                                                     torch.Tensor]:
    """The ``map_tensors`` function that gives a re-run (the eager one, the reference) its copy of
    each input. In grad mode a floating-point copy of an input that requires grad becomes a leaf
    requiring grad, appended once to ``leaves`` as (input index, leaf): a tensor passed at several
    positions is one leaf, as ``ProbedInputs`` probes it once. An input the training call wrote in
    place (``written``, from InputWrites) is given as a fresh copy in the leaf's graph: autograd
    refuses in-place writes to a leaf, the gradient reaching the leaf is that of the input's value
    on entry (what ``register_full_backward_hook`` gives), and the copies taken before the call,
    which replays keep, stay as the call received them."""
    given: Dict[int, torch.Tensor] = {}

    def enter(index: int, tensor: torch.Tensor) -> torch.Tensor:
        if grad_mode and requires_grad(index) and (tensor.is_floating_point()
                                                   or tensor.is_complex()):
            tensor.requires_grad_(True)
            if all(leaf is not tensor for _, leaf in leaves):
                leaves.append((index, tensor))
        if index not in written:
            return tensor
        if id(tensor) not in given:
            given[id(tensor)] = tensor.clone()
        return given[id(tensor)]

    return enter
