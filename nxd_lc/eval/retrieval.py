"""Long-context retrieval evaluation: passkey and needle-in-a-haystack tasks over a length x depth grid.

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

Scoring, both reported:

* ``generate`` — greedy decoding of ``max_new_tokens`` (answer length + 4) and a match when every reference string
  occurs in the output (RULER's ``string_match_all``). With a KV cache (:mod:`nxd_lc.models.common.kv_cache`;
  the default wherever the layout allows: not under CP, SP or PP) the prompt runs once and each new token alone;
  without one each new token re-runs the forward over the whole sequence (cost x answer length).
* ``rank`` — the log-likelihood of each candidate answer after the prompt (with a KV cache the prompt runs once and
  each candidate over its own tokens; without, one forward per candidate over prompt + candidate); a match
  when the ``k`` best candidates are the ``k`` reference answers (``k`` = 1 except multivalue / variable tracking).
  Candidates: the references plus distractors of the same form (chance: ``k / num_candidates`` for ``k`` = 1).

Layouts: every rank calls the functions with the same samples; the model returns vocab-parallel logits
``[B, S, Vp/tp]`` (TP: log-likelihoods via :func:`nxd_lc.layers.parallel_cross_entropy`, next-token argmax over
the TP-gathered vocabulary); under CP > 1 the (right-padded) sequence is sharded with
:func:`nxd_lc.context.shard_batch_for_context_parallel` and sums / the last position's logits are all-reduced over
the CP group; under DP the samples are split over DP ranks and the counts all-reduced.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from nxd_lc.distributed import collectives
from nxd_lc.distributed import parallel_state as ps

ModelFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]

TASKS = ("passkey", "niah_single", "niah_multikey", "niah_multivalue", "variable_tracking")
SCORINGS = ("generate", "rank")
#: RULER's threshold for the "effective length": Llama-2-7B's mean score at 4K (85.6%)
RULER_THRESHOLD = 0.856

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


def _encode(tokenizer: Any, text: str) -> list[int]:
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
    enc = lambda text: _encode(tokenizer, text)  # noqa: E731
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
    hay = (_haystack_window(_encode(tokenizer, PASSKEY_FILLER) * (budget // 8 + 2), budget, rng)
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


# ------------------------------------------------------------------------------------------------ model calls
def _mp_sizes() -> tuple[int, int]:
    if not ps.model_parallel_is_initialized():
        return 1, 1
    return ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size()


def _padded_batch(rows: list[list[int]], labels: list[list[int]], pad_id: int, algo: str) -> dict[str, torch.Tensor]:
    """``[B, S]`` batch right-padded to a length the layout can shard (multiple of 2 x CP x TP), CP-sharded."""
    tp, cp = _mp_sizes()
    multiple = 2 * cp * tp
    seq = max(len(r) for r in rows)
    seq = -(-seq // multiple) * multiple
    ids = torch.full((len(rows), seq), pad_id, dtype=torch.long)
    lab = torch.full((len(rows), seq), -100, dtype=torch.long)
    for i, (r, lb) in enumerate(zip(rows, labels)):
        ids[i, :len(r)] = torch.tensor(r)
        lab[i, :len(lb)] = torch.tensor(lb)
    batch = {"input_ids": ids, "labels": lab, "position_ids": torch.arange(seq).expand(len(rows), seq).clone()}
    if cp > 1:
        from nxd_lc.context import shard_batch_for_context_parallel

        batch = shard_batch_for_context_parallel(batch, ps.get_context_parallel_rank(), cp, algo)
    return batch


def _cp_sum(t: torch.Tensor) -> torch.Tensor:
    if _mp_sizes()[1] > 1:
        collectives.all_reduce(t, ps.get_context_parallel_group())
    return t


def kv_cache_for(model: Any, use: bool | None = None) -> Any | None:
    """A fresh KV cache for ``model`` (:meth:`LlamaForCausalLM.new_kv_cache`), or None to run without one.

    Args:
        use: True requires one, False never uses one, None (auto) uses one when the model and layout allow it
            (a model with ``new_kv_cache``; not CP, SP or PP: :meth:`~LlamaForCausalLM.kv_cache_unsupported`).
    Raises:
        ValueError: ``use=True`` where no cache is possible (says why).
    """
    if use is False:
        return None
    why = model.kv_cache_unsupported() if hasattr(model, "kv_cache_unsupported") else \
        "the model has no KV cache (new_kv_cache)"
    if why is None:
        return model.new_kv_cache()
    if use:
        raise ValueError(f"KV cache requested but not available: {why}")
    return None


def _full_vocab_logits(model: Any, ids: list[int], cache: Any, last: int, device: Any) -> torch.Tensor:
    """Append ``ids`` to ``cache`` through ``model`` and return the fp32 logits of its last ``last`` positions over
    the whole (TP-gathered) vocabulary, ``[last, Vp]`` on the CPU (collective over TP)."""
    x = torch.tensor([ids], dtype=torch.long, device=device)
    with torch.no_grad():
        hidden = model.hidden_states(x, None, None, kv_cache=cache)
        logits = model.logits_from_hidden(hidden[:, -last:])[0].float().cpu()  # [last, Vp/tp]
    tp = _mp_sizes()[0]
    if tp > 1:
        logits = collectives.all_gather(logits.contiguous(), 1, ps.get_tensor_model_parallel_group())
    return logits


def _cached_logprobs(model: Any, cache: Any, prompt: list[int], continuations: list[list[int]], vocab_size: int,
                     device: Any, prompt_logits: torch.Tensor | None = None) -> list[float]:
    """:func:`candidate_logprobs` with a KV cache: the prompt runs once (or not at all when ``cache`` already holds
    it and ``prompt_logits``, its last position's ``[Vp]`` logits, are given), each continuation over its own
    tokens, the cache truncated back to the prompt after each."""
    if prompt_logits is None:
        prompt_logits = _full_vocab_logits(model, prompt, cache, 1, device)[0]
    first = torch.log_softmax(_masked(prompt_logits, vocab_size), -1)
    out = []
    for cont in continuations:
        total = float(first[cont[0]])
        if len(cont) > 1:
            logp = torch.log_softmax(_masked(_full_vocab_logits(model, cont[:-1], cache, len(cont) - 1, device),
                                             vocab_size), -1)
            total += float(logp[torch.arange(len(cont) - 1), torch.tensor(cont[1:])].double().sum())
            cache.truncate(len(prompt))
        out.append(total)
    return out


def _masked(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Padded vocabulary columns (``>= vocab_size``) set to -inf."""
    logits = logits.clone()
    logits[..., vocab_size:] = -math.inf
    return logits


def candidate_logprobs(model: ModelFn, prompt: list[int], continuations: list[list[int]], *, pad_id: int = 0,
                       algo: str = "ring", device: torch.device | str | None = None,
                       kv_cache: bool | None = False, vocab_size: int | None = None) -> list[float]:
    """``log p(continuation | prompt)`` (natural log, summed over its tokens) for each continuation. Without a KV
    cache one forward per continuation over prompt + continuation; with one (``kv_cache`` as :func:`kv_cache_for`;
    needs ``vocab_size``, the real vocabulary) the prompt runs once. Collective over TP and CP when
    ``parallel_state`` is initialised."""
    from nxd_lc.eval.loss_by_position import per_token_loss

    cache = kv_cache_for(model, kv_cache)
    if cache is not None:
        if vocab_size is None:
            raise ValueError("candidate_logprobs: vocab_size is required with a KV cache")
        return _cached_logprobs(model, cache, prompt, continuations, vocab_size, device)
    out = []
    for cont in continuations:
        row = prompt + cont
        labels = [-100] * (len(prompt) - 1) + cont + [-100]  # labels[i] = token i + 1
        batch = _padded_batch([row], [labels], pad_id, algo)
        if device is not None:
            batch = {k: v.to(device) for k, v in batch.items()}
        total = per_token_loss(model, batch).sum().double().cpu()
        out.append(-float(_cp_sum(total.reshape(1))[0]))
    return out


def next_token(model: ModelFn, ids: list[int], vocab_size: int, *, pad_id: int = 0, algo: str = "ring",
               device: torch.device | str | None = None) -> int:
    """Greedy next token after ``ids``: argmax of the logits at the last position over the real vocabulary (padded
    vocab rows excluded). Collective over TP (vocab gathered) and CP (the position's logits all-reduced)."""
    tp, cp = _mp_sizes()
    batch = _padded_batch([ids], [[-100] * len(ids)], pad_id, algo)
    if device is not None:
        batch = {k: v.to(device) for k, v in batch.items()}
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["position_ids"], None)[0].float()  # [S_local, Vp/tp]
    hit = (batch["position_ids"][0] == len(ids) - 1).nonzero()
    last = logits[hit[0, 0]].cpu() if hit.numel() else torch.zeros(logits.shape[-1])
    last = _cp_sum(last.clone())
    if tp > 1:
        last = collectives.all_gather(last.contiguous(), 0, ps.get_tensor_model_parallel_group())
    last[vocab_size:] = -math.inf
    return int(last.argmax())


def generate_greedy(model: ModelFn, prompt: list[int], max_new_tokens: int, vocab_size: int, *,
                    eos_id: int | None = None, pad_id: int = 0, algo: str = "ring",
                    device: torch.device | str | None = None, kv_cache: bool | None = False,
                    prefilled: tuple[Any, torch.Tensor] | None = None) -> list[int]:
    """Greedy continuation of ``prompt`` (up to ``max_new_tokens``, stopping after ``eos_id``). With a KV cache
    (``kv_cache`` as :func:`kv_cache_for`) the prompt runs once and each new token alone; without, every token
    re-runs the forward over the whole sequence. ``prefilled``: ``(cache, logits)`` of a cache that already holds
    exactly ``prompt`` and its last position's ``[Vp]`` logits (the cache is extended by the generated tokens;
    the caller truncates it). Collective as :func:`next_token`."""
    out: list[int] = []
    cache, logits = prefilled if prefilled is not None else (kv_cache_for(model, kv_cache), None)
    if cache is not None:
        if logits is None:
            logits = _full_vocab_logits(model, prompt, cache, 1, device)[0]
        for _ in range(max_new_tokens):
            tok = int(_masked(logits, vocab_size).argmax())
            out.append(tok)
            if (eos_id is not None and tok == eos_id) or len(out) == max_new_tokens:
                break
            logits = _full_vocab_logits(model, [tok], cache, 1, device)[0]
        return out
    for _ in range(max_new_tokens):
        tok = next_token(model, prompt + out, vocab_size, pad_id=pad_id, algo=algo, device=device)
        out.append(tok)
        if eos_id is not None and tok == eos_id:
            break
    return out


def score_sample(model: ModelFn, tokenizer: Any, sample: RetrievalSample, vocab_size: int,
                 scorings: Sequence[str] = SCORINGS, **kw: Any) -> dict[str, Any]:
    """``{"generate": bool, "rank": bool, "output": str, "ranked": [...]}`` for one sample (see module docstring).

    With a KV cache (``kw["kv_cache"]`` as :func:`kv_cache_for`) the prompt is prefilled once for both scorings:
    greedy generation extends the cache, which is then truncated back to the prompt for the candidates."""
    res: dict[str, Any] = {}
    prompt = sample.input_ids
    cache = kv_cache_for(model, kw.get("kv_cache", False))
    prefilled = None if cache is None else (cache, _full_vocab_logits(model, prompt, cache, 1, kw.get("device"))[0])
    if "generate" in scorings:
        n = sum(len(_encode(tokenizer, " " + a)) for a in sample.answers) + 4
        toks = generate_greedy(model, prompt, n, vocab_size, eos_id=getattr(tokenizer, "eos_token_id", None),
                               prefilled=prefilled, **kw)
        text = tokenizer.decode(toks)
        res["output"] = text
        res["generate"] = all(a in text for a in sample.answers)
    if "rank" in scorings:
        conts = [_encode(tokenizer, " " + c) for c in sample.candidates]
        if prefilled is not None:
            cache.truncate(len(prompt))
            lps = _cached_logprobs(model, cache, prompt, conts, vocab_size, kw.get("device"), prefilled[1])
        else:
            lps = candidate_logprobs(model, prompt, conts, vocab_size=vocab_size,
                                     **{k: v for k, v in kw.items() if k != "eos_id"})
        order = sorted(range(len(conts)), key=lambda i: -lps[i])
        best = {sample.candidates[i] for i in order[:len(sample.answers)]}
        res["ranked"] = [sample.candidates[i] for i in order[:len(sample.answers)]]
        res["rank"] = best == set(sample.answers)
    return res


# ------------------------------------------------------------------------------------------------ the grid
def evaluate_grid(model: ModelFn, tokenizer: Any, haystack: Sequence[int], *, tasks: Sequence[str],
                  lengths: Sequence[int], depths: Sequence[float], num_samples: int, vocab_size: int, seed: int = 0,
                  scorings: Sequence[str] = SCORINGS, threshold: float = RULER_THRESHOLD, pad_id: int = 0,
                  algo: str = "ring", device: torch.device | str | None = None,
                  sample_kwargs: dict[str, Any] | None = None, kv_cache: bool | None = None) -> dict[str, Any]:
    """Accuracy of every (task, length, depth) cell with every scoring; collective under a parallel layout (every
    rank calls it with the same arguments; DP ranks split the samples and the counts are all-reduced).

    Returns:
        ``{"tasks": {task: {"cells": [{"length", "depth", "n", "generate", "rank"}...], "by_length": {scoring:
        {length: acc}}, "effective_length": {scoring: L or 0}}}, "meta": {...}}``. ``effective_length`` (RULER):
        the largest evaluated length up to which every length's mean accuracy is >= ``threshold``.

    Raises:
        ValueError: unknown task / scoring, bad depth, a length too short (see :func:`build_sample`).
    """
    for s in scorings:
        if s not in SCORINGS:
            raise ValueError(f"retrieval scoring {s!r} unknown; choose from {', '.join(SCORINGS)}")
    dp = ps.get_data_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    dp_rank = ps.get_data_parallel_rank() if ps.model_parallel_is_initialized() else 0
    use_cache = kv_cache_for(model, kv_cache) is not None
    kw = {"pad_id": pad_id, "algo": algo, "device": device, "kv_cache": use_cache}
    out: dict[str, Any] = {"tasks": {}, "meta": {"lengths": list(lengths), "depths": list(depths), "seed": seed,
                                                   "num_samples": num_samples, "scorings": list(scorings),
                                                   "threshold": threshold, "kv_cache": use_cache}}
    for task in tasks:
        cells = []
        for length in lengths:
            for depth in depths:
                counts = torch.zeros(1 + len(scorings), dtype=torch.float64)
                for i in range(dp_rank, num_samples, dp):
                    sample = build_sample(task, tokenizer, haystack, length, depth, seed, i, **(sample_kwargs or {}))
                    res = score_sample(model, tokenizer, sample, vocab_size, scorings, **kw)
                    counts += torch.tensor([1.0] + [float(res[s]) for s in scorings], dtype=torch.float64)
                if dp > 1:
                    collectives.all_reduce(counts, ps.get_data_parallel_group())
                n = int(counts[0])
                cells.append({"length": length, "depth": depth, "n": n,
                              **{s: float(counts[1 + j] / max(n, 1)) for j, s in enumerate(scorings)}})
        by_length = {s: {str(L): sum(c[s] for c in cells if c["length"] == L) / len(depths) for L in lengths}
                     for s in scorings}
        effective = {}
        for s in scorings:
            eff = 0
            for L in lengths:
                if by_length[s][str(L)] < threshold:
                    break
                eff = L
            effective[s] = eff
        out["tasks"][task] = {"cells": cells, "by_length": by_length, "effective_length": effective}
    return out


def format_table(result: dict[str, Any]) -> str:
    """Text table: one row per task and scoring, mean accuracy per length, and the effective length."""
    lengths = result["meta"]["lengths"]
    head = f"{'task':>18} {'scoring':>9} | " + " ".join(f"{L:>7}" for L in lengths) + " | effective"
    lines = [head, "-" * len(head)]
    for task, r in result["tasks"].items():
        for s, accs in r["by_length"].items():
            lines.append(f"{task:>18} {s:>9} | " + " ".join(f"{accs[str(L)]:7.2f}" for L in lengths)
                         + f" | {r['effective_length'][s]}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ command line
def heldout_haystack(cfg: Any, model_vocab_size: int, num_tokens: int) -> tuple[Any, list[int]]:
    """``(tokenizer, token ids)``: the run's tokenizer and at least ``num_tokens`` tokens of the held-out split of
    its corpus (``data.val_dir``, else the ``data.val_fraction`` split; never training documents), in order.

    Raises:
        ValueError: the config has no held-out split (names ``data.val_fraction`` / ``data.val_dir``).
    """
    from nxd_lc.config.access import seq_length
    from nxd_lc.data.datamodule import PretrainingDataModule

    dm = PretrainingDataModule(cfg.data, seq_length=seq_length(cfg) or 0, seed=cfg.seed,
                               model_vocab_size=model_vocab_size, data_parallel_rank=0, data_parallel_size=1,
                               global_batch_size=cfg.data.micro_batch_size)
    dm.setup()
    if dm.val_dataset is None or len(dm.val_dataset) == 0:
        raise ValueError("retrieval haystack: the run's data has no held-out split; set data.val_fraction > 0 or "
                         "data.val_dir (haystacks never come from the training split)")
    tokens: list[int] = []
    for i in range(len(dm.val_dataset)):
        tokens += [int(t) for t in dm.val_dataset[i][:-1]]
        if len(tokens) >= num_tokens:
            break
    return dm.tokenizer, tokens


def build_arg_parser(prog: str, default_tasks: Sequence[str]) -> Any:
    """The command line of ``python -m nxd_lc.eval.passkey`` / ``nxd_lc.eval.niah``."""
    import argparse

    p = argparse.ArgumentParser(prog=prog, description="Retrieval accuracy of a run config's model over a context "
                                                        "length x needle depth grid (JSON + heatmap PNGs).")
    p.add_argument("--config-name", required=True, help="run config in --config-dir (model, tokenizer, data)")
    p.add_argument("--config-dir", default="conf", help="Hydra config directory (default: ./conf)")
    p.add_argument("--hf-dir", default=None, help="HF weights to evaluate (default: the config's model.hf_weights_dir)")
    p.add_argument("--tasks", default=",".join(default_tasks), help=f"comma-separated, of {', '.join(TASKS)}")
    p.add_argument("--lengths", default="512,1024,2048", help="context lengths in tokens, comma-separated")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths in [0, 1], comma-separated")
    p.add_argument("--num-samples", type=int, default=5, help="samples per (length, depth) cell (default 5)")
    p.add_argument("--scoring", default="generate,rank", help="generate, rank or both (default both)")
    p.add_argument("--num-candidates", type=int, default=10, help="candidates ranked per sample (default 10)")
    p.add_argument("--seed", type=int, default=0, help="sample seed (default 0)")
    p.add_argument("--kv-cache", choices=("auto", "on", "off"), default="auto",
                   help="KV cache for generation and ranking: auto (where the layout allows: not CP, SP or PP), on "
                        "(an error where it cannot), off (re-run the whole sequence)")
    p.add_argument("--out", required=True, help="output directory: retrieval.json and one heatmap PNG per task")
    p.add_argument("--label", default="", help="title of the table and plots")
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the run config, key=value")
    return p


def _numbers(text: str, key: str, cast: Callable[[str], Any], ok: Callable[[Any], bool], what: str) -> list[Any]:
    """Comma-separated ``cast`` values of flag ``key``; ValueError naming the flag unless all are ``ok``."""
    try:
        values = [cast(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"{key}: expected comma-separated {what}, got {text!r}") from e
    if not values or not all(ok(v) for v in values):
        raise ValueError(f"{key}: need {what}, got {text!r}")
    return values


def main(argv: Sequence[str] | None = None, *, prog: str = "python -m nxd_lc.eval.niah",
         default_tasks: Sequence[str] = TASKS[1:]) -> int:
    """Command-line entry point (one process, or torchrun at the config's TP x CP (x DP) layout). Returns 0, or 2
    after printing a config / input error."""
    import dataclasses
    import json
    import logging
    import os
    import sys

    from nxd_lc.checkpoint.convert import build_model, compose_run_config
    from nxd_lc.config.errors import ConfigError
    from nxd_lc.eval.loss_by_position import _eval_layout, eval_session, init_eval_layout
    from nxd_lc.eval.plots import plot_retrieval_heatmaps
    from nxd_lc.runtime.device import launched_world_size

    args = build_arg_parser(prog, default_tasks).parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(name)s] %(message)s", stream=sys.stdout)
    try:
        with eval_session():
            tasks = [t for t in args.tasks.split(",") if t]
            unknown = [t for t in tasks if t not in TASKS]
            if unknown or not tasks:
                raise ValueError(f"--tasks: unknown {unknown or 'none given'}; choose from {', '.join(TASKS)}")
            scorings = [s for s in args.scoring.split(",") if s]
            if not scorings or any(s not in SCORINGS for s in scorings):
                raise ValueError(f"--scoring: {args.scoring!r}; use generate, rank or generate,rank")
            lengths = _numbers(args.lengths, "--lengths", int, lambda v: v >= 1, "positive integers")
            depths = _numbers(args.depths, "--depths", float, lambda v: 0 <= v <= 1, "numbers in [0, 1]")
            if args.num_samples < 1:
                raise ValueError(f"--num-samples: must be >= 1, got {args.num_samples}")
            cfg = _eval_layout(compose_run_config(args.config_name, args.config_dir, args.overrides),
                               launched_world_size())
            hf_dir = args.hf_dir or cfg.model.hf_weights_dir
            if not hf_dir or not os.path.isdir(hf_dir):
                raise ValueError(f"--hf-dir: {hf_dir!r} is not a directory (nor the config's model.hf_weights_dir); "
                                 "convert a checkpoint with python -m nxd_lc.checkpoint.convert first")
            init_eval_layout(cfg)
            ds = cfg.distributed_strategy
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_weights_dir=hf_dir))
            model = build_model(cfg, load_weights=True)
            model.eval()
            tokenizer, haystack = heldout_haystack(cfg, model.config.vocab_size, 2 * max(lengths))
            pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
            result = evaluate_grid(model, tokenizer, haystack, tasks=tasks, lengths=lengths, depths=depths,
                                   num_samples=args.num_samples, vocab_size=model.config.vocab_size, seed=args.seed,
                                   scorings=scorings, pad_id=pad, algo=ds.context_parallel_algo,
                                   sample_kwargs={"num_candidates": args.num_candidates},
                                   kv_cache={"auto": None, "on": True, "off": False}[args.kv_cache])
            result["meta"].update(config=cfg.name, hf_dir=os.path.abspath(hf_dir),
                                  tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                                  context_parallel_size=ps.get_context_parallel_world_size(),
                                  rope=getattr(model.config, "rope_scaling", None))
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        label = args.label or f"{cfg.name} ({hf_dir})"
        print(label)
        print(format_table(result))
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "retrieval.json"), "w") as f:
            json.dump(result, f, indent=2, default=str)
        for path in plot_retrieval_heatmaps(result, args.out, label):
            print(f"wrote {path}")
    return 0


# ------------------------------------------------------------------------------------------------ during training
def _callback_base() -> type:
    import pytorch_lightning as pl

    return pl.Callback


class RetrievalEvalCallback(_callback_base()):  # type: ignore[misc]
    """Runs :func:`evaluate_grid` on the training model every ``every_n_steps`` optimizer steps
    (``exp_manager.retrieval_eval``) and logs ``retrieval/<task>/<scoring>@<length>`` (mean accuracy over the
    depths) and ``retrieval/<task>/<scoring>/effective_length``; rank 0 also prints the table.

    Collective: every rank runs it at the same steps. Haystacks are the first tokens of the data module's held-out
    split (``val_dataset``), read once. The model is put in eval mode for the evaluation and back after.

    Args:
        settings: the ``exp_manager.retrieval_eval`` section.
        seq_length: the run's sequence length (the lengths when ``settings.lengths`` is empty).
        algo: ``distributed_strategy.context_parallel_algo``.

    Raises:
        ValueError: (at the first evaluation) the data module has no held-out split or tokenizer.
    """

    def __init__(self, settings: Any, seq_length: int, algo: str = "ring") -> None:
        super().__init__()
        self.settings = settings
        self.lengths = list(settings.lengths) or [seq_length]
        self.algo = algo
        self._haystack: list[int] | None = None
        self._last_step = -1
        self.history: list[dict[str, Any]] = []

    def _data(self, trainer: Any) -> tuple[Any, list[int]]:
        dm = trainer.datamodule
        val = getattr(dm, "val_dataset", None)
        tok = getattr(dm, "tokenizer", None)
        if val is None or tok is None or len(val) == 0:
            raise ValueError("exp_manager.retrieval_eval: the data module has no held-out split (data.val_fraction "
                             "or data.val_dir) to cut haystacks from")
        if self._haystack is None:
            tokens: list[int] = []
            for i in range(len(val)):
                tokens += [int(t) for t in val[i][:-1]]
                if len(tokens) >= 2 * max(self.lengths):
                    break
            self._haystack = tokens
        return tok, self._haystack

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Evaluate after an optimizer step whose number is a multiple of ``every_n_steps``."""
        step, n = trainer.global_step, self.settings.every_n_steps
        if n <= 0 or step == 0 or step % n or step == self._last_step:
            return
        self._last_step = step
        tok, hay = self._data(trainer)
        model = pl_module.model
        was_training = model.training
        model.eval()
        try:
            s = self.settings
            pad = tok.eos_token_id if tok.eos_token_id is not None else 0
            result = evaluate_grid(model, tok, hay, tasks=list(s.tasks), lengths=self.lengths, depths=list(s.depths),
                                   num_samples=s.num_samples, vocab_size=model.config.vocab_size, seed=s.seed,
                                   scorings=list(s.scorings), pad_id=pad, algo=self.algo, device=pl_module.device,
                                   sample_kwargs={"num_candidates": s.num_candidates})
        finally:
            model.train(was_training)
        metrics: dict[str, float] = {}
        for task, r in result["tasks"].items():
            for scoring, accs in r["by_length"].items():
                metrics.update({f"retrieval/{task}/{scoring}@{L}": float(a) for L, a in accs.items()})
                metrics[f"retrieval/{task}/{scoring}/effective_length"] = float(r["effective_length"][scoring])
        self.history.append({"step": step, **metrics})
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
            print(f"retrieval at step {step}:\n{format_table(result)}", flush=True)
