"""Mixture of experts: the ``model.moe`` config (:mod:`.config`), top-k routing and the load-balancing loss
(:mod:`.routing`), token dispatch over the expert-parallel group and the experts (:mod:`.layer`)."""
