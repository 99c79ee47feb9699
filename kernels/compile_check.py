"""Compile the Triton kernels for a GPU target without a GPU (ahead of time, through ptxas).

The interpreter (TRITON_INTERPRET=1) checks what kernels compute, not that they compile: a
construct the interpreter accepts can still be rejected by Triton's compiler (or by an older
Triton, such as the 3.6 on the GPU machines).  This module builds the launch configurations the
launchers can pick, for sm_90 by default, with the installed Triton and its bundled ptxas:

    TRITON_INTERPRET=0 python -m transformer_fast.kernels.compile_check [--quick] [--resources] [-j N]

Kernels: kernels/layer_norm.py, kernels/attention.py (forward, delta, dk/dv, dq),
kernels/decode.py (split-K forward, combine, cache append), kernels/masked_softmax.py
(fused and looped paths, forward and backward), kernels/ffn.py (the autotuned GEMMs, pointer
and persistent TMA, with their forward and dact epilogues for every activation, with and without
dropout, and the elementwise act-grad / column-sum kernel) and kernels/cross_entropy.py (the fused
loss's row kernel).

How the configurations are found.  The launchers themselves are called, on ``meta`` tensors
(no memory, no device), with their kernels replaced by recorders; each recorded launch is turned
into what ``JITFunction.run`` would compile: the signature and the specialisation come from
Triton's own ``native_specialize_impl`` (pointers and integers divisible by 16 get
``tt.divisibility = 16``, integers equal to 1 become constexprs), so the compiled variant is the
one a real launch runs (without the divisibility attributes Triton does not pipeline loads
through shared memory).  Autotuned kernels contribute every configuration their
``early_config_prune`` keeps for the recorded arguments.  The launchers' device queries are
answered as on an H100 (132 SMs).  Scenario lists (dtypes, head dims, masks, causal, dropout,
sequence lengths) are below; ``--quick`` is a representative subset (bf16 and fp32, head dims 64
and 128 (fp32: 64 and 256), the first configuration of each autotune list, a few flag sets) for
CI.  A first configuration past the shared memory of the target fails the check: it is the one
config that TRANSFORMER_FAST_AUTOTUNE=0 runs.

It must run with the interpreter off (the @triton.jit decorators read TRITON_INTERPRET when the
kernels are imported).  --resources prints registers / spill stack (cuobjdump) and shared memory
(Triton's metadata) per configuration.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time

HIDDEN_SIZES = (1, 7, 127, 512, 768, 1000, 4096, 8192, 12288, 65536)
DTYPES = ("bf16", "fp16", "fp32")
KERNEL_SETS = ("layer_norm", "attention", "decode", "masked_softmax", "ffn", "cross_entropy")
H100_SMS = 132

# ---------------------------------------------------------------------------------------------
# Recording launches


class _Job:
    __slots__ = ("fn", "signature", "constexprs", "attrs", "options", "label", "autotuned", "first")

    def __init__(self, fn, signature, constexprs, attrs, options, label, autotuned=False):
        self.fn, self.signature, self.constexprs = fn, signature, constexprs
        self.attrs, self.options, self.label = attrs, options, label
        self.autotuned = autotuned
        self.first = True  # the config a launch runs alone (autotuned: the first kept, as with AUTOTUNE=0)

    def key(self):
        return (self.fn.__name__, tuple(self.signature.items()), repr(sorted(self.constexprs.items())),
                repr(sorted(self.attrs.items())), tuple(sorted(self.options.items())))


class _Recorder:
    """Stands in for a kernel (or an autotuner) in a launcher: ``k[grid](*args, **kwargs)``
    records the launch instead of running it."""

    def __init__(self, kernel, sink):
        self.kernel, self.sink = kernel, sink

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.sink.append((self.kernel, args, kwargs))
        return launch


@contextlib.contextmanager
def _patched(module, **values):
    old = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(module, name, value)


@contextlib.contextmanager
def _recording(module, names, sink):
    with _patched(module, **{n: _Recorder(getattr(module, n), sink) for n in names}):
        yield


def _jit_fn(kernel):
    from triton.runtime.jit import JITFunction

    fn = kernel
    while not isinstance(fn, JITFunction):
        fn = fn.fn
    return fn


def _job(fn, args, kwargs, label) -> _Job:
    """What JITFunction.run compiles for ``fn[grid](*args, **kwargs)``."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    bound = dict(zip(fn.arg_names, args))
    options = {}
    for k, v in kwargs.items():
        if k in fn.arg_names:
            bound[k] = v
        elif v is not None:
            options[k] = v
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        value = bound[p.name] if p.name in bound else p.default
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", value
            continue
        ty, spec = native_specialize_impl(BaseBackend, value, p.is_const, not p.do_not_specialize,
                                          not p.do_not_specialize_on_alignment)
        if p.annotation_type and ty != "constexpr":
            ty = p.annotation_type
        if ty == "constexpr":
            signature[p.name], constexprs[p.name] = "constexpr", spec
            continue
        signature[p.name] = ty
        if isinstance(spec, str) and BaseBackend.parse_attr(spec):
            attrs[(i,)] = BaseBackend.parse_attr(spec)
    opts = " ".join(f"{k.replace('num_', '')}={v}" for k, v in sorted(options.items()) if k != "num_ctas")
    return _Job(fn, signature, constexprs, attrs, options, f"{label} {opts}".strip())


def _jobs_from(records, label, first_config_only=False):
    """Jobs for recorded launches; an autotuner gives one job per config its pruning keeps."""
    from triton.runtime.autotuner import Autotuner

    jobs = []
    for kernel, args, kwargs in records:
        if isinstance(kernel, Autotuner):
            kernel.nargs = dict(zip(kernel.arg_names, args))
            try:
                configs = kernel.prune_configs(kwargs)
            finally:
                kernel.nargs = None
            if first_config_only:
                configs = configs[:1]
            for i, cfg in enumerate(configs):
                blocks = " ".join(f"{k}={v}" for k, v in cfg.kwargs.items())
                if cfg.pre_hook:  # e.g. the TMA descriptors' boxes (their type in the signature)
                    cfg.pre_hook({**dict(zip(kernel.arg_names, args)), **kwargs, **cfg.all_kwargs()})
                job = _job(_jit_fn(kernel), args, {**kwargs, **cfg.all_kwargs()}, f"{label} {blocks}")
                job.autotuned, job.first = True, i == 0
                jobs.append(job)
        else:
            fn = _jit_fn(kernel)
            blocks = " ".join(f"{k}={kwargs[k]}" for k in kwargs if k.startswith("BLOCK_") or k == "SPLITS_P2")
            jobs.append(_job(fn, args, kwargs, f"{label} {blocks}"))
    return jobs




def _dt(name):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _meta(*shape, dtype):
    import torch

    return torch.empty(shape, dtype=dtype, device="meta")


def _rng():
    import torch

    return torch.empty(2, dtype=torch.int64, device="meta")


# ---------------------------------------------------------------------------------------------
# Scenarios per kernel file


def _layer_norm_jobs(dtypes=DTYPES, quick=False):
    from transformer_fast.kernels import layer_norm as K

    sizes = (7, 768, 1000, 65536) if quick else HIDDEN_SIZES  # 7: fp32 rows of <= 8 in float64
    rows = (4096,) if quick else (4096, 1)
    jobs = []
    with _patched(K, _num_sms=lambda device: H100_SMS):
        for dt in dtypes:
            for n in sizes:
                for m in rows:
                    for drop in (False, True):
                        p = 0.1 if drop else 0.0
                        rec = []
                        x, r = _meta(m, n, dtype=_dt(dt)), _meta(m, n, dtype=_dt(dt))
                        w, b = _meta(n, dtype=_dt("fp32")), _meta(n, dtype=_dt("fp32"))
                        with _recording(K, ("_fwd_kernel", "_fwd_stats_kernel"), rec):
                            y, h, mean, rstd = _ln_fwd(K, x, r, w, b, p)
                        with _recording(K, ("_bwd_kernel", "_bwd_stats_kernel"), rec):
                            K.add_layer_norm_bwd(y, h, x, r, w, b, mean, rstd, p, _rng() if drop else None)
                        jobs += _jobs_from(rec, f"layer_norm {dt} M={m} N={n} dropout={drop}")
    return jobs


def _ln_fwd(K, x, r, w, b, p):
    out = K.add_layer_norm_fwd(x, r, w, b, 1e-5, p, _rng() if p else None, True)
    y, h, mean, rstd = out[:4]
    return y, h, mean, rstd


# Attention flag sets: (is_causal, attn_mask kind, key_padding_mask, dropout)
_ATTN_PLAIN = ((False, None, False, False), (True, None, False, False))
_ATTN_FLAGS = _ATTN_PLAIN + ((True, None, False, True), (True, "float", True, True), (False, "bool", True, True))


def _attention_scenarios(dtypes, quick):
    """(dtype, tf32, head dim, Lq = Lk, flags, (Hkv divisor, forced GQA split, OFF64, atomic dq)).
    Atomic dq None: the launcher's rule (16-bit rows of more than 128 keys add up dq in the dk/dv
    kernel); False: the dq kernel, as under torch.use_deterministic_algorithms."""
    plain = ((1, None, False, None),)
    dq_kernel = (1, None, False, False)
    if quick:  # fp32 (exact dots: 3-30 s per config to compile) at D 64 and 256 (float64 operands
        for dt in dtypes:  # past the shared memory of sm_90 once, 2026-12-02)
            for D in ((64, 256) if dt == "fp32" else (64, 128)):
                for flags in (_ATTN_FLAGS[0], _ATTN_FLAGS[3]):
                    yield dt, False, D, 1024, flags, plain + ((dq_kernel,) if dt != "fp32" and D == 128 else ())
                    if dt != "fp32" and D == 64:  # short 16-bit rows: the dq kernel's EXACT_DELTA pass
                        yield dt, False, D, 64, flags, plain
        return
    for dt in dtypes:
        # fp32: exact (ieee) dots by default (torch's allow_tf32 is off), tf32 when allowed.
        for tf32 in ((False, True) if dt == "fp32" else (False,)):
            main = dt in ("bf16", "fp32") and not tf32
            for D in ((16, 64, 80, 128, 256) if main else (64, 128, 256)):
                for flags in _ATTN_FLAGS:
                    extra = ((2, 2, False, None), (1, None, True, None)) if main and flags == _ATTN_FLAGS[0] else ()
                    if dt != "fp32":
                        extra += (dq_kernel,)
                    yield dt, tf32, D, 1024, flags, plain + extra
                for L in (1, 64):  # short sequences: the small-tile configs the pruning keeps
                    for flags in _ATTN_PLAIN:
                        yield dt, tf32, D, L, flags, plain


def _attention_jobs(dtypes=DTYPES, quick=False):
    import torch
    from transformer_fast.kernels import attention as A

    B, H = 2, 4
    jobs = []
    for dt, tf32, D, L, (causal, mask, kpm, drop), variants in _attention_scenarios(dtypes, quick):
        for hkv_div, split, off64, atomic in variants:
            hkv = H // hkv_div
            q = _meta(B, H, L, D, dtype=_dt(dt))
            k, v = _meta(B, hkv, L, D, dtype=_dt(dt)), _meta(B, hkv, L, D, dtype=_dt(dt))
            am = None
            if mask == "bool":
                am = _meta(B, 1, L, L, dtype=torch.bool).expand(B, H, L, L)
            elif mask == "float":
                am = _meta(B, 1, L, L, dtype=_dt(dt)).expand(B, H, L, L)
            pad = _meta(B, L, dtype=torch.bool) if kpm else None
            p, rng = (0.1, _rng()) if drop else (0.0, None)
            rec = []
            with _patched(A, FORCE_GQA_SPLIT=split, FORCE_OFF64=off64, FORCE_ATOMIC_DQ=atomic):
                with _recording(A, ("_fwd", "_kpm_ranges_kernel"), rec):
                    out, lse = A.attention_fwd(q, k, v, am, pad, causal, D ** -0.5, p, rng, tf32)
                with _recording(A, ("_dkdv", "_dq", "_attn_bwd_delta_kernel", "_kpm_ranges_kernel"), rec):
                    A.attention_bwd(out, q, k, v, out, lse, am, pad, causal, D ** -0.5, p, rng, tf32)
            label = (f"attention {dt}{' tf32' if tf32 else ''} D={D} L={L} causal={int(causal)} "
                     f"mask={mask} kpm={int(kpm)} dropout={int(drop)}"
                     + (f" gqa_split={split}" if split else "") + (" off64" if off64 else "")
                     + (" dq_kernel" if atomic is False else ""))
            jobs += _jobs_from(rec, label, first_config_only=quick)
    return jobs


def _decode_jobs(dtypes=DTYPES, quick=False):
    import torch
    from transformer_fast.kernels import decode as K

    # (L_new, H, Hkv): decoding, GQA decoding, short chunks, a prefill chunk
    shapes = ((1, 16, 16), (64, 8, 8)) if quick else ((1, 16, 16), (1, 32, 8), (32, 8, 8), (64, 8, 8),
                                                       (256, 8, 8), (5, 8, 8))
    splits = (1, 8) if quick else (1, 3, 16, 128)
    B, L_max = 2, 4096
    jobs = []
    for dt in dtypes:
        for tf32 in ((False,) if dt != "fp32" or quick else (False, True)):
            for D in ((64,) if dt == "fp32" else (64, 128)) if quick else (16, 64, 80, 128, 256):
                for L_new, H, Hkv in shapes:
                    for nsplit in splits:
                        q = _meta(B, H, L_new, D, dtype=_dt(dt))
                        kc, vc = _meta(B, Hkv, L_max, D, dtype=_dt(dt)), _meta(B, Hkv, L_max, D, dtype=_dt(dt))
                        kn, vn = _meta(B, Hkv, L_new, D, dtype=_dt(dt)), _meta(B, Hkv, L_new, D, dtype=_dt(dt))
                        seqlens = _meta(B, dtype=torch.int32)
                        rec = []
                        with _recording(K, ("_decode_fwd_kernel", "_decode_combine_kernel", "_kv_append_kernel"), rec):
                            K.attention_with_kv_cache_fwd(q, kc, vc, seqlens, kn, vn, D ** -0.5, tf32,
                                                          num_splits=nsplit)
                        jobs += _jobs_from(rec, f"decode {dt}{' tf32' if tf32 else ''} D={D} L_new={L_new} "
                                                f"H={H} Hkv={Hkv} splits={nsplit}")
        # Key head dim 1 with a value head dim of its own: the append kernel then gets keys
        # whose row stride and width are the constant 1 and values whose are not (one launch
        # appends both, so its two branches must compile with differently specialised arguments).
        q, kc, vc = _meta(B, 4, 1, 1, dtype=_dt(dt)), _meta(B, 4, L_max, 1, dtype=_dt(dt)), _meta(B, 4, L_max, 32, dtype=_dt(dt))
        kn, vn = _meta(B, 4, 1, 1, dtype=_dt(dt)), _meta(B, 4, 1, 32, dtype=_dt(dt))
        rec = []
        with _recording(K, ("_decode_fwd_kernel", "_decode_combine_kernel", "_kv_append_kernel"), rec):
            K.attention_with_kv_cache_fwd(q, kc, vc, _meta(B, dtype=torch.int32), kn, vn, 1.0, False, num_splits=1)
        jobs += _jobs_from(rec, f"decode {dt} append D=1 Dv=32")
    return jobs


def _masked_softmax_jobs(dtypes=DTYPES, quick=False):
    import torch
    from transformer_fast.kernels import masked_softmax as K

    # (B*H, Lq, Lk): many rows (fused up to 16384 columns) and few rows (the looped path)
    shapes = ((64, 64, 1024), (2, 2, 65536)) if quick else (
        (64, 64, 1), (64, 64, 7), (64, 64, 127), (64, 64, 1000), (64, 64, 1024), (64, 64, 4096),
        (64, 64, 16384), (2, 2, 16384), (64, 64, 65536), (2, 2, 65536))
    masks = (None, "bool") if quick else (None, "bool", "float", "bool_expanded")
    jobs = []
    with _patched(K, _num_sms=lambda device: H100_SMS):
        for dt in dtypes:
            for bh, lq, lk in shapes:
                for mask in masks:
                    for causal in (False, True):
                        for drop in (False, True):
                            if quick and mask and (causal or drop):
                                continue
                            s = _meta(1, bh, lq, lk, dtype=_dt(dt))
                            am = None
                            if mask == "bool":
                                am = _meta(1, bh, lq, lk, dtype=torch.bool)
                            elif mask == "float":
                                am = _meta(1, bh, lq, lk, dtype=_dt(dt))
                            elif mask == "bool_expanded":
                                am = _meta(1, 1, lq, lk, dtype=torch.bool).expand(1, bh, lq, lk)
                            p, rng = (0.1, _rng()) if drop else (0.0, None)
                            rec = []
                            with _recording(K, ("_fwd_fused_kernel", "_fwd_stats_kernel", "_fwd_apply_kernel"), rec):
                                out, probs = K.masked_softmax_fwd(s, am, 0.125, causal, p, rng)
                            if mask is None and not causal:
                                with _recording(K, ("_bwd_fused_kernel", "_bwd_stats_kernel", "_bwd_apply_kernel"),
                                                rec):
                                    K.masked_softmax_bwd(out, probs if drop else out, 0.125, p, rng)
                            jobs += _jobs_from(rec, f"masked_softmax {dt} rows={bh * lq} Lk={lk} mask={mask} "
                                                    f"causal={int(causal)} dropout={int(drop)}")
    return jobs


def _ffn_jobs(dtypes=DTYPES, quick=False):
    """feed_forward's launch sequence (forward: two GEMMs; backward: dact GEMM, two wgrad
    GEMMs, dgrad GEMM) and linear_bias_act's elementwise backward, for each activation and
    dropout, at the issue's benchmark shape and at a few rows (the small-tile configs)."""
    from transformer_fast.kernels import ffn as K

    shapes = ((16384, 1024, 4096),) if quick else ((16384, 1024, 4096), (7, 512, 2048), (1000, 33, 70))
    acts = ("relu", "gelu") if quick else ("none", "relu", "gelu", "gelu_tanh")
    jobs = []
    for dt in dtypes:
        for tf32 in ((False, True) if dt == "fp32" and not quick else (False,)):
            for m, d_model, d_ff in shapes:
                # quick fp32: one flag set (exact-fp32 dots compile slowly; CI time).
                for act in (acts[:1] if quick and dt == "fp32" else acts):
                    for drop in ((False,) if quick and dt == "fp32" else (False, True)):
                        p, rng = (0.1, _rng()) if drop else (0.0, None)
                        x = _meta(m, d_model, dtype=_dt(dt))
                        w1, w2 = _meta(d_ff, d_model, dtype=_dt(dt)), _meta(d_model, d_ff, dtype=_dt(dt))
                        b1, b2 = _meta(d_ff, dtype=_dt(dt)), _meta(d_model, dtype=_dt(dt))
                        # 16-bit: the pointer kernel and the persistent TMA kernel (a Hopper
                        # GPU's path where the operands allow it).
                        for path in (("pointer", "tma") if dt != "fp32" else ("pointer",)):
                            rec = []
                            with _recording(K, ("_gemm_kernel", "_gemm_tma_kernel", "_act_bwd_kernel"), rec), \
                                    _patched(K, _gemm_path=lambda path=path: path, sm_count=lambda device: H100_SMS):
                                hidden, pre = K.linear_fwd(x, w1, b1, act, p, rng, K.needs_pre(act), tf32)
                                out, _ = K.linear_fwd(hidden, w2, b2, "none", 0.0, None, False, tf32)
                                aux = hidden if act == "relu" else (pre if K.needs_pre(act) else None)
                                dpre, _ = K.linear_dgrad(out, w2, aux, act, p, rng, True, tf32)
                                K.linear_wgrad(out, hidden, True, tf32)
                                K.linear_dgrad(dpre, w1, None, "none", 0.0, None, False, tf32)
                                if path == "pointer":
                                    K.act_bwd(hidden, aux, act, p, rng, True)
                            jobs += _jobs_from(rec, f"ffn {dt}{' tf32' if tf32 else ''} M={m} d_model={d_model} "
                                                    f"d_ff={d_ff} act={act} dropout={int(drop)} {path}",
                                               first_config_only=quick)
    return jobs


def _cross_entropy_jobs(dtypes=DTYPES, quick=False):
    """The fused loss's row kernel: 16-bit logits, the base model's chunk of a 32000-token
    vocabulary and a vocabulary shorter than one block, with and without the gradient; fp32
    logits (the float32 copy a small 16-bit problem's chunk takes, fused_loss.WIDE_16BIT_MAX_MACS)
    at a short vocabulary."""
    import torch
    from transformer_fast.kernels import cross_entropy as K

    jobs = []
    for dt in dtypes:
        if dt == "fp32":
            shapes = ((100, 50),)
        else:
            shapes = ((1048, 32000),) if quick else ((1048, 32000), (7, 1000), (100, 50))
        for rows, vocab in shapes:
            for smoothing in (0.0, 0.1):
                for grad in (False, True):
                    rec = []
                    with _recording(K, ("_cross_entropy_rows_kernel",), rec):
                        K.cross_entropy_rows(_meta(rows, vocab, dtype=_dt(dt)), _meta(rows, dtype=torch.int64),
                                             _meta(rows, dtype=torch.bool), smoothing, grad)
                    jobs += _jobs_from(rec, f"cross_entropy {dt} rows={rows} V={vocab} smoothing={smoothing} "
                                            f"grad={int(grad)}")
    return jobs


_COLLECTORS = {"layer_norm": _layer_norm_jobs, "attention": _attention_jobs, "decode": _decode_jobs,
               "masked_softmax": _masked_softmax_jobs, "ffn": _ffn_jobs, "cross_entropy": _cross_entropy_jobs}


def collect_jobs(kernel_sets=KERNEL_SETS, dtypes=DTYPES, quick=False):
    """Distinct compilations (the first label wins for a compilation reached by several scenarios)."""
    jobs, seen = [], set()
    for name in kernel_sets:
        for job in _COLLECTORS[name](tuple(dtypes), quick):
            key = job.key()
            if key not in seen:
                seen.add(key)
                jobs.append(job)
    return jobs


# ---------------------------------------------------------------------------------------------
# Compiling


# Largest dynamic shared memory per block (bytes) a launch can get, by compute capability.
SMEM_LIMIT = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


def _resources(kernel) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    fields = {}
    for line in out.splitlines():
        if "REG:" in line:
            for tok in line.split():
                if ":" in tok:
                    k, _, v = tok.partition(":")
                    fields.setdefault(k, v)
    return (f"regs={fields.get('REG', '?')} spill_stack={fields.get('STACK', '?')} "
            f"smem={kernel.metadata.shared}")


_STATE = {}


def _compile(index: int):
    import triton
    from triton.compiler import ASTSource

    job = _STATE["jobs"][index]
    t0 = time.time()
    try:
        src = ASTSource(job.fn, job.signature, constexprs=job.constexprs, attrs=job.attrs)
        kernel = triton.compile(src, target=_STATE["target"], options=job.options)
        extra = f"  {_resources(kernel)}" if _STATE["resources"] else ""
        limit = SMEM_LIMIT.get(_STATE["target"].arch)
        if limit is not None and kernel.metadata.shared > limit:
            # The launch raises OutOfResources: the autotuner skips such a config, a fixed one fails,
            # and so does the first kept one, which TRANSFORMER_FAST_AUTOTUNE=0 runs alone.
            why = (f"needs {kernel.metadata.shared} bytes of shared memory, sm_{_STATE['target'].arch} "
                   f"allows {limit}")
            if job.first:  # a fixed launch's one config, or an autotuned launch's first
                kept = " (the first kept config: AUTOTUNE=0 runs it)" if job.autotuned else ""
                return False, f"FAIL {job.fn.__name__} {job.label}: {why}{kept}{extra}"
            return True, f"warn {job.fn.__name__} {job.label}: {why} (the autotuner skips it){extra}"
        return True, f"ok   {job.fn.__name__} {job.label}{extra} ({time.time() - t0:.1f}s)"
    except Exception as exc:  # noqa: BLE001  (report every failing config)
        msg = " | ".join(str(exc).strip().splitlines()[:12])[:3000]
        return False, f"FAIL {job.fn.__name__} {job.label}: {type(exc).__name__}: {msg}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80, 90")
    parser.add_argument("--dtypes", default=None, help="comma list of bf16,fp16,fp32 "
                        "(default: all; bf16,fp32 with --quick)")
    parser.add_argument("--kernels", default=",".join(KERNEL_SETS), help="comma list of " + ",".join(KERNEL_SETS))
    parser.add_argument("--quick", action="store_true", help="a representative subset (CI)")
    parser.add_argument("--resources", action="store_true", help="print registers / spill stack / shared memory")
    parser.add_argument("--list", action="store_true", help="list the configurations, compile nothing")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="parallel compilations")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check: run with TRITON_INTERPRET unset or 0", file=sys.stderr)
        return 2
    dtypes = args.dtypes.split(",") if args.dtypes else (["bf16", "fp32"] if args.quick else list(DTYPES))
    kernel_sets = [k for k in args.kernels.split(",") if k]
    for k in kernel_sets:
        if k not in _COLLECTORS:
            parser.error(f"unknown kernel set {k!r}")

    import triton
    from triton.backends.compiler import GPUTarget

    t0 = time.time()
    jobs = collect_jobs(kernel_sets, dtypes, args.quick)
    if args.list:
        for job in jobs:
            print(f"{job.fn.__name__} {job.label}")
        print(f"compile_check: {len(jobs)} configurations")
        return 0
    _STATE.update(jobs=jobs, target=GPUTarget("cuda", args.arch, 32), resources=args.resources)
    failures = warnings = 0
    if args.jobs > 1 and len(jobs) > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(min(args.jobs, len(jobs))) as pool:
            results = pool.imap(_compile, range(len(jobs)))
            for ok, line in results:
                failures += not ok
                warnings += line.startswith("warn")
                print(line, flush=True)
    else:
        for i in range(len(jobs)):
            ok, line = _compile(i)
            failures += not ok
            warnings += line.startswith("warn")
            print(line, flush=True)
    print(f"compile_check: triton {triton.__version__} sm_{args.arch}{' (quick)' if args.quick else ''}: "
          f"{len(jobs) - failures} compiled, {failures} failed, {warnings} over the shared-memory limit "
          f"(autotuned, skipped at run time) in {time.time() - t0:.0f}s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
