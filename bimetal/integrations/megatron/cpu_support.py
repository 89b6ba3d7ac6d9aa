"""CPU stand-ins that let megatron-core train on a machine without GPUs (tests, ``bimetal megatron --simulate``).

None of this runs for a GPU user: ``install`` does nothing when torch sees a GPU. Each stand-in replaces one hard
CUDA assumption of megatron-core and names the Megatron functions that made it necessary (``STAND_INS``); at
install every named function is read again, and a release where a function no longer has its assumption is
reported (``outdated``), so a stand-in that is no longer needed is noticed rather than kept forever.

* **current_device**: receive buffers, TP gather buffers and DDP's grad buffers are allocated on
  ``torch.cuda.current_device()``; on CPU it answers 0, which the device mapping below sends to the CPU;
* **cuda_devices**: ``device="cuda"`` literals (the schedules' token count, the causal mask, the grad-norm
  buffers) and ``.cuda()`` calls; a ``TorchFunctionMode`` maps any CUDA device in a call to the CPU;
* **cuda_tensor_type**: Megatron's optimizers sort parameters by ``Tensor.type() == 'torch.cuda.FloatTensor'``;
  under the same mode a CPU tensor's ``type()`` answers its CUDA name;
* **rng_tracker**: the CUDA RNG tracker (``model_parallel_cuda_manual_seed``, ``get_cuda_rng_tracker().fork()``)
  keeps CUDA generator states; the stand-in tracker keeps CPU generator states;
* **synchronize**: ``batch_p2p_comm`` with ``batch_p2p_sync`` calls ``torch.cuda.synchronize()``; a no-op on CPU.

Newer releases than the pinned one also use CUDA streams in DDP's grad sync (0.19.2:
``torch.cuda.current_stream()`` in ``param_and_grad_buffer``) and import ``triton`` under the MoE paged stash; 0.16.1
does neither on the paths used here, so they have no stand-in yet (a run that needs one fails with CUDA's own
error; ``hooks.CHECKED`` refuses those releases until they are checked).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


@dataclass(frozen=True)
class StandIn:
    """One CUDA assumption of megatron-core and where it is."""

    name: str
    needed_by: tuple[str, ...]
    """Megatron functions (``module:qualname``) whose source has the assumption."""
    marker: str
    """The text of the assumption in those functions' source."""


STAND_INS = (
    StandIn("current_device", ("megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator._communicate",
                               "megatron.core.tensor_parallel.mappings:_gather_along_first_dim",
                               "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBuffer.__init__"),
            "torch.cuda.current_device()"),
    StandIn("cuda_devices", ("megatron.core.pipeline_parallel.schedules:forward_backward_no_pipelining",
                             "megatron.core.transformer.utils:get_default_causal_mask",
                             "megatron.core.optimizer.clip_grads:get_grad_norm_fp32"),
            "'cuda'"),
    StandIn("cuda_tensor_type", ("megatron.core.optimizer.distrib_optimizer:"
                                 "DistributedOptimizer._build_model_and_main_param_groups",
                                 "megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32"),
            "'torch.cuda.FloatTensor'"),
    StandIn("rng_tracker", ("megatron.core.tensor_parallel.random:CudaRNGStatesTracker.add",),
            "torch.cuda.get_rng_state()"),
    StandIn("synchronize", ("megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator._communicate",),
            "torch.cuda.synchronize()"),
)


def _source(where: str) -> str:
    module, qualname = where.split(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return ""
    try:
        # "cuda" and 'cuda' are one assumption: compare one spelling
        return inspect.getsource(obj).replace('"', "'")
    except (OSError, TypeError):
        return ""


def outdated() -> list[str]:
    """One line per stand-in whose assumption is in none of the functions it names (this release fixed it, or
    moved it: either way the table must be read again)."""
    lines = []
    for s in STAND_INS:
        if not any(s.marker in _source(where) for where in s.needed_by):
            lines.append(f"bimetal: stand-in {s.name!r}: none of {', '.join(s.needed_by)} still has {s.marker}; "
                         "this megatron-core may no longer need it")
    return lines


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class CudaOnCpu(TorchFunctionMode):
    """``cuda_devices`` and ``cuda_tensor_type``: a CUDA device named in a torch call is the CPU; ``.cuda()`` is the
    tensor itself; a CPU tensor's ``type()`` is its CUDA name (what Megatron's optimizers compare against)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if args[0].is_cuda else name.replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _cpu_rng_tracker_class() -> type:
    """``rng_tracker``: Megatron's tracker with CPU generator states (same names, seeds and fork semantics)."""
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):  # type: ignore[misc, name-defined]
        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRNGStatesTracker


_mode: CudaOnCpu | None = None


def needed() -> bool:
    """Stand-ins apply only where torch sees no GPU."""
    return not torch.cuda.is_available()


def install() -> list[str]:
    """Install every stand-in (idempotent; nothing where a GPU is visible); returns ``outdated()``'s lines."""
    global _mode
    if not needed() or _mode is not None:
        return []
    from megatron.core.tensor_parallel import random as mrandom

    lines = outdated()  # before the replacements below change what it reads
    torch.cuda.current_device = lambda: 0  # current_device: 0, which CudaOnCpu maps to the CPU
    torch.cuda.synchronize = lambda device=None: None  # synchronize
    # rng_tracker: initialize_rng_tracker reads the class by this name when it builds the tracker
    mrandom.CudaRNGStatesTracker = _cpu_rng_tracker_class()  # type: ignore[misc]
    _mode = CudaOnCpu()
    _mode.__enter__()  # for the rest of this (CPU-only) process
    return lines
