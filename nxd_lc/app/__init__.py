"""The application layer: whole-config validation (:mod:`nxd_lc.app.validation`, which calls each package's own
rules) and the assembly of a run (:mod:`nxd_lc.app.build`, :mod:`nxd_lc.app.run`). It may import every package
below it; nothing below imports it (import-linter's layers contract, ``make test``)."""
