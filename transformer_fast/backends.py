"""Backend registry and selection (DESIGN section 3).

A backend is one implementation family: ``reference`` (naive PyTorch), ``torch`` (PyTorch's own
best path), ``triton`` (kernels/), ``cuda`` (csrc/*.cu) and ``cpu`` (csrc/*.cpp).  Every backend
answers ``not_supported_reasons(op, inputs)``; an empty list means it can run those inputs.

Selection, first match wins: the ``backend=`` keyword of a functional op, the innermost
``use_backend(...)`` context, the ``TRANSFORMER_FAST_BACKEND`` environment variable, ``"auto"``.
``auto`` walks ``AUTO_ORDER`` for the inputs' device and takes the first backend that supports
them; it never lands on ``reference`` on a GPU.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import os
import sys
import threading
from typing import Callable, Mapping

import torch

BACKENDS = ("reference", "torch", "triton", "cuda", "cpu")
ENV_VAR = "TRANSFORMER_FAST_BACKEND"

# Preference order per device type and op for backend="auto".  Fastest first, as measured in
# benchmarks/results/ (see benchmarks/NOTES.md); until an op has a GPU measurement, the fused
# kernels come first on CUDA and torch is the fallback.  "reference" is never in these lists.
AUTO_ORDER: dict[str, dict[str, tuple[str, ...]]] = {
    "cuda": {
        "add_layer_norm": ("cuda", "triton", "torch"),
        # Measured on an H200 (results/NVIDIA_H200/2026-11-26-e7e8f21, bf16 B16 H16 L1024 D128):
        # torch's SDPA 603 TFLOP/s forward, triton 394 (0.65x; 0.47x forward+backward), cuda
        # 67 (NOTES.md): torch first until the fused kernels measure faster.
        "scaled_dot_product_attention": ("torch", "triton", "cuda"),
        "attention_with_kv_cache": ("triton", "cuda", "torch"),  # cuda: tested on GPUs, never timed
        "masked_softmax": ("triton", "cuda", "torch"),  # cuda: never run on a GPU yet (NOTES.md)
        # Measured on an H100 (results/NVIDIA_H100_80GB_HBM3/2026-11-26-2ce2d4a, bf16): forward
        # +backward torch 1.0, cuda 0.80-0.97x, triton 0.25-0.65x (cuda's forward alone is
        # 1.22-1.28x without dropout): torch first until a fused backend measures faster in
        # training (NOTES.md, third GPU run).
        "feed_forward": ("torch", "cuda", "triton"),
        "linear_bias_act": ("torch", "cuda", "triton"),
    },
    "cpu": {
        "add_layer_norm": ("cpu", "torch"),
        # C++ cpu attention measured 1.9-10x slower than torch's SDPA (benchmarks/NOTES.md).
        "scaled_dot_product_attention": ("torch", "cpu"),
        "attention_with_kv_cache": ("cpu", "torch"),  # decode steps 1.8-13x torch, 1 thread (NOTES.md)
        "masked_softmax": ("cpu", "torch"),  # cpu measured 2-10x faster than torch (NOTES.md)
        # C++ cpu, with its fp32 forward GEMMs on oneDNN on a Zen 5 EPYC (MKL runs AVX2 code
        # there): 1.07-1.62x torch eager forward and 0.99-1.17x forward+backward without dropout,
        # 1.95-2.2x / 1.14-1.26x with gelu + dropout 0.1; on an Intel Xeon and a Zen 4 EPYC (MKL
        # for every GEMM, as torch) 0.96-1.04x without dropout, 1.16-1.36x forward+backward with
        # gelu + dropout 0.1 (benchmarks/NOTES.md, FFN).
        "feed_forward": ("cpu", "torch"),
        "linear_bias_act": ("cpu", "torch"),
    },
}
_DEFAULT_ORDER = ("torch",)


def _sdpa_measured_kernel_case(inputs: Mapping[str, object]) -> bool:
    """16-bit query, head dim <= 128, no dropout: where the GPU runs compared triton with torch."""
    q = inputs.get("query")
    return (isinstance(q, torch.Tensor) and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] <= 128 and not inputs.get("dropout_p"))


def _is_bool_tensor(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.bool


def _sdpa_bool_mask_16bit(inputs: Mapping[str, object]) -> bool:
    return _sdpa_measured_kernel_case(inputs) and _is_bool_tensor(inputs.get("attn_mask"))


def _sdpa_key_padding_16bit_long(inputs: Mapping[str, object]) -> bool:
    q, k = inputs.get("query"), inputs.get("key")
    return (_sdpa_measured_kernel_case(inputs) and isinstance(k, torch.Tensor)
            and q.shape[-2] >= 1024 and k.shape[-2] >= 1024
            and _is_bool_tensor(inputs.get("key_padding_mask"))
            and inputs.get("attn_mask") is None and not inputs.get("is_causal"))


def _on_hopper(t: object) -> bool:
    """A CUDA tensor on a compute capability 9.0 GPU (where the cuda backend runs its sm_90a
    wgmma attention kernels).  False while torch.compile traces: the device query is not one
    to put in front of dynamo, and the traced order stays the table's."""
    return (isinstance(t, torch.Tensor) and t.is_cuda and not torch.compiler.is_compiling()
            and torch.cuda.get_device_capability(t.device) == (9, 0))


def _sdpa_key_padding_16bit_short_inference(inputs: Mapping[str, object]) -> bool:
    q, k = inputs.get("query"), inputs.get("key")
    return (_sdpa_measured_kernel_case(inputs) and isinstance(k, torch.Tensor)
            and (q.shape[-2] < 1024 or k.shape[-2] < 1024)
            and _is_bool_tensor(inputs.get("key_padding_mask"))
            and inputs.get("attn_mask") is None and not inputs_need_grad(inputs) and _on_hopper(q))


def inputs_need_grad(inputs: Mapping[str, object]) -> bool:
    """Whether autograd will record the call: grad mode on and a tensor input requires grad."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in inputs.values())


def _relu_inference(inputs: Mapping[str, object]) -> bool:
    """A relu FFN / linear without dropout whose result needs no gradient (inference)."""
    return (inputs.get("activation") == "relu" and not inputs.get("dropout_p")
            and not inputs_need_grad(inputs))


# The cpu backend's attention keeps the scores in memory, with dropout or 16-bit inputs, up to
# this many elements per call (B * H * Lq * Lk: 256 MB of fp32 probabilities, two such tensors
# saved for backward); larger calls run its flash kernel, whose memory is linear in the lengths
# (and which is slower than torch's SDPA on the CPU in forward+backward).  Without a gradient to
# take, the flash kernel's forward is the faster one from ~1024 keys.
CPU_ATTENTION_SCORES_IN_MEMORY = 1 << 26
CPU_ATTENTION_FLASH_FORWARD_KEYS = 1024
# bf16 SDPA without dropout goes to the cpu backend (`auto`) up to this many keys: torch's bf16
# CPU SDPA is as fast from 512 (cpu-AMD_EPYC/2026-12-02-3a90c1a-quick).
CPU_ATTENTION_BF16_KEYS = 256


def cpu_attention_in_memory(q: torch.Tensor, k: torch.Tensor, dropout_p: float, needs_grad: bool) -> bool:
    """Whether the cpu backend's attention keeps the scores of q (..., H, Lq, D) against k
    (..., Lk, D) in memory: with dropout, or 16-bit inputs (fp32 without dropout keeps the flash
    kernel, exact in double where this path saves fp32 probabilities), where they fit.  Without
    dropout, symbolic sizes (a traced call) keep the flash kernel: each size comparison would be
    a guard that an exported model's dynamic batch or length is specialised by."""
    if not dropout_p and (q.dtype not in (torch.float16, torch.bfloat16)
                          or not all(type(n) is int for n in (*q.shape, k.shape[-2]))):
        return False
    keys = k.shape[-2]
    return (q.shape[:-1].numel() * keys <= CPU_ATTENTION_SCORES_IN_MEMORY
            and (needs_grad or keys < CPU_ATTENTION_FLASH_FORWARD_KEYS))


def _sdpa_cpu_in_memory(inputs: Mapping[str, object]) -> bool:
    """SDPA where the cpu backend beats torch's on the CPU (benchmarks/NOTES.md, "The cpu
    backend's attention with dropout", "Exact scores for the cpu attention in memory"): with
    dropout, forward+backward with the scores in memory or a forward alone (either of its
    paths); without, 16-bit forward+backward with them in memory: float16 (4-7x torch's SDPA)
    and bfloat16 up to CPU_ATTENTION_BF16_KEYS keys (1.1-2.2x; 0.76-1.02x at 512).  A 16-bit
    forward alone stays on torch: bfloat16's measured 0.65-1.17x, and a layer's inference call
    runs the flash kernel in its C++ op (modules/_native.py), 0.76-1.0x torch's in float16."""
    q, k = inputs.get("query"), inputs.get("key")
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() >= 2):
        return False
    grad = inputs_need_grad(inputs)
    dropout_p = inputs.get("dropout_p") or 0.0
    if dropout_p:
        return not grad or cpu_attention_in_memory(q, k, dropout_p, True)
    # (the key count compared only where the sizes are concrete: cpu_attention_in_memory)
    return (grad and cpu_attention_in_memory(q, k, 0.0, True)
            and (q.dtype != torch.bfloat16 or k.shape[-2] <= CPU_ATTENTION_BF16_KEYS))


def _kv_cache_many_rows(inputs: Mapping[str, object]) -> bool:
    """A KV-cache call with 64 or more query rows per key head (Lq * H / Hkv: a prefill
    chunk), where torch's GEMMs beat the CPU decode kernel."""
    q, k = inputs.get("q"), inputs.get("k_cache")
    return (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == 4
            and k.dim() == 4 and k.shape[1] > 0 and q.shape[2] * (q.shape[1] // k.shape[1]) >= 64)


# Orders for particular inputs, checked before AUTO_ORDER: (device type, op) -> [(applies, order)].
# A bool attn_mask takes SDPA off its flash kernel: the triton kernels measured faster there in
# both GPU runs that timed it (bf16, head dim 128, no dropout; results/NVIDIA_H200/2026-11-26-f9d721d
# and NVIDIA_H100_80GB_HBM3/2026-11-26-2ce2d4a at L 1024 / 4096: forward 1.36-1.66x torch,
# forward+backward 1.02-1.19x).  Only where measured: 16-bit inputs, head dims up to 128, no
# dropout.  A bool key_padding_mask alone (no attn_mask, not causal) measured mixed in run 3
# (0.47-1.52x) and faster everywhere in H100 run 5 (NVIDIA_H100_80GB_HBM3/2026-11-27-b432605, since
# the triton kernels skip the padded key ranges; bf16 D 128, B16 H16 L1024 / B4 H16 L4096: forward
# 1.26x / 1.59x, forward+backward 1.60x / 1.65x): triton first there, at the measured lengths
# (Lq, Lk >= 1024) only.  The FFN in inference with relu and no dropout goes to cuda: its
# forward is two cuBLASLt GEMMs with bias (+ relu) epilogues, against torch's addmm, relu,
# addmm, and measured 1.22x / 1.28x torch's forward (H100 run 3, NVIDIA_H100_80GB_HBM3/
# 2026-11-26-2ce2d4a, bf16 512 / 2048 at M 4096 / 16384); training keeps torch first, where
# cuda's backward was slower.  On the CPU a KV-cache call with 64 or more query rows per key head
# (a prefill chunk) goes to torch: from there the cpu kernel measured 0.54-0.99x torch in 6 of 8
# cases (benchmarks/cpu_kv_cache_prefill.py; results/cpu-Intel_Xeon_Processor/2026-11-29-34cdb84),
# while decoding steps run 1.8-13x torch.  In inference on a Hopper GPU, a bool key_padding_mask
# (alone or with is_causal) at shorter lengths goes to cuda, whose wgmma kernels read the mask
# themselves where the torch path builds a dense mask for SDPA's masked kernels.  `auto` and
# `cuda` differed only in that op's backend there (add_layer_norm and the relu FFN in inference
# were already cuda's): an encoder layer (bf16, B 64, L 128, eval) measured 0.147 ms on cuda
# against 0.292 on auto, and the base Seq2SeqTransformer's forward (S = T = 128) 2.84 against
# 5.48 ms (H200 run, results/NVIDIA_H200/2026-11-29-6ee7f14, results_call2.md).  On the CPU,
# SDPA with dropout goes to cpu, whose materialising path (GEMMs + the fused masked_softmax
# kernel) measured faster than torch's SDPA, which runs its math path with dropout
# (benchmarks/NOTES.md, "The cpu backend's attention with dropout"), and so do 16-bit calls
# without dropout where that path measured faster (_sdpa_cpu_in_memory).
# Everything else keeps AUTO_ORDER (torch first).
AUTO_RULES: dict[tuple[str, str], list] = {
    ("cuda", "scaled_dot_product_attention"): [
        (_sdpa_bool_mask_16bit, ("triton", "torch", "cuda")),
        (_sdpa_key_padding_16bit_long, ("triton", "torch", "cuda")),
        (_sdpa_key_padding_16bit_short_inference, ("cuda", "torch", "triton")),
    ],
    ("cuda", "feed_forward"): [(_relu_inference, ("cuda", "torch", "triton"))],
    ("cuda", "linear_bias_act"): [(_relu_inference, ("cuda", "torch", "triton"))],
    ("cpu", "attention_with_kv_cache"): [(_kv_cache_many_rows, ("torch", "cpu"))],
    ("cpu", "scaled_dot_product_attention"): [(_sdpa_cpu_in_memory, ("cpu", "torch"))],
}


class _Selection(threading.local):
    """The stack of enclosing use_backend(...) names, per thread (as torch.no_grad is).

    A thread-local object rather than a contextvars.ContextVar because torch.compile can both
    guard on it and mutate it (torch 2.11 and 2.14): a compiled function re-traces when the
    selection it was traced under changes, and ``with use_backend(...)`` works inside a
    compiled region. Dynamo cannot set a ContextVar, and torch 2.11's cannot read one."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        # The selection (innermost name, or None) of this thread's last forward with grad
        # enabled, for activation checkpointing's recomputation (_ambient_backend).
        self.forward: str | None | object = _UNSET


_UNSET = object()
_selection = _Selection()
# Any thread's last forward selection (CUDA's backward, recomputation included, runs on the
# autograd engine's device thread, which has no selection of its own), and whether use_backend
# was ever entered: until then none of this is recorded or read.
_last_forward: list = [_UNSET]
_contexts_used = False


class BackendError(ValueError, RuntimeError):
    """An explicitly requested backend cannot run the given inputs.

    A ValueError: the inputs are bad for that backend (DESIGN section 9)."""


# --------------------------------------------------------------------------------------------
# What is installed


# Computed once, eagerly at import (transformer_fast/__init__.py), so that backend selection
# traced by torch.compile reads plain values instead of importing modules.
_STATUS: dict[str, tuple[bool, str]] = {}


def extension_status() -> tuple[bool, str]:
    """(loaded, reason): whether transformer_fast._C imported (it registers the C++/CUDA ops)."""
    if "ext" not in _STATUS:
        try:
            importlib.import_module("transformer_fast._C")
            _STATUS["ext"] = (True, "loaded")
        except Exception as exc:  # ImportError, or an undefined-symbol OSError (ABI mismatch)
            _STATUS["ext"] = (False, f"transformer_fast._C is not built or failed to load ({exc})")
        has_cuda = _STATUS["ext"][0] and cxx_op_has_kernel("add_layer_norm_fwd", "CUDA")
        _STATUS["ext_cuda"] = (
            (True, "CUDA kernels compiled in")
            if has_cuda
            else (False, "transformer_fast._C was built without its CUDA kernels")
        )
    return _STATUS["ext"]


def extension_cuda_status() -> tuple[bool, str]:
    """Whether _C holds the CUDA kernels (it is built without them where nvcc is missing)."""
    extension_status()
    return _STATUS["ext_cuda"]


def triton_status() -> tuple[bool, str]:
    """Whether Triton is installed (found without importing it: the kernels import it)."""
    if "triton" not in _STATUS:
        try:
            spec = importlib.util.find_spec("triton")
        except (ImportError, ValueError):  # a broken or blocked installation
            spec = None
        if spec is None:
            _STATUS["triton"] = (False, "triton is not installed")
        else:
            _STATUS["triton"] = (True, f"triton {importlib.metadata.version('triton')}")
    return _STATUS["triton"]


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _triton_mode_reason() -> str | None:
    """Triton fixes its mode when it is imported (its own @triton.jit library functions are
    then compiled or interpreted for good): TRITON_INTERPRET changed after that cannot take
    effect, and the kernels would fail inside Triton."""
    standard = sys.modules.get("triton.language.standard")
    fn = getattr(standard, "_sum_combine", None)
    if fn is None:  # not imported yet (it will follow the variable), or another Triton layout
        return None
    imported_interpreting = type(fn).__name__ == "InterpretedFunction"
    if imported_interpreting == triton_interpreting():
        return None
    return (f"TRITON_INTERPRET was {'set' if triton_interpreting() else 'unset'} after Triton was imported "
            f"(imported {'with' if imported_interpreting else 'without'} it; Triton reads it once): set it "
            "before importing torch / transformer_fast")


def cxx_op_has_kernel(qualname: str, dispatch_key: str) -> bool:
    """Whether the C++ op ``transformer_fast_C::<qualname>`` has a kernel for CPU or CUDA."""
    full = f"transformer_fast_C::{qualname}"
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(full, dispatch_key)
    except RuntimeError:
        return False


# --------------------------------------------------------------------------------------------
# Registry: which backends implement which op, and their per-input checks

# op -> backend -> check(inputs) -> list of reasons (empty = supported)
Check = Callable[[Mapping[str, object]], list]
_SUPPORT: dict[str, dict[str, Check]] = {}


def register(op: str, backend: str, check: Check | None = None) -> None:
    """Declare that ``backend`` implements ``op``; ``check`` adds op-specific reasons."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    _SUPPORT.setdefault(op, {})[backend] = check or (lambda inputs: [])


def _device_type(inputs: Mapping[str, object]) -> str:
    for v in inputs.values():
        if isinstance(v, torch.Tensor):
            return v.device.type
    return "cpu"


def _backend_reasons(backend: str, device_type: str) -> list[str]:
    """Reasons independent of the op: is the backend installed and does it run on this device."""
    if backend in ("reference", "torch"):
        return []
    if backend == "triton":
        ok, why = triton_status()
        if not ok:
            return [why]
        mode = _triton_mode_reason()
        if mode is not None:
            return [mode]
        if device_type == "cuda":
            return []
        if device_type == "cpu" and triton_interpreting():
            return []
        return [f"triton runs on CUDA tensors (CPU tensors only under TRITON_INTERPRET=1); got {device_type}"]
    if backend == "cuda":
        if device_type != "cuda":
            return [f"the cuda backend runs on CUDA tensors; got {device_type}"]
        ok, why = extension_status()
        if ok:
            ok, why = extension_cuda_status()
        return [] if ok else [why]
    if backend == "cpu":
        if device_type != "cpu":
            return [f"the cpu backend runs on CPU tensors; got {device_type}"]
        ok, why = extension_status()
        return [] if ok else [why]
    return [f"unknown backend {backend!r}"]


def not_supported_reasons(backend: str, op: str, inputs: Mapping[str, object]) -> list[str]:
    """Why ``backend`` cannot run ``op`` on ``inputs`` (empty list: it can)."""
    if backend not in BACKENDS:
        return [f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}"]
    if not isinstance(inputs, Mapping):
        return [f"inputs must be a mapping of the op's argument names to values; got {type(inputs).__name__}"]
    device_type = _device_type(inputs)
    reasons = _backend_reasons(backend, device_type)
    if reasons:
        return reasons
    checks = _SUPPORT.get(op, {})
    if backend not in checks:
        return [f"{op} has no {backend} implementation yet"]
    if backend not in ("reference", "torch"):
        # The kernels read strided memory: a NestedTensor (or a sparse tensor) goes to torch's ops.
        odd = sorted({name for name, t in inputs.items() if isinstance(t, torch.Tensor)
                      and (t.is_nested or t.layout is not torch.strided)})
        if odd:
            return [f"{backend} takes strided tensors only; {', '.join(odd)} is nested or sparse"]
        if _transformed():
            return [f"{backend} has no rules for torch.func's differentiating transforms or forward-mode "
                    "AD (grad, vjp, jvp, also under vmap, gave wrong or no results): torch and reference "
                    "run them"]
        if onnx_exporting():
            return [f"{backend}'s kernels are not ONNX operators: under torch.onnx.export the torch and "
                    "reference backends record torch's own ops"]
    try:
        return list(checks[backend](inputs))
    except KeyError as exc:  # a partial mapping (the ops pass every input; a caller may not)
        return [f"{op} on {backend}: inputs has no {exc.args[0]!r}, which its checks need"]
    except (AttributeError, IndexError, TypeError, ValueError) as exc:
        # Inputs the op itself would reject (a non-tensor, a 1-D query): the answer is still a
        # list, the op's own checks name the argument when it is called.
        return [f"{op} on {backend}: the inputs are malformed ({type(exc).__name__}: {exc}); "
                "the op's checks say which"]


def onnx_exporting() -> bool:
    """Inside ``torch.onnx.export`` (either exporter): the graph must hold ONNX-translatable ops,
    which our kernels' custom ops are not, so ``auto`` takes ``torch`` (as torch.nn's modules,
    whose exports then match).  Not while dynamo traces (torch.compile, strict export: it would
    bake the answer in); torch.onnx first exports non-strict, which runs this Python."""
    if torch.compiler.is_dynamo_compiling():
        return False
    onnx = sys.modules.get("torch.onnx")  # not imported: nobody exports (and no import cost here)
    return onnx is not None and onnx.is_in_onnx_export()


def forward_ad_active() -> bool:
    """Inside ``torch.autograd.forward_ad.dual_level()``: the fused ops have no jvp formula."""
    return torch.autograd.forward_ad._current_level >= 0


def _transformed() -> bool:
    """A torch.func transform that differentiates (grad, vjp, jvp, jacrev, ..., also inside a
    vmap) or a forward-mode AD level is active.  The fused ops' autograd formulas do not hold
    there (vjp's recorded backward and jacrev gave zeros, forward-mode dropped the tangent, vmap
    of grad failed inside), so calls go to torch's ops.  vmap alone runs the ops (through the
    custom op).  (Not while torch.compile traces: it handles the ops itself.)"""
    if torch.compiler.is_compiling():
        return False
    if forward_ad_active():
        return True
    if not torch._C._are_functorch_transforms_active():
        return False
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return any(i.key() != torch._C._functorch.TransformType.Vmap for i in retrieve_all_functorch_interpreters())


def available(backend: str, device_type: str = "cpu") -> tuple[bool, str]:
    """Whether ``backend`` can run on this installation and device type, with the reason."""
    reasons = _backend_reasons(backend, device_type)
    return (not reasons, "; ".join(reasons) if reasons else "available")


def implemented_backends(op: str) -> tuple[str, ...]:
    return tuple(b for b in BACKENDS if b in _SUPPORT.get(op, {}))


# --------------------------------------------------------------------------------------------
# Selection


class use_backend(contextlib.ContextDecorator):  # noqa: N801 (used as a function, like torch.no_grad)
    """Run the enclosed functional ops (and the modules' fused calls) on ``name`` (or "auto")
    unless a call names its own; a context manager or a decorator, reusable like torch.no_grad.
    The name is checked when the object is made."""

    def __init__(self, name: str):
        _validate_name(name, "use_backend")
        self.name = name

    def __enter__(self):
        global _contexts_used
        if not _contexts_used:
            _contexts_used = True
        _selection.stack.append(self.name)
        return self

    def __exit__(self, *exc_info):
        _selection.stack.pop()
        return False


def _validate_name(name: object, where: str) -> None:
    if not isinstance(name, str) or (name != "auto" and name not in BACKENDS):
        raise ValueError(
            f"{where}: backend must be one of {', '.join(('auto',) + BACKENDS)}; got {name!r}"
        )


def requested_backend(backend: str | None = None) -> str:
    if backend is not None:
        _validate_name(backend, "backend")
        return backend
    return _ambient_backend()


# The environment as a dict of bytes that torch.compile guards on (os.environ's own mapping
# methods it reads without a guard, so a compiled function would keep the backend it was traced
# with after TRANSFORMER_FAST_BACKEND changed). While the variable is unset the guard is on the
# number of variables, so setting any variable re-traces once; CPython keeps os.environ._data
# on every platform, and without it the variable is read unguarded.
_ENVIRON_BYTES = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey(ENV_VAR) if _ENVIRON_BYTES is not None else None


def _env_backend() -> str | None:
    if _ENVIRON_BYTES is None:
        return os.environ.get(ENV_VAR)
    if _ENV_KEY not in _ENVIRON_BYTES:
        return None
    return os.environ.decodevalue(_ENVIRON_BYTES[_ENV_KEY])


def _ambient_backend() -> str:
    """The innermost use_backend(...), else TRANSFORMER_FAST_BACKEND, else "auto".

    Inside backward, a thread with no use_backend block of its own takes the selection of the
    last forward run with grad: a forward there is activation checkpointing's recomputation,
    which torch.utils.checkpoint runs with the forward's grad mode, autocast and RNG state but
    not ours, after the block (backward called outside it) or on CUDA's autograd device thread;
    another selection would draw other dropout masks or save other tensors than the forward."""
    stack = _selection.stack
    if _contexts_used and not torch.compiler.is_compiling():
        if torch._C._current_graph_task_id() == -1:
            if torch.is_grad_enabled():
                _selection.forward = _last_forward[0] = stack[-1] if stack else None
        elif not stack:
            recorded = _selection.forward if _selection.forward is not _UNSET else _last_forward[0]
            if recorded is not _UNSET and recorded is not None:
                return recorded
    if stack:
        return stack[-1]
    env = _env_backend()
    if env:
        _validate_name(env, ENV_VAR)
        return env
    return "auto"


def auto_order(op: str, device_type: str, inputs: Mapping[str, object] | None = None) -> tuple[str, ...]:
    """The order ``auto`` tries backends in for ``op`` on ``device_type`` (and ``inputs``)."""
    for applies, order in AUTO_RULES.get((device_type, op), ()):
        if inputs is not None and applies(inputs):
            return order
    return AUTO_ORDER.get(device_type, {}).get(op, _DEFAULT_ORDER)


class _Recording(threading.local):
    def __init__(self) -> None:
        self.lists: list[list] = []


_recording = _Recording()


@contextlib.contextmanager
def recording_resolutions():
    """Collect ``(op, backend)`` for every ``resolve`` inside, in call order (the modules'
    replayed calls, transformer_fast.modules._lane, reuse them).  Nested recordings (a layer's
    and its attention module's) each get every resolution inside them.  Not while torch.compile
    or torch.export traces: traced calls are never replayed, and strict export warned of the
    thread-local list's append / pop as a side effect of the model's forward."""
    names: list = []
    if torch.compiler.is_compiling():
        yield names
        return
    _recording.lists.append(names)
    try:
        yield names
    finally:
        _recording.lists.pop()


@contextlib.contextmanager
def recording_suspended():
    """Inside, no recording is open: for code a layer calls that is not its own (a callable
    activation that may call our modules or ops).  Its resolutions then belong to no enclosing
    record, as they belong to no enclosing replay: the code runs the same way in both (a module
    in it replays its own calls), so a layer's replay does not go out of step with its record."""
    saved = _recording.lists
    _recording.lists = []
    try:
        yield
    finally:
        _recording.lists = saved


def recording() -> bool:
    """Whether a recording_resolutions is open (on this thread)."""
    return bool(_recording.lists)


def resolve(op: str, backend: str | None, inputs: Mapping[str, object]) -> str:
    """The concrete backend that will run ``op`` on ``inputs``."""
    name = _resolve(op, backend, inputs)
    for names in _recording.lists:
        names.append((op, name))
    return name


def _resolve(op: str, backend: str | None, inputs: Mapping[str, object]) -> str:
    name = requested_backend(backend)
    if name != "auto":
        reasons = not_supported_reasons(name, op, inputs)
        if reasons:
            supported = [b for b in BACKENDS if not not_supported_reasons(b, op, inputs)]
            raise BackendError(
                f"{op}: backend {name!r} cannot run these inputs: "
                + "; ".join(reasons)
                + f". Backends that can: {', '.join(supported) or 'none'}"
            )
        return name
    device_type = _device_type(inputs)
    collected = []
    for candidate in auto_order(op, device_type, inputs):
        reasons = not_supported_reasons(candidate, op, inputs)
        if not reasons:
            return candidate
        collected.append(f"{candidate}: {'; '.join(reasons)}")
    raise BackendError(f"{op}: no backend supports these inputs ({' | '.join(collected)})")

