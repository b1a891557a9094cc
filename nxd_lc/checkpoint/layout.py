"""Names in the NxD checkpoint layout (:mod:`nxd_lc.checkpoint.sharded` describes it): the directories and
files of a checkpoint, shard file names and the ranks they name, tags, and the hidden staging / trash directories of
atomic saves and removals.
"""

from __future__ import annotations

import os
import re
import uuid

__all__ = ["CHECKPOINT_MARKER", "DONE_FILE", "MODEL_DIR", "NEWEST_FILE", "OPTIM_DIR", "USER_CONTENT_FILE",
           "check_tag", "checkpoint_file_name", "ep_ranks_found", "is_complete", "ranks_found", "staging_dir",
           "trash_dir"]

MODEL_DIR = "model"
OPTIM_DIR = "optim"
USER_CONTENT_FILE = "user_content.pt"
DONE_FILE = "done"
NEWEST_FILE = "newest"
CHECKPOINT_MARKER = "checkpoint"
#: a shard file name (:func:`checkpoint_file_name`): groups 1, 3, 4 the DP, TP and PP ranks, ``ep`` the EP rank
SHARD_RE = re.compile(r"^dp_rank_(\d+)(?:_ep_rank_(?P<ep>\d+))?_tp_rank_(\d+)_pp_rank_(\d+)\.pt$")
#: a staging directory (:func:`staging_dir`), ``tag`` its tag
PARTIAL_RE = re.compile(r"^\.(?P<tag>.+)\.partial$")
#: a trash directory (:func:`trash_dir`)
TRASH_RE = re.compile(r"^\..+\.trash-[0-9a-f]{32}$")


def checkpoint_file_name(dp_rank: int, tp_rank: int, pp_rank: int, ep_rank: int | None = None) -> str:
    """NxD shard file name, e.g. ``(0, 1, 0) -> "dp_rank_00_tp_rank_01_pp_rank_00.pt"``; with an ``ep_rank``
    (expert parallelism) ``(0, 1, 0, 3) -> "dp_rank_00_ep_rank_03_tp_rank_01_pp_rank_00.pt"``.

    Raises:
        ValueError: a rank is not a non-negative int.
    """
    ranks = (("dp_rank", dp_rank), ("tp_rank", tp_rank), ("pp_rank", pp_rank))
    for name, r in ranks + ((("ep_rank", ep_rank),) if ep_rank is not None else ()):
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"{name} must be a non-negative int, got {r!r}")
    ep = f"_ep_rank_{ep_rank:02d}" if ep_rank is not None else ""
    return f"dp_rank_{dp_rank:02d}{ep}_tp_rank_{tp_rank:02d}_pp_rank_{pp_rank:02d}.pt"


def check_tag(tag: str) -> None:
    """Check a checkpoint tag (the directory name under the checkpoint root).

    Raises:
        ValueError: an empty tag, one with a path separator, starting with '.' or named ``newest``.
    """
    bad = (not isinstance(tag, str) or not tag or tag.startswith(".") or "/" in tag
           or os.sep in tag or tag == NEWEST_FILE)
    if bad:
        raise ValueError(f"checkpoint tag {tag!r} is invalid: use a non-empty name without '/', not "
                         f"starting with '.' and not {NEWEST_FILE!r} (e.g. 'step_100')")


def staging_dir(ckpt_root: str, tag: str) -> str:
    """The hidden directory ``<ckpt_root>/.<tag>.partial`` a save of ``tag`` writes into before it is published."""
    return os.path.join(ckpt_root, f".{tag}.partial")


def trash_dir(ckpt_root: str, tag: str) -> str:
    """A fresh hidden directory name ``<ckpt_root>/.<tag>.trash-<uuid>`` a checkpoint is moved to before deletion."""
    return os.path.join(ckpt_root, f".{tag}.trash-{uuid.uuid4().hex}")


def is_complete(path: str) -> bool:
    """True iff checkpoint directory ``path`` (``<ckpt_root>/<tag>``) has its ``done`` marker."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, DONE_FILE))


def ranks_found(folder: str) -> tuple[set[int], set[int], set[int]]:
    """DP, TP and PP ranks of the shard files in ``folder`` (EP ranks: :func:`ep_ranks_found`)."""
    dps: set[int] = set()
    tps: set[int] = set()
    pps: set[int] = set()
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            m = SHARD_RE.match(name)
            if m:
                dps.add(int(m.group(1)))
                tps.add(int(m.group(3)))
                pps.add(int(m.group(4)))
    return dps, tps, pps


def ep_ranks_found(folder: str) -> set[int]:
    """EP ranks named by the shard files in ``folder`` (empty: saved without expert parallelism)."""
    if not os.path.isdir(folder):
        return set()
    return {int(m.group("ep")) for m in map(SHARD_RE.match, os.listdir(folder)) if m and m.group("ep") is not None}

