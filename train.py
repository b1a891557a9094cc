"""nxd_lc training entry point.

    torchrun --nproc_per_node=2 train.py --config-name cpu_tiny_llama_config
    python train.py --config-name hf_llama3_8B_config +dry_run=true     # validate only

Configs live in ./conf (Hydra). nxd_lc keeps Hydra from creating its own per-run output directory and log files
(the run directory is exp_manager's); pass hydra.* overrides explicitly to change that. Before Hydra composes, the
config files and the hydra node are checked (nxd_lc.config.preflight: alias bombs, duplicate keys, hydra.callbacks).
"""

import os
import sys

import hydra

from nxd_lc.app.run import hydra_defaults, hydra_task
from nxd_lc.config.preflight import preflight_problems
from nxd_lc.config.schema import register_configs

if __name__ == "__main__":
    register_configs()  # `defaults: [nxd_lc_schema, _self_]` in a YAML makes Hydra type-check it too
    given = {a.split("=")[0].lstrip("+~") for a in sys.argv[1:]}
    sys.argv += [d for d in hydra_defaults() if d.split("=")[0] not in given]
    conf_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf")
    refused = preflight_problems(sys.argv[1:], __file__, conf_dir)
    if refused:
        print("error: refused before Hydra composes the config:\n" + "\n".join(f"  - {p}" for p in refused),
              file=sys.stderr)
        sys.exit(2)
    hydra.main(config_path=conf_dir, config_name=None, version_base="1.3")(hydra_task)()
