"""Command-line entry points (the top layer): ``python -m nxd_lc.cli.convert`` (checkpoint <-> HF),
``python -m nxd_lc.cli.niah`` / ``python -m nxd_lc.cli.passkey`` (retrieval evaluation),
``python -m nxd_lc.cli.loss_by_position``. The training entry point is ``train.py`` at the repository root
(:func:`nxd_lc.app.run.hydra_task`); Megatron data preprocessing stays ``python -m nxd_lc.data.megatron_indexed``
(its command line needs nothing above the data layer)."""
