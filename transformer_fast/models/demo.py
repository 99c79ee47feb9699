"""``python -m transformer_fast train-demo``: train a small Seq2SeqTransformer on a synthetic
sequence task and report held-out exact-match accuracy.

Tasks (random strings of ``--symbols`` distinct tokens, lengths ``--min-len`` .. ``--max-len``,
batches padded with pad_id): ``copy`` (target = source), ``reverse``, ``sort``.  Training is
teacher forced with label-smoothed cross entropy, Adam and the paper's warm-up schedule (with a
linear cool-down over the last --cooldown fraction of the steps); the held-out
set is drawn once from a separate generator and its strings never appear in training.  At the end
every held-out source is greedy-decoded (KV cache) and counted right only if the whole output,
eos included, matches.  The loss curve is written as a PNG (matplotlib, Agg backend).
"""
from __future__ import annotations

import argparse
import math
import os
import time

import torch

from .seq2seq import Seq2SeqTransformer
from .training import train_step, warmup_lr_lambda

TASKS = ("copy", "reverse", "sort")
PAD, BOS, EOS = 0, 1, 2
FIRST_SYMBOL = 3


def possible_strings(symbols: int, min_len: int, max_len: int) -> int:
    """How many distinct strings the task draws from."""
    return sum(symbols ** n for n in range(min_len, max_len + 1))


def check_held_out(n: int, symbols: int, min_len: int, max_len: int) -> None:
    """Training draws only strings outside the held-out set: that set must leave most of them
    (with all of them held out, no training string could ever be drawn)."""
    possible = possible_strings(symbols, min_len, max_len)
    if n > possible // 2:
        raise ValueError(f"--held-out {n} is more than half of the {possible} possible strings "
                         f"(--symbols {symbols}, lengths {min_len}..{max_len}): hold out fewer, "
                         f"or allow more symbols or longer strings")


def _target(task: str, seq: list[int]) -> list[int]:
    if task == "copy":
        return list(seq)
    if task == "reverse":
        return seq[::-1]
    return sorted(seq)


class SyntheticTask:
    """Random strings and their targets; ``held_out`` strings are excluded from training."""

    def __init__(self, task: str, symbols: int, min_len: int, max_len: int, seed: int):
        if task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}; got {task!r}")
        if symbols < 2:
            raise ValueError(f"symbols must be >= 2; got {symbols}")
        if not 1 <= min_len <= max_len:
            raise ValueError(f"need 1 <= min_len <= max_len; got {min_len}, {max_len}")
        self.task, self.symbols, self.min_len, self.max_len = task, symbols, min_len, max_len
        self.vocab_size = FIRST_SYMBOL + symbols
        self.generator = torch.Generator().manual_seed(seed)
        self.held_out: set[tuple[int, ...]] = set()

    def _strings(self, n: int, generator: torch.Generator, exclude=None) -> list[list[int]]:
        out = []
        while len(out) < n:
            length = int(torch.randint(self.min_len, self.max_len + 1, (1,), generator=generator))
            seq = (torch.randint(0, self.symbols, (length,), generator=generator) + FIRST_SYMBOL).tolist()
            if exclude is None or tuple(seq) not in exclude:
                out.append(seq)
        return out

    def make_held_out(self, n: int, seed: int) -> list[list[int]]:
        check_held_out(n, self.symbols, self.min_len, self.max_len)
        strings = self._strings(n, torch.Generator().manual_seed(seed))
        self.held_out = {tuple(s) for s in strings}
        return strings

    def batch(self, strings: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
        """src (B, S) padded strings; tgt (B, T) targets + eos, padded."""
        width_src = max(len(s) for s in strings)
        src = torch.full((len(strings), width_src), PAD, dtype=torch.long)
        tgt = torch.full((len(strings), width_src + 1), PAD, dtype=torch.long)
        for i, s in enumerate(strings):
            src[i, : len(s)] = torch.tensor(s)
            tgt[i, : len(s) + 1] = torch.tensor(_target(self.task, s) + [EOS])
        return src.to(device), tgt.to(device)

    def train_batch(self, batch_size: int, device):
        return self.batch(self._strings(batch_size, self.generator, exclude=self.held_out), device)


def exact_match(model, task: SyntheticTask, strings: list[list[int]], device, batch_size=256) -> float:
    """Fraction of strings whose greedy decoding equals target + eos exactly."""
    right = 0
    for start in range(0, len(strings), batch_size):
        chunk = strings[start : start + batch_size]
        src, tgt = task.batch(chunk, device)
        out = model.greedy_decode(src, max_len=tgt.shape[1])  # (B, <= T)
        padded = torch.full_like(tgt, PAD)
        padded[:, : out.shape[1]] = out
        right += int((padded == tgt).all(dim=1).sum())
    return right / len(strings)


def smoothing_floor(vocab_size: int, smoothing: float) -> float:
    """The lowest label-smoothed cross entropy: the entropy of the smoothed target itself."""
    on = 1.0 - smoothing + smoothing / vocab_size
    off = smoothing / vocab_size
    return -on * math.log(on) - (vocab_size - 1) * (off * math.log(off) if off > 0 else 0.0)


def plot_loss(losses: list[float], path: str, title: str, floor: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = range(1, len(losses) + 1)
    ax.plot(steps, losses, lw=0.6, alpha=0.4, label="loss per step")
    window = max(1, len(losses) // 50)
    if window > 1:
        smooth = torch.tensor(losses).unfold(0, window, 1).mean(dim=1).tolist()
        ax.plot(range(window, len(losses) + 1), smooth, lw=1.5, label=f"mean of {window}")
    if floor is not None and floor > 0:
        ax.axhline(floor, color="gray", ls="--", lw=1, label=f"label-smoothing floor {floor:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("label-smoothed cross entropy")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def demo_schedule(args: argparse.Namespace):
    """The paper's warm-up schedule, then a linear cool-down to 0 over the last --cooldown
    fraction of the steps: a short run ends on small updates instead of the still-large
    inverse-square-root rate, which otherwise leaves the exact-match accuracy jittering by
    several percent from one checkpoint to the next."""
    paper = warmup_lr_lambda(args.d_model, args.warmup, args.lr_scale)
    cool = int(args.cooldown * args.steps)

    def rate(step: int) -> float:
        left = args.steps - step
        return paper(step) * (min(1.0, left / cool) if cool > 0 else 1.0)

    return rate


def int_at_least(minimum: int):
    """argparse type: an int >= minimum (argparse names the option in its error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return parse


_positive_int = int_at_least(1)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except None (their help says what happens then)."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The train-demo options (the parser should use HelpFormatter)."""
    p.add_argument("--task", choices=TASKS, default="reverse", help="what the model learns to output")
    p.add_argument("--steps", type=_positive_int, default=1200, help="training updates")
    p.add_argument("--batch-size", type=_positive_int, default=64, help="strings per update")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="where to train (default: cuda when present)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast for training (CUDA)")
    p.add_argument("--out", default="train_demo_loss.png", help="loss-curve PNG path ('' for none)")
    p.add_argument("--symbols", type=_positive_int, default=10, help="distinct tokens in the strings (>= 2)")
    p.add_argument("--min-len", type=_positive_int, default=3, help="shortest string")
    p.add_argument("--max-len", type=_positive_int, default=10, help="longest string")
    p.add_argument("--d-model", type=_positive_int, default=64, help="model width")
    p.add_argument("--nhead", type=_positive_int, default=4, help="attention heads (dividing --d-model)")
    p.add_argument("--layers", type=_positive_int, default=2, help="encoder and decoder layers each")
    p.add_argument("--ffn", type=_positive_int, default=256, help="dim_feedforward")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout probability, in [0, 1)")
    p.add_argument("--warmup", type=_positive_int, default=200, help="warm-up steps of the paper's schedule")
    p.add_argument("--lr-scale", type=float, default=0.5, help="multiplies the paper's rate (> 0)")
    p.add_argument("--cooldown", type=float, default=0.4,
                   help="fraction of the steps at the end with the rate decaying linearly to 0")
    p.add_argument("--smoothing", type=float, default=0.1, help="label smoothing, in [0, 1]")
    p.add_argument("--held-out", type=_positive_int, default=1000,
                   help="held-out strings for the accuracy (at most half of the possible strings)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data and the initial weights")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch CPU threads (default on CPU: 1: the demo's matrices are small, "
                        "and on a busy 2-core machine 2 threads were several times slower)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def check_args(args: argparse.Namespace) -> None:
    """Every option's range and the options' combinations, before anything runs: a ValueError
    naming the option (the command line reports it as a usage error, exit status 2)."""
    if not 0.0 <= args.cooldown <= 1.0:
        raise ValueError(f"--cooldown must be in [0, 1]; got {args.cooldown}")
    if not 0.0 <= args.dropout < 1.0:
        raise ValueError(f"--dropout must be in [0, 1); got {args.dropout}")
    if not 0.0 <= args.smoothing <= 1.0:
        raise ValueError(f"--smoothing must be in [0, 1]; got {args.smoothing}")
    if not (math.isfinite(args.lr_scale) and args.lr_scale > 0.0):
        raise ValueError(f"--lr-scale must be a finite number > 0; got {args.lr_scale}")
    if args.d_model % args.nhead:
        raise ValueError(f"--d-model ({args.d_model}) must be divisible by --nhead ({args.nhead})")
    if args.symbols < 2:
        raise ValueError(f"--symbols must be >= 2; got {args.symbols}")
    if args.min_len > args.max_len:
        raise ValueError(f"--min-len ({args.min_len}) must be <= --max-len ({args.max_len})")
    check_held_out(args.held_out, args.symbols, args.min_len, args.max_len)


def run(args: argparse.Namespace) -> dict:
    """Train and evaluate; returns {"losses", "accuracy", "train_seconds", "eval_seconds", ...}."""
    threads = torch.get_num_threads()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    wanted = args.threads or (1 if torch.device(device).type == "cpu" else None)
    if wanted:
        torch.set_num_threads(wanted)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> dict:
    from tqdm.auto import tqdm

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1; got {args.steps}")
    check_args(args)
    torch.manual_seed(args.seed)
    task = SyntheticTask(args.task, args.symbols, args.min_len, args.max_len, seed=args.seed + 1)
    held_out = task.make_held_out(args.held_out, seed=args.seed + 2)
    model = Seq2SeqTransformer(
        task.vocab_size, task.vocab_size, d_model=args.d_model, nhead=args.nhead,
        num_encoder_layers=args.layers, num_decoder_layers=args.layers,
        dim_feedforward=args.ffn, dropout=args.dropout, pad_id=PAD, bos_id=BOS, eos_id=EOS,
        share_embeddings=True,
    ).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, demo_schedule(args))
    autocast = torch.bfloat16 if args.bf16 else None
    params = sum(p.numel() for p in model.parameters())

    losses = []
    start = time.perf_counter()
    bar = tqdm(range(args.steps), desc=f"train {args.task}", disable=args.no_progress,
               dynamic_ncols=True)
    pending = []
    for step in bar:
        src, tgt = task.train_batch(args.batch_size, device)
        lr = optimizer.param_groups[0]["lr"]  # the rate of this update (train_step advances it)
        pending.append(train_step(model, src, tgt, optimizer, scheduler, smoothing=args.smoothing,
                                  autocast_dtype=autocast))
        if len(pending) == 25 or step == args.steps - 1:  # one host sync per 25 steps
            losses.extend(torch.stack(pending).float().cpu().tolist())
            pending = []
            bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{lr:.2e}")
    bar.close()
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_seconds = time.perf_counter() - start

    start = time.perf_counter()
    accuracy = exact_match(model, task, held_out, device)
    eval_seconds = time.perf_counter() - start
    if args.out:
        plot_loss(losses, args.out, f"train-demo {args.task}: {args.steps} steps, "
                                    f"held-out exact match {accuracy:.1%}",
                  floor=smoothing_floor(task.vocab_size, args.smoothing))
    return {"losses": losses, "accuracy": accuracy, "train_seconds": train_seconds,
            "eval_seconds": eval_seconds, "parameters": params, "device": str(device),
            "model": model, "task": task, "held_out": held_out}


def main(args: argparse.Namespace) -> int:
    result = run(args)
    losses = result["losses"]
    head = sum(losses[:25]) / len(losses[:25])
    tail = sum(losses[-25:]) / len(losses[-25:])
    print(f"task {args.task} on {result['device']}: {result['parameters']:,} parameters, "
          f"{args.steps} steps of {args.batch_size}")
    print(f"loss {head:.3f} (first 25 steps) -> {tail:.3f} (last 25)")
    print(f"held-out exact match: {result['accuracy']:.2%} of {len(result['held_out'])} strings")
    print(f"time: train {result['train_seconds']:.1f} s, eval {result['eval_seconds']:.1f} s")
    model, task = result["model"], result["task"]
    src, _ = task.batch(result["held_out"][:3], result["device"])
    decoded = model.greedy_decode(src, max_len=src.shape[1] + 1).tolist()
    for s, out in zip(result["held_out"][:3], decoded):
        shown = [t - FIRST_SYMBOL for t in out if t not in (PAD, EOS)]
        print(f"  {args.task}({[t - FIRST_SYMBOL for t in s]}) -> {shown}")
    if args.out:
        print(f"loss curve: {args.out}")
    return 0 if math.isfinite(tail) else 1
