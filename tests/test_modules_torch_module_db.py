"""PyTorch's own module test inputs (torch.testing._internal.common_modules.module_db) run
through our modules and compared with torch's.

For every ModuleInput torch provides for MultiheadAttention, LayerNorm, TransformerEncoderLayer,
TransformerDecoderLayer, TransformerEncoder and Transformer (TransformerDecoder has no entry: its
samples are built from the decoder layer's, as torch builds the encoder's from the encoder
layer's), in float64 on the CPU, in eval and in training (every sample has dropout 0): torch's
module and ours with torch's weights (strict load) give the same outputs (attention weights
included), parameter gradients and input gradients, up to 1e-10.  A NaN from torch where ours
gives 0 (a fully masked row, a documented difference) is accepted.  The samples' own
reference_fn (test_modules.py's test_forward) is checked on ours, and a swap()ed copy of torch's
module matches as well.  Classes that the installed torch's module_db lacks are skipped.
"""
import copy

import pytest
import torch

import transformer_fast as tf
from _torch_internal import import_torch_internal

common_modules = import_torch_internal("common_modules")

pytestmark = [pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning"),
              pytest.mark.usefixtures("one_thread")]  # tiny samples


NAMES = ["MultiheadAttention", "LayerNorm", "TransformerEncoderLayer", "TransformerDecoderLayer",
         "TransformerEncoder", "TransformerDecoder", "Transformer"]
STACKS = ("TransformerEncoder", "TransformerDecoder")


def _info(torch_cls):
    return next((mi for mi in common_modules.module_db if mi.module_cls is torch_cls), None)


def _samples(name, training, dtype=torch.float64, requires_grad=True):
    """[(desc, ctor args, ctor kwargs, forward args, forward kwargs, reference_fn)]"""
    if name == "TransformerDecoder":
        mi = _info(torch.nn.TransformerDecoderLayer)
        if mi is None:
            pytest.skip("module_db has no TransformerDecoderLayer entry")
        out = []
        for s in mi.module_inputs_func(mi, device="cpu", dtype=dtype, requires_grad=requires_grad,
                                       training=training):
            k = dict(s.constructor_input.kwargs, device="cpu", dtype=dtype)
            layer = torch.nn.TransformerDecoderLayer(*s.constructor_input.args, **k)
            out.append((s.desc, (layer, 2), {}, s.forward_input.args, s.forward_input.kwargs, None))
        return out
    mi = _info(getattr(torch.nn, name))
    if mi is None:
        pytest.skip(f"module_db has no {name} entry in this torch")
    return [(s.desc, s.constructor_input.args, s.constructor_input.kwargs, s.forward_input.args,
             s.forward_input.kwargs, s.reference_fn)
            for s in mi.module_inputs_func(mi, device="cpu", dtype=dtype,
                                           requires_grad=requires_grad, training=training)
            if s.forward_input is not None]


def _pair(name, cargs, ckwargs, dtype=torch.float64):
    """torch's module and ours with its weights; a stack gets a swapped copy of torch's layer."""
    theirs = getattr(torch.nn, name)(*cargs, **ckwargs).to(dtype)
    oargs = list(cargs)
    if name in STACKS:
        oargs[0] = copy.deepcopy(cargs[0])
        tf.swap(oargs[0])
    ours = getattr(tf, name)(*oargs, **ckwargs).to(dtype)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return theirs, ours


def _clone(args, kwargs):
    def c(x):
        if not isinstance(x, torch.Tensor):
            return x
        return x.detach().clone().requires_grad_(x.requires_grad)
    return [c(a) for a in args], {k: c(v) for k, v in kwargs.items()}


def _flat(out):
    return list(out) if isinstance(out, tuple) else [out]


def _run(module, args, kwargs, seed):
    """Outputs, parameter gradients and input gradients of a random-weighted sum of outputs."""
    args, kwargs = _clone(args, kwargs)
    module.zero_grad(set_to_none=True)
    outs = _flat(module(*args, **kwargs))
    g = torch.Generator().manual_seed(seed)
    loss = sum((torch.nan_to_num(o, nan=0.0) * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum()
               for o in outs if o is not None)
    loss.backward()
    inputs = [t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor) and t.requires_grad]
    return (outs, {n: p.grad for n, p in module.named_parameters()}, [t.grad for t in inputs])


def _assert_close(theirs, ours, what):
    if theirs is None or ours is None:
        assert theirs is None and ours is None, what
        return
    assert theirs.shape == ours.shape and theirs.dtype == ours.dtype, what
    nan = torch.isnan(theirs)
    if nan.any():  # a fully masked row: torch NaN, ours 0 (documented)
        assert (ours[nan] == 0).all(), what
        theirs = torch.where(nan, torch.zeros_like(theirs), theirs)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10, msg=what)


def _compare(ref, got, tag):
    (t_out, t_grads, t_in), (o_out, o_grads, o_in) = ref, got
    assert len(t_out) == len(o_out), tag
    for i, (a, b) in enumerate(zip(t_out, o_out)):
        _assert_close(a, b, f"{tag}: output {i}")
    if any(o is not None and torch.isnan(o).any() for o in t_out):
        return  # torch's gradients are NaN through a fully masked row
    assert list(t_grads) == list(o_grads), tag
    for n in t_grads:
        _assert_close(t_grads[n], o_grads[n], f"{tag}: grad of {n}")
    for i, (a, b) in enumerate(zip(t_in, o_in)):
        _assert_close(a, b, f"{tag}: grad of input {i}")


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", NAMES)
def test_module_db_samples_match_torch(name, training):
    samples = _samples(name, training)
    assert samples
    for i, (desc, cargs, ckwargs, fargs, fkwargs, reference_fn) in enumerate(samples):
        tag = f"{name} sample {i} ({desc}) training={training}"
        theirs, ours = _pair(name, cargs, ckwargs)
        theirs.train(training)
        ours.train(training)
        ref = _run(theirs, fargs, fkwargs, seed=i)
        _compare(ref, _run(ours, fargs, fkwargs, seed=i), tag)
        if i % 3 == 0:
            with tf.use_backend("reference"):
                _compare(ref, _run(ours, fargs, fkwargs, seed=i), tag + " [reference backend]")
        if i % 4 == 0:  # swap() a copy of torch's module, then unswap it
            swapped = copy.deepcopy(theirs)
            tf.swap(swapped)
            _compare(ref, _run(swapped, fargs, fkwargs, seed=i), tag + " [swapped]")
            tf.unswap(swapped)
            assert not any(type(m).__module__.startswith("transformer_fast") for m in swapped.modules())
        if reference_fn is not None:  # test_modules.py's test_forward: the sample's own reference
            args, kwargs = _clone(fargs, fkwargs)
            out = ours(*args, **kwargs)
            args, kwargs = _clone(fargs, fkwargs)
            expected = reference_fn(ours, *args, **kwargs)
            for j, (a, b) in enumerate(zip(_flat(expected), _flat(out))):
                _assert_close(a, b, f"{tag}: reference_fn output {j}")


# --------------------------------------------------------------------------------------------
# The meta device (shapes only, no data): torch's modules run there (init on meta, shape
# inference); ours asked torch.is_autocast_enabled("meta"), which raises.


def _meta(module, args, kwargs):
    module = copy.deepcopy(module).to("meta")
    args = [a.detach().to("meta").requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
            for a in args]
    kwargs = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    outs = _flat(module(*args, **kwargs))
    sum(o.sum() for o in outs if o is not None).backward()
    return ([None if o is None else (o.shape, o.dtype, o.device.type) for o in outs],
            [(n, p.grad.shape, p.grad.device.type) for n, p in module.named_parameters()])


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", NAMES)
def test_forward_backward_on_meta_device_like_torch(name, training):
    desc, cargs, ckwargs, fargs, fkwargs, _ = _samples(name, training)[0]
    theirs, ours = _pair(name, cargs, ckwargs)
    theirs.train(training)
    ours.train(training)
    assert _meta(ours, fargs, fkwargs) == _meta(theirs, fargs, fkwargs)


@pytest.mark.parametrize("need_weights", [False, True])
def test_mha_float_mask_on_meta_device_like_torch(need_weights):
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    ours = tf.MultiheadAttention(8, 2, batch_first=True)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 5, 8, requires_grad=True)
    kwargs = dict(attn_mask=torch.randn(5, 5), key_padding_mask=torch.zeros(2, 5),
                  need_weights=need_weights)
    assert _meta(ours, (x, x, x), kwargs) == _meta(theirs, (x, x, x), kwargs)


# --------------------------------------------------------------------------------------------
# layer_norm_eps = 0.0: torch's layers run it; ours fused every LayerNorm into add_layer_norm,
# which refuses eps <= 0 (tests/test_add_layer_norm.py).  Such norms now run unfused.


@pytest.mark.parametrize("norm_first", [False, True], ids=["postLN", "preLN"])
@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_layers_with_layer_norm_eps_zero_like_torch(kind, norm_first):
    cls = "TransformerEncoderLayer" if kind == "encoder" else "TransformerDecoderLayer"
    ckwargs = dict(dim_feedforward=16, dropout=0.0, batch_first=True, norm_first=norm_first,
                   layer_norm_eps=0.0, dtype=torch.float64)
    theirs, ours = _pair(cls, (8, 2), ckwargs)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    args = (x,) if kind == "encoder" else (x, torch.randn(2, 3, 8, dtype=torch.float64))
    for module in (theirs, ours):
        module.train()
    expected = _flat(theirs(*args))
    got = _flat(ours(*args))
    g = [torch.randn_like(e) for e in expected]
    sum((e * w).sum() for e, w in zip(expected, g)).backward()
    sum((o * w).sum() for o, w in zip(got, g)).backward()
    for a, b in zip(expected, got):
        _assert_close(a, b, f"{cls} output")
    for (name, p_theirs), p_ours in zip(theirs.named_parameters(), ours.parameters()):
        _assert_close(p_theirs.grad, p_ours.grad, f"{cls} grad {name}")
