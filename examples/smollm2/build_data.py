"""Build a long-context retrieval task from Python standard-library modules: SFT and DPO jsonl + a held-out set.

Usage::

    python examples/smollm2/build_data.py                       # -> examples/smollm2/data/ (seq 4096)
    python examples/smollm2/build_data.py --seq-length 8192 --max-per-module 4 --out /tmp/smol_data

Each record asks about one module (a top-level ``.py`` file of ``sysconfig.get_paths()["stdlib"]``, or of
``--source-dir``). The user message holds the whole module source in a code block, then the question::

    Which function in this module does the following? <first sentence of the function's docstring>
    Answer with the function name only.

and the answer is the function's name. Functions are the module's public top-level ``def`` / ``async def``
(ast; the name does not start with ``_``) whose docstring's first sentence has at least ``--min-words`` words
after the function's own name is replaced by "this function"; two functions of a module with the same
description are both left out (the question would be ambiguous). A module needs at least two public functions
(the DPO pair needs a wrong one).

Files written into ``--out`` (default ``examples/smollm2/data``, which should be git-ignored):

* ``sft_train.jsonl`` / ``sft_val.jsonl``: ``{"messages": [user, assistant]}`` (HF chat records);
* ``dpo_train.jsonl`` / ``dpo_val.jsonl``: ``{"prompt": [user], "chosen": [assistant: right name],
  "rejected": [assistant: another public function of the same module]}``;
* ``heldout.jsonl``: ``{"prompt": [user], "answer", "module", "candidates"}`` (all public function names of
  the module), read by ``evaluate.py``;
* ``build_info.json``: the options, module lists and token-length statistics.

The split is by module: the modules are shuffled with ``--seed`` and ``--heldout-fraction`` of them (at least
one) are held out; train records come only from train modules, val and held-out records only from held-out
modules (the val files are the held-out records, capped by ``--max-val``). Every record fits: its token length
is measured with the project's own formatter (:class:`nxd_lc.data.alignment_format.RecordFormatter`, the
tokenizer's chat template, as training tokenizes it): SFT ``prompt + answer``, DPO ``prompt + longer
response``, both ``<= --seq-length``; records that do not fit are dropped and counted.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import os
import random
import re
import sysconfig
import tokenize
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local

import numpy as np  # noqa: E402

QUESTION = "Which function in this module does the following? {description}\nAnswer with the function name only."
PROMPT = "Here is the source code of the Python module `{module}`:\n\n```python\n{source}\n```\n\n{question}"
DEFAULT_OUT = Path(__file__).resolve().parent / "data"
_SIGNATURE = re.compile(r"^[\w.]+\(.*\)\s*(->.*)?$")  # "getopt(args, options[, long_options]) -> opts, args"
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9`'\"(\[])")


@dataclass
class ModuleTask:
    """One module: its name, source, all public function names (source order) and the askable functions."""

    name: str
    source: str
    candidates: list[str]
    questions: list[tuple[str, str]] = field(default_factory=list)  # (function name, description)


def describe(docstring: str, name: str, min_words: int = 5) -> str | None:
    """The question text for a function: the first sentence of its docstring, its own name taken out.

    The docstring is cleaned (``inspect.cleandoc``); leading signature lines (``name(args) -> result``, common in
    old stdlib docstrings) are skipped; the first remaining paragraph is joined into one line and cut
    after its first sentence. Code-like mentions of ``name`` (``name(...)``, ```name```) become "this function".
    Returns None when the name still appears as a word (the question would give the answer away) or fewer
    than ``min_words`` words remain.
    """
    lines = inspect.cleandoc(docstring).splitlines()
    while lines and (not lines[0].strip() or _SIGNATURE.match(lines[0].strip())):
        lines.pop(0)
    first_paragraph = "\n".join(lines).split("\n\n", 1)[0]
    text = _SENTENCE_END.split(" ".join(first_paragraph.split()), maxsplit=1)[0].strip()
    text = re.sub(rf"`+{re.escape(name)}(\(\))?`+|\b{re.escape(name)}\([^)]*\)", "this function", text)
    if re.search(rf"\b{re.escape(name)}\b", text, flags=re.IGNORECASE):
        return None
    return text if len(text.split()) >= min_words else None


def public_functions(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Top-level ``def`` / ``async def`` nodes whose name does not start with ``_``, first definition kept."""
    seen: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            seen.setdefault(node.name, node)
    return list(seen.values())


def module_task(path: Path, min_words: int = 5) -> ModuleTask | None:
    """The :class:`ModuleTask` of one source file; None when it has fewer than 2 public functions or no
    askable one. Raises SyntaxError / UnicodeDecodeError for unreadable files (the caller skips them)."""
    with tokenize.open(path) as f:  # honours the file's encoding declaration
        source = f.read()
    funcs = public_functions(ast.parse(source, filename=str(path)))
    if len(funcs) < 2:
        return None
    described = {}
    for node in funcs:
        doc = ast.get_docstring(node)
        desc = describe(doc, node.name, min_words) if doc else None
        if desc is not None:
            described[node.name] = desc
    counts: dict[str, int] = {}
    for desc in described.values():
        counts[desc] = counts.get(desc, 0) + 1
    questions = [(n, d) for n, d in described.items() if counts[d] == 1]
    if not questions:
        return None
    return ModuleTask(path.stem, source.rstrip("\n"), [f.name for f in funcs], questions)


def user_message(task: ModuleTask, description: str) -> dict[str, str]:
    """The user turn: module source in a code block + the question."""
    question = QUESTION.format(description=description)
    return {"role": "user", "content": PROMPT.format(module=task.name, source=task.source, question=question)}


def make_records(task: ModuleTask, rng: random.Random) -> list[dict[str, Any]]:
    """One record per askable function: ``{"sft", "dpo", "heldout"}`` dicts (the three file formats)."""
    out = []
    for name, desc in task.questions:
        prompt = [user_message(task, desc)]
        rejected = rng.choice([c for c in task.candidates if c != name])
        answer = [{"role": "assistant", "content": name}]
        out.append({
            "sft": {"messages": [*prompt, *answer]},
            "dpo": {"prompt": prompt, "chosen": answer, "rejected": [{"role": "assistant", "content": rejected}]},
            "heldout": {"prompt": prompt, "answer": name, "module": task.name, "candidates": task.candidates},
        })
    return out


def record_length(formatter: Any, record: dict[str, Any]) -> int:
    """Tokens of a record as training sees them: max(SFT prompt + answer, DPO prompt + longer response)."""
    sft = formatter.encode_sft(record["sft"], "sft").input_ids.shape[0]
    pair = formatter.encode_preference(record["dpo"], "dpo")
    dpo = pair.prompt.input_ids.shape[0] + max(pair.chosen.input_ids.shape[0], pair.rejected.input_ids.shape[0])
    return max(sft, dpo)


def load_tasks(source_dir: Path, tokenizer: Any, seq_length: int, modules: list[str] | None,
               min_words: int) -> tuple[list[ModuleTask], dict[str, int]]:
    """Module tasks of ``source_dir/*.py`` (or only ``modules``) whose source alone has < ``seq_length``
    tokens; also counts of skipped files by reason.

    Raises:
        FileNotFoundError: ``source_dir`` missing, or a name in ``modules`` without a ``.py`` file.
    """
    if not source_dir.is_dir():
        raise FileNotFoundError(f"--source-dir: {source_dir} is not a directory")
    if modules:
        paths = [source_dir / f"{m}.py" for m in modules]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"--modules: no such module files {missing}; name top-level .py files of "
                                    f"{source_dir}")
    else:
        paths = sorted(source_dir.glob("*.py"))
    tasks, skipped = [], {"unreadable": 0, "too_long": 0, "no_questions": 0}
    for path in paths:
        try:
            task = module_task(path, min_words)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            skipped["unreadable"] += 1
            continue
        if task is None:
            skipped["no_questions"] += 1
        elif len(tokenizer.backend_tokenizer.encode(task.source, add_special_tokens=False).ids) >= seq_length:
            skipped["too_long"] += 1
        else:
            tasks.append(task)
    return tasks, skipped


def split_modules(names: list[str], heldout_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Deterministic module split: (train, held-out), both sorted, disjoint, each non-empty.

    Raises:
        ValueError: fewer than 2 modules, or ``heldout_fraction`` outside (0, 1).
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"--heldout-fraction must be in (0, 1), got {heldout_fraction}")
    if len(names) < 2:
        raise ValueError(f"only {len(names)} usable module(s) {names}; need 2 or more for a module-level split "
                         f"(raise --seq-length or name more --modules)")
    order = sorted(names)
    random.Random(seed).shuffle(order)
    n_held = min(len(order) - 1, max(1, round(heldout_fraction * len(order))))
    return sorted(order[n_held:]), sorted(order[:n_held])


def _cap(records: list[dict[str, Any]], limit: int | None, rng: random.Random) -> list[dict[str, Any]]:
    """Shuffled copy of ``records`` cut to ``limit`` (None: all)."""
    records = list(records)
    rng.shuffle(records)
    return records if limit is None else records[:limit]


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def length_stats(lengths: list[int]) -> dict[str, float]:
    """min / p10 / p50 / p90 / max / mean of token lengths (empty list: zeros)."""
    if not lengths:
        return dict.fromkeys(("n", "min", "p10", "p50", "p90", "max", "mean"), 0)
    a = np.asarray(lengths)
    return {"n": len(lengths), "min": int(a.min()), "p10": int(np.percentile(a, 10)),
            "p50": int(np.percentile(a, 50)), "p90": int(np.percentile(a, 90)), "max": int(a.max()),
            "mean": round(float(a.mean()), 1)}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    p.add_argument("--seq-length", type=int, default=4096, help="max tokens of a record (default 4096)")
    p.add_argument("--tokenizer-dir", type=Path, default=None,
                   help="HF dir with the tokenizer (default: prepare_smollm2(), the cached SmolLM2 conversion)")
    p.add_argument("--source-dir", type=Path, default=Path(sysconfig.get_paths()["stdlib"]),
                   help="directory of .py modules (default: this interpreter's stdlib)")
    p.add_argument("--modules", default=None, help="comma-separated module names to use (default: all)")
    p.add_argument("--min-words", type=int, default=5, help="min words of a usable docstring sentence")
    p.add_argument("--heldout-fraction", type=float, default=0.25, help="share of modules held out (default 0.25)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--max-per-module", type=int, default=None, help="cap on records per module")
    p.add_argument("--max-train", type=int, default=None, help="cap on train records")
    p.add_argument("--max-heldout", type=int, default=None, help="cap on held-out records")
    p.add_argument("--max-val", type=int, default=None, help="cap on val records (a prefix of the held-out ones)")
    args = p.parse_args(argv)
    for key in ("seq_length", "min_words", "max_per_module", "max_train", "max_heldout", "max_val"):
        value = getattr(args, key)
        if value is not None and value < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1, got {value}")
    return args


def _load_formatter(tokenizer_dir: Path | None) -> Any:
    """RecordFormatter over the tokenizer of ``tokenizer_dir`` (default: the cached SmolLM2 conversion)."""
    from transformers import AutoTokenizer

    from nxd_lc.data.alignment_format import RecordFormatter

    if tokenizer_dir is None:
        from nxd_lc.models.llama.gguf_import import prepare_smollm2

        tokenizer_dir = prepare_smollm2()
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"--tokenizer-dir: {tokenizer_dir} has no tokenizer.json")
    return RecordFormatter(AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True), "default")


def build(args: argparse.Namespace) -> dict[str, Any]:
    """Build and write every file (see the module doc); return the summary written to ``build_info.json``."""
    formatter = _load_formatter(args.tokenizer_dir)
    modules = [m.strip() for m in args.modules.split(",") if m.strip()] if args.modules else None
    tasks, skipped = load_tasks(args.source_dir, formatter.tokenizer, args.seq_length, modules, args.min_words)
    rng = random.Random(args.seed)
    by_module: dict[str, list[dict[str, Any]]] = {}
    dropped = 0
    for task in tasks:
        recs = []
        for rec in make_records(task, rng):
            rec["length"] = record_length(formatter, rec)
            if rec["length"] <= args.seq_length:
                recs.append(rec)
            else:
                dropped += 1
        if recs:
            by_module[task.name] = _cap(recs, args.max_per_module, rng)
    train_mods, held_mods = split_modules(list(by_module), args.heldout_fraction, args.seed)
    train = _cap([r for m in train_mods for r in by_module[m]], args.max_train, rng)
    held = _cap([r for m in held_mods for r in by_module[m]], args.max_heldout, rng)
    val = held if args.max_val is None else held[:args.max_val]
    args.out.mkdir(parents=True, exist_ok=True)
    files = {"sft_train.jsonl": [r["sft"] for r in train], "sft_val.jsonl": [r["sft"] for r in val],
             "dpo_train.jsonl": [r["dpo"] for r in train], "dpo_val.jsonl": [r["dpo"] for r in val],
             "heldout.jsonl": [r["heldout"] for r in held]}
    for name, rows in files.items():
        _write_jsonl(args.out / name, rows)
    info = {"out": str(args.out), "seq_length": args.seq_length, "seed": args.seed, "source_dir": str(args.source_dir),
            "train_modules": train_mods, "heldout_modules": held_mods,
            "counts": {name: len(rows) for name, rows in files.items()},
            "skipped_modules": skipped, "dropped_records_too_long": dropped,
            "train_length": length_stats([r["length"] for r in train]),
            "heldout_length": length_stats([r["length"] for r in held]),
            "heldout_num_candidates": length_stats([len(r["heldout"]["candidates"]) for r in held])}
    (args.out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Command-line entry: build, print counts and the token-length distribution, return the summary."""
    info = build(_parse(argv))
    print(f"modules: {len(info['train_modules'])} train, {len(info['heldout_modules'])} held out; "
          f"skipped {info['skipped_modules']}; records dropped as too long: {info['dropped_records_too_long']}")
    for name, n in info["counts"].items():
        print(f"  {name:18s} {n:6d} records")
    for split in ("train", "heldout"):
        print(f"  {split} tokens per record: {info[f'{split}_length']}")
    print(f"  held-out candidates per question: {info['heldout_num_candidates']}")
    print(f"written to {info['out']}")
    return info


if __name__ == "__main__":
    main()
