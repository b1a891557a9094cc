"""Start-up in waves: ``trainer.sequential_move_factor`` (NxDT).

On a node of ``L`` ranks (``trainer.devices``), building the model and moving it to the device happens in
``ceil(L / f)`` waves of ``f = sequential_move_factor`` ranks: local ranks ``[w f, (w + 1) f)`` work in wave ``w``
while the others wait at a barrier. With ``use_cpu_initialization`` each rank first materialises full layer
weights on the host before keeping its shard, and on Trainium the host copy is freed once the model is on the
device, so at most ``f`` ranks of a node hold start-up host memory at the same time (NxD moves the model to the
XLA device in the same grouped order). Every rank passes the same number of barriers, so all nodes (same
``trainer.devices``) stay in step. ``None`` (the default) builds on every rank at once.

The wave barrier must really wait: torch-xla's process group returns from ``barrier`` at once (its
``ProcessGroupXla.barrier`` is a completed no-op), so on the ``xla`` backend the waves meet at
``xm.rendezvous`` instead, as Lightning's XLA strategy does. Written from torch-xla's source: multi-process XLA
cannot run on the development machines, so that branch is untested here.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Optional, TypeVar

from nxd_lc.distributed import collectives

T = TypeVar("T")
log = logging.getLogger(__name__)


def wave_of(local_rank: int, factor: Optional[int]) -> int:
    """The wave (0-based) in which local rank ``local_rank`` builds; 0 for every rank without a factor."""
    return 0 if not factor else local_rank // factor


def run_in_waves(fn: Callable[[], T], factor: Optional[int], local_rank: int, local_world_size: int) -> T:
    """Call ``fn`` on this rank in its wave (see the module docstring) and return its result.

    Collective over the world group (``ceil(local_world_size / factor)`` barriers on every rank).

    Raises:
        ValueError: ``factor`` < 1 (``trainer.sequential_move_factor``).
    """
    if factor is None:
        return fn()
    if factor < 1:
        raise ValueError(f"trainer.sequential_move_factor must be >= 1, got {factor}")
    waves = math.ceil(local_world_size / factor)
    result: Optional[T] = None
    for wave in range(waves):
        if wave == wave_of(local_rank, factor):
            log.info("sequential_move_factor %d: local rank %d builds its model in wave %d of %d", factor,
                     local_rank, wave + 1, waves)
            result = fn()
        _wave_barrier(wave)
    return result  # type: ignore[return-value]


def _wave_barrier(wave: int) -> None:
    """All ranks meet: ``dist.barrier`` (gloo / nccl), or ``xm.rendezvous`` on the xla backend (module doc)."""
    import torch.distributed as dist

    if dist.is_initialized() and str(dist.get_backend()) == "xla":
        import torch_xla.core.xla_model as xm

        xm.rendezvous(f"nxd_lc_startup_wave_{wave}")
        return
    collectives.barrier()


def _wait_for_count(store: Any, key: str, count: int, timeout_s: float = 60.0) -> None:
    """Wait (polling, at most ``timeout_s``) until the store counter ``key`` (``store.add``) reaches ``count``; on
    timeout return anyway (the caller's error matters more than a peer that did not arrive)."""
    import time

    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < count and time.monotonic() < deadline:
        time.sleep(0.01)


#: store keys of :func:`check_same_config`: ``<prefix>/<restart>/{hash,text}/<rank>``
CONFIG_KEY_PREFIX = "nxd_lc_config"


def check_same_config(text: str, differences: Callable[[str, str], list[str]]) -> str:
    """Collective start-up check that every rank runs one config: each rank hashes ``text`` (its resolved config)
    and compares the hash with rank 0's through the default process group's key-value store (torchrun's
    rendezvous TCPStore: nothing on the device, no collective on the device's backend); one host vote
    (:func:`nxd_lc.distributed.collectives.world_max`) then tells every rank whether any differs, and which is the
    first. Every rank raises the same error, naming the first differing rank, its node (torchrun's
    ``GROUP_RANK``) and the keys (``differences(rank 0's text, its text)``), before anything is built. Where no
    store is reachable (a torch without ``distributed_c10d._get_default_store``, torch-xla's DummyStore) the
    hashes are compared by the vote alone and the error cannot name the keys.

    The keys carry torchrun's restart count (``TORCHELASTIC_RESTART_COUNT``), so a restarted job never reads an
    earlier round's.

    Returns:
        The config's SHA-256 (hex), the same on every rank.

    Raises:
        nxd_lc.config.errors.ConfigError: the ranks' configs differ (every rank raises).
        torch.distributed.DistStoreError: rank 0's hash did not arrive within the store's timeout.
    """
    import hashlib
    import os

    from nxd_lc.config.errors import ConfigError

    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if not collectives.is_initialized() or collectives.get_global_world_size() == 1:
        return digest
    rank, world = collectives.get_global_rank(), collectives.get_global_world_size()
    store = None if collectives.xla_store_is_dummy() else collectives.default_store()
    high, low = int(digest[:15], 16), int(digest[15:30], 16)  # two 60-bit pieces: int64 votes
    if store is not None:
        prefix = f"{CONFIG_KEY_PREFIX}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        store.set(f"{prefix}/hash/{rank}", digest)
        store.set(f"{prefix}/text/{rank}", text)
        store.set(f"{prefix}/node/{rank}", os.environ.get("GROUP_RANK", "?"))
        differs = store.get(f"{prefix}/hash/0").decode() != digest
        vote = collectives.world_max([int(differs), world - rank if differs else 0], tag="nxd_lc_config_vote")
        if not vote[0]:
            return digest
        first = world - vote[1]
        keys = differences(store.get(f"{prefix}/text/0").decode("utf-8"),
                           store.get(f"{prefix}/text/{first}").decode("utf-8"))
        detail = "; ".join(keys) if keys else "the texts differ"
        node = store.get(f"{prefix}/node/{first}").decode()
        shas = (f"config sha256: rank 0 {store.get(f'{prefix}/hash/0').decode()[:12]}, rank {first} "
                f"{store.get(f'{prefix}/hash/{first}').decode()[:12]}")
        # every rank is about to raise and exit; rank 0 leaves last, for the store may live in its process (env://
        # without torchrun's agent store): a rank still reading would otherwise fail on the closed store, with a
        # network error instead of this message (seen in a 3-rank test)
        store.add(f"{prefix}/read", 1)
        if rank == 0:
            _wait_for_count(store, f"{prefix}/read", world)
    else:
        top = collectives.world_max([high, low, -high, -low], tag="nxd_lc_config_vote")
        if top[0] == -top[2] and top[1] == -top[3]:
            return digest
        first, node, shas = -1, "?", f"this rank's config sha256 {digest[:12]}"
        detail = "no key-value store to compare the texts through: compare each node's command line"
    who = f"rank {first} (node {node})" if first >= 0 else "some rank"
    raise ConfigError([f"one job, one config: {who}'s resolved config differs from rank 0's ({detail}); every "
                       f"node must start train.py with the same config file and overrides ({shas})"])
