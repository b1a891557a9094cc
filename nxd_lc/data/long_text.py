"""Tokenizing documents of any length in bounded memory.

The ``tokenizers`` library takes about 110 bytes of memory per character of one input (measured: a 200 MiB
document, one ``.txt`` file or one ``.jsonl`` line, aborted the process with rc 134 asking 3.3 GB, naming no
file), and ``encode_batch_fast`` holds a whole batch at once. So a document longer than
:data:`MAX_ENCODE_CHARS` characters is tokenized in pieces (:func:`text_pieces`) whose ids are concatenated
back into the one document (pretraining packing sees the same document, no separator inside it), and a batch
holds at most :data:`MAX_BATCH_CHARS` characters: the peak is about 110 B x 4 Mi = 0.5 GB whatever the corpus.

A piece ends just before the last whitespace character of a whitespace run (``"a  |" " b"``), where GPT-2 style
pre-tokenizers (byte-level BPE, Llama 3's regex) split anyway, so those tokenizers give the same ids as on the
whole text; only a stretch of :data:`CUT_SEARCH_CHARS` characters without whitespace (a base64 blob) is cut
hard, where the ids at that one cut may differ from tokenizing the whole text.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any, Optional

import numpy as np

#: the most characters of one document tokenized in one piece (~110 MB of tokenizer memory)
MAX_ENCODE_CHARS = 1 << 20
#: the most characters tokenized in one ``encode_batch_fast`` call
MAX_BATCH_CHARS = 4 << 20
#: how far back from a piece's end a whitespace cut is looked for
CUT_SEARCH_CHARS = 1 << 16

_CUT = re.compile(r"\s(?=\S)")


def text_pieces(text: str, max_chars: Optional[int] = None) -> list[str]:
    """``text`` cut into pieces of at most ``max_chars`` characters (``"".join(pieces) == text``).

    Args:
        text: one document.
        max_chars: the bound (default :data:`MAX_ENCODE_CHARS`).

    Returns:
        ``[text]`` when it fits; else pieces each ending just before a whitespace character followed by a
        non-whitespace one (the last such place in the piece's final :data:`CUT_SEARCH_CHARS` characters), or at
        the bound where there is none.
    """
    limit = MAX_ENCODE_CHARS if max_chars is None else max_chars
    if len(text) <= limit:
        return [text]
    pieces, start = [], 0
    while len(text) - start > limit:
        end = start + limit
        cut = None
        for match in _CUT.finditer(text, max(start + 1, end - CUT_SEARCH_CHARS), end):
            cut = match.start()
        pieces.append(text[start:cut or end])
        start = cut or end
    pieces.append(text[start:])
    return pieces


def encode_documents(texts: Iterable[str], backend: Any, batch_size: int = 64) -> Iterator[np.ndarray]:
    """Token ids of each text, in order, as int32 arrays (no special tokens added), in bounded memory.

    Args:
        texts: documents.
        backend: a ``tokenizers.Tokenizer`` (``PreTrainedTokenizerFast.backend_tokenizer``).
        batch_size: the most pieces per ``encode_batch_fast`` call (also at most :data:`MAX_BATCH_CHARS`).

    Yields:
        One int32 array per document: the concatenated ids of its pieces (:func:`text_pieces`).
    """
    pieces: list[str] = []
    owners: list[int] = []
    parts: dict[int, list[np.ndarray]] = {}
    chars = complete = 0
    for index, text in enumerate(texts):
        for piece in text_pieces(text):
            if pieces and (len(pieces) == batch_size or chars + len(piece) > MAX_BATCH_CHARS):
                _encode_into(backend, pieces, owners, parts)
                yield from _take(parts, complete)
                pieces, owners, chars = [], [], 0
            pieces.append(piece)
            owners.append(index)
            chars += len(piece)
        complete = index + 1
    if pieces:
        _encode_into(backend, pieces, owners, parts)
    yield from _take(parts, complete)


def _encode_into(backend: Any, pieces: list[str], owners: list[int], parts: dict[int, list[np.ndarray]]) -> None:
    for owner, enc in zip(owners, backend.encode_batch_fast(pieces, add_special_tokens=False)):
        parts.setdefault(owner, []).append(np.asarray(enc.ids, dtype=np.int32))


def _take(parts: dict[int, list[np.ndarray]], complete: int) -> Iterator[np.ndarray]:
    """Pop and yield, in order, the documents below index ``complete`` (all their pieces are encoded)."""
    for index in sorted(i for i in parts if i < complete):
        chunks = parts.pop(index)
        yield chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
