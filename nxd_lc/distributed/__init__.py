"""Parallel state, collectives, autograd mappings and gradient reductions.

Modules: :mod:`collectives` (the only caller of torch.distributed collectives),
:mod:`parallel_state` (the only source of process groups), :mod:`mappings` (autograd collectives
over TP / sequence parallel), :mod:`grads` (SP / KV-replica / DP gradient reductions, global norms).
"""

from nxd_lc.distributed import collectives, grads, mappings, parallel_state

__all__ = ["collectives", "grads", "mappings", "parallel_state"]
