"""Training helpers for the paper's model: label-smoothed cross entropy that ignores padding,
the warm-up learning-rate schedule (paper section 5.3) and teacher forcing."""
from __future__ import annotations

import contextlib
import numbers

import torch
from torch import nn

from .. import _checks
from . import _validate

REDUCTIONS = ("mean", "sum", "none")


def check_targets(target, shape: tuple, vocab: int, smoothing, ignore_index, reduction: str, against: str):
    """The loss arguments' checks shared with linear_cross_entropy (``against``: the possessive
    of the input whose shape target must match); returns (keep, safe_target):
    keep (...) bool, False at ignore_index; safe_target (...) int64 with 0 there."""
    if not isinstance(target, torch.Tensor) or target.dtype not in _validate.INT_DTYPES:
        raise TypeError(f"target must be an integer torch.Tensor; got "
                        f"{target.dtype if isinstance(target, torch.Tensor) else type(target).__name__}")
    if tuple(target.shape) != shape:
        raise ValueError(f"target must have {against} shape without the class dimension {shape}; "
                         f"got {tuple(target.shape)}")
    if isinstance(smoothing, bool) or not isinstance(smoothing, numbers.Real) or not 0 <= smoothing <= 1:
        raise ValueError(f"smoothing must be a float in [0, 1]; got {smoothing!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}; got {reduction!r}")
    if ignore_index is not None:
        ignore_index = _validate.integer("ignore_index", ignore_index)
    keep = torch.ones_like(target, dtype=torch.bool) if ignore_index is None else target != ignore_index
    safe_target = torch.where(keep, target, torch.zeros_like(target)).long()
    mode = _checks.value_check_mode(target.device)
    # (Under torch.func.vmap a batched target's values cannot be read: torch refuses the branch.
    # Dynamo cannot trace the question, and while it traces the mode is "device".)
    if mode != "off" and not torch.compiler.is_compiling() and torch._C._functorch.is_functorch_wrapped_tensor(target):
        mode = "off"
    if mode == "host" and bool(keep.any()):
        low, high = int(safe_target[keep].min()), int(safe_target[keep].max())
        if low < 0 or high >= vocab:
            raise ValueError(f"target must hold class ids in [0, {vocab}); got [{low}, {high}]")
    elif mode == "device" and target.numel():
        # A GPU's hot path: no host sync; the fused row kernel reads logits at the target, so an
        # id out of range stops the stream here (as torch's cross entropy asserts on the device).
        torch._assert_async(((safe_target >= 0) & (safe_target < vocab)).all(),
                            f"cross entropy: target holds a class id outside [0, {vocab})")
    return keep, safe_target


def label_smoothed_cross_entropy(logits: torch.Tensor, target: torch.Tensor, smoothing: float = 0.1,
                                 ignore_index: int | None = None, reduction: str = "mean") -> torch.Tensor:
    """Cross entropy against ``(1 - smoothing) * one_hot(target) + smoothing / V``.

    Per token: ``-(1 - eps) * log p[target] - eps * mean_v log p[v]`` (the same smoothed
    distribution as ``F.cross_entropy(label_smoothing=eps)``).  Tokens equal to
    ``ignore_index`` (padding) count for nothing: "mean" divides by the number of the others
    (0 when there are none), "none" returns zeros there.

    Args:
        logits: (..., V) float.
        target: (...) integer class ids in [0, V) (or ignore_index).
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point torch.Tensor; got "
                        f"{logits.dtype if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    if logits.dim() < 1:
        raise ValueError("logits must have a class dimension (..., V); got a 0-d tensor")
    keep, safe_target = check_targets(target, tuple(logits.shape[:-1]), logits.shape[-1], smoothing,
                                      ignore_index, reduction, "logits'")
    wide = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    logp = torch.log_softmax(wide, dim=-1)  # (..., V): half-precision logits upcast to float32
    nll = -logp.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)  # (...)
    loss = (1.0 - smoothing) * nll
    if smoothing > 0.0:  # skipped at 0: 0 * inf (a class masked with -inf) would be NaN
        loss = loss + smoothing * -logp.mean(dim=-1)
    loss = loss.masked_fill(~keep, 0.0)  # not a product: NaN/inf logits at padding count for nothing
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / keep.sum().clamp(min=1)


class LabelSmoothedCrossEntropy(nn.Module):
    """Module form of label_smoothed_cross_entropy (``ignore_index`` is usually the pad id)."""

    def __init__(self, smoothing: float = 0.1, ignore_index: int | None = None, reduction: str = "mean"):
        super().__init__()
        self.smoothing, self.ignore_index, self.reduction = smoothing, ignore_index, reduction

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return label_smoothed_cross_entropy(logits, target, self.smoothing, self.ignore_index, self.reduction)


def warmup_lr_lambda(d_model: int, warmup_steps: int = 4000, scale: float = 1.0):
    """The paper's rate as a function of the 0-based scheduler step s (update s + 1):
    ``scale * d_model**-0.5 * min((s + 1)**-0.5, (s + 1) * warmup_steps**-1.5)`` -- linear
    warm-up for warmup_steps updates, then inverse square root decay."""
    d_model = _validate.positive_int("d_model", d_model)
    warmup_steps = _validate.positive_int("warmup_steps", warmup_steps)
    scale = _validate.finite_float("scale", scale, positive=True)

    def rate(step: int) -> float:
        n = step + 1
        return scale * d_model ** -0.5 * min(n ** -0.5, n * warmup_steps ** -1.5)

    return rate


def warmup_scheduler(optimizer: torch.optim.Optimizer, d_model: int, warmup_steps: int = 4000,
                     scale: float = 1.0) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR following warmup_lr_lambda.  LambdaLR multiplies the optimizer's own lr, so
    build the optimizer with lr=1.0 to get the paper's rate (the paper: Adam with betas
    (0.9, 0.98), eps 1e-9, warmup_steps 4000).  Call ``scheduler.step()`` after each update."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_lr_lambda(d_model, warmup_steps, scale))


def shift_right(tgt: torch.Tensor, bos_id: int) -> torch.Tensor:
    """Teacher forcing: the decoder input for target ``tgt`` (B, T) (tokens, eos, padding) is
    ``[bos, tgt[:, :-1]]`` (B, T): position t sees the true tokens before t and predicts tgt[:, t]."""
    if not isinstance(tgt, torch.Tensor) or tgt.dtype not in _validate.INT_DTYPES:
        raise TypeError(f"tgt must be an integer torch.Tensor of token ids; got "
                        f"{tgt.dtype if isinstance(tgt, torch.Tensor) else type(tgt).__name__}")
    if tgt.dim() != 2:
        raise ValueError(f"tgt must have shape (batch, length); got {tuple(tgt.shape)}")
    if isinstance(bos_id, bool) or not isinstance(bos_id, int) or bos_id < 0:
        raise ValueError(f"bos_id must be a token id (an int >= 0); got {bos_id!r}")
    bos = torch.full_like(tgt[:, :1], bos_id)
    return torch.cat([bos, tgt[:, :-1]], dim=1)


def _fused_loss_applies(model) -> bool:
    """Whether Seq2SeqTransformer.loss computes what model(...) then the loss would: the class's
    own forward / decode, and a plain Linear generator without hooks (loss does not call it)."""
    from .seq2seq import Seq2SeqTransformer  # here: seq2seq imports this module (through fused_loss)

    cls = type(model)
    generator = getattr(model, "generator", None)
    return (isinstance(model, Seq2SeqTransformer) and cls.forward is Seq2SeqTransformer.forward
            and cls.decode is Seq2SeqTransformer.decode and type(generator) is nn.Linear
            and not generator._forward_hooks and not generator._forward_pre_hooks)


def train_step(model, src: torch.Tensor, tgt: torch.Tensor, optimizer: torch.optim.Optimizer,
               scheduler=None, smoothing: float = 0.1, clip_norm: float | None = 1.0,
               autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """One teacher-forced update of a Seq2SeqTransformer on (src (B, S), tgt (B, T)), where tgt
    is the target without bos (tokens, eos, then pad).  Returns the detached loss (no host sync).
    ``autocast_dtype`` (e.g. torch.bfloat16) runs forward under torch.autocast; ``clip_norm``
    (> 0, or None for no clipping) bounds the gradients' global norm."""
    device = next(model.parameters()).device
    _validate.tokens("tgt", tgt, model.tgt_vocab_size, device=device)
    if isinstance(src, torch.Tensor) and src.dim() >= 1 and tgt.shape[0] != src.shape[0]:
        raise ValueError(f"tgt must have src's batch size ({src.shape[0]}); got {tgt.shape[0]}")
    if clip_norm is not None:
        clip_norm = _validate.finite_float("clip_norm", clip_norm, positive=True)
    if autocast_dtype is not None and not isinstance(autocast_dtype, torch.dtype):
        raise TypeError(f"autocast_dtype must be a torch.dtype or None; got {autocast_dtype!r}")
    model.train()
    tgt_in = shift_right(tgt, model.bos_id)
    ctx = (torch.autocast(src.device.type, dtype=autocast_dtype) if autocast_dtype is not None
           else contextlib.nullcontext())
    fused = _fused_loss_applies(model)
    with ctx:
        # fused: label_smoothed_cross_entropy(model(src, tgt_in), tgt, ...) without the logits
        out = model.loss(src, tgt_in, tgt, smoothing) if fused else model(src, tgt_in)
    loss = out if fused else label_smoothed_cross_entropy(out, tgt, smoothing, ignore_index=model.pad_id)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if clip_norm is not None:
        nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return loss.detach()


class CudaGraphStep:
    """A whole training step (forward, backward, optimizer step) captured once as a CUDA graph and
    replayed: one graph launch per step instead of hundreds of kernel launches and the Python
    that issues them, for steps whose time goes to the host (small batches, a slow host CPU).

        opt = torch.optim.Adam(model.parameters(), lr=1e-4, capturable=True)

        def step(src, tgt_in, tgt_out):
            loss = model.loss(src, tgt_in, tgt_out)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        graphed = CudaGraphStep(step, optimizer=opt)
        for src, tgt_in, tgt_out in batches:  # the same shapes every step
            loss = graphed(src, tgt_in, tgt_out)

    The first ``warmup`` calls run ``step`` eagerly on a side stream (compiling and autotuning
    the kernels, creating workspaces and the optimizer's state); the next one captures it and
    replays the capture once (a capture records kernels without running them); every later call
    copies its tensor arguments into the captured inputs and replays.  As for any CUDA graph:
    tensor arguments of the same shape, dtype and device every call (other arguments equal), no
    host synchronisation inside ``step`` (the package's modules and ops have none on a GPU), an
    optimizer that steps on the device (``capturable=True`` for Adam / AdamW; given as
    ``optimizer``, it is checked and its gradients are set to None before the capture, so that
    the captured backward writes them instead of adding to them).  Dropout draws fresh masks at
    every replay (torch's CUDA generator advances per replay, and the fused kernels read their
    Philox seed from device memory).

    Returns what ``step`` returns (e.g. the detached loss): after the capture, the graph's own
    tensor, rewritten by the next call; clone it to keep it.  Unless the tensor arguments and the
    optimizer's parameters are all on one CUDA device (a CPU model, say), or with
    ``enabled=False``, ``step`` simply runs every call.
    """

    def __init__(self, step, optimizer: torch.optim.Optimizer | None = None, warmup: int = 3,
                 enabled: bool = True):
        if not callable(step):
            raise TypeError(f"step must be callable; got {type(step).__name__}")
        warmup = _validate.positive_int("warmup", warmup)  # eager steps before the capture
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or None; got {type(optimizer).__name__}")
        self.step, self.optimizer, self.warmup = step, optimizer, warmup
        self.enabled = _checks.boolean("enabled", enabled)
        self.calls = 0
        self.graph = None
        self.static_args: list | None = None
        self.output = None
        self._side_stream = None  # the warm-up's (one per instance: cuBLAS caches per stream)
        self.device: torch.device | None = None

    def _cuda_device(self, args) -> torch.device | None:
        """The one CUDA device of the tensor arguments and parameters, or None."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if self.optimizer is not None:
            tensors += [p for group in self.optimizer.param_groups for p in group["params"]]
        devices = {t.device for t in tensors}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            return None
        return next(iter(devices))

    def _check_optimizer(self) -> None:
        if self.optimizer is None:
            return
        for group in self.optimizer.param_groups:
            if "capturable" in group and not group["capturable"]:
                raise ValueError(
                    f"optimizer: {type(self.optimizer).__name__} must be built with capturable=True to "
                    "step inside a CUDA graph (its step count and update then stay on the device)"
                )

    def __call__(self, *args):
        device = self.device if self.graph is not None else (self._cuda_device(args) if self.enabled else None)
        if device is None:
            return self.step(*args)
        self.device = device
        with torch.cuda.device(device):  # streams and the graph on the step's GPU, whichever is current
            return self._cuda_call(args)

    def _cuda_call(self, args):
        self.calls += 1
        if self.calls == 1:
            self._check_optimizer()  # before any step: a step it cannot capture should not run
        if self.graph is not None:
            self._copy_in(args)
            self.graph.replay()
            return self.output
        if self.calls <= self.warmup:
            # On a side stream, as torch's whole-network capture recipe: the lazy state the
            # warm-up creates (cuBLAS handles, workspaces) is then not tied to the default stream.
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream()
            side = self._side_stream
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = self.step(*args)
            torch.cuda.current_stream().wait_stream(side)
            return out
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self.static_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.output = self.step(*self.static_args)
        except Exception as exc:
            raise RuntimeError(
                f"capturing the training step as a CUDA graph failed ({type(exc).__name__}: {exc}); an op "
                "in the step cannot be captured (a host synchronisation, a CPU tensor, a changing shape): "
                "run the step without CudaGraphStep"
            ) from exc
        self.graph = graph
        graph.replay()  # the capture recorded this call's step without running it
        return self.output

    def _copy_in(self, args) -> None:
        if len(args) != len(self.static_args):
            raise ValueError(f"CudaGraphStep: the captured step took {len(self.static_args)} arguments; "
                             f"got {len(args)}")
        for i, (new, old) in enumerate(zip(args, self.static_args)):
            if isinstance(old, torch.Tensor):
                if (not isinstance(new, torch.Tensor) or new.shape != old.shape or new.dtype != old.dtype
                        or new.device != old.device):
                    got = (f"{tuple(new.shape)} {new.dtype} on {new.device}" if isinstance(new, torch.Tensor)
                           else type(new).__name__)
                    raise ValueError(
                        f"CudaGraphStep: argument {i} must match the captured one ({tuple(old.shape)} "
                        f"{old.dtype} on {old.device}); got {got}"
                    )
                if new.data_ptr() != old.data_ptr():
                    old.copy_(new)
            elif new != old:
                raise ValueError(f"CudaGraphStep: argument {i} must equal the captured one ({old!r}); got {new!r}")
