"""CPU stand-ins that let torchtitan 0.3.0 train on a machine without GPUs (tests, ``--simulate`` demo).

None of this runs for a GPU user: ``bimetal titan`` installs it only under ``--simulate`` or ``--cpu``.
Each stand-in replaces something torchtitan needs and a CPU-only torch 2.13 does not have:

* **Triton**: absent on CPU; torchtitan imports its kernels at import time (see ``_no_triton``).
* **device type**: torchtitan falls back to device type ``"cuda"`` when no accelerator is visible; the
  stand-in makes its device helpers answer ``"cpu"`` and a device module (``torch.cpu`` plus the memory
  calls its metrics make: the step line's memory is the rank process's peak resident memory since the
  previous step line, not the ``-0.00GiB`` an empty answer gives).
* **CUDA graphs**: none on CPU; ``bimetal titan --simulate`` adds ``--training.disable_cuda_graphs``.
* **attention**: FlexAttention has no backward on CPU; ``cpu_attention.SdpaDocumentAttention`` computes the
  same causal, document-masked attention with ``scaled_dot_product_attention`` and a dense mask.
* **assets**: the tokenizer and the ``c4_test`` dataset live in torchtitan's source tree, not its wheel;
  ``write_assets`` generates a small byte-level BPE tokenizer and a JSON dataset from the Shakespeare text
  bimetal ships.
* **PREMUL_SUM**: FSDP2 reduce-scatters with ``ReduceOp.PREMUL_SUM`` when it divides gradients; Gloo has
  no such op, so FSDP is told to divide after a plain SUM (the same arithmetic).

The two torch APIs torchtitan 0.3.0 calls that are newer than torch 2.13 are not CPU matters (a GPU user on
torch 2.13 needs them too): they are adapted in ``_torch_compat``, only where torch lacks them.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

_installed = False


def install(model_module: str = "llama3") -> None:
    """Install every stand-in (idempotent) and import torchtitan's trainer and ``model_module`` under them."""
    global _installed
    if _installed:
        return
    with _no_triton():
        _cpu_device_type()
        import torchtitan.experiments  # noqa: F401
        import torchtitan.trainer  # noqa: F401

        for name in (f"torchtitan.models.{model_module}.config_registry", f"{model_module}.config_registry",
                     model_module):
            try:
                importlib.import_module(name)
                break
            except ImportError:
                continue
    _installed = True


@contextlib.contextmanager
def _no_triton() -> Iterator[None]:
    """torchtitan imports Triton kernels (fused ops, MoE dispatch) at import time; none run on CPU.

    While torchtitan's modules are imported, ``triton`` is a placeholder whose kernels raise when launched;
    it leaves ``sys.modules`` afterwards so torch never takes it for a real Triton.
    """
    if importlib.util.find_spec("triton") is not None:
        yield
        return
    # torch's own modules probe for Triton at import: import them first, while it is truly absent.
    import torch._dynamo  # noqa: F401
    import torch._dynamo.repro.after_dynamo  # noqa: F401
    import torch._inductor.codecache  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    import torch._inductor.utils  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    class _Kernel:
        def __init__(self, fn: Any) -> None:
            self.fn = fn

        def __getitem__(self, grid: Any) -> Any:
            return self

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"Triton kernel {self.fn.__name__} cannot run on this CPU-only machine")

    def jit(fn: Any = None, **_: Any) -> Any:
        return _Kernel(fn) if fn is not None else (lambda f: _Kernel(f))

    class _Placeholder:
        """Stands for any triton name used in kernel signatures (``tl.pointer_type(tl.int64)``)."""

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return self

        def __getitem__(self, key: Any) -> Any:
            return self

        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return self

    def _missing(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()

    triton = types.ModuleType("triton")
    language = types.ModuleType("triton.language")
    language.constexpr = type("constexpr", (), {})  # type: ignore[attr-defined]
    language.__getattr__ = _missing  # type: ignore[method-assign]
    triton.jit = jit  # type: ignore[attr-defined]
    triton.autotune = lambda *a, **k: (lambda f: f)  # type: ignore[attr-defined]
    triton.language = language  # type: ignore[attr-defined]
    triton.__getattr__ = _missing  # type: ignore[method-assign]
    sys.modules["triton"], sys.modules["triton.language"] = triton, language
    try:
        yield
    finally:
        sys.modules.pop("triton", None)
        sys.modules.pop("triton.language", None)


def _cpu_device_type() -> None:
    import torch._utils as tu

    original = tu._get_available_device_type
    tu._get_available_device_type = lambda: "cpu"
    try:
        import torchtitan.tools.utils as tt_utils  # reads the device type once, at import
    finally:
        tu._get_available_device_type = original
    tt_utils.device_module = _cpu_device_module()  # before any other torchtitan module copies it


def _cpu_device_module() -> types.ModuleType:
    """``torch.cpu`` plus the memory-monitor calls torchtitan makes on its device module (CPU answers)."""
    import psutil

    module = types.ModuleType("bimetal_cpu_device")
    for name in ("device_count", "set_device", "synchronize", "is_available"):
        setattr(module, name, getattr(torch.cpu, name))
    # an index, not "cpu": torchtitan passes it to barrier(device_ids=[...])
    module.current_device = lambda: 0  # type: ignore[attr-defined]
    props = types.SimpleNamespace(name="cpu", total_memory=psutil.virtual_memory().total)
    module.get_device_name = lambda device=None: "cpu"  # type: ignore[attr-defined]
    module.get_device_properties = lambda device=None: props  # type: ignore[attr-defined]
    module.memory_stats = lambda device=None: _process_memory_stats()  # type: ignore[attr-defined]
    module.reset_peak_memory_stats = lambda device=None: _reset_peak_rss()  # type: ignore[attr-defined]
    module.empty_cache = lambda: None  # type: ignore[attr-defined]
    return module


def _process_memory_stats() -> dict[str, int]:
    """The step line's memory figures on CPU: this rank process's peak resident memory since the last reset
    (Linux ``VmHWM``), as both the "active" and the "reserved" peak; {} where the kernel does not say (torchtitan
    then prints its -1 placeholder)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return {}
    peak = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:")), None)
    if peak is None:
        return {}
    return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak, "num_alloc_retries": 0, "num_ooms": 0}


def _reset_peak_rss() -> None:
    """Start a new peak (torchtitan resets after each step line): writing 5 to ``clear_refs`` sets ``VmHWM`` to the
    current resident size (Linux >= 4.0); where that is refused the peak runs from the process's start."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def sdpa_attention_config() -> Any:
    """The config of the SDPA stand-in for torchtitan's inner attention (``cpu_attention``: one class, defined
    once, so ``torch.compile`` sees the same module class in every layer)."""
    from bimetal.integrations.torchtitan.cpu_attention import SdpaDocumentAttention

    return SdpaDocumentAttention.Config()


BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def write_assets(folder: str | Path, vocab_size: int = 512, documents: int = 400) -> tuple[Path, Path]:
    """Generate a byte-level BPE tokenizer and a ``c4_test``-shaped JSON dataset; (tokenizer dir, dataset dir).

    The text is bimetal's bundled Shakespeare, one document per paragraph; nothing is downloaded.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = Path(folder)
    tok_dir, data_dir = folder / "tokenizer", folder / "c4_test"
    if (tok_dir / "tokenizer.json").exists() and (data_dir / "train.json").exists():
        return tok_dir, data_dir
    text = (Path(__file__).resolve().parents[2] / "data" / "tinyshakespeare.txt").read_text()
    docs = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 40][:documents]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer)
    tok_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS,
                                                               "add_bos_token": True, "add_eos_token": True}))
    with open(data_dir / "train.json.tmp", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    os.replace(data_dir / "train.json.tmp", data_dir / "train.json")
    return tok_dir, data_dir


def sum_reduction_for_fsdp(model_parts: list[torch.nn.Module]) -> int:
    """Make FSDP reduce-scatter with SUM and divide itself (Gloo has no PREMUL_SUM); returns modules changed."""
    from torch.distributed.fsdp import FSDPModule

    changed = 0
    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
                changed += 1
    return changed


def use_sdpa_attention(model_config: Any) -> None:
    """Swap the inner attention of every layer of a torchtitan decoder config for the SDPA stand-in."""
    for layer in model_config.layers:
        attention = getattr(layer, "attention", None)
        if attention is not None and hasattr(attention, "inner_attention"):
            attention.inner_attention = sdpa_attention_config()
