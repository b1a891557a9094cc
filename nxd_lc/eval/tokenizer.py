"""The tokenizer an evaluation uses: the evaluated model's own, not whatever the run config names.

An HF directory exported by ``python -m nxd_lc.cli.convert`` carries the run's tokenizer files (``tokenizer.json``,
...). The evaluation CLIs (``nxd_lc.cli.passkey`` / ``niah`` / ``loss_by_position``) take the tokenizer from
``--hf-dir`` and tokenize the held-out text of the config's corpus with it (:func:`evaluation_tokenizer`):

* ``--tokenizer DIR`` given: that tokenizer, whatever the config names (not for an already tokenized corpus);
* else ``--hf-dir`` holds tokenizer files: its tokenizer, which must be the one ``data.tokenizer`` resolves to
  (same content, :func:`content_digest`); another is refused naming both (the config belongs to another run);
* else the config's ``data.tokenizer``, with a warning that it cannot be checked against the model's.

Every result records which (:meth:`EvalTokenizer.record`): path, source, SHA-256 of its files and of its content.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from typing import Any

from nxd_lc.config.access import resolve_path
from nxd_lc.data.tokenizer import (
    BYTELEVEL_BPE,
    DEFAULT_CACHE_DIR,
    GPT2_BPE,
    bpe_cache_path,
    load_saved_tokenizer,
    load_tokenizer,
    tokenizer_fingerprint,
)

log = logging.getLogger(__name__)

#: the files of an HF directory that make up its tokenizer (hashed in this order, those present)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model")


def tokenizer_files(directory: str) -> list[str]:
    """The :data:`TOKENIZER_FILES` present in ``directory`` (paths; empty when it holds no tokenizer)."""
    return [os.path.join(directory, n) for n in TOKENIZER_FILES if os.path.isfile(os.path.join(directory, n))]


def files_sha256(paths: list[str]) -> str:
    """SHA-256 hex over the files ``paths`` (each its base name and bytes, in the given order)."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        h.update(os.path.basename(path).encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()


def content_digest(tokenizer: Any) -> str:
    """SHA-256 hex of what a tokenizer does, independent of how its files are formatted: the serialized fast
    backend (vocabulary, merges, added tokens, normalizer, pre-tokenizer) and the eos id
    (:func:`~nxd_lc.data.tokenizer.tokenizer_fingerprint`); for a slow tokenizer its sorted vocabulary and eos id."""
    if getattr(tokenizer, "backend_tokenizer", None) is not None:
        return tokenizer_fingerprint(tokenizer)
    text = json.dumps([sorted(tokenizer.get_vocab().items()), tokenizer.eos_token_id])
    return hashlib.sha256(text.encode()).hexdigest()


@dataclasses.dataclass
class EvalTokenizer:
    """The tokenizer an evaluation runs with, and where it came from.

    Attributes:
        tokenizer: the loaded tokenizer (None when it is the config's, loaded later by the data module).
        path: its directory (or, for GPT-2 BPE files, ``vocab_file, merge_file``).
        source: ``"--tokenizer"``, ``"--hf-dir"`` or ``"data.tokenizer"`` (the HF directory had none).
        files: the files hashed into ``files_sha256``.
        config_path: where the config's ``data.tokenizer`` resolves to.
        matches_config: whether it is the config's tokenizer (None: the config's is not built, so unknown).
        pretokenized: the held-out data is already token ids (only the config's tokenizer can read it).
    """

    tokenizer: Any
    path: str
    source: str
    files: list[str]
    config_path: str
    matches_config: bool | None
    pretokenized: bool = False

    def record(self) -> dict[str, Any]:
        """What results record: ``{"path", "source", "files", "files_sha256", "sha256" (content), "num_tokens",
        "config_tokenizer", "matches_config"}``."""
        tok = self.tokenizer
        return {"path": self.path, "source": self.source, "files": [os.path.basename(p) for p in self.files],
                "files_sha256": files_sha256(self.files) if self.files else None,
                "sha256": content_digest(tok) if tok is not None else None,
                "num_tokens": len(tok) if tok is not None else None,
                "config_tokenizer": self.config_path, "matches_config": self.matches_config}

    def check_model_vocab(self, model_vocab_size: int, model_config: str) -> None:
        """Raise when the tokenizer can emit ids the model's embedding has no row for.

        Raises:
            ValueError: ``len(tokenizer) > model_vocab_size``; names the tokenizer and ``model_config``.
        """
        if self.tokenizer is not None and len(self.tokenizer) > model_vocab_size:
            raise ValueError(f"tokenizer {self.path} ({self.source}) has {len(self.tokenizer)} tokens but the model "
                             f"({model_config}) has vocab_size {model_vocab_size}: it is not this model's tokenizer; "
                             "evaluate with the tokenizer the model was trained with (--tokenizer DIR)")


def _datamodule(cfg: Any) -> Any:
    from nxd_lc.data.datamodule import PretrainingDataModule

    d = cfg.data
    return PretrainingDataModule(d, seq_length=1, seed=cfg.seed, model_vocab_size=1, data_parallel_rank=0,
                                 data_parallel_size=1, global_batch_size=d.micro_batch_size)


def configured_tokenizer(cfg: Any, *, build: bool) -> tuple[Any, str, list[str], bool]:
    """``(tokenizer, path, files, pretokenized)``: the tokenizer the config's ``data.tokenizer`` resolves to.

    A byte-level BPE (``type: bytelevel_bpe``) is the one cached for the config's training corpus
    (:func:`~nxd_lc.data.tokenizer.bpe_cache_path`); when it is not cached, it is trained if ``build`` (as the
    data module would), else ``tokenizer`` is None. ``pretokenized``: the corpus is token ids already
    (``data.data_prefix``, or ``input_ids`` files).

    Raises:
        ValueError: as :func:`~nxd_lc.data.tokenizer.load_tokenizer` (names the ``data.tokenizer`` key).
    """
    from nxd_lc.data.sources import iter_documents

    tok = cfg.data.tokenizer
    if tok.library == "megatron" and tok.type == GPT2_BPE:
        files = [resolve_path(p) for p in (tok.vocab_file, tok.merge_file) if p is not None]
        return (load_tokenizer(tok, None, require_fast=False), ", ".join(files), files,
                cfg.data.data_prefix is not None)
    if cfg.data.data_prefix is not None:
        path = resolve_path(tok.type) if tok.type else str(tok.type)
        return load_tokenizer(tok, None, require_fast=False), path, tokenizer_files(path), True
    train_src, _ = _datamodule(cfg)._sources()  # the train split the run fingerprinted its BPE with
    if tok.type == BYTELEVEL_BPE and tok.library is None:
        cache_root = tok.cache_dir or DEFAULT_CACHE_DIR
        path = bpe_cache_path(tok, cache_root, train_src.fingerprint())
        if not os.path.isdir(path) and not build:
            return None, path, [], False
        texts = None if train_src.pretokenized else (lambda: iter_documents(train_src))
        loaded = load_tokenizer(tok, texts, cache_root, corpus_fingerprint=train_src.fingerprint())
        return loaded, path, tokenizer_files(path), train_src.pretokenized
    path = resolve_path(tok.type) if tok.type else str(tok.type)
    loaded = load_tokenizer(tok, None, require_fast=not train_src.pretokenized)
    return loaded, path, tokenizer_files(path), train_src.pretokenized


def _directory_tokenizer(cfg: Any, directory: str) -> Any:
    """``cfg`` whose ``data.tokenizer`` loads the HF tokenizer in ``directory`` (its cache directory kept)."""
    from nxd_lc.config.schema import TokenizerConfig

    old = cfg.data.tokenizer
    tok = TokenizerConfig(type=os.path.abspath(directory), cache_dir=old.cache_dir, chat_template=old.chat_template)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=tok))


def evaluation_tokenizer(cfg: Any, hf_dir: str, tokenizer_dir: str | None = None) -> tuple[Any, EvalTokenizer]:
    """``(cfg, tokenizer)``: the run config whose ``data.tokenizer`` is the evaluated model's tokenizer (the held-out
    text is tokenized with it), and that tokenizer with its origin (see the module docstring).

    Args:
        cfg: the composed run config.
        hf_dir: the HF directory evaluated (``--hf-dir``).
        tokenizer_dir: ``--tokenizer``: a tokenizer directory to use instead (None: ``hf_dir``'s).

    Raises:
        ValueError: ``--tokenizer`` without tokenizer files; ``hf_dir``'s tokenizer is not the config's (names both:
            evaluate with the run's config, or pass ``--tokenizer``); another tokenizer than the config's for an
            already tokenized corpus; a damaged tokenizer (names its file).
    """
    if tokenizer_dir is not None:
        if not tokenizer_files(tokenizer_dir):
            raise ValueError(f"--tokenizer: {tokenizer_dir} holds no tokenizer files (any of "
                             f"{', '.join(TOKENIZER_FILES)}); give an HF tokenizer directory")
        directory, source = tokenizer_dir, "--tokenizer"
    elif tokenizer_files(hf_dir):
        directory, source = hf_dir, "--hf-dir"
    else:
        loaded, path, files, pre = configured_tokenizer(cfg, build=True)
        log.warning("--hf-dir %s has no tokenizer files: evaluating with the config's data.tokenizer (%s), which "
                    "cannot be checked against the model's; export the model with its tokenizer "
                    "(python -m nxd_lc.cli.convert) or pass --tokenizer DIR", hf_dir, path)
        return cfg, EvalTokenizer(loaded, path, "data.tokenizer", files, path, True, pre)
    tokenizer = load_saved_tokenizer(directory, f"{source} {directory}")
    unavailable = "a byte-level BPE not trained yet"
    try:
        config_tok, config_path, _, pretokenized = configured_tokenizer(cfg, build=False)
    except ValueError as e:  # the config's tokenizer does not load here: only an explicit --tokenizer goes on
        if source != "--tokenizer":
            raise
        config_tok, config_path, pretokenized, unavailable = None, str(cfg.data.tokenizer.type), False, str(e)
    same = None if config_tok is None else content_digest(config_tok) == content_digest(tokenizer)
    ev = EvalTokenizer(tokenizer, os.path.abspath(directory), source, tokenizer_files(directory), config_path, same,
                       pretokenized)
    if same is None:
        log.warning("the config's data.tokenizer (%s) is not available here (%s), so the tokenizer of %s %s cannot "
                    "be compared with it; evaluating with %s", config_path, unavailable, source, directory, directory)
    elif not same and pretokenized:
        raise ValueError(f"{source}: the tokenizer in {directory} is not the config's data.tokenizer "
                         f"({config_path}), with which the held-out data of the config is already tokenized; "
                         "evaluate with the config of the run the model was trained with")
    elif not same and source == "--hf-dir":
        raise ValueError(f"--hf-dir: the tokenizer in {directory} is not the one the config's data.tokenizer "
                         f"resolves to ({config_path}): the model was trained with another tokenizer than "
                         f"--config-name {cfg.name} names. Evaluate with the run's config, or pass --tokenizer "
                         f"{directory} to tokenize the config's held-out text with the model's tokenizer")
    elif not same:
        log.warning("--tokenizer %s is not the config's data.tokenizer (%s): the config's held-out text is "
                    "tokenized with %s", directory, config_path, directory)
    return _directory_tokenizer(cfg, directory), ev
