"""``python -m transformer_fast verify``: the oracle for every implemented op x backend x dtype.

Each case runs a functional op on fresh random inputs on the chosen device and checks outputs
and gradients against the float64 reference (DESIGN section 6).  Prints a table; the exit code
is non-zero when any case fails.
"""
from __future__ import annotations

import dataclasses
import time
import zlib
from typing import Callable, Iterator

import torch

from . import backends, functional, philox, reference

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclasses.dataclass
class Case:
    name: str
    run: Callable[[str], list]  # backend -> oracle results
    # Checks dropout exactly, so only for backends that draw from transformer_fast.philox.
    philox_dropout: bool = False


# Registry: op -> generator of cases for (device, dtype).
CASES: dict[str, Callable[[str, torch.dtype], Iterator[Case]]] = {}


def cases(op: str):
    def wrap(fn):
        CASES[op] = fn
        return fn

    return wrap


def _randn(*shape, dtype, device, generator):
    return torch.randn(*shape, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)


def _dropout_draw(device, shape, dropout_p):
    """(seed, keep): the seed to run the op under test with, and the Philox keep mask of ``shape``
    that the op draws from it (None without dropout)."""
    seed = int(torch.randint(0, 2**31, ()))
    if dropout_p == 0:
        return seed, None
    torch.manual_seed(seed)
    return seed, philox.dropout_keep_mask(philox.new_rng(device), shape, dropout_p)


@cases("add_layer_norm")
def _add_layer_norm_cases(device: str, dtype: torch.dtype) -> Iterator[Case]:
    shapes = [(64, 1), (37, 7), (33, 127), (16, 1000), (8, 4096), (2, 65536), (3, 5, 768)]
    # (dropout_p, prenorm, affine, strided): strided x / residual are row slices of wider rows
    variants = ((0.0, False, True, False), (0.1, True, True, False), (0.1, False, False, True),
                (0.0, True, True, True))
    for shape in shapes:
        for dropout_p, prenorm, affine, strided in variants:
            yield Case(
                f"{'x'.join(map(str, shape))} p={dropout_p}{' prenorm' if prenorm else ''}"
                f"{'' if affine else ' no weight/bias'}{' strided' if strided else ''}",
                _add_layer_norm_runner(shape, dtype, device, dropout_p, prenorm, affine, strided),
                philox_dropout=dropout_p > 0,
            )


def _add_layer_norm_runner(shape, dtype, device, dropout_p, prenorm, affine=True, strided=False):
    def run(backend):
        g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
        n = shape[-1]
        wide = (*shape[:-1], n + 3) if strided else shape
        inputs = {
            "x": _randn(*wide, dtype=dtype, device=device, generator=g)[..., :n],
            "residual": _randn(*wide, dtype=dtype, device=device, generator=g)[..., :n],
            "weight": (1 + 0.5 * _randn(n, dtype=dtype, device=device, generator=g)) if affine else None,
            "bias": _randn(n, dtype=dtype, device=device, generator=g) if affine else None,
        }
        seed, keep = _dropout_draw(device, (inputs["x"].numel() // n, n), dropout_p)
        keep = None if keep is None else keep.reshape(shape)

        def kernel(x, residual, weight, bias):
            torch.manual_seed(seed)  # the op draws the same rng as `keep` above
            return functional.add_layer_norm(
                x, residual, weight, bias, dropout_p=dropout_p, prenorm=prenorm, backend=backend
            )

        def ref(x, residual, weight, bias):
            return reference.add_layer_norm(x, residual, weight, bias, 1e-5, dropout_p, prenorm, keep=keep)

        return reference.run_oracle(kernel, ref, inputs, list(inputs))

    return run


@cases("scaled_dot_product_attention")
def _sdpa_cases(device: str, dtype: torch.dtype) -> Iterator[Case]:
    small = device == "cpu"  # the Triton interpreter on CPU is slow
    shapes = [  # (B, H, Hkv, Lq, Lk, D)
        (2, 2, 2, 7, 33, 64),
        (1, 4, 2, 1, 127, 128) if small else (2, 8, 2, 1, 1000, 128),
        (2, 2, 1, 33, 33, 80) if small else (2, 8, 8, 257, 257, 128),
        (1, 2, 2, 17, 9, 256),
        (1, 4, 1, 9, 300, 32),  # more than 128 keys: the backward's separate delta pass
    ]
    for shape in shapes:
        for mask_kind, dropout_p in (("causal", 0.0), ("padding", 0.0), ("bool", 0.1),
                                     ("float+causal scale=0.3", 0.0), ("2-D bool+left padding strided", 0.0)):
            yield Case(
                f"{'x'.join(map(str, shape))} {mask_kind} p={dropout_p}",
                _sdpa_runner(shape, dtype, device, mask_kind, dropout_p),
                philox_dropout=dropout_p > 0,
            )


def _sdpa_runner(shape, dtype, device, mask_kind, dropout_p):
    b, h, hkv, lq, lk, d = shape

    strided = "strided" in mask_kind
    scale = 0.3 if "scale" in mask_kind else None

    def run(backend):
        g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))

        def heads(n, length):  # (B, n, L, D), as a (B, L, n, D) projection's transposed view
            if strided:
                return _randn(b, length, n, d, dtype=dtype, device=device, generator=g).transpose(1, 2)
            return _randn(b, n, length, d, dtype=dtype, device=device, generator=g)

        inputs = {"query": heads(h, lq), "key": heads(hkv, lk), "value": heads(hkv, lk)}
        masks = {"is_causal": "causal" in mask_kind, "attn_mask": None, "key_padding_mask": None}
        if mask_kind == "padding":  # realistic: each row keeps a random prefix, one row empty
            lengths = torch.randint(1, lk + 1, (b,), generator=g)
            lengths[-1] = 0
            masks["key_padding_mask"] = (torch.arange(lk) >= lengths[:, None]).to(device)
        elif mask_kind == "bool":
            masks["attn_mask"] = (torch.rand(b, 1, lq, lk, generator=g) < 0.8).to(device)
        elif mask_kind.startswith("float"):  # per head, added to the scores (a float mask)
            inputs["attn_mask"] = _randn(1, h, lq, lk, dtype=dtype, device=device, generator=g)
        elif mask_kind.startswith("2-D"):  # query row 0 sees nothing; keys padded at the front
            mask = torch.rand(lq, lk, generator=g) < 0.8
            mask[0] = False
            masks["attn_mask"] = mask.to(device)
            start = torch.randint(0, lk, (b,), generator=g)
            masks["key_padding_mask"] = (torch.arange(lk) < start[:, None]).to(device)
        seed, keep = _dropout_draw(device, (b, h, lq, lk), dropout_p)
        gqa = h != hkv

        def kernel(query, key, value, attn_mask=masks["attn_mask"]):
            torch.manual_seed(seed)
            return functional.scaled_dot_product_attention(
                query, key, value, attn_mask, dropout_p, masks["is_causal"], scale=scale,
                enable_gqa=gqa, key_padding_mask=masks["key_padding_mask"], backend=backend,
            )

        def ref(query, key, value, attn_mask=masks["attn_mask"]):
            return reference.scaled_dot_product_attention(
                query, key, value, attn_mask, dropout_p, masks["is_causal"], scale, gqa,
                key_padding_mask=masks["key_padding_mask"], keep=keep,
            )

        return reference.run_oracle(kernel, ref, inputs, ["query", "key", "value"])

    return run


@cases("masked_softmax")
def _masked_softmax_cases(device: str, dtype: torch.dtype) -> Iterator[Case]:
    shapes = [(2, 2, 7, 1), (2, 4, 33, 127), (1, 2, 5, 1000)]
    if device != "cpu":
        shapes += [(2, 8, 128, 4096), (1, 1, 4, 70000)]
    # (causal, dropout_p, mask kind, scale); the float-mask case reads strided scores
    variants = ((True, 0.0, "bool", 0.5), (False, 0.1, "bool", 0.5), (False, 0.0, "float", 1.0),
                (True, 0.0, "none", 0.7))
    for shape in shapes:
        for causal, dropout_p, mask_kind, scale in variants:
            yield Case(
                f"{'x'.join(map(str, shape))}{' causal' if causal else ''} p={dropout_p} "
                f"{mask_kind} mask scale={scale}{' strided' if mask_kind == 'float' else ''}",
                _masked_softmax_runner(shape, dtype, device, causal, dropout_p, mask_kind, scale),
                philox_dropout=dropout_p > 0,
            )


def _masked_softmax_runner(shape, dtype, device, causal, dropout_p, mask_kind="bool", scale=0.5):
    b, h, lq, lk = shape

    def run(backend):
        g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
        if mask_kind == "float":  # (B, Lq, H, Lk) transposed: rows not laid out head by head
            scores = 3 * _randn(b, lq, h, lk, dtype=dtype, device=device, generator=g).transpose(1, 2)
        else:
            scores = 3 * _randn(*shape, dtype=dtype, device=device, generator=g)
        mask = None
        if mask_kind == "bool":
            mask = torch.rand(b, 1, lq, lk, generator=g) < 0.8
            mask[0, 0, 0] = False  # a fully masked row
            mask = mask.to(device)
        elif mask_kind == "float":  # per head; row 0 of head 0 entirely -inf (fully masked)
            mask = torch.randn(1, h, lq, lk, generator=g)
            mask[0, 0, 0] = float("-inf")
            mask = mask.to(device=device, dtype=dtype)
        seed, keep = _dropout_draw(device, shape, dropout_p)

        inputs = {"scores": scores}
        if mask_kind == "float":  # a float mask in the scores' dtype, float64 in the reference
            inputs["mask"] = mask

        def kernel(scores, mask=mask):
            torch.manual_seed(seed)
            return functional.masked_softmax(
                scores, mask, scale=scale, is_causal=causal, dropout_p=dropout_p, backend=backend
            )

        def ref(scores, mask=mask):
            return reference.masked_softmax(scores, mask, scale, causal, dropout_p, keep=keep)

        return reference.run_oracle(kernel, ref, inputs, ["scores"])

    return run


@cases("attention_with_kv_cache")
def _kv_cache_cases(device: str, dtype: torch.dtype) -> Iterator[Case]:
    shapes = [(2, 4, 2, 1, 40, 64), (3, 2, 2, 5, 33, 128)]  # (B, H, Hkv, L_new, L_max, D)
    if device != "cpu":
        shapes += [(1, 32, 8, 1, 8192, 128), (64, 8, 8, 1, 1024, 64), (4, 8, 2, 129, 2048, 128)]
    for shape in shapes:
        yield Case("x".join(map(str, shape)), _kv_cache_runner(shape, dtype, device))
    # The cache alone (no new keys), a caller's scale, strided q, a row with an empty cache.
    b, h, hkv, l_new, l_max, d = shapes[1]
    yield Case(f"{b}x{h}x{hkv}x{l_new}x{l_max}x{d} no new keys scale=0.2 strided",
               _kv_cache_runner(shapes[1], dtype, device, with_new=False, scale=0.2))


def _kv_cache_runner(shape, dtype, device, with_new=True, scale=None):
    b, h, hkv, l_new, l_max, d = shape

    def run(backend):
        g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
        if with_new:
            q = _randn(b, h, l_new, d, dtype=dtype, device=device, generator=g)
        else:  # (B, L, H, D) transposed, as a projection's view
            q = _randn(b, l_new, h, d, dtype=dtype, device=device, generator=g).transpose(1, 2)
        caches = [_randn(b, hkv, l_max, d, dtype=dtype, device=device, generator=g) for _ in range(2)]
        new = [_randn(b, hkv, l_new, d, dtype=dtype, device=device, generator=g) for _ in range(2)]
        lengths = torch.randint(0, l_max - l_new + 1, (b,), generator=g).to(device=device, dtype=torch.int32)
        if not with_new:
            new = [None, None]
            lengths[0] = 0  # nothing to attend to: zeros
        ours = [c.clone() for c in caches]
        with reference.poisoned_outputs(), torch.no_grad():
            out = functional.attention_with_kv_cache(q, *ours, lengths, *new, scale=scale, backend=backend)
        lp = [c.clone() for c in caches]
        ref_lp = reference.attention_with_kv_cache(q, *lp, lengths, *new, scale=scale)
        ref64 = reference.attention_with_kv_cache(
            q.double(), *(c.double() for c in caches), lengths,
            *(None if t is None else t.double() for t in new), scale=scale,
        )
        results = [reference.oracle_compare("out", out, ref_lp, ref64, dtype)]
        for name, mine, theirs in (("k_cache", ours[0], lp[0]), ("v_cache", ours[1], lp[1])):
            same = torch.equal(mine, theirs)
            results.append(reference.OracleResult(name, 0.0 if same else float("inf"), 0.0, same))
        return results

    return run


@cases("feed_forward")
def _feed_forward_cases(device: str, dtype: torch.dtype) -> Iterator[Case]:
    shapes = [(1, 16, 24), (7, 33, 65), (100, 64, 256)]  # (M, d_model, d_ff)
    if device != "cpu":
        shapes += [(4096, 512, 2048), (1000, 1024, 4096)]
    for i, shape in enumerate(shapes):
        activation = ("relu", "gelu", "gelu_tanh")[i % 3]
        for dropout_p in (0.0, 0.1):
            yield Case(
                f"{'x'.join(map(str, shape))} {activation} p={dropout_p}",
                _feed_forward_runner(shape, dtype, device, activation, dropout_p),
                philox_dropout=dropout_p > 0,
            )
    # x (3, 5, d_model) as a transposed view, no biases (nn.Linear(bias=False))
    for activation in ("relu", "gelu_tanh"):
        yield Case(f"3x5x48x96 {activation} p=0.0 no biases strided",
                   _feed_forward_runner((15, 48, 96), dtype, device, activation, 0.0, biases=False,
                                        strided=True))


def _linear_weight(out_features, in_features, dtype, device, generator):
    """An nn.Linear-shaped weight with unit-variance outputs: randn / sqrt(in_features)."""
    w = _randn(out_features, in_features, dtype=torch.float32, device=device, generator=generator)
    return (w / in_features**0.5).to(dtype)


def _rows(m, k, dtype, device, generator, strided):
    """x (m, k), or with ``strided`` (3, m / 3, k) as a transposed view of (m / 3, 3, k)."""
    if strided:
        return _randn(m // 3, 3, k, dtype=dtype, device=device, generator=generator).transpose(0, 1)
    return _randn(m, k, dtype=dtype, device=device, generator=generator)


def _feed_forward_runner(shape, dtype, device, activation, dropout_p, biases=True, strided=False):
    m, d_model, d_ff = shape

    def run(backend):
        g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
        inputs = {
            "x": _rows(m, d_model, dtype, device, g, strided),
            "w1": _linear_weight(d_ff, d_model, dtype, device, g),
            "b1": _randn(d_ff, dtype=dtype, device=device, generator=g) if biases else None,
            "w2": _linear_weight(d_model, d_ff, dtype, device, g),
            "b2": _randn(d_model, dtype=dtype, device=device, generator=g) if biases else None,
        }
        seed, keep = _dropout_draw(device, (*inputs["x"].shape[:-1], d_ff), dropout_p)

        def kernel(x, w1, b1, w2, b2):
            torch.manual_seed(seed)  # the op draws the same rng as `keep` above
            return functional.feed_forward(x, w1, b1, w2, b2, activation=activation,
                                           dropout_p=dropout_p, backend=backend)

        def ref(x, w1, b1, w2, b2):
            return reference.feed_forward(x, w1, b1, w2, b2, activation, dropout_p, keep=keep)

        return reference.run_oracle(kernel, ref, inputs, list(inputs))

    return run


@cases("linear_bias_act")
def _linear_bias_act_cases(device: str, dtype: torch.dtype) -> Iterator[Case]:
    # (M, in, out, activation, dropout_p, bias, strided: x (3, M / 3, in) as a transposed view)
    grid = [(1, 16, 24, "relu", 0.0, True, False), (7, 33, 65, "gelu_tanh", 0.1, False, False),
            (100, 64, 256, "gelu", 0.0, True, False), (15, 48, 96, None, 0.0, True, True)]
    if device != "cpu":
        grid += [(4096, 1024, 4096, "gelu", 0.1, True, False)]
    for m, k, n, activation, dropout_p, bias, strided in grid:
        yield Case(
            f"{m}x{k}x{n} {activation} p={dropout_p}{'' if bias else ' no bias'}"
            f"{' strided' if strided else ''}",
            _linear_bias_act_runner(m, k, n, dtype, device, activation, dropout_p, bias, strided),
            philox_dropout=dropout_p > 0,
        )


def _linear_bias_act_runner(m, k, n, dtype, device, activation, dropout_p, bias, strided):
    def run(backend):
        g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
        inputs = {
            "x": _rows(m, k, dtype, device, g, strided),
            "w": _linear_weight(n, k, dtype, device, g),
            "b": _randn(n, dtype=dtype, device=device, generator=g) if bias else None,
        }
        seed, keep = _dropout_draw(device, (*inputs["x"].shape[:-1], n), dropout_p)

        def kernel(x, w, b):
            torch.manual_seed(seed)  # the op draws the same rng as `keep` above
            return functional.linear_bias_act(x, w, b, activation=activation, dropout_p=dropout_p,
                                              backend=backend)

        def ref(x, w, b):
            return reference.linear_bias_act(x, w, b, activation, dropout_p, keep=keep)

        return reference.run_oracle(kernel, ref, inputs, list(inputs))

    return run


# Backends whose dropout draws from transformer_fast.philox (so the oracle can check it exactly).
PHILOX_BACKENDS = ("triton", "cuda", "cpu")
# Our kernels must pass; "torch" is PyTorch's own path, the peer we compare against: its rows are
# informational (status PEER-OUTSIDE when torch itself is less accurate than the oracle allows,
# e.g. F.layer_norm's half-precision CPU weight/bias gradients) and never fail the run.
PEER_BACKENDS = ("torch",)


@dataclasses.dataclass
class Row:
    op: str
    backend: str
    dtype: str
    status: str  # PASS / FAIL / SKIP, or PEER-OUTSIDE for a peer outside the bound
    cases: int = 0
    worst: str = ""  # the case with the largest error / bound ratio
    ratio: float = 0.0
    detail: str = ""
    seconds: float = 0.0


def _case_seed(seed: int, op: str, dtype: str, index: int) -> int:
    """The seed of one case's draws: a function of the run's seed and the case alone, so a case
    draws the same inputs whatever ran before it, in one process or in a pool (--jobs)."""
    return zlib.crc32(f"{seed}/{op}/{dtype}/{index}".encode()) & 0x7FFFFFFF


def _run_case(device: str, op: str, backend: str, dtype_name: str, index: int, seed: int):
    """Run case ``index`` of (op, dtype) on ``backend``: ("ok", oracle results), ("skip", why)
    for a BackendError, ("fail", message) for any other exception; and the seconds it took."""
    dtype = getattr(torch, dtype_name)
    case = list(CASES[op](device, dtype))[index]
    torch.manual_seed(_case_seed(seed, op, dtype_name, index))
    start = time.perf_counter()
    try:
        outcome = ("ok", case.run(backend))
    except backends.BackendError as exc:
        outcome = ("skip", str(exc))
    except Exception as exc:  # a crash is a failure, reported not raised
        outcome = ("fail", f"{case.name}: {type(exc).__name__}: {exc}")
    return outcome, time.perf_counter() - start


def _worker_init(threads: int) -> None:
    torch.set_num_threads(threads)


def _run_pool(tasks, jobs: int, on_done, fn=_run_case) -> None:
    """Run ``fn(*task)`` (by default _run_case) for each of ``tasks`` in ``jobs`` spawned
    processes (CUDA cannot be forked), calling ``on_done(task, outcome, seconds)`` as each
    finishes.  A process that dies (a segfault, a CUDA error that kills the context) breaks the
    pool and every task not finished with it: those run again in a fresh pool, and after three
    broken rounds one at a time, where the task that kills its process is the first unfinished
    one and is reported as failed."""
    import concurrent.futures as cf
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    pending, rounds = list(tasks), 0
    while pending:
        workers = min(jobs, len(pending)) if rounds < 3 else 1
        rounds += 1
        threads = max(1, torch.get_num_threads() // workers)
        broken = []
        with cf.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init,
                                    initargs=(threads,)) as pool:
            futures = {pool.submit(fn, *t): t for t in pending}
            for fut in cf.as_completed(futures):
                try:
                    outcome, seconds = fut.result()
                except cf.process.BrokenProcessPool:
                    broken.append(futures[fut])
                    continue
                on_done(futures[fut], outcome, seconds)
        pending = sorted(broken, key=tasks.index)
        if pending and workers == 1:  # one process runs them in order: the first one killed it
            on_done(pending.pop(0), ("fail", "the process running this case died (a crash; "
                                             "--jobs 1 shows it)"), 0.0)


def verify(device: str, ops=None, dtypes=DTYPES, backend_names=None, log=print, jobs: int = 1,
           seed: int | None = None) -> list[Row]:
    """One Row per op x backend x dtype.  ``jobs`` > 1 runs the cases in that many processes
    (on a GPU most of verify's time is compiling Triton kernels, one case at a time in one
    process); the rows are the same as with ``jobs=1`` for the same ``seed`` (default: drawn from
    torch's generator), as each case seeds its own draws."""
    if seed is None:
        seed = int(torch.randint(0, 2**31, ()))
    rows: list[Row] = []
    names: dict[tuple, str] = {}
    plan: dict[int, list[tuple]] = {}  # row index -> its cases' tasks, in case order
    for op, make_cases in CASES.items():
        if ops and op not in ops:
            continue
        for backend in backend_names or backends.implemented_backends(op):
            if backend == "reference":
                continue  # the oracle itself
            ok, why = backends.available(backend, device)
            if not ok:
                rows.append(Row(op, backend, "-", "SKIP", detail=why))
                log(f"  {op:<30} {backend:<8} SKIP  {why}")
                continue
            for dtype in dtypes:
                dtype_name = str(dtype).replace("torch.", "")
                plan[len(rows)] = []
                for i, case in enumerate(make_cases(device, dtype)):
                    if not (case.philox_dropout and backend not in PHILOX_BACKENDS):
                        plan[len(rows)].append((device, op, backend, dtype_name, i, seed))
                        names[plan[len(rows)][-1]] = case.name
                rows.append(Row(op, backend, dtype_name, "PASS"))

    outcomes: dict[tuple, tuple] = {}
    row_of = {t: r for r, ts in plan.items() for t in ts}
    left = {r: len(ts) for r, ts in plan.items()}

    def finish(r: int) -> None:
        row = rows[r]
        skipped: dict[str, int] = {}  # reason -> cases; an unsupported case ends nothing else
        for t in plan[r]:
            (kind, value), seconds = outcomes[t]
            row.seconds += seconds
            if kind == "skip":
                skipped[value] = skipped.get(value, 0) + 1
                continue
            if kind == "fail":
                row.status = "FAIL"
                row.detail += f"[{value}] "
                continue
            row.cases += 1
            name = names[t]
            for res in value:
                ratio = res.error / res.bound if res.bound > 0 else (0.0 if res.ok else float("inf"))
                if ratio > row.ratio or row.worst == "":
                    row.ratio, row.worst = ratio, f"{name} {res.name}"
                if not res.ok:
                    if row.status != "FAIL":
                        row.status = "PEER-OUTSIDE" if row.backend in PEER_BACKENDS else "FAIL"
                    row.detail += f"[{name} {res.name}: err {res.error:.2e} > {res.bound:.2e}] "
        if skipped and row.cases == 0 and row.status == "PASS":
            row.status, row.detail = "SKIP", "; ".join(skipped)
        elif skipped:  # part of the grid not supported: said, never silent
            row.detail += "".join(f"[{n} case{'s' if n > 1 else ''} skipped: {why}] "
                                  for why, n in skipped.items())
        log(f"  {row.op:<30} {row.backend:<8} {row.dtype:<9} {row.status}  cases={row.cases} "
            f"worst err/bound={row.ratio:.3f} ({row.worst}) {row.detail}")

    def on_done(t: tuple, outcome, seconds: float) -> None:
        outcomes[t] = (outcome, seconds)
        r = row_of[t]
        left[r] -= 1
        if left[r] == 0:
            finish(r)

    for r, ts in plan.items():
        if not ts:
            finish(r)
    tasks = [t for ts in plan.values() for t in ts]
    if jobs > 1 and len(tasks) > 1:
        # Triton and CUDA rows first: their first cases compile kernels (the long poles).
        order = {"triton": 0, "cuda": 1}
        tasks.sort(key=lambda t: order.get(t[2], 2))
        _run_pool(tasks, min(jobs, len(tasks)), on_done)
    else:
        for t in tasks:
            on_done(t, *_run_case(*t))
    return rows


def markdown_table(rows: list[Row]) -> str:
    lines = [
        "| op | backend | dtype | status | cases | worst err/bound | worst case | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.op} | {r.backend} | {r.dtype} | {r.status} | {r.cases} | {r.ratio:.3f} | "
            f"{r.worst} | {_table_cell(r.detail)} |"
        )
    return "\n".join(lines)


def _table_cell(text: str) -> str:
    """One markdown table cell: an error message's line breaks (a Triton compile error spans
    several) become spaces and its pipes are escaped, so the row keeps its columns."""
    return " ".join(text.split()).replace("|", "\\|")
