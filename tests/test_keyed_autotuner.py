"""kernels/common.py's autotune: Triton's Autotuner with a cheaper launch for tuned keys.

Its fast path must find exactly the config Triton's own ``Autotuner.run`` would: the same key
tuple (key arguments, then every argument's dtype string), the same cache, the same pre_hook and
best_config.  Checked here on the CPU against a plain ``triton.autotune`` over one kernel, with
the timing and the launch replaced by recorders (no GPU, no compilation)."""
import random

import pytest
import torch
import triton
import triton.language as tl

from transformer_fast.kernels import common


@triton.jit
def _kernel(X, Y, N, M, FLAG: tl.constexpr, BLOCK: tl.constexpr):
    pass


BLOCKS = (16, 32, 64, 128)


class _Launches:
    """Stands in for the JIT function: records the config keywords of each launch."""

    def __init__(self):
        self.blocks = []

    def run(self, *args, grid, warmup, **kwargs):
        self.blocks.append((kwargs["BLOCK"], kwargs["num_warps"]))


def _tuner(make, hook_calls=None):
    def hook(nargs):
        hook_calls.append(dict(nargs))

    configs = [triton.Config({"BLOCK": b}, num_warps=w, pre_hook=hook if hook_calls is not None else None)
               for b in BLOCKS for w in (4, 8)]
    tuner = make(configs=configs, key=["N", "FLAG"])(_kernel)
    tuner.fn = _Launches()
    tuner.tunings = 0

    def bench(*args, config, **kwargs):  # the fastest config depends on the key's N and dtypes
        tuner.tunings += 1
        n = kwargs["N"] if "N" in kwargs else args[2]
        wide = args[0].dtype == torch.float32
        return [abs(config.kwargs["BLOCK"] - n) + (config.num_warps == 8) * (0.5 if wide else -0.5)]

    tuner._bench = bench
    return tuner


def _calls(seed: int, count: int):
    rng = random.Random(seed)
    tensors = {dt: torch.empty(4, dtype=dt) for dt in (torch.float16, torch.bfloat16, torch.float32)}
    for _ in range(count):
        x = tensors[rng.choice(list(tensors))]
        y = tensors[rng.choice(list(tensors))]
        n = rng.choice((10, 20, 50, 100))
        m = rng.randint(1, 5)
        flag = rng.random() < 0.5
        form = rng.randrange(3)
        if form == 0:
            yield (x, y, n, m), {"FLAG": flag}
        elif form == 1:
            yield (x, y), {"N": n, "M": m, "FLAG": flag}
        else:
            yield (x,), {"Y": y, "N": n, "M": m, "FLAG": flag}


@pytest.fixture
def slow(monkeypatch):
    """The calls that reach Triton's own Autotuner.run (a list, one entry per call)."""
    calls = []
    real = triton.runtime.autotuner.Autotuner.run

    def counting(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(triton.runtime.autotuner.Autotuner, "run", counting)
    return calls


def test_the_keyed_tuner_is_tritons_autotuner():
    tuner = common.autotune(configs=[triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})],
                            key=["N"])(_kernel)
    assert isinstance(tuner, triton.runtime.autotuner.Autotuner)
    assert type(tuner) is common._KeyedAutotuner


@pytest.mark.parametrize("seed", range(3))
def test_same_configs_keys_and_tunings_as_triton(seed):
    plain = _tuner(triton.autotune)
    keyed = _tuner(common.autotune)
    for args, kwargs in _calls(seed, 200):
        plain[(1,)](*args, **kwargs)
        keyed[(1,)](*args, **kwargs)
        assert keyed.best_config is plain.best_config or keyed.best_config.all_kwargs() == plain.best_config.all_kwargs()
    assert keyed.fn.blocks == plain.fn.blocks
    assert list(keyed.cache) == list(plain.cache)  # the same key tuples, in the same order
    assert keyed.tunings == plain.tunings  # tuned once per key, as Triton
    assert len(set(keyed.fn.blocks)) > 1  # the keys chose different configs


def test_tuned_keys_skip_autotuner_run(slow):
    keyed = _tuner(common.autotune)
    x = torch.empty(4, dtype=torch.float16)
    for _ in range(5):
        keyed[(1,)](x, x, 20, 3, FLAG=True)
    assert len(slow) == 1
    keyed[(1,)](x, x.float(), 20, 3, FLAG=True)  # another dtype: another key
    keyed[(1,)](x, x, 50, 3, FLAG=True)  # another N
    keyed[(1,)](x, x, 20, 4, FLAG=True)  # M is not in the key
    assert len(slow) == 3
    keyed.cache.clear()  # as the tests and benchmarks do to re-tune
    keyed[(1,)](x, x, 20, 3, FLAG=True)
    assert len(slow) == 4
    # Every argument form (tensors and key arguments positional or by keyword): once tuned, a
    # key never reaches Autotuner.run again.
    keyed.cache.clear()
    for args, kwargs in _calls(7, 300):
        keyed[(1,)](*args, **kwargs)
    tuned = len(slow)
    assert tuned - 4 == len(keyed.cache)
    for args, kwargs in _calls(7, 300):
        keyed[(1,)](*args, **kwargs)
    assert len(slow) == tuned


def test_pre_hook_runs_on_every_launch_with_all_arguments():
    calls = []
    keyed = _tuner(common.autotune, hook_calls=calls)
    x = torch.empty(4, dtype=torch.bfloat16)
    for m in (1, 2, 3):
        keyed[(1,)](x, x, 100, m, FLAG=False)
    launched = [c for c in calls if c.get("M") is not None][-3:]
    assert [c["M"] for c in launched] == [1, 2, 3]
    for c in launched:
        assert c["X"] is x and c["N"] == 100 and c["FLAG"] is False
        assert c["BLOCK"] == keyed.best_config.kwargs["BLOCK"]


def test_host_helpers_match_triton():
    for n in range(-3, 5000):
        assert common.next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 64, 128):
            assert common.cdiv(n, d) == triton.cdiv(n, d), (n, d)


@pytest.mark.gpu
def test_tuned_attention_launches_skip_autotuner_run_on_the_gpu(monkeypatch, slow):
    """On a GPU, with tuning on: the first forward tunes (Autotuner.run), the next ones with the
    same key launch directly with the same config and give the same bits."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from transformer_fast import functional as F
    from transformer_fast.kernels import attention as A

    monkeypatch.setenv("TRANSFORMER_FAST_AUTOTUNE", "1")
    A._fwd.cache.clear()
    q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    kpm = torch.zeros(2, 300, dtype=torch.bool, device="cuda")
    kpm[1, 250:] = True
    first = F.scaled_dot_product_attention(q, k, v, key_padding_mask=kpm, backend="triton")
    config = A._fwd.best_config
    tuned = len(slow)
    for _ in range(3):
        again = F.scaled_dot_product_attention(q, k, v, key_padding_mask=kpm, backend="triton")
        assert torch.equal(again, first)
        assert A._fwd.best_config is config
    assert len(slow) == tuned
