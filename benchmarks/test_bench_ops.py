"""CPU (and, with a GPU, GPU) microbenchmarks of each op per provider under pytest-benchmark:

    pytest benchmarks/ --benchmark-only                       # all ops, every provider that can run
    pytest benchmarks/ --benchmark-only -k add_layer_norm --benchmark-compare

One representative shape per op (the first of ``python -m benchmarks --quick``'s), mask kinds
none and causal, forward and forward+backward; the providers of one point share a benchmark
group, so the table reads reference vs torch vs cpu (vs triton / cuda on a GPU) side by side.
Each benchmark also records max |error| vs float64 on its input (extra_info) and fails when it
is not finite.
"""
from __future__ import annotations

import math

import pytest
import torch

from benchmarks import common, ops

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32


def _points():
    points = []
    for op in ops.OPS:
        cases = ops.cases(op, DEVICE, [DTYPE], "quick")
        first = cases[0].shape
        for case in cases:
            same_size = {k: v for k, v in case.shape.items() if k != "pass"} == \
                {k: v for k, v in first.items() if k != "pass"}
            if same_size and case.mask in ("none", "causal"):
                points.append(case)
    return points


POINTS = _points()


def _id(case):
    return f"{case.op}-{case.mask}-{case.shape['pass']}"


@pytest.mark.parametrize("provider", ops.PROVIDERS)
@pytest.mark.parametrize("case", POINTS, ids=[_id(c) for c in POINTS])
def test_op(benchmark, case, provider):
    g = ops.Draw(0, DEVICE)
    inputs = case.make(g)
    for name in case.grad_names:
        inputs[name].requires_grad_(True)
    reasons = ops.provider_reasons(provider, case, inputs, DEVICE)
    if reasons:
        pytest.skip("; ".join(reasons))
    upstream = None
    if case.backward:
        with torch.no_grad():
            probe = case.call({k: (v.detach() if isinstance(v, torch.Tensor) else v)
                               for k, v in inputs.items()}, "torch")
        upstream = ops._randn(g, *probe.shape, dtype=probe.dtype, device=DEVICE)

    ref_outs, ref_grads = (case.ref64 or (lambda i, u: ops._default_ref64(case, i, u)))(inputs, upstream)
    with torch.set_grad_enabled(case.backward):
        outs, grads = ops._forward_backward(case, inputs, provider, upstream)
    error = common.max_err([t.detach() for t in outs + grads], ref_outs + ref_grads)

    def step():
        with torch.set_grad_enabled(case.backward):
            result = ops._forward_backward(case, inputs, provider, upstream)
        common.sync(DEVICE)
        return result

    benchmark.group = f"{case.op} {common._shape_text(case.shape)} {case.mask} {case.shape['pass']}"
    benchmark.extra_info.update(max_err=error, dtype=common.dtype_name(DTYPE), device=str(DEVICE))
    benchmark.pedantic(step, rounds=5 if provider == "reference" else 20, warmup_rounds=1)
    assert math.isfinite(error), f"{provider}: max_err {error}"
