"""Tokenizers: an HF tokenizer directory, GPT-2 BPE files, or a byte-level BPE trained (and cached) on the corpus.

``data.tokenizer.library`` (NeMo's key) picks how ``type`` is read:

* unset: ``type`` is a local HF tokenizer directory or ``'bytelevel_bpe'`` (below);
* ``huggingface``: ``type`` is a local HF tokenizer directory (no hub downloads);
* ``megatron``: ``type: GPT2BPETokenizer`` with ``vocab_file`` (vocab.json) and ``merge_file`` (merges.txt) builds
  transformers' ``GPT2TokenizerFast`` from those files (EOD = eos = ``<|endoftext|>``, which the vocab must hold,
  as Megatron's GPT-2 tokenizer requires); a ``type`` that is a directory path is an HF tokenizer directory (as
  NxDT's Mixtral examples use it). Other Megatron types, other libraries (sentencepiece, tabular, ...), ``model``,
  ``delimiter`` and ``sentencepiece_legacy: true`` are reported by :func:`tokenizer_unsupported`.

``use_fast`` is AutoTokenizer's (unset: true). Tokenizing text (``train_dir``, alignment records) needs a fast
tokenizer; Megatron indexed data (``data.data_prefix``) is already tokenized and only reads the EOD id and size.

An HF directory is loaded with ``AutoTokenizer.from_pretrained``; ``type: 'bytelevel_bpe'`` is a GPT-2 style
byte-level BPE (Radford et al. 2019; ``tokenizers`` ``ByteLevel`` pre-tokenizer + decoder, so every byte sequence
round-trips) trained with the ``tokenizers`` library on at most ``data.tokenizer.train_max_bytes`` UTF-8 bytes
of the training documents, with ``<|endoftext|>`` as the only special token serving as eos, bos and pad.

Trained tokenizers are cached under ``<cache_dir>/tokenizers/<key>`` with key = SHA-256 of (corpus fingerprint,
vocab_size, train_max_bytes, format version), so later runs load it instead of retraining.

Several ranks may start at once: :func:`build_once` lets one builder per node write into a private temporary
path and publish it with an atomic ``os.replace``; the others wait for the published path (or meet at a
``barrier`` callable). Packing uses the same helper.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from nxd_lc.config.access import resolve_path
from nxd_lc.config.input_files import read_json, read_text
from nxd_lc.config.schema import TokenizerConfig
from nxd_lc.data.long_text import text_pieces
from nxd_lc.runtime import faults

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

log = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
BYTELEVEL_BPE = "bytelevel_bpe"
DEFAULT_CACHE_DIR = "./.cache/nxd_lc"
_FORMAT_VERSION = "bpe-v1"
_MIN_VOCAB = 256 + 1  # the byte alphabet plus <|endoftext|>


def default_is_builder() -> bool:
    """Whether this process builds shared caches: local rank 0 of its node.

    Uses ``LOCAL_RANK`` (set by torchrun and Lightning's launchers); else global rank 0 when
    ``torch.distributed`` is initialised; else True (a single process).
    """
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"]) == 0
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return True


def build_once(path: str, build: Callable[[str], None], *, is_builder: bool | None = None,
               barrier: Callable[[], None] | None = None, timeout_s: float = 7200.0,
               poll_s: float = 0.5) -> bool:
    """Make sure ``path`` exists, building it at most once per node; safe when many ranks start together.

    The builder calls ``build(tmp)`` (which must create the file or directory ``tmp``) and publishes it with
    ``os.replace(tmp, path)``; readers never see a partial result. If another builder (another node on a
    shared file system) published first, this one's copy is discarded. Non-builders wait at ``barrier`` when
    given, then poll until ``path`` exists.

    Args:
        path: final file or directory.
        build: writes the artifact to the temporary path it is given.
        is_builder: whether this process builds; default :func:`default_is_builder`.
        barrier: optional callable all ranks reach after the builder finished (e.g. ``dist.barrier``).
        timeout_s, poll_s: how long / how often a waiting rank polls, in seconds.
    Returns:
        True when this call built the artifact, False when it already existed or another process built it.
    Raises:
        TimeoutError: ``path`` did not appear within ``timeout_s`` (names the path: check the builder's log).
    """
    builder = default_is_builder() if is_builder is None else is_builder
    built = False
    if builder and not os.path.exists(path):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            build(tmp)
            faults.inject("mid_cache_build", 0)  # fault-injection point (nothing unless NXD_LC_FAULT is set)
            built = _publish(tmp, path)
        finally:
            _remove(tmp)
    if barrier is not None:
        barrier()
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {path} to be built by the local rank 0 process; "
                               "check that rank's log, or delete stale *.tmp-* entries next to it")
        time.sleep(poll_s)
    return built


def _publish(tmp: str, path: str) -> bool:
    try:
        os.replace(tmp, path)
    except OSError:
        if os.path.exists(path):  # another builder won the race (non-empty directory target)
            return False
        raise
    return True


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


def _limited_texts(texts: Iterable[str], max_bytes: int) -> Iterator[str]:
    """Yield texts until ``max_bytes`` UTF-8 bytes were produced (the last text is cut at the limit), a long text
    in pieces (:func:`nxd_lc.data.long_text.text_pieces`: the BPE trainer's memory grows with one input's length;
    cut at whitespace, the trainer's word counts are the same)."""
    budget = max_bytes
    for text in texts:
        for piece in text_pieces(text):
            data = piece.encode("utf-8")
            if len(data) >= budget:
                yield data[:budget].decode("utf-8", errors="ignore")
                return
            budget -= len(data)
            yield piece


def train_bytelevel_bpe(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE and wrap it as a ``PreTrainedTokenizerFast``.

    Args:
        texts: training documents.
        vocab_size: target size including the byte alphabet (256) and ``<|endoftext|>``.
    Raises:
        ValueError: ``vocab_size`` < 257 (names ``data.tokenizer.vocab_size``).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < _MIN_VOCAB:
        raise ValueError(f"data.tokenizer.vocab_size: {vocab_size} is below {_MIN_VOCAB} (256 bytes + "
                         f"{EOS_TOKEN}); use e.g. 8192")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN,
                                   pad_token=EOS_TOKEN)


def bpe_cache_path(tok_cfg: TokenizerConfig, cache_dir: str, corpus_fingerprint: str) -> str:
    """Cache directory of the BPE trained with ``tok_cfg`` on the corpus with ``corpus_fingerprint``."""
    key = hashlib.sha256(repr((_FORMAT_VERSION, corpus_fingerprint, tok_cfg.vocab_size,
                               tok_cfg.train_max_bytes)).encode()).hexdigest()[:24]
    return os.path.join(resolve_path(cache_dir), "tokenizers", f"{BYTELEVEL_BPE}-{tok_cfg.vocab_size}-{key}")


def load_tokenizer(tok_cfg: TokenizerConfig, train_texts_fn: Callable[[], Iterable[str]] | None,
                   cache_dir: str | None = None, *, corpus_fingerprint: str = "",
                   is_builder: bool | None = None, barrier: Callable[[], None] | None = None,
                   require_fast: bool = True) -> PreTrainedTokenizerFast:
    """The tokenizer named by ``data.tokenizer``.

    Args:
        tok_cfg: ``data.tokenizer`` (``type`` = HF tokenizer dir or ``'bytelevel_bpe'``).
        train_texts_fn: returns the training documents (called only when a BPE must be trained).
        cache_dir: cache root; default ``tok_cfg.cache_dir`` or ``./.cache/nxd_lc``.
        corpus_fingerprint: identity of the training corpus (``DocumentSource.fingerprint()``: file list +
            sizes); part of the BPE cache key.
        is_builder, barrier: see :func:`build_once`.
        require_fast: the caller tokenizes text with the fast backend (False: only the EOD id and size are read).
    Returns:
        A tokenizer (fast when ``require_fast``) with an ``eos_token_id``.
    Raises:
        ValueError: ``type`` unset, not a directory / 'bytelevel_bpe', not a fast tokenizer, without an eos
            token, or 'bytelevel_bpe' without training texts (all name ``data.tokenizer.type``); a key of
            :func:`tokenizer_unsupported` ("not supported yet"); GPT-2 files missing or without
            ``<|endoftext|>`` (names ``data.tokenizer.vocab_file`` / ``merge_file``).
    """
    problems = tokenizer_unsupported(tok_cfg)
    if problems:
        raise ValueError("; ".join(problems))
    kind = tok_cfg.type
    if tok_cfg.library == "megatron" and kind == GPT2_BPE:
        return _gpt2_bpe(tok_cfg)
    if kind is None:
        raise ValueError("data.tokenizer.type: not set; give an HF tokenizer directory or 'bytelevel_bpe'")
    if kind == BYTELEVEL_BPE and tok_cfg.library is None:
        if train_texts_fn is None:
            raise ValueError("data.tokenizer.type: 'bytelevel_bpe' needs training text, but the corpus is "
                             "already tokenized (input_ids); give the tokenizer directory used to tokenize it")
        cache_root = cache_dir or tok_cfg.cache_dir or DEFAULT_CACHE_DIR
        path = bpe_cache_path(tok_cfg, cache_root, corpus_fingerprint)
        built = build_once(path, lambda tmp: _train_and_save(tok_cfg, train_texts_fn, tmp),
                           is_builder=is_builder, barrier=barrier)
        log.info("%s byte-level BPE tokenizer %s", "cached trained" if built else "reusing", path)
        return _load_dir(path, kind)
    directory = resolve_path(kind)
    if not os.path.isdir(directory):
        what = "not an existing" if tok_cfg.library else "neither 'bytelevel_bpe' nor an existing"
        raise ValueError(f"data.tokenizer.type: {kind!r} is {what} tokenizer directory ({directory})")
    return _load_dir(directory, kind, use_fast=tok_cfg.use_fast is not False, require_fast=require_fast)


def _train_and_save(tok_cfg: TokenizerConfig, train_texts_fn: Callable[[], Iterable[str]], out_dir: str) -> None:
    start = time.perf_counter()
    tok = train_bytelevel_bpe(_limited_texts(train_texts_fn(), tok_cfg.train_max_bytes), tok_cfg.vocab_size)
    tok.save_pretrained(out_dir)
    log.info("trained byte-level BPE: %d tokens on <= %d bytes in %.1f s", len(tok), tok_cfg.train_max_bytes,
             time.perf_counter() - start)


#: files of an HF tokenizer directory whose ``auto_map`` can point AutoTokenizer at Python code in the directory
_CODE_MAP_FILES = ("tokenizer_config.json", "config.json")
#: JSON / text files of an HF tokenizer directory that transformers or tokenizers read (checked first, see
#: :func:`check_tokenizer_files`)
_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
               "config.json", "vocab.json")
_TEXT_FILES = ("merges.txt",)


def _json_file(path: str, key: str) -> Any:
    """:func:`read_json` of a tokenizer file with a syntax error worded for it (names file, line and column)."""
    try:
        return read_json(path, key=key)
    except json.JSONDecodeError as e:
        raise ValueError(f"{key}: {path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); the "
                         "tokenizer file is damaged: copy it again from the model's release") from None


def check_tokenizer_files(directory: str, key: str) -> dict[str, Any]:
    """Read the tokenizer files of ``directory`` that exist (:data:`_JSON_FILES` as JSON, ``merges.txt`` as text)
    with :mod:`nxd_lc.config.input_files`' checks, before transformers parses them (whose errors name neither the
    file nor, for too-deep JSON, anything: a ``RecursionError``).

    Returns:
        ``{file name: parsed JSON}`` of the JSON files present.
    Raises:
        ValueError: a file that is not UTF-8 (UTF-16, other bytes, NUL bytes), not valid JSON, nested too deep or
            holding out-of-range numbers; names ``key``, the file and its line, and the fix.
    """
    parsed = {}
    for name in _JSON_FILES:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            parsed[name] = _json_file(path, key)
    for name in _TEXT_FILES:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            read_text(path, key=key)
    config = parsed.get("tokenizer_config.json")
    if config is not None:
        problem = _tokenizer_config_problem(config)
        if problem:
            raise ValueError(f"{key}: {os.path.join(directory, 'tokenizer_config.json')}: {problem}; the file is "
                             "damaged or not a transformers tokenizer config: fix it or copy it again")
    return parsed


_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _token_entry_problem(value: Any) -> bool:
    """True unless ``value`` is how transformers stores a special token: a string, or an object with a string
    ``content`` (an AddedToken)."""
    return not (isinstance(value, str) or (isinstance(value, dict) and isinstance(value.get("content"), str)))


def _tokenizer_config_problem(config: Any) -> str | None:
    """The first field of a parsed ``tokenizer_config.json`` whose type transformers cannot use (it fails later
    with a TypeError / AttributeError that names no file), else None."""
    if not isinstance(config, dict):
        return f"the top level is {type(config).__name__}, not an object"
    for k in _SPECIAL_TOKEN_KEYS:
        if config.get(k) is not None and _token_entry_problem(config[k]):
            return f"{k!r} must be a string or an object with a string 'content', got {config[k]!r:.60}"
    extra = config.get("additional_special_tokens")
    if extra is not None and (not isinstance(extra, list) or any(_token_entry_problem(t) for t in extra)):
        return "'additional_special_tokens' must be a list of strings / objects with a string 'content'"
    length = config.get("model_max_length")
    if length is not None and (isinstance(length, bool) or not isinstance(length, (int, float)) or length <= 0):
        return f"'model_max_length' must be a positive number, got {length!r:.60}"
    decoder = config.get("added_tokens_decoder")
    if decoder is not None and (not isinstance(decoder, dict)
                                or any(not isinstance(v, dict) or not isinstance(v.get("content"), str)
                                       for v in decoder.values())):
        return "'added_tokens_decoder' must map ids to objects with a string 'content'"
    for k in ("tokenizer_class", "chat_template", "padding_side", "truncation_side"):
        if config.get(k) is not None and not isinstance(config[k], (str, list) if k == "chat_template" else str):
            return f"{k!r} must be a string, got {config[k]!r:.60}"
    return None


def _tokenizer_code_map(name: str, record: Any) -> Any:
    """The ``auto_map`` entry of a parsed ``tokenizer_config.json`` / ``config.json`` that maps AutoTokenizer to code
    in the directory (None: none). ``tokenizer_config.json`` may hold the older form, a bare ``[slow, fast]`` list."""
    auto_map = record.get("auto_map") if isinstance(record, dict) else None
    if isinstance(auto_map, dict):
        return auto_map.get("AutoTokenizer") or None
    if name == "tokenizer_config.json" and isinstance(auto_map, (list, tuple)) and any(auto_map):
        return auto_map
    return None


def refuse_remote_code(directory: str, key: str, parsed: dict[str, Any] | None = None) -> None:
    """Raise when ``directory``'s tokenizer is Python code in the directory: an ``auto_map`` entry for
    ``AutoTokenizer`` in ``tokenizer_config.json`` or ``config.json``. nxd_lc never runs code from a model directory;
    every load passes ``trust_remote_code=False``, so transformers would load a built-in class in its place, which
    is not the tokenizer the directory defines. Entries for model classes (``AutoConfig``, ``AutoModel...``) are
    allowed: they run no code for the tokenizer, and nxd_lc builds its model from config.json's fields.

    Args:
        directory: the tokenizer directory.
        key: config key naming it.
        parsed: the files already read by :func:`check_tokenizer_files` (None: read them here).
    Raises:
        ValueError: naming ``key``, the file and the entry; or a damaged file (as :func:`check_tokenizer_files`).
    """
    for name in _CODE_MAP_FILES:
        path = os.path.join(directory, name)
        if parsed is not None:
            record = parsed.get(name)
        elif os.path.isfile(path):
            record = _json_file(path, key)
        else:
            continue
        entry = _tokenizer_code_map(name, record)
        if entry is not None:
            raise ValueError(f"{key}: {path} maps AutoTokenizer to Python code in the directory "
                             f"(auto_map['AutoTokenizer']: {entry}); nxd_lc never runs code from a model directory: "
                             "use a tokenizer of a built-in type (a fast tokenizer.json with a standard "
                             "tokenizer_class)")


def _present_files(directory: str, parsed: dict[str, Any]) -> str:
    """The tokenizer files of ``directory`` transformers reads (the JSON files :func:`check_tokenizer_files` read,
    and the text files present), comma-separated paths, for an error that cannot tell which one is at fault."""
    names = [*parsed, *(n for n in _TEXT_FILES if os.path.isfile(os.path.join(directory, n)))]
    return ", ".join(os.path.join(directory, n) for n in names)


def _load_dir(directory: str, kind: str, *, use_fast: bool = True,
              require_fast: bool = True, key: str = "data.tokenizer.type") -> PreTrainedTokenizerFast:
    from transformers import AutoTokenizer

    parsed = check_tokenizer_files(directory, key)
    refuse_remote_code(directory, key, parsed)
    try:
        tok = AutoTokenizer.from_pretrained(directory, local_files_only=True, use_fast=use_fast,
                                            trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on a file it cannot parse
        files = _present_files(directory, parsed) or "none of the known tokenizer files"
        raise ValueError(f"{key}: cannot load a tokenizer from {directory}: one of its files "
                         f"({files}) holds what transformers "
                         f"cannot use ({type(e).__name__}: {e}); copy the tokenizer files again") from e
    if require_fast and not getattr(tok, "is_fast", False):
        hint = "; set data.tokenizer.use_fast: true" if not use_fast else ""
        raise ValueError(f"{key}: {kind!r} loads a slow tokenizer ({type(tok).__name__}); text is "
                         f"tokenized with a fast (tokenizer.json) tokenizer{hint}")
    vocab = tok.get_vocab()
    top = max(vocab.values(), default=-1)
    if top >= len(tok) or len(set(vocab.values())) != len(vocab):  # ids must be 0..N-1, each once
        files = _present_files(directory, parsed) or directory
        raise ValueError(f"{key}: the tokenizer in {directory} ({files}) gives token ids up to {top} "
                         f"for {len(tok)} tokens: its vocabulary repeats or skips ids, so ids would fall outside "
                         "the embedding; the tokenizer files are damaged: copy them again")
    if tok.eos_token_id is None:
        raise ValueError(f"{key}: tokenizer {kind!r} has no eos token; packing separates "
                         f"documents with it; set eos_token in {os.path.join(directory, 'tokenizer_config.json')}")
    return tok


def load_saved_tokenizer(directory: str, key: str) -> PreTrainedTokenizerFast:
    """The tokenizer saved in ``directory`` (a run's ``<log_dir>/tokenizer``, an HF model directory), loaded with
    the checks of ``data.tokenizer.type``'s directories: valid files, no remote code, ids 0..N-1, an eos token.

    Args:
        key: what the errors name as the tokenizer's source (a path or an option).

    Raises:
        ValueError: a damaged or incomplete tokenizer (names ``key``, the file and the fix).
    """
    return _load_dir(directory, directory, key=key)


def special_token_ids(tokenizer: Any) -> dict[str, int | None]:
    """``{"bos_token_id", "eos_token_id", "pad_token_id"}`` of an HF tokenizer (None where it has no such token):
    the ids an HF ``config.json`` / ``generation_config.json`` must carry for ``generate`` to stop at the eos the
    training data was packed with (:class:`~nxd_lc.data.datamodule.PretrainingDataModule` separates documents with
    ``tokenizer.eos_token_id``)."""
    return {name: (None if getattr(tokenizer, name, None) is None else int(getattr(tokenizer, name)))
            for name in ("bos_token_id", "eos_token_id", "pad_token_id")}


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerFast) -> str:
    """SHA-256 hex of the tokenizer's serialized model/normalizer/pre-tokenizer and its eos id (cache key)."""
    h = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode("utf-8"))
    h.update(str(tokenizer.eos_token_id).encode())
    return h.hexdigest()


def check_vocab(tokenizer: PreTrainedTokenizerFast, model_vocab_size: int) -> None:
    """Raise when the tokenizer can emit ids the model's embedding cannot hold.

    Raises:
        ValueError: ``len(tokenizer) > model_vocab_size``; names ``data.tokenizer`` and ``model.model_config``.
    """
    n = len(tokenizer)
    if n > model_vocab_size:
        raise ValueError(f"data.tokenizer: the tokenizer has {n} tokens but the model's vocab_size (from "
                         f"model.model_config) is {model_vocab_size}; lower data.tokenizer.vocab_size to "
                         f"<= {model_vocab_size} or use a model config with vocab_size >= {n}")


GPT2_BPE = "GPT2BPETokenizer"
#: ``data.tokenizer.library`` values nxd_lc loads (None: nxd_lc's own reading of ``type``)
TOKENIZER_LIBRARIES = (None, "huggingface", "megatron")


def _is_path(kind: str | None) -> bool:
    """Whether a Megatron-library ``type`` names a directory rather than a Megatron tokenizer class."""
    return kind is not None and (os.sep in kind or "/" in kind or kind.startswith((".", "~")) or
                                 os.path.isdir(resolve_path(kind)))


def tokenizer_unsupported(tok: TokenizerConfig) -> list[str]:
    """``not supported yet: data.tokenizer.<key>=<value>`` for each tokenizer key nxd_lc cannot honour (empty: all
    can be): a library other than huggingface / megatron, a Megatron ``type`` other than GPT2BPETokenizer or a
    directory, ``model`` (SentencePiece files), ``delimiter`` (tabular), ``sentencepiece_legacy: true``, and
    ``vocab_file`` / ``merge_file`` outside library megatron + GPT2BPETokenizer."""
    out: list[str] = []
    gpt2 = tok.library == "megatron" and tok.type == GPT2_BPE
    if tok.library not in TOKENIZER_LIBRARIES:
        out.append(f"data.tokenizer.library={tok.library!r} (nxd_lc loads HF tokenizer directories: library "
                   "huggingface, and Megatron's GPT2BPETokenizer files: library megatron)")
    elif tok.library == "megatron" and not gpt2 and not _is_path(tok.type):
        out.append(f"data.tokenizer.type={tok.type!r} with library megatron (supported: GPT2BPETokenizer with "
                   "vocab_file + merge_file, or an HF tokenizer directory)")
    for key, why in (("model", "a SentencePiece model file; give its HF tokenizer directory as data.tokenizer.type"),
                     ("delimiter", "NeMo's tabular tokenizer")):
        if getattr(tok, key) is not None:
            out.append(f"data.tokenizer.{key}={getattr(tok, key)!r} ({why})")
    if tok.sentencepiece_legacy:
        out.append("data.tokenizer.sentencepiece_legacy=True (NeMo's sentencepiece library; set it false)")
    for key in ("vocab_file", "merge_file"):
        if getattr(tok, key) is not None and not gpt2 and tok.library in TOKENIZER_LIBRARIES:
            out.append(f"data.tokenizer.{key}={getattr(tok, key)!r} (read only with library megatron, type "
                       f"{GPT2_BPE}; an HF tokenizer directory carries its own files)")
    return [f"not supported yet: {p}" for p in out]


def tokenizer_problems(tok: TokenizerConfig) -> list[str]:
    """Config errors of the ``data.tokenizer`` library keys (names the key and the fix): GPT2BPETokenizer needs
    both files; ``bytelevel_bpe`` is nxd_lc's own trained tokenizer, read only without a library."""
    p: list[str] = []
    if tok.library == "megatron" and tok.type == GPT2_BPE:
        for key in ("vocab_file", "merge_file"):
            if getattr(tok, key) is None:
                p.append(f"data.tokenizer.{key}: library megatron, type {GPT2_BPE} needs the GPT-2 "
                         f"{'vocab.json' if key == 'vocab_file' else 'merges.txt'} file; set it")
    if tok.library in ("huggingface", "megatron") and tok.type == BYTELEVEL_BPE:
        p.append(f"data.tokenizer.type: {BYTELEVEL_BPE!r} is nxd_lc's trained tokenizer, not a {tok.library} one; "
                 "remove data.tokenizer.library, or give an HF tokenizer directory")
    if tok.library in ("huggingface", "megatron") and tok.type is None:
        p.append(f"data.tokenizer.type: library {tok.library} needs a type (an HF tokenizer directory"
                 + (f", or {GPT2_BPE})" if tok.library == "megatron" else ")"))
    return p


def tokenizer_paths(tok: TokenizerConfig) -> list[tuple[str, str, bool]]:
    """``(key, path, is_dir)`` of the on-disk inputs the tokenizer config names (checked at launch)."""
    if tok.library == "megatron" and tok.type == GPT2_BPE:
        return [(f"data.tokenizer.{k}", getattr(tok, k), False) for k in ("vocab_file", "merge_file")
                if getattr(tok, k) is not None]
    if tok.type is None or (tok.type == BYTELEVEL_BPE and tok.library is None):
        return []
    return [("data.tokenizer.type", tok.type, True)]


def _gpt2_bpe(tok_cfg: TokenizerConfig) -> PreTrainedTokenizerFast:
    """transformers' GPT2TokenizerFast from ``vocab_file`` + ``merge_file`` (Megatron's GPT2BPETokenizer)."""
    from transformers import GPT2TokenizerFast

    paths = {}
    for key in ("vocab_file", "merge_file"):
        path = getattr(tok_cfg, key)
        if path is None or not os.path.isfile(resolve_path(path)):
            raise ValueError(f"data.tokenizer.{key}: {GPT2_BPE} needs an existing file, got {path!r}")
        paths[key] = resolve_path(path)
    vocab = _json_file(paths["vocab_file"], "data.tokenizer.vocab_file")
    if not isinstance(vocab, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in vocab.values()):
        got = "an object with a value that is not an integer" if isinstance(vocab, dict) else \
            f"a JSON {type(vocab).__name__}"
        raise ValueError(f"data.tokenizer.vocab_file: {paths['vocab_file']} must be one JSON object of token -> "
                         f"integer id (GPT-2's vocab.json), got {got}")
    read_text(paths["merge_file"], key="data.tokenizer.merge_file")
    try:
        tok = GPT2TokenizerFast(vocab=paths["vocab_file"], merges=paths["merge_file"])
    except Exception as e:  # tokenizers raises its own exception types on malformed files
        raise ValueError(f"data.tokenizer.vocab_file / merge_file: cannot build a GPT-2 BPE from {paths['vocab_file']}"
                         f" and {paths['merge_file']}: {e}") from e
    if EOS_TOKEN not in tok.get_vocab() or tok.convert_tokens_to_ids(EOS_TOKEN) >= tok.vocab_size:
        raise ValueError(f"data.tokenizer.vocab_file: {paths['vocab_file']} has no {EOS_TOKEN!r} entry, which "
                         f"Megatron's {GPT2_BPE} uses as EOD")
    return tok


def tokenizer_vocab_size(tok_cfg: TokenizerConfig) -> int:
    """Vocabulary size of the configured on-disk tokenizer as NeMo counts it: ``len(tokenizer)`` (base vocabulary
    plus added tokens), before any padding to ``make_vocab_size_divisible_by``.

    Raises:
        ValueError: the tokenizer cannot be loaded (names the ``data.tokenizer`` key), including
            ``type: bytelevel_bpe``, which is trained from the corpus when the data module is set up.
    """
    if tok_cfg.type == BYTELEVEL_BPE and tok_cfg.library is None:
        raise ValueError(f"data.tokenizer.type: {BYTELEVEL_BPE!r} is trained from the corpus at data setup, so its "
                         "size is not known before; give an HF tokenizer directory (or GPT-2 vocab/merges files)")
    return len(load_tokenizer(tok_cfg, None, require_fast=False))
