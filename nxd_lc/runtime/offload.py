"""Host offload of activations between forward and backward, copied on a side stream and prefetched for backward.

Used by ``model.activations_offload`` (:mod:`nxd_lc.models.common.checkpointing`): each recomputed decoder layer is
one :class:`OffloadGroup` holding its input (and, with ``activations_checkpoint_save_attention``, the attention
kernel's output and log-sum-exp). Forward copies each tensor to host memory as soon as it exists and lets the
device memory go; backward brings a layer's group back when its recomputation starts and, at the same moment,
starts bringing back the group of the layer before it, whose backward comes next (DeepSpeed's activation
checkpoint offload and ALST, arXiv:2506.13996, section 3, offload the layer inputs the same way; the side-stream
prefetch is the pattern of torch's FSDP and torchao's activation offload).

On CUDA both directions run on one side stream per device, into pinned host buffers (torch's caching host
allocator reuses them step to step), ordered against the compute stream by events; the device memory of a tensor
being copied out is not reused before the copy ends (``Tensor.record_stream``). On other devices (a native
``neuron`` device, MPS) the copies are made on the current stream, synchronously: correct, but not overlapped with
compute. On the CPU the "device" is host memory already and nothing is copied.

Memory: a group's device tensors exist in forward until their copies end, and in backward from the prefetch
(one layer ahead) to the end of the layer's backward; its host copies live as long as autograd's graph holds the
group (a ``retain_graph`` backward can fetch it again).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["ActivationOffloader", "OffloadGroup"]


class _Item:
    """One offloaded tensor: its host copy, and its device copy while a backward needs it."""

    __slots__ = ("device", "host", "on_device", "ready")

    def __init__(self, device: torch.device, host: torch.Tensor, ready: Any) -> None:
        self.device = device
        self.host = host
        self.on_device: torch.Tensor | None = None
        self.ready = ready  # event: the last copy of this item (out in forward, back in backward) has ended


class OffloadGroup:
    """The offloaded tensors of one recomputed region (one decoder layer's call), fetched back together.

    Created by :meth:`ActivationOffloader.group` in forward order; :meth:`get` in backward returns a tensor's
    device copy, first starting the copies of this whole group (if :meth:`prefetch` has not) and of the group
    created just before it (the next one backward needs).
    """

    def __init__(self, offloader: ActivationOffloader, previous: weakref.ref[OffloadGroup] | None) -> None:
        self._offloader = offloader
        self._previous = previous
        self._items: list[_Item | torch.Tensor] = []
        self._fetching = False

    def __len__(self) -> int:
        return len(self._items)

    def offload(self, tensor: torch.Tensor) -> int:
        """Start copying ``tensor`` (any shape, dtype and layout) to host memory; returns its index for :meth:`get`.

        The caller drops its own reference to ``tensor``: the device memory is freed once the copy has ended. A
        tensor the offloader does not move (on the CPU, see the module docstring) is kept as it is.
        """
        tensor = tensor.detach()
        moved = self._offloader.to_host(tensor)
        self._items.append(tensor if moved is None else _Item(tensor.device, *moved))
        return len(self._items) - 1

    def prefetch(self) -> None:
        """Start copying every tensor of the group back to its device (no-op for those already there)."""
        for item in self._items:
            if isinstance(item, _Item):
                self._bring_back(item)

    def _bring_back(self, item: _Item) -> None:
        """Start the copy of ``item`` back to its device unless it is there already."""
        if item.on_device is None:
            item.on_device, item.ready = self._offloader.to_device(item.host, item.device, item.ready)

    def get(self, index: int) -> torch.Tensor:
        """The device copy of the tensor :meth:`offload` returned ``index`` for, ready for the current stream.

        The group forgets the device copy it hands out (autograd owns it from then on); a second :meth:`get` of
        the same index (a ``retain_graph`` backward) copies it back again.

        Raises:
            IndexError: no tensor with that index.
        """
        if not self._fetching:  # this layer's backward starts: bring back its group and the one before it
            self._fetching = True
            self.prefetch()
            previous = self._previous() if self._previous is not None else None
            if previous is not None and not previous._fetching:
                previous.prefetch()
        item = self._items[index]
        if not isinstance(item, _Item):
            return item
        self._bring_back(item)  # already under way unless a retained graph fetches it again
        tensor, item.on_device = item.on_device, None
        self._offloader.wait(tensor, item.ready)
        return tensor


class ActivationOffloader:
    """Makes the :class:`OffloadGroup` of each recomputed region and the copies between device and host.

    One is shared by the checkpointed layers of a model (:func:`nxd_lc.models.common.checkpointing.
    apply_activation_checkpointing` with ``offload=True``), so that a group knows the group made before it.

    Args:
        copy_on_same_device: also copy tensors that already are in host memory (the CPU), into new host buffers.
            Nothing but a test on a CPU-only machine needs it: it makes the copies, and the release of the
            originals, observable there.
    """

    def __init__(self, copy_on_same_device: bool = False) -> None:
        self.copy_on_same_device = copy_on_same_device
        self._previous: weakref.ref[OffloadGroup] | None = None
        self._streams: dict[torch.device, Any] = {}

    def __deepcopy__(self, memo: dict[int, Any]) -> ActivationOffloader:
        return ActivationOffloader(self.copy_on_same_device)  # a copied model gets its own, with no groups

    def __getstate__(self) -> dict[str, Any]:
        return {"copy_on_same_device": self.copy_on_same_device}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)

    def group(self) -> OffloadGroup:
        """A new, empty group, linked to the one made before it (forward order)."""
        group = OffloadGroup(self, self._previous)
        self._previous = weakref.ref(group)
        return group

    def _side_stream(self, device: torch.device) -> Any:
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any] | None:
        """Start the copy of ``tensor`` (detached) into host memory: ``(host buffer, event)``, or None where it is
        not moved (already in host memory)."""
        if tensor.device.type == "cpu" and not self.copy_on_same_device:
            return None
        stream = self._side_stream(tensor.device)
        if stream is None:  # CPU (tests), or a device without the CUDA stream API: copy on the current stream
            return tensor.to("cpu", copy=True), None
        stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor has been computed
        with torch.cuda.stream(stream):
            host = torch.empty_like(tensor, device="cpu", pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            event = stream.record_event()
        tensor.record_stream(stream)  # its memory is not reused before the copy has read it
        return host, event

    def to_device(self, host: torch.Tensor, device: torch.device, after: Any) -> tuple[torch.Tensor, Any]:
        """Start the copy of ``host`` back to ``device``, after the event ``after`` (the copy out):
        ``(device tensor, event)``."""
        stream = self._side_stream(device)
        if stream is None:
            return host.to(device, copy=True), None
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            tensor = host.to(device, non_blocking=True)
            event = stream.record_event()
        return tensor, event

    @staticmethod
    def wait(tensor: torch.Tensor, event: Any) -> None:
        """Make the current stream wait for ``event`` (a copy into ``tensor`` on the side stream), and tell the
        allocator that ``tensor``, allocated on the side stream, is used on the current one."""
        if event is None:
            return
        current = torch.cuda.current_stream(tensor.device)
        current.wait_event(event)
        tensor.record_stream(current)
