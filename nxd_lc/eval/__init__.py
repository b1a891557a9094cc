"""Evaluation of trained models.

:mod:`nxd_lc.eval.loss_by_position` -- held-out loss per token-position bucket (does a model use its long
context?); ``from nxd_lc.eval.loss_by_position import loss_by_position``. The package re-exports nothing, so the
function does not collide with the submodule of the same name and ``python -m nxd_lc.cli.loss_by_position``
runs the module once.
"""
