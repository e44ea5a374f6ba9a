"""Memory of one rank, with the planner's categories: model states and bytes saved for backward.

Built on ``torch.autograd.graph.saved_tensors_hooks`` (:class:`SavedTensorMeter`), optimizer step
hooks (``Optimizer.register_step_pre_hook`` / ``register_step_post_hook``: the caller registers
them and calls :func:`gradient_bytes` / :func:`optimizer_state_bytes`) and, on CUDA, the caching
allocator's peaks (``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``, read by the
instrument).

Why not ``torch.distributed._tools.mem_tracker.MemTracker``: it is a ``TorchDispatchMode``, so
Python runs on every op of the step, and its ``Activation`` category is every tensor produced in
the forward (temporaries included, attributed per module), whereas the planner's activation bill
(``workbench.predict.memory``) is the bytes kept for the backward: exactly what the saved-tensor
hooks see, at a little Python per *saved* tensor only.

Not measured: activations inside recomputed regions (activation checkpointing installs its own
saved-tensor hooks, which take precedence: a fully recomputed block shows as ~0).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: a DTensor's local shard (``DTensor.to_local()``, under
    ``no_grad`` so that no autograd node is recorded), else ``t`` itself."""
    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


def local_nbytes(t: torch.Tensor) -> int:
    """Bytes of this rank's part of ``t`` (a DTensor's local buffer is what is stored and sent)."""
    t = local_tensor(t)
    return t.numel() * t.element_size()


def local_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    return sum(local_nbytes(t) for t in tensors if t is not None)


def gradient_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the gradients the optimizer is about to apply (call it just before ``step()``)."""
    return local_bytes(p.grad for group in optimizer.param_groups for p in group["params"])


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the per-parameter optimizer states (Adam's m and v; not the scalar step counter),
    as held on this rank (call it just after ``step()``, when they exist)."""
    total = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            n = local_nbytes(p) // max(1, p.element_size())
            for value in optimizer.state.get(p, {}).values():
                if isinstance(value, torch.Tensor) and value.numel() > 1 and local_nbytes(value) // value.element_size() == n:
                    total += local_nbytes(value)
    return total


class SavedTensorMeter:
    """Bytes saved for backward, live and peak: ``torch.autograd.graph.saved_tensors_hooks``.

    pack: count a saved tensor's storage once (several ops often save the same tensor, and views
    share a storage), skip parameters (leaves that require grad: weights are not activations);
    unpack (backward uses it, then frees it): release the storage when its last saver is done."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._refs: dict[int, list[int]] = {}
        self._ctx: Any = None

    def _pack(self, t: torch.Tensor) -> Any:
        if t.requires_grad and t.is_leaf or isinstance(t, nn.Parameter):
            return t
        base = t._base
        if base is not None and base.requires_grad and base.is_leaf:
            return t  # a view of a weight (linear saves weight.t()): not an activation
        local = local_tensor(t)
        local = getattr(local, "elem", local)  # AsyncCollectiveTensor: the tensor inside
        try:
            storage = local.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):
            # a wrapper without real storage: count the tensor itself
            key, nbytes = id(local), local.numel() * local.element_size()
        entry = self._refs.get(key)
        if entry is None:
            self._refs[key] = [nbytes, 1]
            self.live += nbytes
            if self.live > self.peak:
                self.peak = self.live
        else:
            entry[1] += 1
        return (key, t)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, tuple):
            return packed
        key, t = packed
        entry = self._refs.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                self.live -= entry[0]
                del self._refs[key]
        return t

    def start(self) -> None:
        self.live = self.peak = 0
        self._refs.clear()
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()

    def stop(self) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None

    @property
    def active(self) -> bool:
        return self._ctx is not None
