"""Staged sequence-length curriculum inside one run: ``data.curriculum``.

``data.curriculum`` is a list of stages ``{until_step, seq_length, micro_batch_size?, rope_scaling?}``: optimizer
steps ``[previous until_step, until_step)`` train on packed samples of ``seq_length`` tokens (the last stage's
``until_step`` is null or >= ``trainer.max_steps``). Each stage has its own packed (and mixed, upsampled, synthetic)
data built by an ordinary :class:`~nxd_lc.data.datamodule.PretrainingDataModule` at that length, and its own
position in it: a stage starts at the beginning of its own seeded order, so the data of a stage does not depend on
the lengths of the stages before it.

Batch geometry: gradient accumulation (``num_microbatches = global_batch_size / (micro_batch_size x DP)``) is fixed
for the run, as Lightning's ``accumulate_grad_batches`` is; a stage may change ``micro_batch_size`` (default
``data.micro_batch_size``), and its global batch is ``micro_batch_size x DP x num_microbatches``. The usual choice
keeps tokens per step constant (ProLong, Gao et al. 2024, trains every length stage at a fixed token budget per
batch): 8 x 512 then 2 x 2048.

RoPE: a stage's ``rope_scaling`` (validated like ``model.hf_config_overrides.rope_scaling``) replaces the model's
RoPE while that stage trains and validates; a stage without it uses the model's own (config.json +
``hf_config_overrides``). The last stage may not set one: the model's RoPE is what the checkpoint and its HF
conversion carry. The typical two-stage recipe (short unscaled, then YaRN at 4x, as in Peng et al. 2023 "YaRN")
sets the model's rope_scaling to YaRN and the first stage's to ``{rope_type: default}``.

Resume: a checkpoint stores ``consumed_samples`` (the sum of every finished step's global batch); the step and the
position inside the current stage follow from it and the stage table (:func:`step_of_consumed`). A curriculum
changed before the checkpoint's step is an error; stages after it may be changed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import DataLoader

from nxd_lc.config.access import num_microbatches
from nxd_lc.config.schema import DataConfig
from nxd_lc.data.datamodule import PretrainingDataModule
from nxd_lc.data.sampler import PretrainingSampler

log = logging.getLogger(__name__)

#: keys a ``data.curriculum`` entry may have
CURRICULUM_KEYS = ("until_step", "seq_length", "micro_batch_size", "rope_scaling")


@dataclass(frozen=True)
class CurriculumStage:
    """One stage of ``data.curriculum``.

    Attributes:
        index: position in ``data.curriculum``.
        start_step: first optimizer step of the stage (0-based; the previous stage's ``until_step``).
        until_step: first step after the stage; None for the last stage (it runs to the end of training).
        seq_length: tokens per packed sample.
        micro_batch_size: samples per rank per forward pass.
        global_batch_size: samples per optimizer step over all DP ranks.
        rope_scaling: RoPE scaling while the stage trains; None = the model's own.
    """

    index: int
    start_step: int
    until_step: int | None
    seq_length: int
    micro_batch_size: int
    global_batch_size: int
    rope_scaling: dict[str, Any] | None

    def steps(self) -> float:
        """Optimizer steps in the stage (inf for an open-ended last stage)."""
        return float("inf") if self.until_step is None else float(self.until_step - self.start_step)


def parse_curriculum(entries: Sequence[Mapping[str, Any]], *, micro_batch_size: int, global_batch_size: int,
                     data_parallel_size: int) -> list[CurriculumStage]:
    """The stages of a validated ``data.curriculum``.

    Args:
        entries: the ``data.curriculum`` list (see module doc).
        micro_batch_size, global_batch_size: ``data.micro_batch_size`` / ``data.global_batch_size``; they fix
            ``num_microbatches = global_batch_size / (micro_batch_size x data_parallel_size)``.
        data_parallel_size: DP.
    Returns:
        One :class:`CurriculumStage` per entry, in order.
    Raises:
        ValueError: an empty list, a missing ``seq_length``, ``until_step`` not increasing, a non-last stage
            without ``until_step``, or a batch geometry that does not divide (each naming ``data.curriculum[i]``);
            :func:`nxd_lc.app.validation.load_config` reports these (and more) before a run starts.
    """
    if not entries:
        raise ValueError("data.curriculum: empty; give at least one {until_step, seq_length} stage or remove it")
    n_micro = num_microbatches(global_batch_size, micro_batch_size, data_parallel_size)
    stages: list[CurriculumStage] = []
    start = 0
    for i, raw in enumerate(entries):
        e = dict(raw)
        key = f"data.curriculum[{i}]"
        if not isinstance(e.get("seq_length"), int) or e["seq_length"] < 1:
            raise ValueError(f"{key}.seq_length: must be an int >= 1, got {e.get('seq_length')!r}")
        until = e.get("until_step")
        last = i == len(entries) - 1
        if until is None and not last:
            raise ValueError(f"{key}.until_step: only the last stage may omit it (it runs to trainer.max_steps)")
        if until is not None and (not isinstance(until, int) or until <= start):
            raise ValueError(f"{key}.until_step: must be an int > {start} (the stage's first step), got {until!r}")
        mbs = int(e.get("micro_batch_size") or micro_batch_size)
        rope = e.get("rope_scaling")
        until = None if last else until  # the last stage runs to the end (validation: null or >= max_steps)
        stages.append(CurriculumStage(i, start, until, int(e["seq_length"]), mbs, mbs * data_parallel_size * n_micro,
                                      dict(rope) if rope is not None else None))
        start = until if until is not None else start
    return stages


def stage_at(stages: Sequence[CurriculumStage], step: int) -> CurriculumStage:
    """The stage that trains optimizer step ``step`` (0-based)."""
    for s in stages:
        if s.until_step is None or step < s.until_step:
            return s
    raise ValueError("curriculum stages must end with an open stage (until_step None); use parse_curriculum")


def consumed_at(stages: Sequence[CurriculumStage], step: int) -> int:
    """Samples consumed over all DP ranks before optimizer step ``step``: the sum of each earlier step's stage
    global batch."""
    total = 0
    for s in stages:
        end = step if s.until_step is None else min(step, s.until_step)
        total += max(0, end - s.start_step) * s.global_batch_size
        if s.until_step is None or step <= s.until_step:
            break
    return total


def step_of_consumed(stages: Sequence[CurriculumStage], consumed_samples: int) -> int:
    """Inverse of :func:`consumed_at`: the optimizer step at which ``consumed_samples`` had been consumed.

    Raises:
        ValueError: ``consumed_samples`` is not on a step boundary of this curriculum (the checkpoint was written
            with other stages before its step, or without ``data.curriculum``).
    """
    left = int(consumed_samples)
    for s in stages:
        span = None if s.until_step is None else (s.until_step - s.start_step) * s.global_batch_size
        if span is None or left < span:
            if left % s.global_batch_size == 0:
                return s.start_step + left // s.global_batch_size
            break
        left -= span
    raise ValueError(f"consumed_samples {consumed_samples} (from the checkpoint) is not a step boundary of "
                     f"data.curriculum {[(s.until_step, s.seq_length, s.global_batch_size) for s in stages]}: the "
                     "stages before the checkpoint's step were changed since it was written; restore them (stages "
                     "after it may change)")


class StagedDataset:
    """Indexable by ``(stage, index)`` pairs: ``datasets[stage][index]`` (rows of that stage's length).

    Args:
        datasets: one packed dataset per stage (anything with ``__getitem__`` / ``__len__``).
    """

    def __init__(self, datasets: Sequence[Any]) -> None:
        self.datasets = list(datasets)

    def __len__(self) -> int:
        return sum(len(d) for d in self.datasets)

    def __getitem__(self, key: tuple[int, int]) -> np.ndarray:
        stage, index = key
        return self.datasets[stage][index]


class CurriculumBatchSampler:
    """Yields this DP rank's micro-batches of ``(stage, index)`` pairs, stage by stage, from a resume point.

    Inside a stage the order is :class:`~nxd_lc.data.sampler.PretrainingSampler`'s over that stage's dataset
    (seeded epochs, DP slices), starting at the stage's first sample. One ``__iter__`` yields until the current
    stage's dataset ends an epoch (Lightning's epoch end; the next ``__iter__`` continues) and crosses stage
    boundaries without ending it.

    Args:
        stages: :func:`parse_curriculum`'s stages.
        lengths: packed samples of each stage's dataset.
        consumed_samples: the resume point (:func:`step_of_consumed` gives its step).
        num_microbatches: micro-batches per optimizer step.
        data_parallel_rank, data_parallel_size, seed, shuffle: as for ``PretrainingSampler``.
    Raises:
        ValueError: as :func:`step_of_consumed`, or a stage whose dataset is smaller than its global batch.
    """

    def __init__(self, stages: Sequence[CurriculumStage], lengths: Sequence[int], consumed_samples: int,
                 num_microbatches: int, data_parallel_rank: int, data_parallel_size: int, seed: int,
                 shuffle: bool = True) -> None:
        self.stages, self.lengths = list(stages), list(lengths)
        self.num_microbatches = num_microbatches
        self.rank, self.dp, self.seed, self.shuffle = data_parallel_rank, data_parallel_size, seed, shuffle
        self.step = step_of_consumed(self.stages, consumed_samples)
        self.micro = 0  # micro-batches yielded in the current step
        self._stage = stage_at(self.stages, self.step)
        self._sampler = self._sampler_for(self._stage, self.step)

    def _sampler_for(self, stage: CurriculumStage, step: int) -> PretrainingSampler:
        try:
            return PretrainingSampler(self.lengths[stage.index], (step - stage.start_step) * stage.global_batch_size,
                                      stage.micro_batch_size, self.rank, self.dp, self.seed, shuffle=self.shuffle,
                                      global_batch_size=stage.global_batch_size)
        except ValueError as e:
            raise ValueError(f"data.curriculum[{stage.index}] (seq_length {stage.seq_length}): {e}") from e

    @property
    def stage(self) -> CurriculumStage:
        """The stage of the next micro-batch."""
        return self._stage

    # no __len__: an epoch crosses stage boundaries, so its length is not known when Lightning asks (once, at the
    # start of fit); without one Lightning ends an epoch when the iterator does, and never cuts it short.

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        while True:
            for batch in self._sampler:
                out = [(self._stage.index, i) for i in batch]
                self.micro += 1
                switch = False
                if self.micro == self.num_microbatches:
                    self.micro, self.step = 0, self.step + 1
                    switch = stage_at(self.stages, self.step) is not self._stage
                yield out
                if switch:
                    break
            else:
                return  # the stage's dataset ended an epoch: Lightning's epoch ends here
            self._stage = stage_at(self.stages, self.step)
            self._sampler = self._sampler_for(self._stage, self.step)


class StageValidationSampler:
    """Validation micro-batches of the stage that trains the current step: one sequential pass over that stage's
    held-out samples, this DP rank's slice.

    Args:
        stages: :func:`parse_curriculum`'s stages.
        lengths: held-out samples of each stage.
        current_step: returns the trainer's optimizer step (called at each ``__iter__``).
        data_parallel_rank, data_parallel_size, seed: as for ``PretrainingSampler``.
    """

    def __init__(self, stages: Sequence[CurriculumStage], lengths: Sequence[int], current_step: Callable[[], int],
                 data_parallel_rank: int, data_parallel_size: int, seed: int) -> None:
        self.stages, self.lengths, self.current_step = list(stages), list(lengths), current_step
        self.rank, self.dp, self.seed = data_parallel_rank, data_parallel_size, seed

    def _sampler(self) -> tuple[CurriculumStage, PretrainingSampler]:
        stage = stage_at(self.stages, self.current_step())
        return stage, PretrainingSampler(self.lengths[stage.index], 0, stage.micro_batch_size, self.rank, self.dp,
                                         self.seed, shuffle=False)

    def __len__(self) -> int:
        return len(self._sampler()[1])

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        stage, sampler = self._sampler()
        for batch in sampler:
            yield [(stage.index, i) for i in batch]


def curriculum_stages(cfg: Any) -> list[CurriculumStage] | None:
    """The run's :class:`CurriculumStage` list (``cfg``: a validated ``NxdConfig``), or None without
    ``data.curriculum``."""
    from nxd_lc.config.access import data_parallel_size

    if not cfg.data.curriculum:
        return None
    return parse_curriculum(cfg.data.curriculum, micro_batch_size=cfg.data.micro_batch_size,
                            global_batch_size=cfg.data.global_batch_size, data_parallel_size=data_parallel_size(cfg))


class CurriculumDataModule(PretrainingDataModule):
    """:class:`~nxd_lc.data.datamodule.PretrainingDataModule` over the stages of ``data.curriculum`` (module doc).

    Each stage's data is built by its own ``PretrainingDataModule`` at the stage's ``seq_length`` and
    ``micro_batch_size`` (same corpus, tokenizer, mixture, upsampling and seed); batches are those modules'
    batches (``[B_stage, S_stage]``), stage after stage; ``consumed_samples`` counts samples of every stage.

    Args:
        data_cfg, seq_length, seed, model_vocab_size, data_parallel_rank, data_parallel_size, global_batch_size,
        barrier: as for ``PretrainingDataModule`` (``seq_length`` / ``global_batch_size`` are the run's; stages
            take their own from ``data_cfg.curriculum``).
    Raises:
        ValueError: as :func:`parse_curriculum`, and as ``PretrainingDataModule`` for each stage.
    """

    def __init__(self, data_cfg: DataConfig, *, seq_length: int, seed: int, model_vocab_size: int,
                 data_parallel_rank: int, data_parallel_size: int, global_batch_size: int,
                 barrier: Callable[[], None] | None = None) -> None:
        super().__init__(data_cfg, seq_length=seq_length, seed=seed, model_vocab_size=model_vocab_size,
                         data_parallel_rank=data_parallel_rank, data_parallel_size=data_parallel_size,
                         global_batch_size=global_batch_size, barrier=barrier)
        self.stages = parse_curriculum(data_cfg.curriculum or [], micro_batch_size=data_cfg.micro_batch_size,
                                       global_batch_size=global_batch_size, data_parallel_size=data_parallel_size)
        self.num_microbatches = global_batch_size // (data_cfg.micro_batch_size * data_parallel_size)
        self.stage_modules = [
            PretrainingDataModule(dataclasses.replace(data_cfg, micro_batch_size=s.micro_batch_size, curriculum=None),
                                  seq_length=s.seq_length, seed=seed, model_vocab_size=model_vocab_size,
                                  data_parallel_rank=data_parallel_rank, data_parallel_size=data_parallel_size,
                                  global_batch_size=s.global_batch_size, barrier=barrier)
            for s in self.stages]

    def setup(self, stage: str | None = None) -> None:
        """Build every stage's data (idempotent; the tokenizer and corpus caches are shared)."""
        if self.train_dataset is not None:
            return
        for i, module in enumerate(self.stage_modules):
            try:
                module.setup(stage)
            except ValueError as e:
                raise ValueError(f"data.curriculum[{i}] (seq_length {self.stages[i].seq_length}): {e}") from e
            log.info("data.curriculum[%d]: steps %d..%s, %d samples of %d tokens, global batch %d", i,
                     self.stages[i].start_step, self.stages[i].until_step or "end", len(module.train_dataset),
                     self.stages[i].seq_length, self.stages[i].global_batch_size)
        self._tokenizer = self.stage_modules[0].tokenizer
        self.train_dataset = StagedDataset([m.train_dataset for m in self.stage_modules])
        vals = [m.val_dataset for m in self.stage_modules]
        self.val_dataset = StagedDataset(vals) if all(v is not None for v in vals) else None

    def global_batch_size_at(self, step: int) -> int:
        """Samples of optimizer step ``step`` over all DP ranks (its stage's global batch)."""
        return stage_at(self.stages, step).global_batch_size

    def train_sampler(self) -> CurriculumBatchSampler:  # type: ignore[override]
        """Micro-batches of ``(stage, index)`` from the current ``consumed_samples`` on."""
        if self.train_dataset is None:
            raise RuntimeError("CurriculumDataModule.setup() has not run yet")
        return CurriculumBatchSampler(self.stages, [len(m.train_dataset) for m in self.stage_modules],
                                      self.consumed_samples, self.num_microbatches, self.data_parallel_rank,
                                      self.data_parallel_size, self.seed, shuffle=self.cfg.shuffle)

    def train_dataloader(self) -> DataLoader:
        """Training batches, stage after stage (pipeline parallelism is not supported with a curriculum)."""
        if self.micro_batches_per_batch > 1:
            raise ValueError("data.curriculum: not supported with pipeline_model_parallel_size > 1 yet")
        return self._loader(self.train_dataset, self.train_sampler())

    def _current_step(self) -> int:
        return int(self.trainer.global_step) if self.trainer is not None else 0

    def val_dataloader(self) -> DataLoader | list:
        """The held-out samples of the stage that trains the current step (re-chosen at every validation)."""
        if self.val_dataset is None:
            return []
        sampler = StageValidationSampler(self.stages, [len(m.val_dataset) for m in self.stage_modules],
                                         self._current_step, self.data_parallel_rank, self.data_parallel_size,
                                         self.seed)
        return self._loader(self.val_dataset, sampler)
