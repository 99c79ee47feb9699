"""Transformer layers and stacks: torch.nn's interfaces on the fused functional ops.

TransformerEncoderLayer, TransformerDecoderLayer, TransformerEncoder, TransformerDecoder and
Transformer have torch's constructor and forward signatures, attributes, submodule names
(self_attn, multihead_attn, linear1, linear2, norm1..3, dropout*, layers.N, encoder.norm,
decoder.norm), init and state_dict.  Inside a layer:

* attention: our MultiheadAttention (one QKV GEMM viewed into the flash-attention kernel);
* residual-add + dropout + LayerNorm: one functional.add_layer_norm call.  Post-LN:
  ``add_layer_norm(sublayer_out, residual)``; pre-LN: ``add_layer_norm(..., prenorm=True)``
  returns the next sublayer's normed input and the running residual from one kernel, and the
  encoder/decoder stacks also fuse each layer's last residual-add with the NEXT layer's norm1
  (or the stack's final norm);
* FFN: functional.feed_forward when the activation is relu / gelu / tanh-gelu (F.relu, F.gelu,
  nn.ReLU, nn.GELU, "relu", "gelu"); any other callable runs unfused.

The fused path is taken when the submodules are the standard ones (nn.Linear, a 1-D LayerNorm,
nn.Dropout), no forward hooks are registered below the module and autocast is off; otherwise
the layer calls its submodules exactly as torch's slow path does.  Dropout follows each Dropout
submodule's ``p`` and ``training`` (0 in eval).

Differences from torch: see MultiheadAttention (fully masked rows -> zeros; is_causal trusted).
Where torch's encoder layer would run its inference fast path (eval, no grad, batch_first, ...),
ours reads the inputs as that path does (float masks by zero / nonzero, any float dtype; the
is_causal hint ignored without a mask; a CPU autocast's dtype out): _torch_layer_fast_path.
The encoder never converts its input to a NestedTensor (``enable_nested_tensor`` is accepted
and recorded); where torch's encoder would, ours returns torch's zeros at padded positions
(TransformerEncoder._nested_padding) and, replayed in inference, computes the valid tokens
alone (modules/_native.py, packed_encoder).

Host time: a call with a signature seen before replays the checked call's backends
(modules/_lane.py), a stack its whole chain of layers; in inference each layer then runs as one
C++ op (modules/_native.py).
"""
import copy
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.init import xavier_uniform_
from torch.nn.modules.container import ModuleList
from torch.nn.modules.dropout import Dropout
from torch.nn.modules.linear import Linear
from torch.nn.modules.module import Module

from .. import backends
from .. import functional as tf_functional
from . import _lane, _native
from . import _semantics as sem
from .activation import MultiheadAttention
from .normalization import LayerNorm

__all__ = [
    "Transformer",
    "TransformerEncoder",
    "TransformerDecoder",
    "TransformerEncoderLayer",
    "TransformerDecoderLayer",
]


def _get_clones(module, N):
    return ModuleList([copy.deepcopy(module) for _ in range(N)])


# --------------------------------------------------------------------------------------------
# Fused building blocks shared by the layers


def _norm_fusable(norm, x) -> bool:
    """A LayerNorm (ours or torch's) over x's last dimension with an eps the fused kernel takes
    (> 0; torch's layers also run eps = 0) and parameters F.layer_norm takes: in x's dtype, or
    all float32 for a 16-bit x (other mixes raise there, so the unfused blocks raise them)."""
    if type(norm) not in (LayerNorm, torch.nn.LayerNorm) or not norm.eps > 0:
        return False
    if tuple(norm.normalized_shape) != (x.shape[-1],):
        return False
    dtypes = {p.dtype for p in (norm.weight, norm.bias) if p is not None}
    return dtypes <= {x.dtype} or (
        dtypes == {torch.float32} and x.dtype in (torch.float16, torch.bfloat16))


def _add_norm(sub, residual, norm, p, prenorm=False, lane=None):
    """norm(residual + dropout_p(sub)) in one kernel (and the sum when prenorm)."""
    if lane is not None:
        return tf_functional.run_add_layer_norm(
            lane.next("add_layer_norm"), sub, residual, norm.weight, norm.bias, norm.eps, p, prenorm)
    return tf_functional.add_layer_norm(
        sub, residual, norm.weight, norm.bias, norm.eps, dropout_p=p, prenorm=prenorm,
        backend=sem.backend_for("add_layer_norm"),
    )


def _attention(mha, x, memory, mask, padding, is_causal, lane, role):
    """``mha(x, memory, memory)[0]`` without weights; a replayed call skips its checks.  The
    fused layers reach here only without hooks of the layer's own (_fusable), so its forward is
    called directly: a global module hook sees the layer's call alone, as on torch's fast path.
    ``role``: the layer's names for this attention's arguments (sem.layer_arguments)."""
    if lane is not None:
        return mha._attend(x, memory, memory, padding, False, mask, True, is_causal, lane)[0]
    with sem.layer_arguments(role):
        return mha.forward(x, memory, memory, attn_mask=mask, key_padding_mask=padding,
                           need_weights=False, is_causal=is_causal)[0]


def _layer_norm(x, norm):
    """A standalone norm (the first pre-LN norm of a stack): nothing to fuse it with."""
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def _residual_out(f, x, p, next_norm, lane=None):
    """The last residual-add of a pre-LN layer: ``x + dropout(f)``, fused with the next layer's
    norm when there is one.  Returns (x_out, normed x_out or None)."""
    if next_norm is None:
        return x + (F.dropout(f, p) if p > 0.0 else f), None
    normed, summed = _add_norm(f, x, next_norm, p, prenorm=True, lane=lane)
    return summed, normed


class _FusedFFN:
    """The FFN of a layer (linear1 -> activation -> dropout -> linear2) on functional.feed_forward,
    mixed into the layer classes."""

    def _ffn(self, x, p, lane=None):
        name = sem.fused_activation(self.activation)
        if name is None:
            hidden = F.linear(x, self.linear1.weight, self.linear1.bias)
            with backends.recording_suspended():  # the user's code: outside this layer's record
                hidden = self.activation(hidden)
            if p > 0.0:
                hidden = F.dropout(hidden, p)
            return F.linear(hidden, self.linear2.weight, self.linear2.bias)
        if lane is not None:
            return tf_functional.run_feed_forward(
                lane.next("feed_forward"), x, self.linear1.weight, self.linear1.bias,
                self.linear2.weight, self.linear2.bias, name, p)
        return tf_functional.feed_forward(
            x, self.linear1.weight, self.linear1.bias, self.linear2.weight, self.linear2.bias,
            activation=name, dropout_p=p, backend=sem.backend_for("feed_forward"),
        )

    def _fusable(self, x, norms, dropouts, check_hooks=True) -> bool:
        if sem.autocast_enabled(x.device.type):  # autocast mixes dtypes: torch's path
            return False
        # A Linear subclass with its own forward (LoRA, quantised, low-rank) is called as is.
        if not all(isinstance(m, Linear) and type(m).forward is Linear.forward
                   for m in (self.linear1, self.linear2)):
            return False
        # Not a plain Dropout, or one that drops everything (p = 1: the functional ops take
        # [0, 1); torch's Dropout zeroes the branch, which the unfused blocks then do).
        # (a list first: torch 2.11's dynamo cannot read a walrus target inside a generator)
        rates = [sem.dropout_p(d) for d in dropouts]
        if not all(p is not None and p < 1.0 for p in rates):
            return False
        if not all(_norm_fusable(n, x) for n in norms):
            return False
        if not check_hooks:
            return True
        # torch's encoder-layer fast path calls no submodule and looks only at the layer's own
        # forward hooks, so a global module hook (FlopCounterMode, ModuleTracker, a logger)
        # sees the layer's call alone there: ours then fuses too.
        global_hooks = not (sem.has_global_hooks() and self._torch_fast_path(x))
        return not sem.has_hooks(self, global_hooks=global_hooks)

    def _torch_fast_path(self, x) -> bool:
        return False


def _plain_parts(layer, base, blocks, attentions) -> bool:
    """The fused path computes ``base``'s blocks itself and, replayed, runs each attention's
    computation without its forward: a subclass that overrides a block, or an attention module
    that is not exactly ours (torch's, a subclass with its own forward), goes through the
    blocks and the modules' forwards, as torch's layers do.  So does a block set on the
    instance (``layer._sa_block = ...``)."""
    cls, own = type(layer), layer.__dict__
    return (all(getattr(cls, name) is getattr(base, name) and name not in own for name in blocks)
            and all(type(a) is MultiheadAttention for a in attentions))


# --------------------------------------------------------------------------------------------
# Layers


class TransformerEncoderLayer(_FusedFFN, Module):
    """Drop-in for torch.nn.TransformerEncoderLayer (self-attention + FFN, post- or pre-LN)."""

    __constants__ = ["norm_first"]

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable[[Tensor], Tensor] = F.relu,
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.self_attn = MultiheadAttention(
            d_model, nhead, dropout=dropout, bias=bias, batch_first=batch_first, **factory_kwargs
        )
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias, **factory_kwargs)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias, **factory_kwargs)

        self.norm_first = norm_first
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory_kwargs)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory_kwargs)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)

        if isinstance(activation, str):
            activation = sem.activation_from_string(activation)
        # torch's flag (read by torch's fast path and by code inspecting layers).
        if activation is F.relu or isinstance(activation, torch.nn.ReLU):
            self.activation_relu_or_gelu = 1
        elif activation is F.gelu or isinstance(activation, torch.nn.GELU):
            self.activation_relu_or_gelu = 2
        else:
            self.activation_relu_or_gelu = 0
        self.activation = activation

    def __setstate__(self, state):
        super().__setstate__(state)
        if not hasattr(self, "activation"):
            self.activation = F.relu

    def forward(
        self,
        src: Tensor,
        src_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor:
        """torch.nn.TransformerEncoderLayer.forward: src (S, N, E) / (N, S, E) batch_first /
        (S, E); src_mask (S, S) or (N * nhead, S, S) (bool True = not allowed, float added);
        src_key_padding_mask (N, S) (True = padding); is_causal: src_mask is causal (hint)."""
        if isinstance(src, Tensor) and src.is_nested and src_mask is None and src_key_padding_mask is None:
            return self._forward_nested(src)
        key = _lane.signature(self, (src, src_mask, src_key_padding_mask), is_causal)
        lane = _lane.plan(self, key)
        if lane is not None:  # this signature's checks passed before: replay (modules/_lane.py)
            return self._fused(src, src_mask, src_key_padding_mask, is_causal, lane=lane)[0]
        sem.check_layer_inputs(sem.layer_d_model(self), src=src)
        masks = sem.canonical_pair(
            src_mask, src_key_padding_mask, src.dtype, "src_mask", "src_key_padding_mask"
        )
        if masks[0] is not src_mask or masks[1] is not src_key_padding_mask:
            key = None  # converted (and warned, mixed kinds): the replay would do neither
        src_mask, src_key_padding_mask = masks
        if _fast_path_may_differ(src, src_mask, src_key_padding_mask, is_causal) and _torch_layer_fast_path(self, src):
            if _non_cuda_autocast(src):
                return self._torch_fast_path_op(src, src_mask, src_key_padding_mask)
            key = None
            src_mask, src_key_padding_mask, is_causal = self._as_torch_fast_path(
                src, src_mask, src_key_padding_mask, is_causal)
        return self._forward(src, src_mask, src_key_padding_mask, is_causal, key)

    def _torch_fast_path_op(self, src, src_mask, src_key_padding_mask):
        """torch's inference fast path under a CPU autocast, which its check does not see: the
        autocast casts every input of its op, parameters included, to the autocast dtype, so it
        runs (and returns that dtype) whatever the parameters' and the input's dtypes, where its
        other paths raise on such a mix.  Ours calls that op for torch's numbers there."""
        src_mask = sem.to_additive(src_mask, src.dtype)
        src_key_padding_mask = sem.to_additive(src_key_padding_mask, src.dtype)
        attn = self.self_attn
        merged, mask_type = attn.merge_masks(src_mask, src_key_padding_mask, src)
        return torch._transformer_encoder_layer_fwd(
            src, attn.embed_dim, attn.num_heads, attn.in_proj_weight, attn.in_proj_bias,
            attn.out_proj.weight, attn.out_proj.bias, self.activation_relu_or_gelu == 2,
            self.norm_first, self.norm1.eps, self.norm1.weight, self.norm1.bias,
            self.norm2.weight, self.norm2.bias, self.linear1.weight, self.linear1.bias,
            self.linear2.weight, self.linear2.bias, merged, mask_type)

    def _forward_nested(self, src):
        """A NestedTensor of N (S_i, E) sequences, as torch's TransformerEncoder passes its
        layers in inference when it kept its nested path (swap left it alone: a subclass of it,
        or swap(encoder.layers)): run padded, with the padding as a key padding mask, and handed
        back nested, as torch's layer does."""
        lengths = [row.shape[0] for row in src.unbind()]
        padded = src.to_padded_tensor(0.0)  # (N, S, E)
        padding = (torch.arange(padded.shape[1], device=padded.device)
                   >= torch.tensor(lengths, device=padded.device)[:, None])  # (N, S)
        if not self.self_attn.batch_first:
            padded = padded.transpose(0, 1)
        out = self.forward(padded, src_key_padding_mask=padding)
        if not self.self_attn.batch_first:
            out = out.transpose(0, 1)
        return torch.nested.nested_tensor([out[i, :n] for i, n in enumerate(lengths)])

    def _as_torch_fast_path(self, src, src_mask, src_key_padding_mask, is_causal):
        """The inputs as torch's inference fast path reads them (it runs in eval without grad,
        batch_first, ...: _torch_layer_fast_path): it merges the masks (merge_masks) and reads
        the float result by zero / nonzero (nonzero = not allowed) instead of adding it, so a
        float mask of any dtype is accepted; it ignores the is_causal hint without a mask (under a
        CPU autocast: _torch_fast_path_op).  -> (src_mask, src_key_padding_mask, is_causal)."""
        if any(m is not None and m.is_floating_point() for m in (src_mask, src_key_padding_mask)):
            # (canonical_pair made both float when their kinds differed.)
            if src_key_padding_mask is None:
                src_mask = src_mask != 0  # as given, (L, L) or (N * H, L, L): no expansion
            elif src_mask is None:
                src_key_padding_mask = src_key_padding_mask != 0
            else:  # torch adds the two into an (N, H, L, L) mask, then reads it
                merged, _ = self.self_attn.merge_masks(src_mask, src_key_padding_mask, src)
                src_mask, src_key_padding_mask = (merged != 0).flatten(0, 1), None
                is_causal = False  # the merged mask carries the padding: read it
        if src_mask is None:
            is_causal = False
        return src_mask, src_key_padding_mask, is_causal

    def _forward(self, src, src_mask, src_key_padding_mask, is_causal, key=None):
        if self._can_fuse(src):
            with backends.recording_resolutions() as names:
                out, _ = self._fused(src, src_mask, src_key_padding_mask, is_causal)
            if key is not None:
                _lane.remember(self, key, names)
            return out
        # torch's layer hands its blocks float masks (_canonical_mask): so does ours where the
        # blocks run, since self_attn, a block or a hook there may be the user's own.
        src_mask = sem.to_additive(src_mask, src.dtype)
        src_key_padding_mask = sem.to_additive(src_key_padding_mask, src.dtype)
        x = src
        if self.norm_first:
            with sem.layer_arguments(sem.ENCODER_SELF_ATTENTION):
                a = self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal=is_causal)
            x = x + a
            x = x + self._ff_block(self.norm2(x))
        else:
            with sem.layer_arguments(sem.ENCODER_SELF_ATTENTION):
                a = self._sa_block(x, src_mask, src_key_padding_mask, is_causal=is_causal)
            x = self.norm1(x + a)
            x = self.norm2(x + self._ff_block(x))
        return x

    def _torch_fast_path(self, x) -> bool:
        return _torch_layer_fast_path(self, x)

    def _can_fuse(self, x, check_hooks=True) -> bool:
        if not _plain_parts(self, TransformerEncoderLayer, ("_sa_block", "_ff_block"), (self.self_attn,)):
            return False
        return self._fusable(
            x, (self.norm1, self.norm2), (self.dropout, self.dropout1, self.dropout2), check_hooks
        )

    def _fused(self, x, mask, padding, is_causal, normed=None, next_norm=None, lane=None):
        """One layer on the fused ops.  Pre-LN: ``normed`` is norm1(x) when the previous layer
        already computed it; with ``next_norm`` the last residual-add also applies it.
        ``lane``: a replayed call's backends (modules/_lane.py).
        Returns (out, next_norm(out) or None)."""
        if lane is not None:  # plain inference: the whole layer in one C++ op (modules/_native.py)
            out = _native.encoder_layer(self, lane, x, mask, padding, is_causal, normed, next_norm)
            if out is not None:
                return out
        p, p1, p2 = (sem.dropout_p(d) for d in (self.dropout, self.dropout1, self.dropout2))
        if self.norm_first:
            h = _layer_norm(x, self.norm1) if normed is None else normed
            a = _attention(self.self_attn, h, h, mask, padding, is_causal, lane, sem.ENCODER_SELF_ATTENTION)
            h, x = _add_norm(a, x, self.norm2, p1, prenorm=True, lane=lane)
            return _residual_out(self._ffn(h, p, lane), x, p2, next_norm, lane)
        a = _attention(self.self_attn, x, x, mask, padding, is_causal, lane, sem.ENCODER_SELF_ATTENTION)
        x = _add_norm(a, x, self.norm1, p1, lane=lane)
        return _add_norm(self._ffn(x, p, lane), x, self.norm2, p2, lane=lane), None

    # torch's slow-path blocks (used when the layer cannot fuse)
    def _sa_block(self, x, attn_mask, key_padding_mask, is_causal=False):
        x = self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                           need_weights=False, is_causal=is_causal)[0]
        return self.dropout1(x)

    def _ff_block(self, x):
        x = self.linear2(self.dropout(self.activation(self.linear1(x))))
        return self.dropout2(x)


class TransformerDecoderLayer(_FusedFFN, Module):
    """Drop-in for torch.nn.TransformerDecoderLayer (self-attention, cross-attention, FFN)."""

    __constants__ = ["norm_first"]

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable[[Tensor], Tensor] = F.relu,
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.self_attn = MultiheadAttention(
            d_model, nhead, dropout=dropout, batch_first=batch_first, bias=bias, **factory_kwargs
        )
        self.multihead_attn = MultiheadAttention(
            d_model, nhead, dropout=dropout, batch_first=batch_first, bias=bias, **factory_kwargs
        )
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias, **factory_kwargs)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias, **factory_kwargs)

        self.norm_first = norm_first
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory_kwargs)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory_kwargs)
        self.norm3 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory_kwargs)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.dropout3 = Dropout(dropout)

        if isinstance(activation, str):
            self.activation = sem.activation_from_string(activation)
        else:
            self.activation = activation

    def __setstate__(self, state):
        # Checkpoints pickled before `activation` existed ran relu.  torch's version also fires
        # when the activation is a module (kept in _modules, not in __dict__), so a deepcopy or
        # unpickled copy of torch's layer (every layer of nn.TransformerDecoder!) silently runs
        # relu instead of e.g. nn.GELU().  Ours keeps the module.  (A layer swapped from torch's
        # keeps whatever torch's copy had, so swapped models compute exactly what they did.)
        if "activation" not in state and "activation" not in state.get("_modules", {}):
            state["activation"] = F.relu
        super().__setstate__(state)

    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_is_causal: bool = False,
        memory_is_causal: bool = False,
    ) -> Tensor:
        """torch.nn.TransformerDecoderLayer.forward (masks as torch's: bool True = not allowed /
        padding, float added; *_is_causal: hints that the mask is causal)."""
        inputs = (tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask)
        key = None
        if not (sem.mixed_kinds(tgt_mask, tgt_key_padding_mask)  # MHA warns for these: no replay
                or sem.mixed_kinds(memory_mask, memory_key_padding_mask)):
            key = _lane.signature(self, inputs, (tgt_is_causal, memory_is_causal))
        lane = _lane.plan(self, key)
        if lane is not None:  # this signature's checks passed before: replay (modules/_lane.py)
            return self._fused(*inputs, tgt_is_causal, memory_is_causal, lane=lane)[0]
        d_model = sem.layer_d_model(self)
        sem.check_layer_inputs(d_model, tgt=tgt)
        # memory feeds the cross-attention's key / value projections: its width is their kdim
        # (d_model unless multihead_attn was built with kdim / vdim, as torch's layer accepts)
        kdim = getattr(self.multihead_attn, "kdim", d_model)
        sem.check_layer_inputs(kdim, "d_model" if kdim == d_model else "multihead_attn.kdim", memory=memory)
        if self._can_fuse(tgt):
            with backends.recording_resolutions() as names:
                out, _ = self._fused(*inputs, tgt_is_causal, memory_is_causal)
            if key is not None:
                _lane.remember(self, key, names)
            return out
        x = tgt
        if self.norm_first:
            with sem.layer_arguments(sem.DECODER_SELF_ATTENTION):
                a = self._sa_block(self.norm1(x), tgt_mask, tgt_key_padding_mask, tgt_is_causal)
            x = x + a
            with sem.layer_arguments(sem.DECODER_CROSS_ATTENTION):
                c = self._mha_block(self.norm2(x), memory, memory_mask, memory_key_padding_mask,
                                    memory_is_causal)
            x = x + c
            x = x + self._ff_block(self.norm3(x))
        else:
            with sem.layer_arguments(sem.DECODER_SELF_ATTENTION):
                a = self._sa_block(x, tgt_mask, tgt_key_padding_mask, tgt_is_causal)
            x = self.norm1(x + a)
            with sem.layer_arguments(sem.DECODER_CROSS_ATTENTION):
                c = self._mha_block(x, memory, memory_mask, memory_key_padding_mask, memory_is_causal)
            x = self.norm2(x + c)
            x = self.norm3(x + self._ff_block(x))
        return x

    def _can_fuse(self, x, check_hooks=True) -> bool:
        if not _plain_parts(self, TransformerDecoderLayer, ("_sa_block", "_mha_block", "_ff_block"),
                            (self.self_attn, self.multihead_attn)):
            return False
        return self._fusable(
            x, (self.norm1, self.norm2, self.norm3),
            (self.dropout, self.dropout1, self.dropout2, self.dropout3), check_hooks,
        )

    def _fused(self, x, memory, tgt_mask, memory_mask, tgt_padding, memory_padding,
               tgt_is_causal, memory_is_causal, normed=None, next_norm=None, lane=None):
        """One layer on the fused ops; ``normed`` / ``next_norm`` / ``lane`` as the encoder
        layer's."""
        if lane is not None:  # plain inference: the whole layer in one C++ op (modules/_native.py)
            out = _native.decoder_layer(self, lane, x, memory, tgt_mask, memory_mask, tgt_padding,
                                        memory_padding, tgt_is_causal, memory_is_causal, normed,
                                        next_norm)
            if out is not None:
                return out
        p, p1, p2, p3 = (
            sem.dropout_p(d) for d in (self.dropout, self.dropout1, self.dropout2, self.dropout3)
        )
        if self.norm_first:
            h = _layer_norm(x, self.norm1) if normed is None else normed
            a = _attention(self.self_attn, h, h, tgt_mask, tgt_padding, tgt_is_causal, lane,
                           sem.DECODER_SELF_ATTENTION)
            h, x = _add_norm(a, x, self.norm2, p1, prenorm=True, lane=lane)
            c = _attention(self.multihead_attn, h, memory, memory_mask, memory_padding,
                           memory_is_causal, lane, sem.DECODER_CROSS_ATTENTION)
            h, x = _add_norm(c, x, self.norm3, p2, prenorm=True, lane=lane)
            return _residual_out(self._ffn(h, p, lane), x, p3, next_norm, lane)
        a = _attention(self.self_attn, x, x, tgt_mask, tgt_padding, tgt_is_causal, lane,
                       sem.DECODER_SELF_ATTENTION)
        x = _add_norm(a, x, self.norm1, p1, lane=lane)
        c = _attention(self.multihead_attn, x, memory, memory_mask, memory_padding,
                       memory_is_causal, lane, sem.DECODER_CROSS_ATTENTION)
        x = _add_norm(c, x, self.norm2, p2, lane=lane)
        return _add_norm(self._ffn(x, p, lane), x, self.norm3, p3, lane=lane), None

    # torch's slow-path blocks (used when the layer cannot fuse)
    def _sa_block(self, x, attn_mask, key_padding_mask, is_causal=False):
        x = self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                           is_causal=is_causal, need_weights=False)[0]
        return self.dropout1(x)

    def _mha_block(self, x, mem, attn_mask, key_padding_mask, is_causal=False):
        x = self.multihead_attn(x, mem, mem, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                                is_causal=is_causal, need_weights=False)[0]
        return self.dropout2(x)

    def _ff_block(self, x):
        x = self.linear2(self.dropout(self.activation(self.linear1(x))))
        return self.dropout3(x)


# --------------------------------------------------------------------------------------------
# Stacks


def _chainable(stack, layer_cls, x) -> bool:
    """Whether a stack can run its layers chained (_chain_layers: one signature and one replay
    for the whole stack): all layers ours, fusable and all pre-LN or all post-LN, the final norm
    fusable, no hooks."""
    layers = list(stack.layers)
    if not layers or not all(type(m) is layer_cls and m.norm_first == layers[0].norm_first
                             for m in layers):
        return False
    if stack.norm is not None and not _norm_fusable(stack.norm, x):
        return False
    if sem.has_hooks(stack):
        return False
    return all(m._can_fuse(x, check_hooks=False) for m in layers)


def _chain_layers(stack, x, step):
    """The stack's layers one after the other, ``step(layer, x, normed, next_norm) -> (x,
    next_norm(x) or None)`` being a layer's ``_fused``.  Pre-LN layers fuse their last residual
    add with the next layer's first norm (the last one with the final norm) and hand the
    normed result on; after post-LN layers the final norm runs on its own."""
    layers = stack.layers
    n = len(layers)
    normed = None
    for i, mod in enumerate(layers):
        next_norm = None
        if mod.norm_first:
            next_norm = layers[i + 1].norm1 if i + 1 < n else stack.norm
        x, normed = step(mod, x, normed, next_norm)
    if stack.norm is None:
        return x
    return normed if normed is not None else _layer_norm(x, stack.norm)


def _chained(stack, layer_cls, inputs, flags, chain):
    """``chain(lane)`` (the stack's layers chained, see _chainable) when the stack can
    chain, replayed when this signature's checks passed before (modules/_lane.py); None when it
    cannot chain."""
    key = _lane.signature(stack, inputs, flags)
    lane = _lane.plan(stack, key)
    if lane is not None:
        return chain(lane)
    if not _chainable(stack, layer_cls, inputs[0]):
        return None
    with backends.recording_resolutions() as names:
        out = chain(None)
    if key is not None:
        _lane.remember(stack, key, names)
    return out


def _nested_tensor_capable(layer) -> bool:
    """torch.nn.TransformerEncoder's conditions for its NestedTensor fast path (that path is
    torch's; ours runs such batches padded, _nested_padding)."""
    return not _why_not_nested_tensor(layer)


def _why_not_nested_tensor(layer) -> str:
    """Why torch.nn.TransformerEncoder's constructor turns use_nested_tensor off for this layer,
    in its words ("" when it does not); our layer counts as its TransformerEncoderLayer."""
    name = "encoder_layer"
    if not isinstance(layer, (TransformerEncoderLayer, torch.nn.TransformerEncoderLayer)):
        return f"{name} was not TransformerEncoderLayer"
    attn = layer.self_attn
    if layer.norm_first:
        return f"{name}.norm_first was True"
    if not attn.batch_first:
        return f"{name}.self_attn.batch_first was not True(use batch_first for better inference performance)"
    if not attn._qkv_same_embed_dim:
        return f"{name}.self_attn._qkv_same_embed_dim was not True"
    if attn.in_proj_bias is None:
        return f"{name}.self_attn was passed bias=False"
    if not layer.activation_relu_or_gelu:
        return f"{name}.activation_relu_or_gelu was not True"
    if layer.norm1.eps != layer.norm2.eps:
        return f"{name}.norm1.eps was not equal to {name}.norm2.eps"
    if attn.num_heads % 2 == 1:
        return f"{name}.self_attn.num_heads is odd"
    return ""


def _fast_path_tensors_ok(layer, src) -> bool:
    """The tensor checks torch's encoder fast paths end with (its order): no __torch_function__
    override, devices it runs on, nothing that needs grad."""
    attn = layer.self_attn
    tensor_args = (src, attn.in_proj_weight, attn.in_proj_bias, attn.out_proj.weight,
                   attn.out_proj.bias, layer.norm1.weight, layer.norm1.bias, layer.norm2.weight,
                   layer.norm2.bias, layer.linear1.weight, layer.linear1.bias,
                   layer.linear2.weight, layer.linear2.bias)
    devices = ("cpu", "cuda", "xpu", torch.utils.backend_registration._privateuse1_backend_name)
    # (While tracing, the tracer's own tensors answer has_torch_function: non-strict export.)
    if ((not torch.compiler.is_compiling() and torch.overrides.has_torch_function(tensor_args))
            or src.device.type not in devices):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensor_args))


def _torch_layer_fast_path(layer, src) -> bool:
    """Whether torch.nn.TransformerEncoderLayer would run this call on its inference fast path
    (torch._transformer_encoder_layer_fwd): its checks, in its order."""
    attn = layer.self_attn
    if not (torch.backends.mha.get_fastpath_enabled() and src.dim() == 3 and not layer.training
            and attn.batch_first and attn.in_proj_bias is not None and attn._qkv_same_embed_dim
            and layer.activation_relu_or_gelu and layer.norm1.eps == layer.norm2.eps
            and attn.num_heads % 2 == 0 and not torch.is_autocast_enabled()):  # CUDA's autocast
        return False
    if any(m._forward_hooks or m._forward_pre_hooks for m in layer.modules()):
        return False
    return _fast_path_tensors_ok(layer, src)


def _non_cuda_autocast(src) -> bool:
    """An autocast on src's device other than CUDA's, which torch's fast-path check (its
    argument-less torch.is_autocast_enabled()) does not see."""
    return src.device.type != "cuda" and sem.autocast_enabled(src.device.type)


def _fast_path_may_differ(src, mask, key_padding_mask, is_causal) -> bool:
    """Inputs on which torch's encoder-layer fast path computes something else than its
    training path (see TransformerEncoderLayer._as_torch_fast_path); cheap, checked first."""
    return (any(m is not None and m.is_floating_point() for m in (mask, key_padding_mask))
            or (bool(is_causal) and mask is None) or _non_cuda_autocast(src))


class TransformerEncoder(Module):
    """Drop-in for torch.nn.TransformerEncoder (a stack of N encoder layers + optional norm)."""

    __constants__ = ["norm"]

    def __init__(
        self,
        encoder_layer: "TransformerEncoderLayer",
        num_layers: int,
        norm: Module | None = None,
        enable_nested_tensor: bool = True,
        mask_check: bool = True,
    ) -> None:
        super().__init__()
        self.layers = _get_clones(encoder_layer, num_layers)
        self.num_layers = num_layers
        self.norm = norm
        # Recorded as torch records them, and read by the same rule (_nested_padding): where
        # torch would run a padded batch as a NestedTensor, ours runs it padded through the
        # kernels' key padding mask and gives the padded positions the values torch gives them.
        self.enable_nested_tensor = enable_nested_tensor
        self.use_nested_tensor = enable_nested_tensor
        why_not = _why_not_nested_tensor(encoder_layer)
        if enable_nested_tensor and why_not:
            warnings.warn(  # torch's warning, word for word
                f"enable_nested_tensor is True, but self.use_nested_tensor is False because {why_not}",
                stacklevel=2,
            )
            self.use_nested_tensor = False
        self.mask_check = mask_check

    def forward(
        self,
        src: Tensor,
        mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool | None = None,
    ) -> Tensor:
        """torch.nn.TransformerEncoder.forward.  ``is_causal=None`` detects a causal ``mask``
        (comparing it with the square subsequent mask, as torch; pass the hint to skip that)."""
        mask, src_key_padding_mask = sem.canonical_pair(
            mask, src_key_padding_mask, src.dtype, "mask", "src_key_padding_mask"
        )
        if src.is_nested:
            raise sem.InputError(
                "TransformerEncoder (transformer_fast) does not take NestedTensor inputs; pass a "
                "padded tensor and src_key_padding_mask"
            )
        batch_first = self.layers[0].self_attn.batch_first
        seq_len = sem.seq_len(src, batch_first)
        is_causal = sem.detect_is_causal_mask(mask, is_causal, seq_len)
        nested = self._nested_padding(src, mask, src_key_padding_mask)
        if nested is not None and nested[1] is True:
            # torch's NestedTensor path: the mask only says which keys exist
            src_key_padding_mask = nested[0]

        # Where torch's layers would run their inference fast path on inputs it computes
        # differently (float masks, the is_causal hint alone, a CPU autocast), each layer's
        # forward gives torch's numbers: no chaining across layers then.
        quirks = _fast_path_may_differ(src, mask, src_key_padding_mask, is_causal) and any(
            _torch_layer_fast_path(m, src) for m in self.layers if isinstance(m, TransformerEncoderLayer))
        def chain(lane):
            if (lane is not None and nested is not None and nested[1] is True
                    and not torch.are_deterministic_algorithms_enabled()):
                # torch's NestedTensor path: the valid tokens alone (modules/_native.py).  Not in
                # deterministic mode: GEMMs over fewer rows round apart from the first (checked,
                # padded) call's, and that mode promises the same bits every call.
                out = _native.packed_encoder(self, lane, src, src_key_padding_mask)
                if out is not None:
                    return out if self.norm is None else _layer_norm(out, self.norm)
            def step(mod, x, normed, next_norm):
                # torch's layer checks the masks as the stack handed them (bool made float):
                # float masks of two dtypes warn there again, once a layer
                sem.check_mask_kind(src_key_padding_mask, "src_key_padding_mask", mask, "src_mask")
                return mod._fused(x, mask, src_key_padding_mask, is_causal, normed, next_norm, lane=lane)
            return _chain_layers(self, src, step)

        output = None if quirks else _chained(
            self, TransformerEncoderLayer, (src, mask, src_key_padding_mask), is_causal, chain)
        # torch pads the NestedTensor's output with zeros, then applies the final norm.
        where = None
        if nested is not None:
            padded, aligned = nested
            where = (padded if batch_first else padded.t()).unsqueeze(-1)
            if aligned is not True:
                where = where & aligned
        if output is not None:  # chained: the norm is a fused op here, not a module call
            if where is not None:
                fill = output.new_zeros(1, 1, output.shape[-1])
                if self.norm is not None:
                    fill = _layer_norm(fill, self.norm)
                output = torch.where(where, fill, output)
            return output
        # The layers one by one, as torch's stack calls them: with float masks (_canonical_mask),
        # since a layer, its blocks or a hook there may be the user's own.
        mask = sem.to_additive(mask, src.dtype)
        src_key_padding_mask = sem.to_additive(src_key_padding_mask, src.dtype)
        output = src
        for mod in self.layers:
            output = mod(output, src_mask=mask, is_causal=is_causal,
                         src_key_padding_mask=src_key_padding_mask)
        if where is not None:
            output = output.masked_fill(where, 0.0)
        if self.norm is not None:
            output = self.norm(output)
        return output

    def _nested_padding(self, src, mask, src_key_padding_mask):
        """Where torch.nn.TransformerEncoder would run this call as a NestedTensor (its eager
        fast path: eval, no grad, batched input, a left-aligned padding mask, no attention mask,
        ...: the same checks in the same order): (padded positions, True), else None.  torch
        then leaves padded positions out, reading a float mask by zero / nonzero alone, and
        returns zeros there (norm(0) with a final norm).  While tracing (torch.compile, export)
        torch skips that path, since its left-alignment check reads the mask; ours keeps the
        eager numbers instead, with the check as a tensor: (padded positions, 0-d bool tensor).
        """
        first = self.layers[0]
        if (not torch.backends.mha.get_fastpath_enabled() or not getattr(self, "use_nested_tensor", False)
                or first.training or src.dim() != 3 or src_key_padding_mask is None):
            return None
        keep = src_key_padding_mask.logical_not()
        aligned = True
        if getattr(self, "mask_check", True):
            if torch.compiler.is_compiling():
                # each row: its kept keys first, then padding
                positions = torch.arange(keep.shape[-1], device=keep.device)
                aligned = (keep == (positions < keep.sum(-1, keepdim=True))).all()
            elif tuple(keep.shape) != tuple(src.shape[:2]):
                # torch's left-alignment check fails on it first, with a RuntimeError
                raise sem.InputRuntimeError(
                    f"src_key_padding_mask must have shape {tuple(src.shape[:2])} (batch, source "
                    f"length); got {tuple(keep.shape)}"
                )
            elif not torch._nested_tensor_from_mask_left_aligned(src, keep):
                return None
        if mask is not None or torch.is_autocast_enabled():
            return None
        if not _fast_path_tensors_ok(first, src):
            return None
        return keep.logical_not(), aligned


class TransformerDecoder(Module):
    """Drop-in for torch.nn.TransformerDecoder (a stack of N decoder layers + optional norm)."""

    __constants__ = ["norm"]

    def __init__(
        self,
        decoder_layer: "TransformerDecoderLayer",
        num_layers: int,
        norm: Module | None = None,
    ) -> None:
        super().__init__()
        self.layers = _get_clones(decoder_layer, num_layers)
        self.num_layers = num_layers
        self.norm = norm

    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_is_causal: bool | None = None,
        memory_is_causal: bool = False,
    ) -> Tensor:
        """torch.nn.TransformerDecoder.forward (``tgt_is_causal=None`` detects a causal tgt_mask)."""
        seq_len = sem.seq_len(tgt, self.layers[0].self_attn.batch_first)
        tgt_is_causal = sem.detect_is_causal_mask(tgt_mask, tgt_is_causal, seq_len, "tgt_mask")

        inputs = (tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask)

        def chain(lane):
            return _chain_layers(self, tgt, lambda mod, x, normed, next_norm: mod._fused(
                x, *inputs[1:], tgt_is_causal, memory_is_causal, normed, next_norm, lane=lane))

        output = None
        if not (sem.mixed_kinds(tgt_mask, tgt_key_padding_mask)
                or sem.mixed_kinds(memory_mask, memory_key_padding_mask)):
            output = _chained(self, TransformerDecoderLayer, inputs,
                              (tgt_is_causal, memory_is_causal), chain)
        elif _chainable(self, TransformerDecoderLayer, tgt):  # MHA warns for these: no replay
            output = chain(None)
        if output is not None:
            return output

        output = tgt
        for mod in self.layers:
            output = mod(output, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                         tgt_key_padding_mask=tgt_key_padding_mask,
                         memory_key_padding_mask=memory_key_padding_mask,
                         tgt_is_causal=tgt_is_causal, memory_is_causal=memory_is_causal)
        if self.norm is not None:
            output = self.norm(output)
        return output


class Transformer(Module):
    """Drop-in for torch.nn.Transformer (encoder-decoder of "Attention Is All You Need")."""

    def __init__(
        self,
        d_model: int = 512,
        nhead: int = 8,
        num_encoder_layers: int = 6,
        num_decoder_layers: int = 6,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable[[Tensor], Tensor] = F.relu,
        custom_encoder: Any | None = None,
        custom_decoder: Any | None = None,
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        if custom_encoder is not None:
            self.encoder = custom_encoder
        else:
            encoder_layer = TransformerEncoderLayer(
                d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps,
                batch_first, norm_first, bias, **factory_kwargs,
            )
            encoder_norm = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory_kwargs)
            self.encoder = TransformerEncoder(encoder_layer, num_encoder_layers, encoder_norm)

        if custom_decoder is not None:
            self.decoder = custom_decoder
        else:
            decoder_layer = TransformerDecoderLayer(
                d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps,
                batch_first, norm_first, bias, **factory_kwargs,
            )
            decoder_norm = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory_kwargs)
            self.decoder = TransformerDecoder(decoder_layer, num_decoder_layers, decoder_norm)

        self._reset_parameters()

        self.d_model = d_model
        self.nhead = nhead
        self.batch_first = batch_first

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        src_is_causal: bool | None = None,
        tgt_is_causal: bool | None = None,
        memory_is_causal: bool = False,
    ) -> Tensor:
        """torch.nn.Transformer.forward: encode ``src``, decode ``tgt`` against it."""
        is_batched = src.dim() == 3
        if not self.batch_first and src.size(1) != tgt.size(1) and is_batched:
            raise sem.InputRuntimeError("the batch number of src and tgt must be equal")
        elif self.batch_first and src.size(0) != tgt.size(0) and is_batched:
            raise sem.InputRuntimeError("the batch number of src and tgt must be equal")

        if src.size(-1) != self.d_model or tgt.size(-1) != self.d_model:
            raise sem.InputRuntimeError("the feature number of src and tgt must be equal to d_model")

        memory = self.encoder(src, mask=src_mask, src_key_padding_mask=src_key_padding_mask,
                              is_causal=src_is_causal)
        return self.decoder(tgt, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                            tgt_key_padding_mask=tgt_key_padding_mask,
                            memory_key_padding_mask=memory_key_padding_mask,
                            tgt_is_causal=tgt_is_causal, memory_is_causal=memory_is_causal)

    @staticmethod
    def generate_square_subsequent_mask(
        sz: int,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> Tensor:
        """A (sz, sz) float mask: -inf above the diagonal (future positions), 0 elsewhere."""
        return sem.square_subsequent_mask(sz, dtype=dtype, device=device)

    def _reset_parameters(self) -> None:
        for p in self.parameters():
            if p.dim() > 1:
                xavier_uniform_(p)
