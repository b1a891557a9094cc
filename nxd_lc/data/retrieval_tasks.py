"""Long-context retrieval samples: passkey and needle-in-a-haystack prompts of an exact token length (the data
of the retrieval evaluation, :mod:`nxd_lc.eval.retrieval`, and of synthetic training mixtures,
:mod:`nxd_lc.data.synthetic`).

Tasks (``TASKS``); every prompt is exactly ``length`` tokens, the needle(s) placed at token positions:

* ``passkey`` — Mohtashami & Jaggi 2023 ("Landmark Attention", appendix): an instruction, the repeated filler
  "The grass is green. The sky is blue. ...", the line "The pass key is 68246. Remember it. 68246 is the pass key."
  at depth ``d``, and "What is the pass key? The pass key is". Answer: the 5-digit key.
* ``niah_single`` / ``niah_multikey`` / ``niah_multivalue`` / ``variable_tracking`` — after RULER (Hsieh et al.
  2024, "RULER: What's the Real Context Size of Your Long-Context Language Models?"): the haystack is real text
  (held-out tokens of the run's corpus, never its training split); needles "The special magic number for
  <key> is: <7 digits>." — one (single); one plus distractors with other keys (multikey); several values of one
  key, all to be returned (multivalue); variable tracking: "VAR ABCDE = 12345." followed by a chain
  "VAR FGHIJ = VAR ABCDE." ..., plus a distractor chain of another value, all variables of the queried value to
  be returned. The question repeats the needle's own wording up to the answer (our templates differ from RULER's
  in that respect, so that a model that copies perfectly scores 1 — the harness's own test).

The primary needle starts after ``round(depth * budget)`` haystack tokens (``budget`` = length minus the
instruction, needles and question); other needles (distractors, further values, chain links) go to seeded
random haystack offsets (chain links after the first, in order). Samples are a function of ``(seed, task,
length, depth, index)``: every rank builds the same ones.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

TASKS = ("passkey", "niah_single", "niah_multikey", "niah_multivalue", "variable_tracking")


PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about the important information there.")


PASSKEY_FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."


PASSKEY_QUESTION = " What is the pass key? The pass key is"


NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
              "I will quiz you about the numbers afterwards.\n")


NIAH_NEEDLE = " The special magic number for {key} is: {value}."


NIAH_QUESTION = "\nWhat is the special magic number for {key}? The special magic number for {key} is:"


NIAH_QUESTION_ALL = "\nWhat are all the special magic numbers for {key}? The special magic numbers for {key} are:"


VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n"


VT_FIRST = " VAR {var} = {value}."


VT_LINK = " VAR {var} = VAR {prev}."


VT_QUESTION = ("\nFind all variables that are assigned the value {value} in the text above. The variables assigned "
               "the value {value} are:")


_WORDS = ("apple", "river", "candle", "forest", "silver", "thunder", "garden", "pencil", "marble", "window",
          "falcon", "copper", "meadow", "lantern", "harbor", "velvet", "orchid", "canyon", "pepper", "glacier",
          "tiger", "violin", "saddle", "quartz", "basket", "comet", "walnut", "ember", "island", "anchor")


@dataclass
class RetrievalSample:
    """One prompt of a task.

    Attributes:
        task, length, depth: the grid cell (``length`` tokens, primary needle at ``depth`` in [0, 1]).
        input_ids: the prompt, exactly ``length`` token ids.
        answers: reference strings, all to be produced (one for single-answer tasks).
        candidates: strings ranked by log-likelihood (``answers`` among them).
        needle_spans: ``[start, stop)`` token ranges of the needles in ``input_ids``, the primary needle first.
    """

    task: str
    length: int
    depth: float
    input_ids: list[int]
    answers: list[str]
    candidates: list[str]
    needle_spans: list[tuple[int, int]] = field(default_factory=list)


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _digits(rng: random.Random, n: int) -> str:
    return str(rng.randint(10 ** (n - 1), 10 ** n - 1))


def _key(rng: random.Random) -> str:
    return f"{rng.choice(_WORDS)}-{rng.choice(_WORDS)}"


def _var(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))


def _distinct(rng: random.Random, make: Callable[[random.Random], str], n: int, avoid: Sequence[str] = ()) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        v = make(rng)
        if v not in out and v not in avoid:
            out.append(v)
    return out


def _haystack_window(stream: Sequence[int], n: int, rng: random.Random) -> list[int]:
    """``n`` consecutive tokens of ``stream`` from a seeded offset, wrapping around (a short stream repeats)."""
    if not stream:
        raise ValueError("retrieval: the haystack token stream is empty; point data at held-out text")
    start = rng.randrange(len(stream))
    reps = math.ceil((start + n) / len(stream))
    return (list(stream) * reps)[start:start + n] if reps > 1 else list(stream[start:start + n])


def _assemble(intro: list[int], hay: list[int], needles: list[tuple[int, list[int]]], question: list[int]
              ) -> tuple[list[int], list[tuple[int, int]]]:
    """``intro + hay`` with each ``(offset, needle)`` inserted after ``offset`` haystack tokens, then ``question``.
    Returns the ids and each needle's span, in the order given."""
    order = sorted(range(len(needles)), key=lambda i: (needles[i][0], i))
    ids, spans, pos = list(intro), [(0, 0)] * len(needles), 0
    for i in order:
        offset, needle = needles[i]
        ids += hay[pos:offset]
        pos = offset
        spans[i] = (len(ids), len(ids) + len(needle))
        ids += needle
    ids += hay[pos:] + question
    return ids, spans


def build_sample(task: str, tokenizer: Any, haystack: Sequence[int], length: int, depth: float, seed: int,
                 index: int = 0, *, num_candidates: int = 10, num_distractors: int = 3, num_values: int = 4,
                 num_hops: int = 3, with_answer: bool = False) -> RetrievalSample:
    """The ``index``-th sample of grid cell ``(task, length, depth)`` (deterministic in all arguments).

    Args:
        task: one of :data:`TASKS`.
        tokenizer: an HF tokenizer (``encode(text, add_special_tokens=False)``, ``decode``).
        haystack: token ids of the haystack text (held-out corpus); ``passkey`` uses its own filler instead.
        length: prompt length in tokens.
        depth: where the primary needle starts, as a fraction of the haystack (0 = first, 1 = last).
        seed: evaluation seed.
        num_candidates: candidates ranked per sample (single-answer tasks; the others rank all keys' values /
            variables of the prompt plus random ones up to this number).
        num_distractors: other-key needles of ``niah_multikey``.
        num_values: values of ``niah_multivalue``.
        num_hops: chain links after the first assignment in ``variable_tracking`` (the distractor chain too).
        with_answer: a training document instead: ``input_ids`` ends with the answer (``" " + ", ".join(answers)
            + "."``) and still has exactly ``length`` tokens (:mod:`nxd_lc.data.synthetic`).

    Raises:
        ValueError: unknown task, depth outside [0, 1], or ``length`` too short for instruction + needles +
            question (names the minimum).
    """
    if task not in TASKS:
        raise ValueError(f"retrieval task {task!r} unknown; choose from {', '.join(TASKS)}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"retrieval depth must be in [0, 1], got {depth}")
    rng = random.Random(f"{seed}/{task}/{length}/{depth:.6f}/{index}")
    enc = lambda text: encode(tokenizer, text)  # noqa: E731
    needle_texts: list[str] = []
    if task == "passkey":
        keys = _distinct(rng, lambda r: _digits(r, 5), num_candidates)
        intro, question = enc(PASSKEY_INTRO), enc(PASSKEY_QUESTION)
        needle_texts = [PASSKEY_NEEDLE.format(key=keys[0])]
        answers, candidates = [keys[0]], keys
    elif task in ("niah_single", "niah_multikey"):
        names = _distinct(rng, _key, 1 + (num_distractors if task == "niah_multikey" else 0))
        values = _distinct(rng, lambda r: _digits(r, 7), max(num_candidates, len(names)))
        intro, question = enc(NIAH_INTRO), enc(NIAH_QUESTION.format(key=names[0]))
        needle_texts = [NIAH_NEEDLE.format(key=k, value=v) for k, v in zip(names, values)]
        answers, candidates = [values[0]], values[:max(num_candidates, len(names))]
    elif task == "niah_multivalue":
        name = _key(rng)
        values = _distinct(rng, lambda r: _digits(r, 7), max(num_candidates, 2 * num_values))
        intro, question = enc(NIAH_INTRO), enc(NIAH_QUESTION_ALL.format(key=name))
        needle_texts = [NIAH_NEEDLE.format(key=name, value=v) for v in values[:num_values]]
        answers, candidates = values[:num_values], values
    else:  # variable_tracking: the queried chain, then a distractor chain of another value
        names = _distinct(rng, _var, 2 * (num_hops + 1) + max(0, num_candidates - 2 * (num_hops + 1)))
        value, other = _distinct(rng, lambda r: _digits(r, 5), 2)
        chain, decoy = names[:num_hops + 1], names[num_hops + 1:2 * (num_hops + 1)]
        for vars_, val in ((chain, value), (decoy, other)):
            needle_texts.append(VT_FIRST.format(var=vars_[0], value=val))
            needle_texts += [VT_LINK.format(var=v, prev=p) for p, v in zip(vars_, vars_[1:])]
        intro, question = enc(VT_INTRO), enc(VT_QUESTION.format(value=value))
        answers, candidates = chain, names
    needles = [enc(t) for t in needle_texts]
    if with_answer:
        question = question + enc(" " + ", ".join(answers) + ".")
    budget = length - len(intro) - len(question) - sum(len(n) for n in needles)
    if budget < 0:
        raise ValueError(f"retrieval {task}: length {length} is too short for its instruction, needles and question "
                         f"({length - budget} tokens with this tokenizer); use lengths >= {length - budget}")
    hay = (_haystack_window(encode(tokenizer, PASSKEY_FILLER) * (budget // 8 + 2), budget, rng)
           if task == "passkey" else _haystack_window(haystack, budget, rng))
    offsets = [round(depth * budget)] + [rng.randint(0, budget) for _ in needles[1:]]
    if task == "variable_tracking":  # chain links in order, after the chain's first assignment
        k = num_hops + 1
        offsets[1:k] = sorted(rng.randint(offsets[0], budget) for _ in range(k - 1))
        decoy_offsets = sorted(offsets[k:])
        offsets[k:] = decoy_offsets
    ids, spans = _assemble(intro, hay, list(zip(offsets, needles)), question)
    assert len(ids) == length, (len(ids), length)
    return RetrievalSample(task=task, length=length, depth=depth, input_ids=ids, answers=answers,
                           candidates=candidates, needle_spans=spans)
