"""Held-out accuracy of an HF Llama model directory on the retrieval task of ``build_data.py``.

Usage::

    python examples/smollm2/evaluate.py ~/.cache/nxd_lc/smollm2-135m-instruct --limit 40 --out before.json
    python examples/smollm2/evaluate.py nxd_lc_runs/hf/smollm2_sft --data examples/smollm2/data/heldout.jsonl

(A training checkpoint is NxD-format; convert it to an HF directory first with
``python -m nxd_lc.cli.convert``, see ``examples/smollm2/README.md``.)

The model is ``transformers.LlamaForCausalLM.from_pretrained(model_dir)`` in float32 on ``--device`` (CPU by
default, ``torch.set_num_threads(--threads)``). For each record of ``heldout.jsonl`` the prompt messages go
through the tokenizer's chat template with ``add_generation_prompt=True``; the prompt is run once (prefill) and
its KV cache serves two metrics:

* **accuracy** (generation): greedy decoding of up to ``--max-new-tokens`` tokens (stopping at an EOS /
  end-of-turn token); correct when the first identifier of the output (backticks, parentheses and a dotted
  qualifier such as ``module.`` stripped) equals the answer. ``lenient_accuracy`` also reports whether the
  first candidate the output names (anywhere, as a whole word: "The function `getsize` returns ...") is the
  answer, which separates finding the function from following the answer format;
* **choice accuracy** (ranking): every candidate (all public functions of the module) is scored by the
  log-likelihood of the assistant reply the chat template renders for it (``name<|im_end|>\\n`` for ChatML,
  the same tokens SFT trains on and DPO scores), summed over its tokens, given the prompt; correct when the
  answer's score is strictly the highest. Chance level (the mean of ``1 / num_candidates``) is reported too.

The cache is cut back to the prompt after each continuation, so a record costs one prefill plus a few
single-token steps. Prints the accuracies, N and seconds; ``--out`` writes them with per-record details as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local

import torch  # noqa: E402

DEFAULT_DATA = Path(__file__).resolve().parent / "data" / "heldout.jsonl"
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")


def first_identifier(text: str) -> str | None:
    """The first Python identifier in ``text``, a dotted name reduced to its last part (``os.path.join`` ->
    ``join``); backticks, parentheses and other punctuation are skipped. None when there is none."""
    match = _IDENTIFIER.search(text)
    return match.group(0).rsplit(".", 1)[-1] if match else None


def first_candidate(text: str, candidates: list[str]) -> str | None:
    """The candidate named earliest in ``text`` as a whole word (``readmodule`` does not match inside
    ``readmodule_ex``); None when no candidate is named."""
    found = [(m.start(), c) for c in candidates if (m := re.search(rf"(?<!\w){re.escape(c)}\b", text))]
    return min(found)[1] if found else None


def load_heldout(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Records of ``heldout.jsonl`` (first ``limit``): ``prompt`` (message list or string), ``answer``,
    ``candidates`` (containing the answer), optional ``module``.

    Raises:
        FileNotFoundError: ``path`` does not exist (run build_data.py first).
        ValueError: a line that is not JSON or lacks / mistypes a key (names ``file:line``).
    """
    if not path.is_file():
        raise FileNotFoundError(f"--data: {path} does not exist; run examples/smollm2/build_data.py first")
    from nxd_lc.data.alignment_datamodule import read_records  # jsonl reading with file:line errors

    out = []
    for rec, where in read_records(str(path), "--data", limit):
        prompt = rec.get("prompt")
        if isinstance(prompt, str):
            rec["prompt"] = [{"role": "user", "content": prompt}]
        elif not isinstance(prompt, list):
            raise ValueError(f"{where}: 'prompt' must be a message list or a string")
        cands = rec.get("candidates")
        if not isinstance(rec.get("answer"), str) or not isinstance(cands, list) or rec["answer"] not in cands:
            raise ValueError(f"{where}: needs a string 'answer' contained in the list 'candidates'")
        out.append(rec)
    return out


def crop_cache(cache: Any, length: int) -> None:
    """Cut a transformers ``DynamicCache`` back to its first ``length`` positions, in place.

    ``DynamicCache.crop(n)`` with ``n < 0`` removes ``|n|`` positions both in transformers 4.x (``max_length``,
    negative = from the end) and 5.x (``tokens_to_remove``, which must be negative).
    """
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


class Evaluator:
    """Greedy generation and candidate scoring over one shared prompt prefill (see the module doc).

    Args:
        model: ``LlamaForCausalLM`` (eval mode) on ``device``.
        tokenizer: its tokenizer, with a chat template.
        max_new_tokens: cap on generated tokens.
    """

    def __init__(self, model: Any, tokenizer: Any, max_new_tokens: int = 12) -> None:
        self.model, self.tokenizer, self.max_new_tokens = model, tokenizer, max_new_tokens
        self.device = next(model.parameters()).device
        eos = [tokenizer.eos_token_id, model.config.eos_token_id, getattr(model.generation_config, "eos_token_id",
                                                                             None)]
        self.eos_ids = {int(i) for e in eos if e is not None for i in (e if isinstance(e, list) else [e])}

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def _ids(self, text: str) -> torch.Tensor:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return torch.tensor([ids], dtype=torch.long, device=self.device)

    def reply_ids(self, prompt: list[dict[str, Any]], prompt_text: str, reply: str) -> torch.Tensor:
        """[1, R] tokens of the assistant turn ``reply`` as the chat template renders it after the prompt.

        Raises:
            ValueError: the template is not prefix-stable (the full rendering does not start with the prompt's).
        """
        full = self._render([*prompt, {"role": "assistant", "content": reply}], False)
        if not full.startswith(prompt_text):
            raise ValueError("the chat template renders the conversation without the generation prompt as "
                             "its prefix; candidates cannot be scored as continuations")
        return self._ids(full[len(prompt_text):])

    def _step(self, ids: torch.Tensor, cache: Any) -> torch.Tensor:
        """Logits [T, V] (fp32) of ``ids`` [1, T] given the cache (which grows by T)."""
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
        return out.logits[0].float()

    def generate(self, cache: Any, last_logits: torch.Tensor, prompt_len: int) -> list[int]:
        """Greedy tokens after the prompt (EOS excluded); the cache is cut back to ``prompt_len`` after."""
        tokens: list[int] = []
        logits = last_logits
        for _ in range(self.max_new_tokens):
            nxt = int(logits.argmax())
            if nxt in self.eos_ids:
                break
            tokens.append(nxt)
            logits = self._step(torch.tensor([[nxt]], device=self.device), cache)[-1]
        crop_cache(cache, prompt_len)
        return tokens

    def score(self, cache: Any, last_logits: torch.Tensor, prompt_len: int, reply: torch.Tensor) -> float:
        """Sum of log p(reply tokens | prompt) in nats; ``reply`` [1, R]; the cache is cut back after."""
        target = reply[0]
        total = torch.log_softmax(last_logits, -1)[target[0]]
        if target.shape[0] > 1:
            logp = torch.log_softmax(self._step(reply[:, :-1], cache), -1)
            total = total + logp.gather(-1, target[1:, None]).sum()
            crop_cache(cache, prompt_len)
        return float(total)

    @torch.inference_mode()
    def evaluate_one(self, record: dict[str, Any]) -> dict[str, Any]:
        """Both metrics for one held-out record (see the module doc); a dict of per-record results."""
        start = time.perf_counter()
        prompt_text = self._render(record["prompt"], True)
        ids = self._ids(prompt_text)
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
        cache, last = out.past_key_values, out.logits[0, -1].float()
        generated = self.tokenizer.decode(self.generate(cache, last, ids.shape[1]), skip_special_tokens=True)
        predicted = first_identifier(generated)
        mentioned = first_candidate(generated, record["candidates"])
        scores = {c: self.score(cache, last, ids.shape[1], self.reply_ids(record["prompt"], prompt_text, c))
                  for c in record["candidates"]}
        best = max(scores, key=scores.__getitem__)
        unique = sum(v == scores[best] for v in scores.values()) == 1
        return {"module": record.get("module"), "answer": record["answer"], "generated": generated,
                "predicted": predicted, "correct": predicted == record["answer"],
                "mentioned": mentioned, "lenient_correct": mentioned == record["answer"], "choice": best,
                "choice_correct": unique and best == record["answer"], "scores": scores,
                "num_candidates": len(scores), "prompt_tokens": int(ids.shape[1]),
                "seconds": round(time.perf_counter() - start, 3)}


def load_model(model_dir: Path, device: str = "cpu") -> tuple[Any, Any]:
    """(model in eval mode, float32 on ``device``; tokenizer) of an HF directory.

    Raises:
        FileNotFoundError: ``model_dir`` has no ``config.json`` (an NxD checkpoint must be converted first).
    """
    from transformers import AutoTokenizer, LlamaForCausalLM

    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"model_dir: {model_dir} has no config.json; give an HF model directory (convert "
                                f"an nxd_lc checkpoint with `python -m nxd_lc.cli.convert`)")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
    return model.to(device).eval(), tokenizer


def summarize(results: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """Accuracy, choice accuracy, chance level, N and timing of per-record results."""
    n = len(results)
    mean = (lambda xs: sum(xs) / n) if n else (lambda xs: 0.0)
    return {"n": n, "accuracy": mean([r["correct"] for r in results]),
            "lenient_accuracy": mean([r["lenient_correct"] for r in results]),
            "choice_accuracy": mean([r["choice_correct"] for r in results]),
            "chance_choice_accuracy": mean([1.0 / r["num_candidates"] for r in results]),
            "seconds": round(seconds, 2), "seconds_per_example": round(seconds / n, 3) if n else 0.0,
            "mean_prompt_tokens": mean([r["prompt_tokens"] for r in results])}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", type=Path, help="HF model directory (config.json, safetensors, tokenizer)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help=f"held-out jsonl (default {DEFAULT_DATA})")
    p.add_argument("--limit", type=int, default=None, help="evaluate the first N records only")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--max-new-tokens", type=int, default=12, help="greedy generation cap (default 12)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--out", type=Path, default=None, help="write the summary and per-record results as JSON")
    p.add_argument("--quiet", action="store_true", help="no per-record lines")
    args = p.parse_args(argv)
    for key in ("limit", "threads", "max_new_tokens"):
        if getattr(args, key) is not None and getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Command-line entry: evaluate, print the summary, write ``--out``; return the summary dict."""
    args = _parse(argv)
    torch.set_num_threads(args.threads)
    records = load_heldout(args.data, args.limit)
    model, tokenizer = load_model(args.model_dir, args.device)
    evaluator = Evaluator(model, tokenizer, args.max_new_tokens)
    results, start = [], time.perf_counter()
    for i, rec in enumerate(records, 1):
        res = evaluator.evaluate_one(rec)
        results.append(res)
        if not args.quiet:
            print(f"[{i}/{len(records)}] {res['module']}: {res['answer']!r} gen={res['generated']!r} "
                  f"{'ok' if res['correct'] else 'x'} choice={res['choice']!r} "
                  f"{'ok' if res['choice_correct'] else 'x'} ({res['prompt_tokens']} tok, {res['seconds']:.1f} s)",
                  flush=True)
    summary = {"model_dir": str(args.model_dir), "data": str(args.data), "threads": args.threads,
               "device": args.device, "max_new_tokens": args.max_new_tokens,
               **summarize(results, time.perf_counter() - start)}
    print(f"accuracy {summary['accuracy']:.3f}  lenient_accuracy {summary['lenient_accuracy']:.3f}  "
          f"choice_accuracy {summary['choice_accuracy']:.3f} "
          f"(chance {summary['chance_choice_accuracy']:.3f})  N={summary['n']}  {summary['seconds']:.1f} s "
          f"({summary['seconds_per_example']:.2f} s/example)")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**summary, "examples": results}, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
