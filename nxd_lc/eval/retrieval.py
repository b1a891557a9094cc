"""Long-context retrieval evaluation: scoring a model on passkey and needle-in-a-haystack samples
(:mod:`nxd_lc.data.retrieval_tasks`) over a length x depth grid.

Scoring, both reported:

* ``generate`` — greedy decoding of ``max_new_tokens`` (answer length + 4) and a match when every reference string
  occurs in the output (RULER's ``string_match_all``). With a KV cache (:mod:`nxd_lc.models.common.kv_cache`;
  the default wherever the layout allows: not under SP or PP; under CP every CP rank runs the unsharded sequence)
  the prompt runs once and each new token alone; without one each new token re-runs the forward over the whole
  sequence (cost x answer length).
* ``rank`` — the log-likelihood of each candidate answer after the prompt (with a KV cache the prompt runs once and
  each candidate over its own tokens; without, one forward per candidate over prompt + candidate); a match
  when the ``k`` best candidates are the ``k`` reference answers (``k`` = 1 except multivalue / variable tracking).
  Candidates: the references plus distractors of the same form (chance: ``k / num_candidates`` for ``k`` = 1).

Layouts: every rank calls the functions with the same samples; the model returns vocab-parallel logits
``[B, S, Vp/tp]`` (TP: log-likelihoods via :func:`nxd_lc.layers.parallel_cross_entropy`, next-token argmax over
the TP-gathered vocabulary); under CP > 1 the (right-padded) sequence is sharded with
:func:`nxd_lc.context.shard_batch_for_context_parallel` and sums / the last position's logits are all-reduced over
the CP group (with a KV cache the sequence is not sharded: every CP rank computes the same logits); under DP the
samples are split over DP ranks and the counts all-reduced. :func:`evaluate_grid` logs why it runs without a KV
cache and its progress (samples done, elapsed, time left).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Callable

import torch

from nxd_lc.data.retrieval_tasks import RetrievalSample, build_sample, encode
from nxd_lc.distributed import collectives
from nxd_lc.distributed import parallel_state as ps

ModelFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]

log = logging.getLogger(__name__)

SCORINGS = ("generate", "rank")
#: RULER's threshold for the "effective length": Llama-2-7B's mean score at 4K (85.6%)
RULER_THRESHOLD = 0.856


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


def kv_cache_unavailable(model: Any, use: bool | None = None) -> str | None:
    """Why :func:`kv_cache_for` gives no cache for ``model`` with ``use`` (None: it gives one).

    Raises:
        ValueError: ``use=True`` where no cache is possible (says why).
    """
    if use is False:
        return "--kv-cache off"
    why = model.kv_cache_unsupported() if hasattr(model, "kv_cache_unsupported") else \
        "the model has no KV cache (new_kv_cache)"
    if why is not None and use:
        raise ValueError(f"KV cache requested but not available: {why}")
    return why


def kv_cache_for(model: Any, use: bool | None = None) -> Any | None:
    """A fresh KV cache for ``model`` (:meth:`LlamaForCausalLM.new_kv_cache`), or None to run without one.

    Args:
        use: True requires one, False never uses one, None (auto) uses one when the model and layout allow it
            (a model with ``new_kv_cache``; not SP or PP: :meth:`~LlamaForCausalLM.kv_cache_unsupported`; under
            CP the sequence is not sharded).
    Raises:
        ValueError: ``use=True`` where no cache is possible (says why).
    """
    return model.new_kv_cache() if kv_cache_unavailable(model, use) is None else None


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
        n = sum(len(encode(tokenizer, " " + a)) for a in sample.answers) + 4
        toks = generate_greedy(model, prompt, n, vocab_size, eos_id=getattr(tokenizer, "eos_token_id", None),
                               prefilled=prefilled, **kw)
        text = tokenizer.decode(toks)
        res["output"] = text
        res["generate"] = all(a in text for a in sample.answers)
    if "rank" in scorings:
        conts = [encode(tokenizer, " " + c) for c in sample.candidates]
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
def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


_LOGGED: set[str] = set()


def _log_once(message: str) -> None:
    """Warn ``message`` on global rank 0, once per process (a training run evaluates many times)."""
    if _global_rank() == 0 and message not in _LOGGED:
        _LOGGED.add(message)
        log.warning("%s", message)


def _duration(seconds: float) -> str:
    """``"1h02m"``, ``"3m05s"`` or ``"42s"``."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class GridProgress:
    """Progress of this rank's samples of a grid, logged on global rank 0: ``retrieval: 3/12 samples (passkey,
    length 512, depth 0.5), 1m10s elapsed, about 3m30s left``.

    The time left assumes that a sample's cost is proportional to its weight (:func:`evaluate_grid` weighs by
    context length): elapsed x remaining weight / weight done.

    Args:
        weights: one per sample, in the order they run (> 0).
        interval_s: log after a sample when this long has passed since the last line (0: every sample); the
            last sample is always logged.
        clock: seconds (``time.monotonic``; tests pass their own).
    """

    def __init__(self, weights: list[float], interval_s: float = 10.0,
                 clock: Callable[[], float] | None = None) -> None:
        import time

        self.weights = list(weights)
        self.interval_s = interval_s
        self.clock = clock or time.monotonic
        self.enabled = _global_rank() == 0
        self.done = 0
        self.start = self.last = self.clock()
        self._weight_done = 0.0

    @property
    def total(self) -> int:
        """Samples in all."""
        return len(self.weights)

    def step(self, what: str) -> str | None:
        """Record one finished sample (``what``: its cell); return the line logged, or None."""
        self._weight_done += self.weights[self.done]
        self.done += 1
        now = self.clock()
        if not self.enabled or (now - self.last < self.interval_s and self.done < self.total):
            return None
        self.last = now
        elapsed = now - self.start
        left = elapsed * (sum(self.weights) - self._weight_done) / max(self._weight_done, 1e-9)
        line = (f"retrieval: {self.done}/{self.total} samples ({what}), {_duration(elapsed)} elapsed, "
                + ("done" if self.done == self.total else f"about {_duration(left)} left"))
        log.info("%s", line)
        return line


def evaluate_grid(model: ModelFn, tokenizer: Any, haystack: Sequence[int], *, tasks: Sequence[str],
                  lengths: Sequence[int], depths: Sequence[float], num_samples: int, vocab_size: int, seed: int = 0,
                  scorings: Sequence[str] = SCORINGS, threshold: float = RULER_THRESHOLD, pad_id: int = 0,
                  algo: str = "ring", device: torch.device | str | None = None,
                  sample_kwargs: dict[str, Any] | None = None, kv_cache: bool | None = None,
                  progress_interval_s: float = 10.0) -> dict[str, Any]:
    """Accuracy of every (task, length, depth) cell with every scoring; collective under a parallel layout (every
    rank calls it with the same arguments; DP ranks split the samples and the counts are all-reduced).

    Logs (global rank 0): at start the samples of this rank and, without a KV cache, why and what it costs
    (once per process); then progress (:class:`GridProgress`: samples done, elapsed, estimated time left) after a
    sample at most every ``progress_interval_s`` seconds (0: every sample) and after the last.

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
    no_cache = kv_cache_unavailable(model, kv_cache)
    use_cache = no_cache is None
    kw = {"pad_id": pad_id, "algo": algo, "device": device, "kv_cache": use_cache}
    out: dict[str, Any] = {"tasks": {}, "meta": {"lengths": list(lengths), "depths": list(depths), "seed": seed,
                                                   "num_samples": num_samples, "scorings": list(scorings),
                                                   "threshold": threshold, "kv_cache": use_cache,
                                                   "kv_cache_off_reason": no_cache}}
    mine = list(range(dp_rank, num_samples, dp))
    progress = GridProgress([float(L) for _ in tasks for L in lengths for _ in depths for _ in mine],
                            progress_interval_s)
    if no_cache is not None:
        num_candidates = (sample_kwargs or {}).get("num_candidates", 10)
        _log_once(f"retrieval: no KV cache ({no_cache}): every generated token re-runs the forward over the whole "
                  f"sequence and every candidate one forward over prompt + candidate, so a sample costs about "
                  f"{'(answer tokens + 4) + ' if 'generate' in scorings else ''}"
                  f"{num_candidates if 'rank' in scorings else 0} full forwards over its context instead of one "
                  "prompt forward plus single-token steps")
    cp = _mp_sizes()[1]
    if use_cache and cp > 1:
        _log_once(f"retrieval: KV cache under CP {cp}: every CP rank runs the whole (unsharded) sequence and holds its "
                  "whole cache (no gradient: the cache plus one layer's activations); --kv-cache off keeps the "
                  "sequence sharded but re-runs the forward for every generated token and candidate")
    if progress.enabled:
        log.info("retrieval: %d samples on this rank (%d tasks x %d lengths x %d depths x %d of %d samples), KV "
                 "cache %s", progress.total, len(tasks), len(lengths), len(depths), len(mine), num_samples,
                 "on" if use_cache else "off")
    for task in tasks:
        cells = []
        for length in lengths:
            for depth in depths:
                counts = torch.zeros(1 + len(scorings), dtype=torch.float64)
                for i in mine:
                    sample = build_sample(task, tokenizer, haystack, length, depth, seed, i, **(sample_kwargs or {}))
                    res = score_sample(model, tokenizer, sample, vocab_size, scorings, **kw)
                    counts += torch.tensor([1.0] + [float(res[s]) for s in scorings], dtype=torch.float64)
                    progress.step(f"{task}, length {length}, depth {depth:g}")
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


