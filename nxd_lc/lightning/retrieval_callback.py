"""In-training retrieval evaluation (``exp_manager.retrieval_eval``): a Lightning callback that scores the model
on the retrieval grid (:mod:`nxd_lc.eval.retrieval`) every N optimizer steps and logs the accuracies."""

from __future__ import annotations

from typing import Any

from nxd_lc.eval.retrieval import evaluate_grid, format_table


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
