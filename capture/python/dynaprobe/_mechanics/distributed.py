"""Agreement between the ranks of a distributed job: rank and world size, the run folder they
share, rank summaries gathered on rank 0, and what FSDP2/DTensor sharding rules out."""

from __future__ import annotations

import datetime
import itertools
import os
from typing import Optional, Tuple

import torch
import torch.nn as nn

from dynaprobe._C.vocabulary import RANK_DIR_PREFIX, RUNS_DIR

_checker_numbers = itertools.count()  # default dump folders of checkers in one process differ


def rank_and_world() -> Tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def resolve_dump_dir(dump_dir: Optional[str]) -> str:
    """This rank's dump folder: ``dump_dir`` (``<dump_dir>/rank<R>`` with several ranks), or by
    default ``dynaprobe_runs/<run>/rank<R>``, the run named by rank 0 and broadcast to all
    (every rank must call this together)."""
    rank, world = rank_and_world()
    if dump_dir is not None:
        return os.path.join(dump_dir, rank_dir_name(rank)) if world > 1 else dump_dir
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    run = f"{stamp}-{os.getpid()}-{next(_checker_numbers)}"
    if world > 1:  # rank 0's name for all: one run folder, rank<R>/ in it
        names = [run]
        torch.distributed.broadcast_object_list(names, src=0)
        run = names[0]
    return os.path.join(RUNS_DIR, run, rank_dir_name(rank))


def rank_dir_name(rank: int) -> str:
    """The name of rank ``rank``'s dump folder in a run folder: ``rank<R>``."""
    return f"{RANK_DIR_PREFIX}{rank}"


def gather_to_rank0(value, timeout: float) -> Optional[list]:
    """Every rank's ``value`` on rank 0 (a list in rank order), None on the others; a RuntimeError
    that says what happened instead of a hang when a rank does not come."""
    dist = torch.distributed
    rank, world = rank_and_world()
    try:
        if dist.get_backend() == "gloo":  # names the ranks that did not come, after timeout
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout),
                                   wait_all_ranks=True)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(value, gathered, dst=0)
    except RuntimeError as error:
        raise RuntimeError(
            f"dynaprobe: gather_report() on rank {rank}: not all {world} ranks reached "
            f"gather_report() within {timeout:g} s (a rank failed or stopped before it, or did "
            f"not call it): {error}") from error
    return gathered


def is_deepcopy_forbidden(model: nn.Module) -> bool:
    """FSDP2 (fully_shard) and other DTensor-sharded models cannot be deep-copied."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        FSDPModule = ()
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return True
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def nested_fully_shard(module: nn.Module) -> list:
    """The names of fully_shard units below ``module`` (not itself)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return []
    return [n for n, m in module.named_modules() if n and isinstance(m, FSDPModule)]
