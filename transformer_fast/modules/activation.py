"""MultiheadAttention: torch.nn.MultiheadAttention's interface on the fused functional ops.

Same constructor, parameters (names, shapes, init), state_dict and forward (arguments, mask
rules, return values) as the installed torch.  The forward differs in how it computes:

* self-attention (query is key is value) runs ONE in-projection GEMM; q, k and v are strided
  views of its output, ``(.., 3, H, D)`` permuted to ``(B, H, L, D)``, passed straight to
  functional.scaled_dot_product_attention (the kernels read strides; nothing is copied).
  Encoder-decoder attention (key is value) runs one GEMM for q and one for k/v together.
* need_weights=False -> functional.scaled_dot_product_attention (flash attention: the scores
  are never materialised); need_weights=True -> the scores are materialised once and go
  through functional.masked_softmax (fused scale + mask + softmax + dropout).
* masks are handed to the kernels as given (bool stays bool, a 2-D mask stays 2-D and is
  broadcast), instead of torch's conversion of every mask to a float tensor per head.

Documented differences from torch (results are otherwise the same up to rounding):
* A query row whose keys are all masked gives zeros (zero gradients), where torch's
  need_weights=True path gives NaN (and its SDPA paths NaN or zeros, depending on the kernel).
* ``is_causal=True`` is taken as true: the causal mask is applied and ``attn_mask`` is not read.
  torch does the same without key_padding_mask and with need_weights=False, and otherwise reads
  ``attn_mask``; the two agree whenever the hint is correct, which torch requires of it.  With
  add_bias_kv / add_zero_attn, where torch reads ``attn_mask`` so do we (the appended keys are
  open to every query there, which a causal mask over them would not be).
* The output of a batch_first module is contiguous (torch returns a transposed view).
"""
import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.init import constant_, xavier_normal_, xavier_uniform_
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear
from torch.nn.modules.module import Module
from torch.nn.parameter import Parameter

from .. import backends
from .. import functional as tf_functional
from .. import masks as tf_masks
from . import _lane
from ._semantics import (
    InputError,
    InputRuntimeError,
    as_slow_path_error,
    autocast_enabled,
    backend_for,
    check_float_kinds,
    check_mask_kind,
    mixed_kinds,
)

__all__ = ["MultiheadAttention"]


def _check_float_mask_dtype(attn_mask, key_padding_mask, query, need_weights) -> None:
    """torch's rule for the float masks' dtype (outside autocast, which casts).  torch turns a
    bool mask into a float one of the query's dtype, adds attn_mask and key_padding_mask when
    both are given (type promotion), and hands the sum to SDPA (need_weights=False: the query's
    dtype or float32) or adds it to the scores (need_weights=True: the query's dtype exactly).
    ``attn_mask`` is None here where torch drops it unread."""
    masks = [m for m in (attn_mask, key_padding_mask) if m is not None]
    if not any(m.is_floating_point() for m in masks):
        return
    if autocast_enabled(query.device.type):
        return
    merged = functools.reduce(
        torch.promote_types, (query.dtype if m.dtype == torch.bool else m.dtype for m in masks))
    if merged == query.dtype or (merged == torch.float32 and not need_weights):
        return
    allowed = str(query.dtype)
    if not need_weights and query.dtype != torch.float32:
        allowed += " or torch.float32"
    names = " + ".join(n for n, m in (("attn_mask", attn_mask), ("key_padding_mask", key_padding_mask))
                       if m is not None)
    raise InputRuntimeError(
        f"the float mask ({names}, as torch adds them: {merged}) must have the query's dtype "
        f"({allowed}, as torch.nn.MultiheadAttention requires with need_weights={need_weights}); "
        f"got {', '.join(str(m.dtype) for m in masks)}"
    )


def _reads_attn_mask(is_causal, key_padding_mask, need_weights) -> bool:
    """torch drops attn_mask (after checking only its rank) exactly when this is False."""
    return not (is_causal and key_padding_mask is None and not need_weights)


def _project(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """F.linear, except that a bias of another dtype than the weight is added after the GEMM,
    as torch's in-projection of batched inputs does (matmul, then add_: the bias is promoted),
    where addmm would refuse the mix.  An inference tensor that the GEMM must save for the weight's
    gradient is copied first: torch's batch-first modules project a transposed copy of theirs,
    and autograd cannot save an inference tensor (training on data made under inference_mode)."""
    if (not torch.compiler.is_compiling() and x.is_inference() and w.requires_grad
            and torch.is_grad_enabled() and not torch.is_inference_mode_enabled()):
        x = x.clone()
    if b is None or b.dtype == w.dtype:
        return F.linear(x, w, b)
    return F.linear(x, w).add_(b)


class MultiheadAttention(Module):
    """Drop-in for torch.nn.MultiheadAttention (see the module docstring for what is fused)."""

    __constants__ = ["batch_first"]
    bias_k: torch.Tensor | None
    bias_v: torch.Tensor | None

    def __init__(
        self,
        embed_dim,
        num_heads,
        dropout=0.0,
        bias=True,
        add_bias_kv=False,
        add_zero_attn=False,
        kdim=None,
        vdim=None,
        batch_first=False,
        device=None,
        dtype=None,
    ) -> None:
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(
                f"embed_dim and num_heads must be greater than 0,"
                f" got embed_dim={embed_dim} and num_heads={num_heads} instead"
            )
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim

        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        if self.head_dim * num_heads != self.embed_dim:
            raise AssertionError("embed_dim must be divisible by num_heads")

        # Parameters created in torch's order, so that the same seed gives the same init.
        if not self._qkv_same_embed_dim:
            self.q_proj_weight = Parameter(torch.empty((embed_dim, embed_dim), **factory_kwargs))
            self.k_proj_weight = Parameter(torch.empty((embed_dim, self.kdim), **factory_kwargs))
            self.v_proj_weight = Parameter(torch.empty((embed_dim, self.vdim), **factory_kwargs))
            self.register_parameter("in_proj_weight", None)
        else:
            self.in_proj_weight = Parameter(torch.empty((3 * embed_dim, embed_dim), **factory_kwargs))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)

        if bias:
            self.in_proj_bias = Parameter(torch.empty(3 * embed_dim, **factory_kwargs))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias, **factory_kwargs)

        if add_bias_kv:
            self.bias_k = Parameter(torch.empty((1, 1, embed_dim), **factory_kwargs))
            self.bias_v = Parameter(torch.empty((1, 1, embed_dim), **factory_kwargs))
        else:
            self.bias_k = self.bias_v = None

        self.add_zero_attn = add_zero_attn

        self._reset_parameters()

    def _reset_parameters(self) -> None:
        if self._qkv_same_embed_dim:
            xavier_uniform_(self.in_proj_weight)
        else:
            xavier_uniform_(self.q_proj_weight)
            xavier_uniform_(self.k_proj_weight)
            xavier_uniform_(self.v_proj_weight)

        if self.in_proj_bias is not None:
            constant_(self.in_proj_bias, 0.0)
            constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            xavier_normal_(self.bias_k)
        if self.bias_v is not None:
            xavier_normal_(self.bias_v)

    def __setstate__(self, state):
        # Checkpoints pickled by torch 1.1 lack this flag (as in torch).
        if "_qkv_same_embed_dim" not in state:
            state["_qkv_same_embed_dim"] = True
        super().__setstate__(state)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Attention of ``query`` over ``key``/``value``; torch.nn.MultiheadAttention.forward's
        arguments, shapes, mask conventions and return values.

        Shapes (E = embed_dim): query (L, N, E), or (N, L, E) with batch_first, or (L, E)
        unbatched; key/value likewise with S and kdim/vdim.  key_padding_mask (N, S) ((S,)
        unbatched): bool True = padding, float added.  attn_mask (L, S) or (N * num_heads, L, S)
        ((num_heads, L, S) unbatched): bool True = NOT allowed, float added.

        Returns ``(attn_output, attn_weights)``: attn_output shaped like query; attn_weights
        None unless need_weights, else (N, L, S) averaged over heads or (N, num_heads, L, S)
        (without N when unbatched), after attention dropout as torch's.
        """
        inputs = (query, key, value, key_padding_mask, attn_mask)
        lane_key = None
        if not mixed_kinds(attn_mask, key_padding_mask):  # (torch warns for those: no replay)
            lane_key = _lane.signature(self, inputs, (
                need_weights, average_attn_weights, is_causal, query is key, key is value))
        lane = _lane.plan(self, lane_key)
        if lane is not None:  # this signature's checks passed before: replay (modules/_lane.py)
            return self._attend(query, key, value, key_padding_mask, need_weights, attn_mask,
                                average_attn_weights, is_causal, lane)
        with backends.recording_resolutions() as names:
            out = self._checked_forward(query, key, value, key_padding_mask, need_weights,
                                        attn_mask, average_attn_weights, is_causal)
        if lane_key is not None:
            _lane.remember(self, lane_key, names)
        return out

    def _checked_forward(self, query, key, value, key_padding_mask, need_weights, attn_mask,
                         average_attn_weights, is_causal):
        try:
            self._check_inputs(query, key, value, key_padding_mask, need_weights, attn_mask,
                               is_causal)
        except InputError as exc:
            raise as_slow_path_error(exc, self._torch_surely_slow(query, key, value)) from None
        return self._attend(query, key, value, key_padding_mask, need_weights, attn_mask,
                            average_attn_weights, is_causal)

    def _torch_surely_slow(self, query, key, value) -> bool:
        """Whether torch's MultiheadAttention, and any layer fast path around it, surely runs
        its Python slow path for this call (its input errors are then AssertionErrors): one of
        the conditions every torch fast path (MHA's, the encoder layer's, the encoder's nested
        one) refuses.  False where one may run (their RuntimeErrors: InputError is both)."""
        params = (self.in_proj_weight, self.in_proj_bias, self.out_proj.weight, self.out_proj.bias)
        return (not torch.backends.mha.get_fastpath_enabled() or self.training
                or not self.batch_first or not isinstance(query, Tensor) or query.dim() != 3
                or query is not key or key is not value or self.num_heads % 2 == 1
                or not self._qkv_same_embed_dim or self.in_proj_bias is None
                or torch.is_autocast_enabled()
                or (torch.is_grad_enabled()
                    and any(isinstance(t, Tensor) and t.requires_grad for t in (query, *params))))

    def _check_inputs(self, query, key, value, key_padding_mask, need_weights, attn_mask,
                      is_causal) -> None:
        """torch's checks of MultiheadAttention's inputs, in its order."""
        check_mask_kind(key_padding_mask, "key_padding_mask", attn_mask, "attn_mask")
        check_mask_kind(attn_mask, "attn_mask")
        if isinstance(query, Tensor):
            check_float_kinds(key_padding_mask, "key_padding_mask", attn_mask, "attn_mask", query.dtype)
        if query.is_nested or key.is_nested or value.is_nested:
            raise InputError(
                "MultiheadAttention (transformer_fast) does not take NestedTensor inputs; pass a "
                "padded tensor and key_padding_mask (the kernels skip padded keys)"
            )
        is_batched = self._check_shapes(query, key, value, key_padding_mask, attn_mask)
        if is_causal and attn_mask is None:  # (after the shape checks, as torch's order)
            raise InputRuntimeError(
                "Need attn_mask if specifying the is_causal hint. You may use the Transformer "
                "module method `generate_square_subsequent_mask` to create this mask."
            )
        bsz, tgt_len, src_len = self._lengths(query, key)
        use_attn_mask = _reads_attn_mask(is_causal, key_padding_mask, need_weights)
        # torch's order: attn_mask's size, key_padding_mask's, then the dtype of their sum.
        if attn_mask is not None and use_attn_mask:
            self._check_attn_mask(attn_mask, is_batched, bsz, tgt_len, src_len)
        if key_padding_mask is not None:
            expected = (bsz, src_len) if is_batched else (src_len,)
            if tuple(key_padding_mask.shape) != expected:
                raise InputError(
                    f"key_padding_mask must have shape {expected} (batch, key length); got "
                    f"{tuple(key_padding_mask.shape)}"
                )
        _check_float_mask_dtype(attn_mask if use_attn_mask else None, key_padding_mask, query,
                                need_weights)

    def _lengths(self, query, key):
        """(batch size, query length, key length) of checked inputs."""
        if query.dim() == 2:
            return 1, query.shape[0], key.shape[0]
        seq_dim = 1 if self.batch_first else 0
        return query.shape[1 - seq_dim], query.shape[seq_dim], key.shape[seq_dim]

    def _attend(self, query, key, value, key_padding_mask, need_weights, attn_mask,
                average_attn_weights, is_causal, lane=None):
        """forward's computation on checked inputs.  ``lane``: the backends a layer's replayed
        call (modules._lane) runs the functional ops on, their checks skipped."""
        is_batched = query.dim() == 3
        bsz, tgt_len, src_len = self._lengths(query, key)
        num_heads, head_dim = self.num_heads, self.head_dim
        use_attn_mask = _reads_attn_mask(is_causal, key_padding_mask, need_weights)

        q, k, v = self._in_projection(query, key, value)  # each (.., H, D) in the input layout
        q, k, v = (self._heads(t, is_batched) for t in (q, k, v))  # (N, H, L|S, D) views

        extra = 0  # keys appended by add_bias_kv / add_zero_attn
        if self.bias_k is not None or self.bias_v is not None:
            if self.bias_k is None or self.bias_v is None:
                raise AssertionError("bias_k and bias_v must be set together")
            # (1, 1, E) -> (N, H, 1, D): one more key/value at the end of every sequence.
            bk = self.bias_k.reshape(1, num_heads, 1, head_dim).expand(bsz, -1, -1, -1)
            bv = self.bias_v.reshape(1, num_heads, 1, head_dim).expand(bsz, -1, -1, -1)
            k, v = torch.cat([k, bk], dim=2), torch.cat([v, bv], dim=2)
            extra += 1
        if self.add_zero_attn:
            zeros = k.new_zeros((bsz, num_heads, 1, head_dim))
            k, v = torch.cat([k, zeros], dim=2), torch.cat([v, zeros], dim=2)
            extra += 1

        # The hint stands for attn_mask, except where torch reads the mask (use_attn_mask) and
        # keys were appended: torch pads the mask with open columns for them, which a causal
        # mask over S + extra keys would hide from most queries.
        causal = bool(is_causal) and not (extra and use_attn_mask)
        mask = None
        if attn_mask is not None and not causal:
            mask = self._sdpa_attn_mask(attn_mask, is_batched, bsz, tgt_len, src_len, q.dtype, extra)
        padding = None
        if key_padding_mask is not None:
            padding = key_padding_mask if is_batched else key_padding_mask.unsqueeze(0)  # (N, S)
            if padding.is_floating_point() and padding.dtype not in (q.dtype, torch.float32):
                padding = padding.to(q.dtype)
            if extra:  # the appended keys are not padding
                padding = F.pad(padding, (0, extra), value=False if padding.dtype == torch.bool else 0.0)

        dropout_p = float(self.dropout) if self.training else 0.0
        # p = 1 (torch's Dropout accepts it, the functional ops take [0, 1)): every probability
        # dropped, i.e. the attention times zero, as torch's dropout computes it.
        drop_all = dropout_p == 1.0
        if drop_all:
            dropout_p = 0.0
        weights = None
        if not need_weights:
            if lane is None:
                out = tf_functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal,
                    key_padding_mask=padding, backend=backend_for("scaled_dot_product_attention"),
                )  # (N, H, L, D)
            else:
                out = tf_functional.run_scaled_dot_product_attention(
                    lane.next("scaled_dot_product_attention"), q, k, v, mask, dropout_p, causal,
                    None, False, padding,
                )
            if drop_all:
                out = out * 0.0
        else:
            scores = torch.matmul(q, k.transpose(-2, -1))  # (N, H, L, S + extra)
            merged = tf_masks.combine(
                mask, False, padding, tgt_len, scores.shape[-1], 4, q.dtype, q.device
            )
            if lane is None:
                probs = tf_functional.masked_softmax(
                    scores, merged, scale=1.0 / math.sqrt(head_dim), is_causal=causal,
                    dropout_p=dropout_p, backend=backend_for("masked_softmax"),
                )
            else:
                probs = tf_functional.run_masked_softmax(
                    lane.next("masked_softmax"), scores, merged, 1.0 / math.sqrt(head_dim),
                    causal, dropout_p)
            if drop_all:
                probs = probs * 0.0
            out = torch.matmul(probs, v)  # (N, H, L, D)
            weights = probs.mean(dim=1) if average_attn_weights else probs
            if not is_batched:
                weights = weights.squeeze(0)

        # Merge heads back into the input layout: the one copy of the forward (the kernels write
        # (N, H, L, D); the out-projection needs (.., H * D) rows).
        if not is_batched:
            merged_out = out[0].transpose(0, 1).reshape(tgt_len, self.embed_dim)
        elif self.batch_first:
            merged_out = out.transpose(1, 2).reshape(bsz, tgt_len, self.embed_dim)
        else:
            merged_out = out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, self.embed_dim)
        attn_output = F.linear(merged_out, self.out_proj.weight, self.out_proj.bias)
        return attn_output, weights

    def merge_masks(
        self, attn_mask: Tensor | None, key_padding_mask: Tensor | None, query: Tensor
    ) -> tuple[Tensor | None, int | None]:
        """torch.nn.MultiheadAttention.merge_masks (torch's encoder-layer fast path calls it on
        its self_attn): ``(mask, mask_type)`` with mask_type 1 for key_padding_mask alone, 2 for
        an attn_mask (expanded to (N, num_heads, L, L), plus key_padding_mask when both are
        given), ``(None, None)`` for neither.  query is (N, L, E)."""
        if attn_mask is None:
            return (key_padding_mask, 1) if key_padding_mask is not None else (None, None)
        batch, length, _ = query.shape
        if attn_mask.dim() == 3:  # (N * H, L, L)
            merged = attn_mask.view(batch, -1, length, length)
        else:  # (L, L)
            merged = attn_mask.view(1, 1, length, length).expand(batch, self.num_heads, -1, -1)
        if key_padding_mask is not None:  # (N, L) over the keys
            merged = merged + key_padding_mask.view(batch, 1, 1, length).expand(-1, self.num_heads, -1, -1)
        return merged, 2

    # ---- helpers

    def _check_shapes(self, query, key, value, key_padding_mask, attn_mask) -> bool:
        """torch's _mha_shape_check (the masks' ranks, and an unbatched 3-D attn_mask's shape,
        checked even where the is_causal hint then drops attn_mask) plus the embedding checks;
        returns is_batched."""
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if query.dim() == 3:
            if key.dim() != 3 or value.dim() != 3:
                raise InputError(
                    "For batched (3-D) `query`, expected `key` and `value` to be 3-D"
                    f" but found {key.dim()}-D and {value.dim()}-D tensors respectively"
                )
            if key_padding_mask is not None and key_padding_mask.dim() != 2:
                raise InputError(
                    "For batched (3-D) `query`, expected `key_padding_mask` to be `None` or 2-D"
                    f" but found {key_padding_mask.dim()}-D tensor instead"
                )
            is_batched = True
        elif query.dim() == 2:
            if key.dim() != 2 or value.dim() != 2:
                raise InputError(
                    "For unbatched (2-D) `query`, expected `key` and `value` to be 2-D"
                    f" but found {key.dim()}-D and {value.dim()}-D tensors respectively"
                )
            if key_padding_mask is not None and key_padding_mask.dim() != 1:
                raise InputError(
                    "For unbatched (2-D) `query`, expected `key_padding_mask` to be `None` or 1-D"
                    f" but found {key_padding_mask.dim()}-D tensor instead"
                )
            is_batched = False
        else:
            raise InputError(
                "query should be unbatched 2D or batched 3D tensor but received "
                f"{query.dim()}-D query tensor"
            )
        if query.shape[-1] != self.embed_dim:
            raise InputError(
                f"was expecting embedding dimension of {self.embed_dim}, but got {query.shape[-1]} "
                f"(query shape {tuple(query.shape)})"
            )
        if key.shape[-1] != self.kdim or value.shape[-1] != self.vdim:
            raise InputError(
                f"key and value must have kdim={self.kdim} and vdim={self.vdim} features; got key "
                f"{tuple(key.shape)}, value {tuple(value.shape)}"
            )
        if key.shape[:-1] != value.shape[:-1]:
            raise InputError(
                f"key's sequence and batch dims {tuple(key.shape[:-1])} do not match value's "
                f"{tuple(value.shape[:-1])}"
            )
        if is_batched:
            bdim = 0 if self.batch_first else 1
            if key.shape[bdim] != query.shape[bdim]:
                raise InputRuntimeError(  # torch's view of k fails with a RuntimeError
                    f"key must have query's batch size {query.shape[bdim]} (dim {bdim}); got "
                    f"key {tuple(key.shape)}, query {tuple(query.shape)}"
                )
        if attn_mask is not None:
            kind = "batched (3-D)" if is_batched else "unbatched (2-D)"
            if attn_mask.dim() not in (2, 3):
                raise InputError(
                    f"For {kind} `query`, expected `attn_mask` to be `None`, 2-D or 3-D but found "
                    f"{attn_mask.dim()}-D tensor instead"
                )
            expected = (self.num_heads, query.shape[0], key.shape[0])
            if not is_batched and attn_mask.dim() == 3 and tuple(attn_mask.shape) != expected:
                raise InputError(f"Expected `attn_mask` shape to be {expected} but got {attn_mask.shape}")
        return is_batched

    def _check_attn_mask(self, attn_mask, is_batched, bsz, tgt_len, src_len) -> None:
        if attn_mask.dim() == 2:
            if tuple(attn_mask.shape) != (tgt_len, src_len):
                raise InputRuntimeError(
                    f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be "
                    f"{(tgt_len, src_len)}."
                )
        else:  # 3-D (_check_shapes checked the rank)
            expected = (bsz * self.num_heads, tgt_len, src_len)
            if tuple(attn_mask.shape) != expected:
                cls = InputRuntimeError if is_batched else InputError
                raise cls(f"The shape of the 3D attn_mask is {attn_mask.shape}, but should be {expected}.")

    def _in_projection(self, query, key, value):
        """q, k, v projections, each (.., num_heads, head_dim) in the input's own layout."""
        e, h, d = self.embed_dim, self.num_heads, self.head_dim
        b = self.in_proj_bias
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight
            if query is key and key is value:
                # One GEMM; q/k/v are views of its output (.., 3, H, D).  unbind (not three
                # selects): its backward stacks dq/dk/dv into the packed gradient in one pass,
                # where select's would zero-fill and add three full-size buffers.
                proj = _project(query, w, b).unflatten(-1, (3, h, d))
                return proj.unbind(-3)
            if key is value:  # encoder-decoder attention: k and v from one GEMM
                # split (not chunk + a slice): its backward concatenates dwq and dwkv into the
                # packed gradient in one pass, where a slice's would zero-fill a full-size
                # buffer and add it to the chunk's (itself zero-filled where dwk, dwv are).
                wq, wkv = w.split([e, 2 * e])
                bq, bkv = (None, None) if b is None else b.split([e, 2 * e])
                q = _project(query, wq, bq).unflatten(-1, (h, d))
                k, v = _project(key, wkv, bkv).unflatten(-1, (2, h, d)).unbind(-3)
                return q, k, v
            bq, bk, bv = (None, None, None) if b is None else b.chunk(3)
            wq, wk, wv = w.chunk(3)
            q = _project(query, wq, bq).unflatten(-1, (h, d))
            k = _project(key, wk, bk).unflatten(-1, (h, d))
            v = _project(value, wv, bv).unflatten(-1, (h, d))
            return q, k, v
        bq, bk, bv = (None, None, None) if b is None else b.chunk(3)
        q = _project(query, self.q_proj_weight, bq).unflatten(-1, (h, d))
        k = _project(key, self.k_proj_weight, bk).unflatten(-1, (h, d))
        v = _project(value, self.v_proj_weight, bv).unflatten(-1, (h, d))
        return q, k, v

    def _heads(self, t, is_batched):
        """(.., H, D) projection in the input layout -> (N, H, L, D) view (no copy)."""
        if not is_batched:
            return t.unsqueeze(0).transpose(1, 2)  # (L, H, D) -> (1, H, L, D)
        if self.batch_first:
            return t.transpose(1, 2)  # (N, L, H, D) -> (N, H, L, D)
        return t.permute(1, 2, 0, 3)  # (L, N, H, D) -> (N, H, L, D)

    def _sdpa_attn_mask(self, attn_mask, is_batched, bsz, tgt_len, src_len, dtype, extra):
        """torch.nn polarity -> SDPA polarity, broadcastable to (N, H, L, S + extra)."""
        if attn_mask.dtype == torch.bool:
            mask = attn_mask.logical_not()  # True = takes part
        else:
            mask = attn_mask if attn_mask.dtype in (dtype, torch.float32) else attn_mask.to(dtype)
        if mask.dim() == 3:  # (N * H, L, S) -> (N, H, L, S)
            mask = mask.reshape(bsz, self.num_heads, tgt_len, src_len)
        if extra:  # the appended keys take part
            mask = F.pad(mask, (0, extra), value=True if mask.dtype == torch.bool else 0.0)
        return mask
