"""fp32 master weights (O2/O5): swapped into the optimizer, copied back into the model, kept in step.

The optimizer steps an fp32 master in place of each low-precision model param; after every step
the masters are rounded into the model. Something other than amp may write a model param in
between (DDP's broadcast of rank 0's weights, ``load_state_dict`` on a submodule, an in-place
edit): each step first takes such a param's value into its master, so that the stale master is
not stepped and written back.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import _collective_writes
from .._master_weights import swap_in_fp32_masters
from .._remainder_master import RemainderMaster

__all__ = ["Masters"]


def _remainder_master(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The master of a bf16 ``param`` whose fp32 value is ``value``, as weight plus remainders."""
    if value.stride() != param.stride():
        value = torch.empty_like(param, dtype=torch.float32).copy_(value)
    return nn.Parameter(RemainderMaster.of(param, value))


class Masters:
    """The masters of one optimizer, their low-precision model params, and what amp last wrote."""

    def __init__(self, optimizer: Any, param_names: dict[torch.Tensor, str], remainders: bool = False) -> None:
        self.optimizer = optimizer
        self.param_names = param_names
        # master_weights="remainder": each master is a RemainderMaster, whose bits are the model param's.
        self.remainders = remainders
        self.reset()

    def reset(self) -> None:
        # Per param group: the model's low-precision params, their masters, the fp32 params kept.
        self.model_groups: list[list[torch.Tensor]] = []
        self.master_groups: list[list[torch.Tensor]] = []
        self.fp32_groups: list[list[torch.Tensor]] = []
        # The same, flat over all groups.
        self.model_params: list[torch.Tensor] = []
        self.masters: list[torch.Tensor] = []
        # Each model param's version right after amp wrote it (see refresh_written_elsewhere).
        self.versions: list[int] = []
        # Remainder masters: their remainders' versions at the same time.
        self.remainder_versions: list[int] = []

    def swap_in(self, group: dict[str, Any], fp32_values: dict[int, torch.Tensor] | None) -> list[torch.Tensor]:
        """Swap an fp32 master into ``group`` for each low-precision param; returns the fp32 params kept."""
        make_master = _remainder_master if self.remainders else None
        fp16_params, masters, fp32_params = swap_in_fp32_masters(self.optimizer, group, fp32_values, make_master)
        for param, master in zip(fp16_params, masters):
            name = self.param_names.get(param)
            if name is not None:  # an unnamed param's master is named by its position, as the param
                self.param_names.setdefault(master, name)
        self.model_groups.append(fp16_params)
        self.master_groups.append(masters)
        self.fp32_groups.append(fp32_params)
        self.model_params += fp16_params
        self.masters += masters
        _collective_writes.watch(self, fp16_params)
        return fp32_params

    def clear_grads(self) -> None:
        for master in self.masters:
            master.grad = None

    def copy_to_model(self) -> None:
        """Round the masters into the model's low-precision params (remainder masters always are)."""
        if self.model_params and not self.remainders:
            # A plain rounding copy, no scaling and no check: PyTorch's foreach copy is the fastest
            # kernel for it (amp_C's scale-by-1.0 measured 2x slower on CPU for fp32 -> fp16).
            with torch.no_grad():
                torch._foreach_copy_(self.model_params, self.masters)
        self.note_versions()

    def note_versions(self) -> None:
        """Remember each low-precision param's version right after amp wrote it (see below)."""
        self.versions = [param._version for param in self.model_params]
        if self.remainders:
            self.remainder_versions = [master.remainders._version for master in self.masters
                                       if isinstance(master, RemainderMaster)]

    def refresh_written_elsewhere(self) -> None:
        """Take into its master the value of each low-precision param that something else wrote.

        Runs at the start of every step, before the masters are stepped and copied back. DDP's
        broadcast of rank 0's weights, ``load_state_dict`` on a submodule or an in-place edit changes
        a param after its master was made; stepping the stale master would write it back (and DDP
        ranks would diverge). A master is kept only if it rounds to the param and was itself
        written since it was made (by a step, or by loading a checkpoint through the model): the param
        was then rounded from it, and its extra fp32 bits are the same on every rank. An untouched
        master holds this process's own initial weights, which another rank's broadcast weights may
        round alike from different fp32 values, so it is replaced.

        Collectives (``dist.broadcast(p, 0)``, also through ``p.data``) do not bump the version; a
        param that one wrote is seen by ``_collective_writes`` on every rank of the group, and its
        master is replaced on every rank whatever the values, so that all ranks hold the same
        masters (in a group of one rank, the rule above applies). Other writes through
        ``param.data`` bypass the version counter and go unseen.

        A remainder master is the param's own bits plus its remainders, so it always rounds to the
        param: there the param's value becomes the master (its remainders zeroed) whenever something
        wrote the param, unless amp wrote the remainders since the last step (loading a checkpoint
        through the model writes both), or the write was a collective within a group of this rank
        alone (which leaves every value as it was). Unlike an fp32 master, it is replaced even by a
        write that left every value of the param as it was: the values written cannot be told from
        new ones.
        """
        written = _collective_writes.take_written(self)
        versions = [param._version for param in self.model_params]
        recorded = self.versions
        if versions == recorded and not written:
            return
        with torch.no_grad():
            for index, (param, master) in enumerate(zip(self.model_params, self.masters)):
                group_size = _collective_writes.group_size_of_write(param, written) if written else 0
                if group_size > 1:
                    master.copy_(param)
                    continue
                if not group_size and index < len(recorded) and recorded[index] == versions[index]:
                    continue
                if self._keeps(index, param, master, group_size):
                    continue
                master.copy_(param)
        self.versions = versions

    def _keeps(self, index: int, param: torch.Tensor, master: torch.Tensor, group_size: int) -> bool:
        """Whether the master of a param that something wrote stays (refresh_written_elsewhere's rules)."""
        if isinstance(master, RemainderMaster):
            loaded = index < len(self.remainder_versions) and \
                master.remainders._version != self.remainder_versions[index]
            return group_size == 1 or loaded
        return master._version != 0 and torch.equal(master.to(param.dtype), param)
