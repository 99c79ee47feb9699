"""Host time of the triton backend's calls, measured without a GPU.

    python benchmarks/triton_host_time.py [--case NAME ...] [--python-top N]
    PYTHONPATH=.venv/triton36 python benchmarks/triton_host_time.py    # with the GPU machines' Triton 3.6

On the lent GPU machines small calls on the triton backend are bound by the host (a Triton
add_layer_norm forward at 16384 x 1024 took 0.098 ms where the cuda one took 0.051; benchmarks/
NOTES.md).  This measures that host time on any machine: Triton's own launch path runs for real
(its JIT cache lookup and argument specialisation, the autotuner's key, our launchers, the ops,
functional and module layers above them) against a stand-in driver that answers device queries
as a Hopper GPU (sm_90) and launches nothing.  Kernels are compiled for sm_90 by the installed
Triton on their first call (seconds per kernel, cached by Triton on disk).

Not counted: Triton's C launcher (argument packing and cuLaunchKernelEx, a few microseconds
a launch on a GPU host).  Different from a GPU: tensors are CPU tensors, so the torch ops
between launches (allocations, views, small reductions) run on the CPU instead of being
launched, launchers that branch on the device type take their non-CUDA branch (the FFN GEMM
its pointer kernel, not the TMA one; grid sizes from 4 "SMs"), and a GPU host may be slower or
faster per Python operation than this one.  Shapes are tiny so that the CPU's own arithmetic
stays negligible; host time hardly depends on shape.

Per case: microseconds per call (the minimum over --rounds rounds of --calls calls), Triton
launches per call, and the part of the call spent in Triton's ``JITFunction.run`` (a second
pass with it replaced by a no-op).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

# Triton fixes interpreted or compiled mode when it is imported: this tool needs compiled.
os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("TRANSFORMER_FAST_AUTOTUNE", "0")  # one config per key: no timing runs

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.driver import GPUDriver  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

SMS = 132


class _Counter:
    launches = 0


class _Launcher:
    """Stands in for Triton's compiled C launcher."""

    def __init__(self, src, metadata):
        pass

    def __call__(self, *args):
        _Counter.launches += 1


class _Utils:
    def load_binary(self, name, kernel, shared, device):
        return 0, 0, 64, 0, 1024  # module, function, registers, spills, max threads

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": SMS, "max_num_regs": 65536,
                "warpSize": 32, "sm_clock_rate": 1980000, "mem_clock_rate": 2619000, "mem_bus_width": 5120}


class HostOnlyDriver(GPUDriver):
    """A CUDA driver for Triton without a GPU: device 0 is an sm_90 part, launches do nothing."""

    def __init__(self):  # not GPUDriver's: it would ask torch.cuda
        self.utils = _Utils()
        self.launcher_cls = _Launcher
        self.get_device_capability = lambda device=None: (9, 0)
        self.get_current_stream = lambda device=None: 0
        self.get_current_device = lambda: 0
        self.set_current_device = lambda device: None

    @staticmethod
    def is_active():
        return True

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cuda", 0)

    def get_device_interface(self):
        return torch.cuda

    def map_python_to_cpp_type(self, ty: str) -> str:
        from triton.backends.nvidia.driver import ty_to_cpp

        return ty_to_cpp(ty)

    def get_benchmarker(self):
        def bench(kernel_call, quantiles=None, **kwargs):
            kernel_call()  # compiles; every config "takes" the same time, the first is kept
            return [1.0, 1.0, 1.0] if quantiles else 1.0

        return bench


def _install(hopper_tma: bool = False) -> None:
    driver.set_active(HostOnlyDriver())
    from transformer_fast import backends

    if hopper_tma:  # 16-bit FFN GEMMs on the persistent TMA kernel, as on a Hopper GPU
        from transformer_fast.kernels import ffn

        ffn._tma_capable = lambda t: True
        ffn.sm_count = lambda device: SMS  # its persistent grid

    # The triton backend takes CPU tensors only under the interpreter; here they stand for CUDA
    # tensors with the kernels compiled.
    backends.triton_interpreting = lambda: True
    backends._triton_mode_reason = lambda: None


# ---------------------------------------------------------------------------------------------
# Cases: name -> builder returning a no-argument call


def _ops_cases():
    import transformer_fast as tf
    from transformer_fast import functional as F

    dt = torch.bfloat16
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, grad=False):
        return torch.randn(*shape, generator=g).to(dt).requires_grad_(grad)

    def with_grad(fn, outs):
        def call():
            out = fn()
            out = out[0] if isinstance(out, tuple) else out
            out.backward(outs)
        return call

    m, n = 16, 64
    x, r, w, b = rnd(m, n), rnd(m, n), rnd(n), rnd(n)
    xg, rg, wg, bg = rnd(m, n, grad=True), rnd(m, n, grad=True), rnd(n, grad=True), rnd(n, grad=True)
    B, H, L, D = 2, 2, 8, 16
    q, k, v = rnd(B, H, L, D), rnd(B, H, L, D), rnd(B, H, L, D)
    qg, kg, vg = rnd(B, H, L, D, grad=True), rnd(B, H, L, D, grad=True), rnd(B, H, L, D, grad=True)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[0, -2:] = True
    w1, b1, w2, b2 = rnd(4 * n, n), rnd(4 * n), rnd(n, 4 * n), rnd(n)
    w1g, b1g, w2g, b2g = (t.detach().clone().requires_grad_() for t in (w1, b1, w2, b2))
    scores, scores_g = rnd(B, H, L, L), rnd(B, H, L, L, grad=True)

    def op(fn):
        def call():
            with tf.use_backend("triton"):
                return fn()
        return call

    return {
        "add_layer_norm": op(lambda: F.add_layer_norm(x, r, w, b)),
        "add_layer_norm fwd+bwd": op(with_grad(lambda: F.add_layer_norm(xg, rg, wg, bg), torch.ones(m, n, dtype=dt))),
        "sdpa key_padding": op(lambda: F.scaled_dot_product_attention(q, k, v, key_padding_mask=kpm)),
        "sdpa key_padding fwd+bwd": op(with_grad(
            lambda: F.scaled_dot_product_attention(qg, kg, vg, key_padding_mask=kpm), torch.ones(B, H, L, D, dtype=dt))),
        "feed_forward": op(lambda: F.feed_forward(x, w1, b1, w2, b2)),
        "feed_forward fwd+bwd": op(with_grad(
            lambda: F.feed_forward(xg, w1g, b1g, w2g, b2g), torch.ones(m, n, dtype=dt))),
        "masked_softmax causal": op(lambda: F.masked_softmax(scores, is_causal=True)),
        "masked_softmax causal fwd+bwd": op(with_grad(
            lambda: F.masked_softmax(scores_g, is_causal=True), torch.ones(B, H, L, L, dtype=dt))),
    }


def _layer_cases():
    import transformer_fast as tf

    dt = torch.bfloat16
    torch.manual_seed(0)
    B, L, d, h = 2, 8, 64, 2
    # One module per mode: a .train() call per call would add its own host time.
    enc = {m: tf.TransformerEncoderLayer(d, h, 4 * d, dropout=0.1, batch_first=True).to(dt).train(m)
           for m in (True, False)}
    dec = {m: tf.TransformerDecoderLayer(d, h, 4 * d, dropout=0.1, batch_first=True).to(dt).train(m)
           for m in (True, False)}
    x = torch.randn(B, L, d, dtype=dt, requires_grad=True)
    mem = torch.randn(B, L, d, dtype=dt, requires_grad=True)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[0, -2:] = True
    causal = torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=dt)

    def enc_call(train):
        def call():
            with tf.use_backend("triton"), torch.set_grad_enabled(train):
                y = enc[train](x, src_key_padding_mask=kpm)
                if train:
                    y.sum().backward()
        return call

    def dec_call(train):
        def call():
            with tf.use_backend("triton"), torch.set_grad_enabled(train):
                y = dec[train](x, mem, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=kpm)
                if train:
                    y.sum().backward()
        return call

    return {
        "encoder layer train fwd+bwd": enc_call(True),
        "encoder layer eval": enc_call(False),
        "decoder layer train fwd+bwd": dec_call(True),
        "decoder layer eval": dec_call(False),
    }


def _time_us(call, calls: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def _no_launch(self, *args, grid, warmup, **kwargs):
    _Counter.launches += 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", nargs="*", help="substrings of the case names to run (default: all)")
    parser.add_argument("--calls", type=int, default=100, help="calls per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hopper-tma", action="store_true",
                        help="16-bit FFN GEMMs on the TMA kernel, as on a Hopper (not the pointer kernel)")
    parser.add_argument("--python-top", type=int, default=0,
                        help="also the N Python functions with the most own time per case (cProfile)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    _install(args.hopper_tma)
    cases = {**_ops_cases(), **_layer_cases()}
    if args.case:
        cases = {k: v for k, v in cases.items() if any(s in k for s in args.case)}
    print(f"Triton {triton.__version__}, torch {torch.__version__}; host time per call, no GPU "
          "(stand-in sm_90 driver; launches not issued)")
    print(f"{'case':32s} {'us/call':>9s} {'launches':>9s} {'in JITFunction.run':>19s}")
    real_run = JITFunction.run
    for name, call in cases.items():
        call()  # compile and tune
        before = _Counter.launches
        call()
        launches = _Counter.launches - before
        total = _time_us(call, args.calls, args.rounds)
        JITFunction.run = _no_launch
        try:
            without = _time_us(call, args.calls, args.rounds)
        finally:
            JITFunction.run = real_run
        print(f"{name:32s} {total:9.1f} {launches:9d} {total - without:19.1f}", flush=True)
        if args.python_top:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                call()
            prof.disable()
            pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(args.python_top)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
