"""Optimizer wrapper for bf16 parameters (fp32 master weights, stochastic rounding) and ZeRO-1 sharding.

:class:`NxDOptimizer` wraps a torch optimizer (built by :func:`nxd_lc.optim.build_optimizer`) that steps fp32
*working* tensors instead of the model's parameters:

* one working tensor per model parameter: its full fp32 value, or under ZeRO-1 (``distributed_strategy.zero1``)
  this rank's contiguous slice of the flattened parameter, padded to a multiple of the DP x CP size
  (ZeRO stage 1, Rajbhandari et al. 2020; NxD ``NeuronZero1Optimizer`` shards over DP the same way);
* persistent (fp32 **master weights**) when the policy asks for them or the parameters are fp32 (then the
  working tensor is the param's shard); otherwise (``bf16SR``) allocated from the bf16 parameter at each step
  and freed after it, so bf16SR keeps no fp32 copy between steps;
* gradient: the fp32 ``main_grad`` buffer (fp32 gradient accumulation, :func:`install_fp32_grad_accumulation`)
  or the parameter's ``.grad`` cast to fp32, sliced to this rank's shard under ZeRO-1;
* after the inner step the fp32 result is written back to the parameter: round-to-nearest, or **stochastic
  rounding** to bf16 (:func:`nxd_lc.precision.stochastic_round_to_bf16`, unbiased; a plain cast where Neuron's
  runtime rounds stochastically itself, :func:`~nxd_lc.precision.stochastic_rounding.hardware_rounding`); under
  ZeRO-1 the rounded shards are all-gathered over DP x CP;
* the step runs in buckets of ~64 MiB of fp32 working data (the inner optimizer skips tensors without a
  gradient), so transient fp32 copies exist for one bucket at a time;
* optimizer state is kept in ``optim_state_dtype`` between steps (bf16 for bf16SR + adamw, as NxDT's bf16SR
  keeps it under ``XLA_USE_BF16``) and computed in fp32 during the step. On torch-xla every fp32 tensor here is
  fp32 on the device: nxd_lc never sets ``XLA_USE_BF16`` / ``XLA_DOWNCAST_BF16`` (:mod:`nxd_lc.runtime.env`).

Expert parameters (flag ``expert_model_parallel``, :mod:`nxd_lc.moe`) are distinct on each rank of an EP group:
under ZeRO-1 they are sharded over their expert-data-parallel x CP group (the ranks that hold the same experts),
NxD's rule for expert parameters; every other parameter over DP x CP.

Stochastic rounding uses a generator seeded with ``seed`` (plus the shard index under ZeRO-1) so that
data-parallel replicas round identically and stay equal; its state is saved with the optimizer.

Gradients are reduced by the LightningModule before the step (all-reduce over DP x CP, see
:mod:`nxd_lc.distributed.grads`); ZeRO-1 here shards optimizer state and master weights, not the gradient
communication (NxD reduce-scatters instead; same result, half the gradient traffic).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from nxd_lc.distributed import collectives
from nxd_lc.distributed import parallel_state as ps
from nxd_lc.precision.policy import PrecisionPolicy
from nxd_lc.precision.stochastic_rounding import hardware_rounding, stochastic_round_to_bf16
from nxd_lc.runtime.accel import HOST

ParamGroup = dict[str, Any]
_STEP_BUCKET_BYTES = 64 * 1024 * 1024  # fp32 working data stepped (and all-gathered) at once


def install_fp32_grad_accumulation(params: list[nn.Parameter]) -> list[Any]:
    """Accumulate each bf16 parameter's gradient in an fp32 ``param.main_grad`` buffer (Megatron's name).

    A post-accumulate-grad hook adds ``param.grad`` to ``main_grad`` in fp32 and frees ``param.grad``, so no
    bf16 gradient outlives its backward and micro-batch sums are exact in fp32. Code that reads gradients uses
    :func:`nxd_lc.distributed.grads.grad_of`. Requires torch >= 2.1 (``register_post_accumulate_grad_hook``).

    Args:
        params: parameters to equip (fp32 parameters are skipped: their grads are fp32 already).

    Returns:
        the hook handles (call ``.remove()`` to uninstall).
    """
    handles = []
    for p in params:
        if p.dtype == torch.float32 or not p.requires_grad:
            continue
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)  # type: ignore[attr-defined]

        def hook(param: nn.Parameter) -> None:
            param.main_grad.add_(param.grad)
            param.grad = None

        handles.append(p.register_post_accumulate_grad_hook(hook))
    return handles


@dataclass(frozen=True)
class _Domain:
    """The ranks one parameter's ZeRO-1 shards are spread over: ``group`` of ``world`` ranks, this one ``rank``."""

    group: Any
    world: int
    rank: int
    rank_name: str = "dp_cp"  # the group's name in parallel_state (the rank as device data: rank_tensor)


@dataclass
class _Slot:
    """One model parameter and its working tensor (full, or this rank's ZeRO-1 shard ``[start, stop)`` of the
    flattened parameter over ``domain``, zero-padded to ``shard_numel`` elements on every rank)."""

    param: nn.Parameter
    work: nn.Parameter
    start: int
    stop: int
    shard_numel: int
    domain: _Domain


class NxDOptimizer(torch.optim.Optimizer):
    """A torch optimizer over fp32 working tensors of (possibly bf16, possibly ZeRO-1-sharded) parameters.

    Args:
        groups: parameter groups of the *model* parameters (:func:`nxd_lc.optim.param_groups`).
        build_inner: builds the torch optimizer from groups of the same layout (``params`` replaced by the
            working tensors).
        policy: the run's :class:`~nxd_lc.precision.PrecisionPolicy`.
        zero1: shard state and master weights over the DP x CP group (``distributed_strategy.zero1``).
        seed: seed of the stochastic-rounding generator (``seed`` of the config).

    ``param_groups`` and ``state`` are the inner optimizer's, so LR schedulers and Lightning see one optimizer.
    """

    def __init__(self, groups: list[ParamGroup], build_inner: Callable[[list[ParamGroup]], torch.optim.Optimizer],
                 policy: PrecisionPolicy, zero1: bool = False, seed: int = 0) -> None:
        self.policy = policy
        self.zero1 = zero1
        self._group = ps.get_data_parallel_group(with_context_parallel=True) if zero1 else None
        self._world = ps.get_data_parallel_world_size(with_context_parallel=True) if zero1 else 1
        self._rank = ps.get_data_parallel_rank(with_context_parallel=True) if zero1 else 0
        self._dense = _Domain(self._group, self._world, self._rank)
        self._experts = _Domain(ps.get_expert_data_parallel_group(with_context_parallel=True),
                                ps.get_expert_data_parallel_world_size(with_context_parallel=True),
                                ps.get_expert_data_parallel_rank(with_context_parallel=True),
                                "edp_cp") if zero1 else self._dense
        self.persistent = policy.master_weights or not policy.low_precision_params
        self.slots: list[_Slot] = []
        inner_groups = []
        for g in groups:
            works = [self._make_slot(p).work for p in g["params"]]
            inner_groups.append({**g, "params": works})
        self.inner = build_inner(inner_groups)
        device = self.slots[0].param.device if self.slots else HOST
        self._generator = torch.Generator(device=device.type if device.type != "xla" else HOST.type)
        self._generator.manual_seed(int(seed) + 7919 * self._rank)
        # stochastic rounding in software, unless Neuron's runtime already rounds the cast (hardware_rounding)
        self._software_sr = policy.stochastic_rounding and not hardware_rounding(device)
        super().__init__([s.work for s in self.slots], dict(self.inner.defaults))
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        # set by nxd_lc.optim.nonfinite.skip_update when the step's gradients are not finite: the next step() runs
        # its closure and changes nothing else (no inner step, no write-back, no rounding draw); reset by step()
        self.skip_next_step = False
        self._store_state(policy.optim_state_dtype)

    # ---- construction -------------------------------------------------------------------------------------
    @staticmethod
    def _shard_range(numel: int, domain: _Domain) -> tuple[int, int, int]:
        per = math.ceil(numel / domain.world)
        start = min(domain.rank * per, numel)
        return start, min(start + per, numel), per

    def _make_slot(self, p: nn.Parameter) -> _Slot:
        domain = self._experts if getattr(p, "expert_model_parallel", False) else self._dense
        start, stop, per = self._shard_range(p.numel(), domain) if self.zero1 else (0, p.numel(), p.numel())
        if self.persistent:
            src = self._rank_slice(p.detach(), per, domain) if self.zero1 else p.detach()
            work = nn.Parameter(src.to(torch.float32).clone())
        else:
            work = nn.Parameter(torch.empty(0, dtype=torch.float32, device=p.device))
        slot = _Slot(p, work, start, stop, per, domain)
        self.slots.append(slot)
        return slot

    # ---- step ---------------------------------------------------------------------------------------------
    @staticmethod
    def _rank_slice(full: torch.Tensor, per: int, domain: _Domain) -> torch.Tensor:
        """This rank's ``per`` elements of ``full`` flattened and zero-padded to ``per x domain.world``.

        The shard is chosen with the rank as device data (``index_select`` by
        :func:`~nxd_lc.distributed.parallel_state.rank_tensor`), and every rank's shard has the same size: the
        optimizer step traces the same graph on every rank (DESIGN.md 16; a Python slice offset would differ).
        """
        flat = full.reshape(-1)
        if flat.numel() < per * domain.world:
            flat = F.pad(flat, (0, per * domain.world - flat.numel()))
        index = ps.rank_tensor(domain.rank_name, flat.device)
        return flat.view(domain.world, per).index_select(0, index).reshape(per)

    def _shard(self, s: _Slot, full: torch.Tensor) -> torch.Tensor:
        """``full`` (parameter-shaped) -> the working tensor's layout, fp32."""
        flat = self._rank_slice(full, s.shard_numel, s.domain) if self.zero1 else full
        return flat.to(torch.float32)

    def _buckets(self) -> list[list[_Slot]]:
        """Slots in groups of about ``_STEP_BUCKET_BYTES`` of fp32 working data: the optimizer steps one group at
        a time, so the transient fp32 copies (working tensors of bf16SR, fp32 gradients, fp32 state) of only one
        group exist at once."""
        buckets: list[list[_Slot]] = [[]]
        size = 0
        for s in self.slots:
            if buckets[-1] and size + 4 * s.shard_numel > _STEP_BUCKET_BYTES:
                buckets.append([])
                size = 0
            buckets[-1].append(s)
            size += 4 * s.shard_numel
        return [b for b in buckets if b]

    def _load_work(self, bucket: list[_Slot]) -> None:
        """Working values (bf16SR) and fp32 gradients of ``bucket``; an fp32 gradient (``main_grad``, fp32
        params) is used in place, not copied (torch optimizers do not modify ``.grad``)."""
        from nxd_lc.distributed.grads import grad_of

        for s in bucket:
            if not self.persistent:
                s.work.data = self._shard(s, s.param.detach()).clone()
            g = grad_of(s.param)
            s.work.grad = None if g is None else self._shard(s, g).reshape(s.work.shape)

    def _store_state(self, dtype: torch.dtype, bucket: Optional[list[_Slot]] = None) -> None:
        """Cast floating state tensors (not ``step``) of ``bucket`` (default: all) to ``dtype``, replacing them."""
        states = self.inner.state.values() if bucket is None else [self.inner.state[s.work] for s in bucket
                                                                    if s.work in self.inner.state]
        for state in states:
            for k, v in state.items():
                if k != "step" and torch.is_tensor(v) and v.is_floating_point() and v.dtype != dtype:
                    state[k] = v.to(dtype)

    def _rounded(self, s: _Slot) -> torch.Tensor:
        """The working tensor in the parameter's dtype (stochastic rounding when the policy says so)."""
        w = s.work.detach()
        if s.param.dtype == torch.bfloat16 and self._software_sr:
            gen = self._generator if self._generator.device.type == w.device.type else None
            return stochastic_round_to_bf16(w, gen)
        return w.to(s.param.dtype)

    def _write_back(self, bucket: list[_Slot]) -> None:
        """Parameters of ``bucket`` from their working tensors (rounded; all-gathered under ZeRO-1)."""
        if not self.zero1:
            for s in bucket:
                s.param.data.copy_(self._rounded(s).view_as(s.param))
            return
        self._gather_bucket(bucket)

    def _gather_bucket(self, bucket: list[_Slot]) -> None:
        """All-gather the rounded shards of ``bucket`` into the parameters (one collective per parameter dtype
        and shard domain)."""
        by_dtype: dict[torch.dtype, list[_Slot]] = {}
        for s in bucket:
            by_dtype.setdefault(s.param.dtype, []).append(s)
        for dtype, slots in by_dtype.items():
            fulls = self._all_gather_shards(slots, [self._rounded(s).to(dtype) for s in slots])
            for s, full in zip(slots, fulls):
                s.param.data.copy_(full)

    def _all_gather_shards(self, slots: list[_Slot], shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """Full parameter-shaped tensors from each rank's ``shards`` (one per slot, same dtype, unpadded), in
        ``slots`` order: one all-gather per shard domain (DP x CP; expert-DP x CP for expert parameters) of the
        padded shards laid end to end. Every rank must call it with the same slots."""
        out: list[torch.Tensor | None] = [None] * len(slots)
        for domain in [self._dense] if self._experts is self._dense else [self._dense, self._experts]:
            idx = [i for i, s in enumerate(slots) if s.domain is domain]
            if not idx:
                continue
            pieces = [F.pad(shards[i], (0, slots[i].shard_numel - shards[i].numel()))
                      if shards[i].numel() < slots[i].shard_numel else shards[i] for i in idx]
            total = sum(slots[i].shard_numel for i in idx)
            gathered = collectives.all_gather(torch.cat(pieces), 0, domain.group).view(domain.world, total)
            offset = 0
            for i in idx:
                s = slots[i]
                out[i] = gathered[:, offset:offset + s.shard_numel].reshape(-1)[: s.param.numel()].view_as(s.param)
                offset += s.shard_numel
        return [t for t in out if t is not None]

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        """Run ``closure`` (forward/backward/grad reduction), step the fp32 working tensors, write them back.

        When :attr:`skip_next_step` is set (by the closure's non-finite check, :func:`nxd_lc.optim.nonfinite.
        skip_update`), nothing but the closure runs, and the flag is cleared.

        Returns:
            the closure's result (None without closure).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.skip_next_step:
            self.skip_next_step = False
            return loss
        for bucket in self._buckets():  # the inner optimizer skips working tensors whose .grad is None
            self._load_work(bucket)
            self._store_state(torch.float32, bucket)
            self.inner.step()
            self._store_state(self.policy.optim_state_dtype, bucket)
            self._write_back(bucket)
            for s in bucket:
                s.work.grad = None
                if not self.persistent:
                    s.work.data = s.work.data.new_empty(0)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model parameters' gradients (and zero their fp32 ``main_grad`` buffers)."""
        for s in self.slots:
            s.param.grad = None
            mg = getattr(s.param, "main_grad", None)
            if mg is not None:
                mg.zero_()
            s.work.grad = None

    # ---- checkpoint ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The inner optimizer's state dict plus ``nxd``: master weights (this rank's shards), the ZeRO-1 layout
        and the stochastic-rounding generator state."""
        sd = self.inner.state_dict()
        sd["nxd"] = {"master_weights": [s.work.detach().clone() for s in self.slots] if self.persistent else None,
                     "zero1_world": self._world if self.zero1 else 0, "zero1_rank": self._rank,
                     "zero1_expert_world": self._experts.world if self.zero1 else 0,
                     "sr_generator": self._generator.get_state()}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore state, master weights and generator.

        Raises:
            ValueError: the checkpoint was written with another ZeRO-1 layout (DP x CP size or zero1 on/off).
        """
        sd = dict(state_dict)
        extra = sd.pop("nxd", None) or {}
        saved_world = extra.get("zero1_world", 0)
        mine = self._world if self.zero1 else 0
        if saved_world != mine:
            raise ValueError(
                f"optimizer checkpoint was written with zero1 over {saved_world or 'no'} DP x CP ranks but this run "
                f"uses {mine or 'no'} zero1 ranks: resume with the same distributed_strategy.zero1 and DP x CP "
                "size, or load weights only (model.weight_init_only: true)")
        if self.zero1:  # shards saved unpadded (before every rank's shard had the same size): pad them
            sd["state"] = {i: {k: self._padded(self.slots[i], v) for k, v in st.items()}
                           for i, st in sd.get("state", {}).items()}
        self.inner.load_state_dict(sd)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self._store_state(self.policy.optim_state_dtype)
        masters = extra.get("master_weights")
        if masters is not None and self.persistent:
            for s, m in zip(self.slots, masters):
                s.work.data.copy_(self._padded(s, m).to(s.work.device))
        if "sr_generator" in extra:
            self._generator.set_state(extra["sr_generator"])

    def _padded(self, s: _Slot, t: Any) -> Any:
        """A saved ZeRO-1 shard tensor of ``s`` zero-padded to ``s.shard_numel`` (shards of the last ranks were
        saved without padding by earlier versions); anything else unchanged."""
        if (self.zero1 and torch.is_tensor(t) and t.ndim == 1 and t.numel() == s.stop - s.start
                and t.numel() < s.shard_numel):
            return F.pad(t, (0, s.shard_numel - t.numel()))
        return t

    def full_master_weights(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(model parameter, its full fp32 master value) for every parameter; all-gathered under ZeRO-1
        (collective over DP x CP: every rank must call it). Empty without persistent master weights."""
        if not self.persistent:
            return []
        works = [s.work.detach() for s in self.slots]
        fulls = (self._all_gather_shards(self.slots, works) if self.zero1
                 else [w.reshape(s.param.shape) for s, w in zip(self.slots, works)])
        return [(s.param, w) for s, w in zip(self.slots, fulls)]
