"""The paper's models on the fused modules: the encoder-decoder with its decoders, the
encoder-only classifier, training helpers and the train-demo."""
from .classifier import TransformerClassifier
from .decoding import beam_search, greedy_decode, sample
from .fused_loss import linear_cross_entropy
from .embedding import ScaledEmbedding, SinusoidalPositionalEncoding, sinusoidal_positions
from .seq2seq import Seq2SeqTransformer, causal_mask
from .training import (
    CudaGraphStep,
    label_smoothed_cross_entropy,
    LabelSmoothedCrossEntropy,
    shift_right,
    train_step,
    warmup_lr_lambda,
    warmup_scheduler,
)

__all__ = [
    "Seq2SeqTransformer",
    "TransformerClassifier",
    "ScaledEmbedding",
    "SinusoidalPositionalEncoding",
    "sinusoidal_positions",
    "causal_mask",
    "greedy_decode",
    "beam_search",
    "sample",
    "label_smoothed_cross_entropy",
    "linear_cross_entropy",
    "LabelSmoothedCrossEntropy",
    "shift_right",
    "train_step",
    "CudaGraphStep",
    "warmup_lr_lambda",
    "warmup_scheduler",
]
