"""What a launch needs beyond the cross-field rules (issue 50, item 4): each key the launch path reads and would
refuse late (after the model is built) is refused here, before anything is built, naming the key and the fix.

Checked with the input paths (:func:`nxd_lc.app.validation.path_problems`: ``load_config(check_paths=True)``, on
every rank at launch) and listed by the dry run, which then exits with status 3 (:mod:`nxd_lc.app.run`):

* ``data.tokenizer`` (:func:`tokenizer_launch_problems`): every run loads a tokenizer
  (:func:`nxd_lc.data.tokenizer.load_tokenizer`: text data, pre-tokenized ``input_ids``, Megatron indexed data for
  its EOD id and size, alignment records), so ``type`` unset stopped the launch after the model was built
  (``ValueError: data.tokenizer.type: not set``; NxDT's 8B example has no tokenizer key). ``bytelevel_bpe`` (trained
  from text at data setup) is refused where the data module refuses it: alignment runs, ``data.data_prefix`` (no
  text to train on) and a ``vocab_size`` below the byte alphabet + ``<|endoftext|>``.
* ``model.enable_cuda_graph`` on ``trainer.accelerator: auto`` (:func:`accelerator_launch_problems`): judged on the
  accelerator ``auto`` resolves to on this host; off CUDA the compiled layers' CUDA graphs cannot exist, and the key
  was accepted and ignored (the run trained on CPU).
* ``NEURON_EXTRACT_GRAPHS_ONLY`` (:func:`nxd_lc.runtime.prewarm.graph_extraction_problems`).

These are launch-host checks, not cross-field rules: the dry run may run on another host (a login node), and code
that builds a config only to inspect it (tests, converters) need not name a tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping

from nxd_lc.config.schema import NxdConfig
from nxd_lc.data.tokenizer import BYTELEVEL_BPE, GPT2_BPE
from nxd_lc.runtime.prewarm import graph_extraction_problems

__all__ = ["accelerator_launch_problems", "launch_problems", "tokenizer_launch_problems"]

#: The smallest ``data.tokenizer.vocab_size`` of a trained byte-level BPE: 256 bytes + ``<|endoftext|>``.
MIN_BPE_VOCAB = 257


def tokenizer_launch_problems(cfg: NxdConfig) -> list[str]:
    """``data.tokenizer`` as the data modules load it (module docstring); a ``library`` set without a ``type`` is the
    cross-field rule's (:func:`nxd_lc.data.tokenizer.tokenizer_problems`), not repeated here."""
    tok, d = cfg.data.tokenizer, cfg.data
    if tok.library == "megatron" and tok.type == GPT2_BPE:
        return []  # vocab_file / merge_file: checked by tokenizer_problems and the path checks
    if tok.type is None:
        if tok.library is not None:
            return []
        return ["data.tokenizer.type: not set; every run loads a tokenizer (pre-tokenized data and data.data_prefix "
                "too: the EOD id and vocabulary size come from it): give the HF tokenizer directory the data was "
                f"(or will be) tokenized with, e.g. the model's, or '{BYTELEVEL_BPE}' to train one on text data"]
    if tok.type != BYTELEVEL_BPE or tok.library is not None:
        return []
    if cfg.model_alignment_strategy is not None:
        return [f"data.tokenizer.type: '{BYTELEVEL_BPE}' trains a new tokenizer, but alignment fine-tuning "
                "(model_alignment_strategy) needs the pretrained model's own: give its HF tokenizer directory"]
    if d.data_prefix is not None:
        return [f"data.tokenizer.type: '{BYTELEVEL_BPE}' is trained on text, but data.data_prefix is already "
                "tokenized: give the HF tokenizer directory (or GPT-2 vocab / merges files) it was tokenized with"]
    if tok.vocab_size < MIN_BPE_VOCAB:
        return [f"data.tokenizer.vocab_size: {tok.vocab_size} is below {MIN_BPE_VOCAB} (256 bytes + <|endoftext|>) "
                f"for type '{BYTELEVEL_BPE}'; use e.g. 8192"]
    return []


def accelerator_launch_problems(cfg: NxdConfig) -> list[str]:
    """``model.enable_cuda_graph: true`` on ``trainer.accelerator: auto`` where ``auto`` resolves to something other
    than gpu on this host (``gpu`` without CUDA is refused by the accelerator itself at launch; other accelerators
    by the cross-field rule :func:`nxd_lc.app.validation.model.cuda_graph_problems`)."""
    if not cfg.model.enable_cuda_graph or cfg.trainer.accelerator != "auto":
        return []
    from nxd_lc.runtime.device import resolve_accelerator

    resolved = resolve_accelerator("auto")
    if resolved == "gpu":
        return []
    return [f"model.enable_cuda_graph: true needs CUDA, but trainer.accelerator auto resolves to {resolved} on this "
            "host (no CUDA device), where the key would be ignored; set model.enable_cuda_graph: false, or launch on "
            "a CUDA host (trainer.accelerator gpu)"]


def launch_problems(cfg: NxdConfig, environ: Mapping[str, str] | None = None) -> list[str]:
    """Every launch requirement of the module docstring that ``cfg`` on this host (environment ``environ``, default
    ``os.environ``) does not meet; empty when the launch would pass them."""
    return tokenizer_launch_problems(cfg) + accelerator_launch_problems(cfg) + graph_extraction_problems(cfg, environ)
