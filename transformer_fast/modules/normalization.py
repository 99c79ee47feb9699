"""LayerNorm: torch.nn.LayerNorm's constructor, parameters, init and forward.

Standing alone, a LayerNorm has nothing to fuse with, so its forward is F.layer_norm (exactly
torch's).  Its point is inside the Transformer layers, which read its weight, bias and eps and
run residual-add + dropout + LayerNorm as one functional.add_layer_norm call.
"""
import numbers

import torch
from torch import Size, Tensor
from torch.nn import functional as F, init
from torch.nn.parameter import Parameter

_shape_t = int | list[int] | Size

__all__ = ["LayerNorm"]


class LayerNorm(torch.nn.Module):
    """Drop-in for torch.nn.LayerNorm (same signature, parameters, init, state_dict)."""

    __constants__ = ["normalized_shape", "eps", "elementwise_affine"]
    normalized_shape: tuple[int, ...]
    eps: float
    elementwise_affine: bool

    def __init__(
        self,
        normalized_shape: _shape_t,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if self.elementwise_affine:
            self.weight = Parameter(torch.empty(self.normalized_shape, **factory_kwargs))
            if bias:
                self.bias = Parameter(torch.empty(self.normalized_shape, **factory_kwargs))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.elementwise_affine:
            init.ones_(self.weight)
            if self.bias is not None:
                init.zeros_(self.bias)

    def forward(self, input: Tensor) -> Tensor:
        return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)

    # The installed torch's own repr (it reads the same attributes): torch 2.14 prints bias=,
    # 2.11 does not, and a drop-in prints what the torch beside it prints.
    extra_repr = torch.nn.LayerNorm.extra_repr
