"""transformer_fast.models.CudaGraphStep: a whole training step captured as one CUDA graph.

On the CPU it runs the step eagerly (tested here); on a GPU the captured step must give the
eager step's losses and parameters (marked gpu).
"""
import copy

import pytest
import torch

from transformer_fast.models import CudaGraphStep, Seq2SeqTransformer

PAD, BOS = 0, 1


def _model(dropout=0.0, device="cpu"):
    return Seq2SeqTransformer(23, 23, d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                              dim_feedforward=64, dropout=dropout).to(device).train()


def _batch(g, b=3, s=7, t=6, device="cpu"):
    src = torch.randint(3, 23, (b, s), generator=g)
    tgt = torch.randint(3, 23, (b, t + 1), generator=g)
    src[0, -2:] = PAD  # padded rows, as real batches
    tgt[1, -3:] = PAD
    tgt_in, tgt_out = tgt[:, :-1].clone(), tgt[:, 1:].clone()
    tgt_in[:, 0] = BOS
    return src.to(device), tgt_in.to(device), tgt_out.to(device)


def _stepper(model, capturable, lr=1e-3):
    opt = torch.optim.Adam(model.parameters(), lr=lr, capturable=capturable)

    def step(src, tgt_in, tgt_out):
        loss = model.loss(src, tgt_in, tgt_out, smoothing=0.1)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, opt


def test_on_the_cpu_it_runs_the_step():
    """No CUDA tensor: every call runs the step itself (same losses as calling it directly)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    a = _model()
    b = copy.deepcopy(a)
    step_a, _ = _stepper(a, capturable=False)
    step_b, opt_b = _stepper(b, capturable=False)
    graphed = CudaGraphStep(step_b, optimizer=opt_b, warmup=1)
    for _ in range(4):
        batch = _batch(g)
        torch.testing.assert_close(graphed(*batch), step_a(*batch), rtol=0, atol=0)
    assert graphed.graph is None
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)


@pytest.mark.parametrize("kwargs, error, text", [
    (dict(step=3), TypeError, "step must be callable"),
    (dict(step=lambda: None, warmup=0), ValueError, "warmup must be a positive int"),
    (dict(step=lambda: None, warmup=True), TypeError, "warmup must be a positive int"),
    (dict(step=lambda: None, optimizer="adam"), TypeError, "optimizer must be a torch.optim.Optimizer"),
    (dict(step=lambda: None, enabled=1), TypeError, "enabled must be a bool"),
])
def test_bad_arguments(kwargs, error, text):
    with pytest.raises(error, match=text):
        CudaGraphStep(**kwargs)


@pytest.mark.gpu
def test_graphed_steps_match_eager_steps_on_gpu():
    """Dropout 0: the warm-up, the captured step and the replays give the eager steps' losses
    and parameters (new batches copied into the captured inputs each call)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    seed = int(torch.randint(0, 2**31, ()))
    torch.manual_seed(seed)
    a = _model(device="cuda")
    b = copy.deepcopy(a)
    step_a, _ = _stepper(a, capturable=True)
    step_b, opt_b = _stepper(b, capturable=True)
    graphed = CudaGraphStep(step_b, optimizer=opt_b, warmup=2)
    g = torch.Generator().manual_seed(seed)
    for i in range(7):
        batch = _batch(g, device="cuda")
        want = step_a(*batch)
        got = graphed(*batch).clone()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"step {i}, seed {seed}")
    assert graphed.graph is not None
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pb, pa, rtol=1e-4, atol=1e-6, msg=f"seed {seed}")


@pytest.mark.gpu
def test_graphed_dropout_draws_new_masks_on_gpu():
    """Dropout 0.1, learning rate 0 (the parameters stay put): replays on the same batch give
    different (finite) losses, so each replay draws fresh masks."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = _model(dropout=0.1, device="cuda")
    step, opt = _stepper(model, capturable=True, lr=0.0)
    graphed = CudaGraphStep(step, optimizer=opt, warmup=1)
    batch = _batch(torch.Generator().manual_seed(5), device="cuda")
    losses = torch.stack([graphed(*batch).clone() for _ in range(6)])
    assert torch.isfinite(losses).all() and len(set(losses.tolist()[2:])) == 4, losses


@pytest.mark.gpu
def test_capture_needs_a_capturable_optimizer_and_static_shapes_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = _model(device="cuda")
    step, opt = _stepper(model, capturable=False)
    graphed = CudaGraphStep(step, optimizer=opt, warmup=1)
    batch = _batch(torch.Generator().manual_seed(6), device="cuda")
    with pytest.raises(ValueError, match="capturable=True"):
        graphed(*batch)  # refused before the first (eager) step
    step, opt = _stepper(model, capturable=True)
    graphed = CudaGraphStep(step, optimizer=opt, warmup=1)
    graphed(*batch)
    graphed(*batch)  # captured
    with pytest.raises(ValueError, match="argument 0 must match the captured one"):
        graphed(*_batch(torch.Generator().manual_seed(7), s=9, device="cuda"))
