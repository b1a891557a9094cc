"""The attributes nxd_lc's parallel layers attach to their parameters, and device moves that keep them.

The layers mark parameters with plain Python attributes (NxD's convention) that the gradient reductions, global
norms, optimizer domains, checkpoint sharding and precision casts read back later (:data:`PARALLEL_ATTRIBUTES`;
readers: :mod:`nxd_lc.distributed.grads`, :mod:`nxd_lc.layers.linear`, :mod:`nxd_lc.optim.wrapper`,
:mod:`nxd_lc.precision.policy`). On torch-xla and PrivateUse1 devices (TorchNeuron's ``neuron``) ``module.to(device)``
replaces every ``nn.Parameter`` by a new object, which carries none of them, and unties shared parameters; so does
any conversion while ``torch.__future__.set_overwrite_module_params_on_conversion(True)`` is on (how the CPU tests
reproduce it). Without them a sharded weight counts as replicated in the global norm and sequence-parallel norm
weights are no longer summed over TP, with no error anywhere (DESIGN.md principle 17).

:func:`move_module` records the attributes and the ties by parameter name, moves, re-ties and re-applies them
(NxD's ``move_model_to_device`` with ``preserve_parallel_attributes`` / ``preserve_shared_weights``).
:func:`check_parallel_attributes` compares a module with a record, or, given none, with the rule the layers
establish (checked at model build and after the strategy's move): every parameter carries ``tensor_model_parallel``
(set by ``mark_parameter`` on every parameter of the parallel linears, the GQA QKV projection, the vocab-parallel
embedding, the LoRA adapters, the experts and the router, replicated ones included with ``False``) or
``sequence_parallel_enabled`` (set on every TP-replicated norm weight / bias and
position table, ``False`` without sequence parallelism).

Only these plain values (bools, ints, tuples, None) are carried over; tensors hung on parameters (the optimizer's
``main_grad``) are device state, rebuilt by their owner, never copied across a move.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = [
    "LAYOUT_ATTRIBUTES",
    "PARALLEL_ATTRIBUTES",
    "check_parallel_attributes",
    "move_module",
    "preserving_parallel_attributes",
    "record_parallel_attributes",
    "restore_parallel_attributes",
    "retie_shared_parameters",
    "shared_parameter_names",
]

#: Every attribute an nxd_lc layer sets on a parameter (the one list): TP layout (``tensor_model_parallel``,
#: ``partition_dim``, ``partition_stride``, ``partition_order``: :func:`nxd_lc.layers.linear.mark_parameter`),
#: TP-replicated with partial gradients (``sequence_parallel_enabled``: norms, position tables, row biases under SP,
#: LoRA adapters, the MoE router), KV replicas (``kv_replicated``, ``kv_replicated_rows``: GQA QKV with
#: ``kv_replicator > 1``), experts (``expert_model_parallel``), the tied embedding split over pipeline stages
#: (``pipeline_tied``, ``pipeline_tied_copy``) and the router's fp32 master flag (``keep_fp32``).
PARALLEL_ATTRIBUTES: tuple[str, ...] = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_order",
    "partition_stride",
    "sequence_parallel_enabled",
    "kv_replicated",
    "kv_replicated_rows",
    "expert_model_parallel",
    "pipeline_tied",
    "pipeline_tied_copy",
    "keep_fp32",
)

#: One of these marks every parameter an nxd_lc layer created (the rule :func:`check_parallel_attributes` checks
#: when given no ``expected`` record).
LAYOUT_ATTRIBUTES: tuple[str, ...] = ("tensor_model_parallel", "sequence_parallel_enabled")

_PLAIN = (bool, int, float, str, type(None))


def _is_plain(value: Any) -> bool:
    """Whether ``value`` is plain metadata (None, a bool / int / float / str, or a tuple or list of those)."""
    if isinstance(value, (tuple, list)):
        return all(_is_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def record_parallel_attributes(module: nn.Module) -> dict[str, dict[str, Any]]:
    """The :data:`PARALLEL_ATTRIBUTES` each parameter of ``module`` carries, by qualified parameter name.

    Every name of a shared (tied) parameter is listed (``named_parameters(remove_duplicate=False)``), so a tie the
    move breaks still gets its attributes back on both sides. A parameter that carries none maps to ``{}``.

    Args:
        module: the module (any ``nn.Module``; nothing is changed).

    Returns:
        ``{parameter name: {attribute: value}}``; lists are stored as tuples.

    Raises:
        TypeError: an attribute holds something other than plain metadata (a tensor, say): it would tie device
            state to the record; names the parameter and the attribute.
    """
    recorded: dict[str, dict[str, Any]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        attrs: dict[str, Any] = {}
        for attr in PARALLEL_ATTRIBUTES:
            if not hasattr(param, attr):
                continue
            value = getattr(param, attr)
            if not _is_plain(value):
                raise TypeError(f"parameter {name!r}: attribute {attr!r} is {type(value).__name__}, not plain "
                                "metadata (bool, int, tuple, None); parallel attributes must not hold tensors")
            attrs[attr] = tuple(value) if isinstance(value, list) else value
        recorded[name] = attrs
    return recorded


def restore_parallel_attributes(module: nn.Module, recorded: Mapping[str, Mapping[str, Any]]) -> None:
    """Set the recorded attributes again on ``module``'s (possibly new) parameter objects, by name.

    Attributes a parameter carries but the record lacks are left alone; recorded ones are overwritten with the
    recorded value.

    Args:
        module: the module the record was taken from (after a move, a copy or a re-initialisation).
        recorded: :func:`record_parallel_attributes`' result.

    Raises:
        KeyError: ``module`` has no parameter of a recorded name (the record belongs to another module); names it.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    for name, attrs in recorded.items():
        if name not in params:
            raise KeyError(f"restore_parallel_attributes: the module has no parameter {name!r} (the record was taken "
                           "from another module)")
        for attr, value in attrs.items():
            setattr(params[name], attr, value)


def _missing_layout(name: str, param: nn.Parameter) -> str | None:
    """Why ``param`` breaks the layers' rule (module docstring), or None."""
    if any(hasattr(param, attr) for attr in LAYOUT_ATTRIBUTES):
        return None
    return (f"parameter {name!r} carries neither {' nor '.join(LAYOUT_ATTRIBUTES)}: every parameter of nxd_lc's "
            "parallel layers and norms is given one at construction (nxd_lc.layers.linear.mark_parameter, the norms' "
            "sequence_parallel_enabled), so it was lost (a device move that created new Parameter objects without "
            "nxd_lc.layers.param_attrs.move_module; a deep copy) or the parameter was made outside the layers")


def _differs(name: str, param: nn.Parameter, attrs: Mapping[str, Any]) -> str | None:
    """How ``param`` differs from its record ``attrs``, or None."""
    for attr, want in attrs.items():
        if not hasattr(param, attr):
            return f"parameter {name!r} lost its parallel attribute {attr!r} (recorded {want!r})"
        got = getattr(param, attr)
        if (tuple(got) if isinstance(got, list) else got) != want:
            return f"parameter {name!r}: parallel attribute {attr!r} is {got!r}, recorded {want!r}"
    return None


def check_parallel_attributes(module: nn.Module, expected: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """Fail fast when a parameter of ``module`` lacks the parallel attributes its layer gave it.

    Without ``expected``: every parameter must carry ``tensor_model_parallel`` or ``sequence_parallel_enabled``
    (:data:`LAYOUT_ATTRIBUTES`), the rule nxd_lc's layers establish (module docstring); true of every model
    :func:`nxd_lc.app.build.build_model` returns, at any TP size. With ``expected`` (a
    :func:`record_parallel_attributes` record taken before a move or copy): every recorded parameter must still
    exist and carry each recorded attribute with the recorded value; parameters the record lacks are not checked.
    Parameters are visited in ``module``'s order; the first failure is reported.

    Args:
        module: the module to check.
        expected: the record to compare with, or None for the layers' rule.

    Raises:
        RuntimeError: names the first parameter (qualified name) that lacks an attribute (or has another value, or
            no longer exists) and the attribute.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    for name, param in params.items():
        if expected is None:
            problem = _missing_layout(name, param)
        elif name in expected:
            problem = _differs(name, param, expected[name])
        else:
            problem = None
        if problem is not None:
            raise RuntimeError(problem)
    for name in expected or {}:
        if name not in params:
            raise RuntimeError(f"parameter {name!r} was recorded but the module no longer has it")


def shared_parameter_names(module: nn.Module) -> list[list[str]]:
    """Groups of names under which one parameter object is registered more than once (tied weights, e.g. the lm
    head sharing the token embedding), each in ``module``'s order; groups of one are left out.

    Args:
        module: any ``nn.Module`` (unchanged).
    """
    groups: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def retie_shared_parameters(module: nn.Module, groups: list[list[str]]) -> None:
    """Register the parameter now under each group's first name under the group's other names as well, so
    parameters a move untied (one new object per registration) are one object again (the first name's copy is
    kept, the others are dropped).

    Args:
        module: the module the groups were taken from.
        groups: :func:`shared_parameter_names`' result, taken before the move.

    Raises:
        AttributeError: a name of a group does not lead to a parameter of ``module`` (names it).
    """
    for first, *others in groups:
        keep = module.get_parameter(first)
        for name in others:
            module.get_parameter(name)  # AttributeError naming it when it is not a parameter
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner) if owner else module, leaf, keep)


@contextmanager
def preserving_parallel_attributes(module: nn.Module) -> Iterator[dict[str, dict[str, Any]]]:
    """Around code that may replace ``module``'s Parameter objects (a device move, a re-initialisation): records
    the parallel attributes and the ties on entry; on a normal exit re-ties shared parameters
    (:func:`retie_shared_parameters`) and re-applies the attributes (:func:`restore_parallel_attributes`), by name.

    Args:
        module: the module; it must keep its parameter names inside the block.

    Yields:
        The record (:func:`record_parallel_attributes`).

    Raises:
        TypeError: as :func:`record_parallel_attributes`.
        KeyError, AttributeError: the block removed or renamed a parameter (names it).
    """
    recorded = record_parallel_attributes(module)
    groups = shared_parameter_names(module)
    yield recorded
    retie_shared_parameters(module, groups)
    restore_parallel_attributes(module, recorded)


def move_module(module: nn.Module, device: torch.device | str | None = None,
                dtype: torch.dtype | None = None) -> nn.Module:
    """``module.to(device, dtype)`` in place, keeping what the parallel layers attached to the parameters and the
    ties between shared parameters (:func:`preserving_parallel_attributes`), on every device: where ``.to()``
    keeps the Parameter objects this costs one pass over the parameter names.

    Args:
        module: the module to move.
        device: target device (None: keep).
        dtype: target floating dtype (None: keep).

    Returns:
        ``module`` (moved in place, as ``nn.Module.to``).

    Raises:
        TypeError: a parallel attribute holds a tensor (:func:`record_parallel_attributes`); errors of
            ``nn.Module.to`` itself (an unknown device) pass through.
    """
    kwargs: dict[str, Any] = {}
    if device is not None:
        kwargs["device"] = device
    if dtype is not None:
        kwargs["dtype"] = dtype
    with preserving_parallel_attributes(module):
        if kwargs:
            module.to(**kwargs)
    return module
