"""torch.nn's input rules for the Transformer modules, in one place.

The modules must accept exactly what torch's accept and reject what torch's reject.  torch
raises AssertionError / RuntimeError for malformed inputs; our project contract (DESIGN section 9)
is ValueError / TypeError naming the argument.  The error classes below are both at once, so
code written against either convention keeps working, and of torch's class for the same input:
AssertionError alone where torch's Python path asserts, RuntimeError alone where it raises one,
both where torch's inference fast path (RuntimeError) or its Python path may run.

Mask polarity: torch.nn's masks say True = NOT allowed (bool attn_mask) and True = padding (bool
key_padding_mask); float masks are added.  The functional ops take SDPA polarity for attn_mask
(True = takes part), so the modules invert bool attention masks once, here.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F

from .. import backends


class InputError(ValueError, AssertionError, RuntimeError):
    """A malformed module input (torch raises AssertionError for these on its slow path and
    RuntimeError on its inference fast path, so it is both where either may run)."""


class InputAssertionError(ValueError, AssertionError):
    """An InputError where torch surely runs its slow path (training, batch_first=False, ...):
    an AssertionError and not a RuntimeError, as torch's there."""


class InputRuntimeError(ValueError, RuntimeError):
    """A malformed module input (torch raises RuntimeError for these)."""


class LayerInputError(ValueError, AssertionError, RuntimeError):
    """A layer input of the wrong rank or width: torch raises AssertionError or RuntimeError
    depending on which of its ops meets it first (MHA's check, layer_norm, a matmul)."""


# What a layer's arguments are to each of its attentions, for messages raised inside them.
ENCODER_SELF_ATTENTION = ("self-attention: src_mask is its attn_mask, src_key_padding_mask its "
                          "key_padding_mask, is_causal its is_causal")
DECODER_SELF_ATTENTION = ("self-attention: tgt_mask is its attn_mask, tgt_key_padding_mask its "
                          "key_padding_mask, tgt_is_causal its is_causal")
DECODER_CROSS_ATTENTION = ("cross-attention: tgt is its query, memory its key and value, memory_mask "
                           "its attn_mask, memory_key_padding_mask its key_padding_mask, "
                           "memory_is_causal its is_causal")


@contextlib.contextmanager
def layer_arguments(role: str):
    """Inside a layer's attention call, an input error (raised with the attention's argument
    names, as torch's) also says which of the layer's arguments they are (DESIGN section 9: the
    error names the argument the caller passed): ``role`` is appended in parentheses, the type
    and the start of the message stay torch's."""
    try:
        yield
    except (InputError, InputAssertionError, InputRuntimeError, LayerInputError, MaskTypeError,
            MaskRuntimeError) as exc:
        if len(exc.args) != 1 or not isinstance(exc.args[0], str) or role in exc.args[0]:
            raise
        raise type(exc)(f"{exc.args[0]} (in the layer's {role})").with_traceback(exc.__traceback__) from None


def layer_d_model(layer) -> int | None:
    """A layer's d_model: its self-attention's embed_dim, or (a wrapper in that slot, without
    one) its first linear's in_features; None when neither says (then torch's modules decide)."""
    d_model = getattr(layer.self_attn, "embed_dim", None)
    if d_model is None:
        d_model = getattr(getattr(layer, "linear1", None), "in_features", None)
    return d_model if isinstance(d_model, int) else None


def check_layer_inputs(d_model: int | None, features: str = "d_model", **tensors) -> None:
    """(L, E) or (N, L, E) / (L, N, E) tensors with E = d_model (named ``features`` in the
    message; not checked when d_model is None), checked before any kernel."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.is_nested:
            raise InputError(
                f"{name}: NestedTensor inputs are not supported by transformer_fast's layers; pass "
                "a padded tensor and a key padding mask (the kernels skip padded keys)"
            )
        if t.dim() not in (2, 3):
            raise LayerInputError(
                f"{name} must be 2-D (unbatched) or 3-D (batched); got shape {tuple(t.shape)}"
            )
        if d_model is not None and t.shape[-1] != d_model:
            raise LayerInputError(
                f"{name} must have {features}={d_model} features (last dim); got shape {tuple(t.shape)}"
            )


class MaskTypeError(TypeError, AssertionError):
    """A mask of a dtype torch rejects (neither bool nor floating point), met by its mask checks
    (``_canonical_mask``, before any fast path): AssertionError."""


class MaskRuntimeError(TypeError, RuntimeError):
    """Such a mask met first by a stack's causal-mask detection (TransformerDecoder's tgt_mask),
    where torch fails building its comparison mask in the mask's dtype: RuntimeError."""


def as_slow_path_error(exc: Exception, slow: bool) -> Exception:
    """The error torch raises for ``exc``'s input: an InputError (both AssertionError and
    RuntimeError) becomes an InputAssertionError where torch surely runs its slow path
    (``slow``); anything else as is."""
    if not (slow and isinstance(exc, InputError)):
        return exc
    return InputAssertionError(*exc.args).with_traceback(exc.__traceback__)


def check_mask_kind(mask, name: str, other=None, other_name: str = "") -> None:
    """torch's ``F._canonical_mask`` checks: bool or floating point; a mismatch of the two masks'
    dtypes is deprecated (warned) but accepted."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None; got {type(mask).__name__}")
    if mask.dtype != torch.bool and not torch.is_floating_point(mask):
        raise MaskTypeError(f"only bool and floating types of {name} are supported; got {mask.dtype}")
    if other is not None and isinstance(other, torch.Tensor) and other.dtype != mask.dtype:
        _warn_mismatched(name, other_name)


def _warn_mismatched(name: str, other_name: str) -> None:
    warnings.warn(
        f"Support for mismatched {name} and {other_name} is deprecated. Use same type for both "
        "instead.",
        stacklevel=4,
    )


def check_float_kinds(mask, name: str, other, other_name: str, dtype) -> None:
    """torch's second mask check, in F.multi_head_attention_forward after
    MultiheadAttention.forward made bool masks ``dtype`` float masks: float masks of two dtypes
    warn a second time."""
    if not (isinstance(mask, torch.Tensor) and isinstance(other, torch.Tensor)):
        return
    if (dtype if mask.dtype == torch.bool else mask.dtype) != (dtype if other.dtype == torch.bool else other.dtype):
        _warn_mismatched(name, other_name)


def to_additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """torch.nn polarity -> additive float (bool True = not allowed -> -inf), as torch's
    ``_canonical_mask``."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))


def mixed_kinds(mask, key_padding_mask) -> bool:
    """Both masks given with different dtypes: deprecated in torch, which warns and turns both
    into float masks."""
    return mask is not None and key_padding_mask is not None and mask.dtype != key_padding_mask.dtype


def canonical_pair(mask, key_padding_mask, dtype, mask_name, kpm_name):
    """Check both masks as torch does.  When their dtypes differ (deprecated in torch, which then
    turns both into float masks) both become additive, so that the layers below see one kind
    and do not warn again; otherwise they pass through unchanged (bool stays bool: cheaper)."""
    check_mask_kind(key_padding_mask, kpm_name, mask, mask_name)
    check_mask_kind(mask, mask_name)
    if mixed_kinds(mask, key_padding_mask):
        return to_additive(mask, dtype), to_additive(key_padding_mask, dtype)
    return mask, key_padding_mask


def square_subsequent_mask(sz: int, device=None, dtype=None) -> torch.Tensor:
    """torch.nn.Transformer.generate_square_subsequent_mask: -inf above the diagonal, 0 elsewhere."""
    return torch.triu(torch.full((sz, sz), float("-inf"), dtype=dtype, device=device), diagonal=1)


def seq_len(src: torch.Tensor, batch_first: bool) -> int | None:
    """torch's ``_get_seq_len``."""
    if src.is_nested:
        return None
    if src.dim() == 2:
        return src.shape[0]
    return src.shape[1 if batch_first else 0]


def detect_is_causal_mask(mask, is_causal=None, size=None, name: str = "mask") -> bool:
    """torch's ``_detect_is_causal_mask``: an explicit hint wins; with ``is_causal=None`` a mask
    equal to the square subsequent mask counts as causal.  Bool masks (True = not allowed) are
    compared with their float meaning, as torch compares them after ``_canonical_mask``.  Like
    torch this reads the mask's values (a host sync on a GPU); pass ``is_causal`` to avoid it.
    While tracing (torch.compile, export) a mask is not read: False, the mask applied as given."""
    make_causal = is_causal is True
    if is_causal is None and mask is not None:
        if torch.compiler.is_compiling():
            # Reading the mask while tracing is a data-dependent branch (fullgraph fails, as
            # torch's own stacks do in training).  The hint only lets kernels skip tiles: the
            # mask itself is still applied, so the numbers do not change.
            return False
        if mask.dtype != torch.bool and not torch.is_floating_point(mask):
            # torch builds its comparison mask in the mask's dtype before comparing shapes:
            # -inf does not fit an integer dtype (RuntimeError), whatever the mask's shape.
            raise MaskRuntimeError(f"only bool and floating types of {name} are supported; got {mask.dtype}")
        sz = size if size is not None else mask.size(-2)
        if tuple(mask.shape) != (sz, sz):
            return False
        if mask.dtype == torch.bool:
            causal = torch.ones(sz, sz, dtype=torch.bool, device=mask.device).triu_(1)
        else:
            causal = square_subsequent_mask(sz, device=mask.device, dtype=mask.dtype)
        make_causal = bool((mask == causal).all())
    return make_causal


def autocast_enabled(device_type: str) -> bool:
    """torch.is_autocast_enabled(device_type), False for a device type autocast does not know
    (meta: torch's modules run there, shapes only; torch.is_autocast_enabled("meta") raises)."""
    # (cpu / cuda answered without is_autocast_available: torch 2.11's dynamo cannot trace it)
    if device_type not in ("cpu", "cuda") and not torch.amp.is_autocast_available(device_type):
        return False
    return torch.is_autocast_enabled(device_type)


def fused_activation(activation) -> str | None:
    """The functional.feed_forward name of an activation torch's layers accept, or None when
    it is some other callable (which then runs unfused)."""
    if activation is F.relu or isinstance(activation, torch.nn.ReLU):
        return "relu"
    if activation is F.gelu:
        return "gelu"
    if isinstance(activation, torch.nn.GELU):
        return "gelu" if activation.approximate == "none" else "gelu_tanh"
    func = getattr(activation, "func", None)  # functools.partial(F.gelu, approximate="tanh")
    if func is F.gelu and not getattr(activation, "args", ()):
        approximate = activation.keywords.get("approximate", "none")
        if set(activation.keywords) <= {"approximate"} and approximate in ("none", "tanh"):
            return "gelu" if approximate == "none" else "gelu_tanh"
    return None


def activation_from_string(activation: str):
    """torch's ``_get_activation_fn``."""
    if activation == "relu":
        return F.relu
    if activation == "gelu":
        return F.gelu
    raise RuntimeError(f"activation should be relu/gelu, not {activation}")


def dropout_p(module) -> float | None:
    """The rate a torch.nn.Dropout applies now (0 in eval); None when it is not a plain Dropout
    (a replaced module is called as is, unfused)."""
    if type(module) is not torch.nn.Dropout:
        return None
    return float(module.p) if module.training else 0.0


def has_global_hooks() -> bool:
    """A module hook registered for every module (torch.nn.modules.module.register_module_*)."""
    mod = torch.nn.modules.module
    return bool(mod._global_forward_hooks or mod._global_forward_pre_hooks
                or mod._global_backward_hooks or mod._global_backward_pre_hooks)


def has_hooks(root: torch.nn.Module, global_hooks: bool = True) -> bool:
    """Any forward or backward (pre-)hook on ``root`` or below, a global module hook (unless
    ``global_hooks`` is False), or a ``forward`` set on an instance below ``root``
    (``module.forward = ...``: accelerate's hooks, ad-hoc LoRA or logging patches): the fused
    path would skip them, so the layers then call their submodules one by one (torch's fast
    path makes the same check for forward hooks)."""
    if global_hooks and has_global_hooks():
        return True
    # A plain walk: root.modules() (a generator per level, names) cost ~5% of a small layer.
    stack, seen = [root], set()
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            return True
        if m is not root and "forward" in m.__dict__:
            return True
        stack.extend(c for c in m._modules.values() if c is not None)
    return False


def backend_for(op: str) -> str | None:
    """The ``backend=`` a module passes to a functional op.

    Modules follow ``transformer_fast.use_backend`` / TRANSFORMER_FAST_BACKEND (None lets the
    functional op read them).  A layer runs several ops, and a backend need not implement all of
    them (e.g. the C++ ``cpu`` backend has add_layer_norm but no attention yet): such an op runs
    on ``auto`` instead of failing the whole layer.  An op the backend implements but cannot run
    on these inputs still raises, as an explicit choice should."""
    name = backends.requested_backend()
    if name != "auto" and name not in backends.implemented_backends(op):
        return "auto"
    return None
