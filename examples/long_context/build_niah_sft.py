"""Long-document SFT records for SmolLM2: needle retrieval over thousands of tokens of real text (issue 12).

Each record is NxDT's SFT format ``{"input": prompt, "output": answer}``: the prompt is a retrieval task of
:mod:`nxd_lc.eval.retrieval` (the same templates the harness evaluates: needles in corpus text, a question at the
end), the output the answer as the harness expects it after the prompt (``" " + ", ".join(answers) + "."``), so the
answer depends on a passage up to thousands of tokens before it. Haystacks come from the *training* split of this
interpreter's stdlib corpus (``data.val_fraction`` 0.05, as ``cpu_passkey_config``); the harness draws its
haystacks from the held-out split with another seed, so no evaluation prompt or text is trained on.

    python examples/long_context/build_niah_sft.py --tokenizer-dir ~/.cache/nxd_lc/smollm2-135m-instruct

writes ``examples/long_context/data/niah_sft_{train,val}.jsonl`` (git-ignored) and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from nxd_lc.data.retrieval_tasks import TASKS, build_sample  # noqa: E402
from nxd_lc.data.sources import builtin_source, iter_documents, split_source  # noqa: E402


def train_haystack(tokenizer: Any, num_tokens: int, val_fraction: float = 0.05) -> list[int]:
    """``num_tokens`` token ids of the training split of the stdlib corpus, documents in order, EOS-separated."""
    train, _ = split_source(builtin_source("python_stdlib"), val_fraction)
    out: list[int] = []
    for text in iter_documents(train):
        out += tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        if len(out) >= num_tokens:
            break
    return out[:num_tokens]


def records(tokenizer: Any, haystack: list[int], n: int, tasks: list[str], min_len: int, max_len: int, seed: int
            ) -> list[dict[str, Any]]:
    """``n`` SFT records; record ``i``: a seeded task, prompt length in ``[min_len, max_len]`` tokens and depth."""
    out = []
    for i in range(n):
        rng = random.Random(f"niah-sft/{seed}/{i}")
        task, length, depth = rng.choice(tasks), rng.randint(min_len, max_len), rng.random()
        s = build_sample(task, tokenizer, haystack, length, depth, seed, i)
        out.append({"input": tokenizer.decode(s.input_ids), "output": " " + ", ".join(s.answers) + ".",
                    "task": task, "prompt_tokens": length, "depth": depth})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer-dir", required=True, help="the model's HF tokenizer directory")
    p.add_argument("--out", default=str(REPO / "examples" / "long_context" / "data"))
    p.add_argument("--tasks", default="niah_single,niah_multikey,niah_multivalue,variable_tracking")
    p.add_argument("--num-train", type=int, default=96)
    p.add_argument("--num-val", type=int, default=8)
    p.add_argument("--min-length", type=int, default=1024, help="shortest prompt in tokens")
    p.add_argument("--max-length", type=int, default=3968, help="longest prompt (fits 4096 with the answer)")
    p.add_argument("--seed", type=int, default=1234, help="not the harness's seed (0)")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    tasks = [t for t in args.tasks.split(",") if t]
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        p.error(f"--tasks: unknown {bad or 'none given'}; choose from {', '.join(TASKS)}")
    tok = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    hay = train_haystack(tok, 400_000)
    os.makedirs(args.out, exist_ok=True)
    for split, n, seed in (("train", args.num_train, args.seed), ("val", args.num_val, args.seed + 1)):
        rows = records(tok, hay, n, tasks, args.min_length, args.max_length, seed)
        path = os.path.join(args.out, f"niah_sft_{split}.jsonl")
        with open(path, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        by_task = {t: sum(r["task"] == t for r in rows) for t in tasks}
        print(f"{path}: {n} records {by_task}, prompt tokens {min(r['prompt_tokens'] for r in rows)}-"
              f"{max(r['prompt_tokens'] for r in rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
