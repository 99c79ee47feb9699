"""The paper's encoder-decoder ("Attention Is All You Need", base configuration by default).

    model = Seq2SeqTransformer(src_vocab_size, tgt_vocab_size)      # 6 + 6 layers, d_model 512
    logits = model(src, tgt_in)                                    # (B, T, V), teacher forcing
    loss = model.loss(src, tgt_in, tgt_out)                        # the same loss, no (B, T, V) logits
    tokens = model.greedy_decode(src, max_len=64)                  # KV-cached
    tokens = model.beam_search(src, beam_size=4, max_len=64)

Token ids are batch first, padded with ``pad_id``; the padding masks come from it.  The
decoding methods live in decoding.py and run on the layers' own parameters with the fused
functional ops.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import _checks
from . import _validate, decoding
from ._layers import LayerNorm, TransformerDecoder, TransformerDecoderLayer, TransformerEncoder, TransformerEncoderLayer
from .embedding import ScaledEmbedding, SinusoidalPositionalEncoding
from .fused_loss import linear_cross_entropy


def causal_mask(length: int, device=None) -> torch.Tensor:
    """(length, length) bool, True above the diagonal = not allowed (the torch.nn convention)."""
    return torch.ones(length, length, dtype=torch.bool, device=device).triu_(1)


class Seq2SeqTransformer(nn.Module):
    """Encoder-decoder Transformer with scaled embeddings, sinusoidal positions and an optional
    shared source/target embedding and pre-softmax projection.

    Args:
        src_vocab_size, tgt_vocab_size: vocabulary sizes (token ids are in [0, size)).
        d_model, nhead, num_encoder_layers, num_decoder_layers, dim_feedforward, dropout: the
            paper's hyper-parameters (base model by default).
        pad_id, bos_id, eos_id: special token ids (the same in both vocabularies).
        share_embeddings: tie the source embedding, the target embedding and the output
            projection (one matrix; needs src_vocab_size == tgt_vocab_size).
        activation: "relu" (the paper) or "gelu", as torch.nn.TransformerEncoderLayer.
        norm_first: pre-LN layers (with a final LayerNorm after each stack) instead of the
            paper's post-LN.
    """

    def __init__(self, src_vocab_size, tgt_vocab_size, d_model=512, nhead=8, num_encoder_layers=6,
                 num_decoder_layers=6, dim_feedforward=2048, dropout=0.1, pad_id=0, bos_id=1,
                 eos_id=2, share_embeddings=False, *, activation="relu", norm_first=False):
        super().__init__()
        # (integer-like values, a numpy integer say, become ints: the layers take ints)
        (src_vocab_size, tgt_vocab_size, d_model, nhead, num_encoder_layers, num_decoder_layers,
         dim_feedforward) = (
            _validate.positive_int(name, value) for name, value in (
                ("src_vocab_size", src_vocab_size), ("tgt_vocab_size", tgt_vocab_size),
                ("d_model", d_model), ("nhead", nhead), ("num_encoder_layers", num_encoder_layers),
                ("num_decoder_layers", num_decoder_layers), ("dim_feedforward", dim_feedforward)))
        if d_model % nhead:
            raise ValueError(f"d_model ({d_model}) must be divisible by nhead ({nhead})")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise ValueError(f"dropout must be a float in [0, 1); got {dropout!r}")
        for name, value in (("pad_id", pad_id), ("bos_id", bos_id), ("eos_id", eos_id)):
            _validate.token_id(name, value, min(src_vocab_size, tgt_vocab_size))
        if len({pad_id, bos_id, eos_id}) != 3:
            raise ValueError(
                f"pad_id, bos_id and eos_id must differ; got {pad_id}, {bos_id}, {eos_id}"
            )
        share_embeddings = _checks.boolean("share_embeddings", share_embeddings)
        if share_embeddings and src_vocab_size != tgt_vocab_size:
            raise ValueError(
                "share_embeddings needs one vocabulary: src_vocab_size == tgt_vocab_size; got "
                f"{src_vocab_size} and {tgt_vocab_size}"
            )
        if activation not in ("relu", "gelu"):
            raise ValueError(f"activation must be 'relu' or 'gelu'; got {activation!r}")

        self.src_vocab_size, self.tgt_vocab_size = src_vocab_size, tgt_vocab_size
        self.d_model, self.nhead = d_model, nhead
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id
        self.share_embeddings = share_embeddings

        self.src_embed = ScaledEmbedding(src_vocab_size, d_model)
        self.tgt_embed = self.src_embed if share_embeddings else ScaledEmbedding(tgt_vocab_size, d_model)
        self.positions = SinusoidalPositionalEncoding(d_model)
        self.dropout = nn.Dropout(dropout)
        layer_args = dict(d_model=d_model, nhead=nhead, dim_feedforward=dim_feedforward,
                          dropout=dropout, activation=activation, batch_first=True,
                          norm_first=norm_first)
        # Pre-LN stacks need a final norm (their residual stream is never normalised); the
        # paper's post-LN layers end in one already.
        self.encoder = TransformerEncoder(
            TransformerEncoderLayer(**layer_args), num_encoder_layers,
            norm=LayerNorm(d_model) if norm_first else None, enable_nested_tensor=False,
        )
        self.decoder = TransformerDecoder(
            TransformerDecoderLayer(**layer_args), num_decoder_layers,
            norm=LayerNorm(d_model) if norm_first else None,
        )
        self.generator = nn.Linear(d_model, tgt_vocab_size, bias=False)  # pre-softmax projection
        for p in list(self.encoder.parameters()) + list(self.decoder.parameters()):
            if p.dim() > 1:  # as torch.nn.Transformer
                nn.init.xavier_uniform_(p)
        if share_embeddings:
            self.generator.weight = self.src_embed.weight
        else:
            nn.init.normal_(self.generator.weight, mean=0.0, std=d_model ** -0.5)

    # ---- the two halves, for teacher forcing and for decoders

    def _device(self) -> torch.device:
        return self.generator.weight.device

    def encode(self, src: torch.Tensor):
        """src (B, S) token ids -> (memory (B, S, d_model), src_padding (B, S) bool, True = pad)."""
        _validate.tokens("src", src, self.src_vocab_size, pad_id=self.pad_id, device=self._device())
        src_padding = src == self.pad_id  # (B, S)
        x = self.dropout(self.positions(self.src_embed(src)))  # (B, S, d)
        memory = self.encoder(x, src_key_padding_mask=src_padding)
        return memory, src_padding

    def decode(self, tgt_in: torch.Tensor, memory: torch.Tensor, src_padding: torch.Tensor) -> torch.Tensor:
        """All positions at once: tgt_in (B, T) -> logits (B, T, V), causal and padding masked."""
        return self.generator(self.decoder_states(tgt_in, memory, src_padding))

    def decoder_states(self, tgt_in: torch.Tensor, memory: torch.Tensor, src_padding: torch.Tensor) -> torch.Tensor:
        """decode() without the pre-softmax projection: (B, T, d_model)."""
        _validate.tokens("tgt_in", tgt_in, self.tgt_vocab_size, device=self._device())
        if tgt_in.shape[0] != memory.shape[0]:
            raise ValueError(
                f"tgt_in must have the source batch size ({memory.shape[0]}); got {tgt_in.shape[0]}"
            )
        length = tgt_in.shape[1]
        y = self.dropout(self.positions(self.tgt_embed(tgt_in)))  # (B, T, d)
        return self.decoder(
            y, memory,
            tgt_mask=causal_mask(length, y.device),
            tgt_is_causal=True,  # the hint: no data-dependent mask inspection (torch.compile)
            tgt_key_padding_mask=tgt_in == self.pad_id,
            memory_key_padding_mask=src_padding,
        )  # (B, T, d)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        """Teacher forcing: src (B, S), tgt_in (B, T) (bos + target[:-1]) -> logits (B, T, V)."""
        memory, src_padding = self.encode(src)
        return self.decode(tgt_in, memory, src_padding)

    def loss(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor, smoothing: float = 0.1,
             reduction: str = "mean") -> torch.Tensor:
        """The teacher-forced training loss: ``label_smoothed_cross_entropy(self(src, tgt_in),
        tgt_out, smoothing, ignore_index=pad_id, reduction)``, with the pre-softmax projection
        fused into the loss (fused_loss.py): the (B, T, V) logits are never all in
        memory.  The generator's own forward (and any hook on it) is not called."""
        # tgt_out is checked here, under its own name, before any work (decoder_states checks
        # tgt_in, as forward's decode does).
        _validate.tokens("tgt_out", tgt_out, self.tgt_vocab_size, device=self._device())
        if isinstance(tgt_in, torch.Tensor) and tgt_out.shape != tgt_in.shape:
            raise ValueError(f"tgt_out must have tgt_in's shape {tuple(tgt_in.shape)} (one target per "
                             f"input position); got {tuple(tgt_out.shape)}")
        memory, src_padding = self.encode(src)
        h = self.decoder_states(tgt_in, memory, src_padding)  # (B, T, d)
        return linear_cross_entropy(h, self.generator.weight, tgt_out, self.generator.bias, smoothing,
                                    ignore_index=self.pad_id, reduction=reduction)

    # ---- decoding (decoding.py)

    def greedy_decode(self, src, max_len, use_cache=True, *, cuda_graph=None):
        """(B, <= max_len) tokens after bos, each row stopping at (and keeping) its eos; rows
        that stopped are padded with pad_id.  See decoding.greedy_decode (on a GPU each step is
        replayed as a CUDA graph unless cuda_graph=False)."""
        return decoding.greedy_decode(self, src, max_len, use_cache=use_cache, cuda_graph=cuda_graph)

    def beam_search(self, src, beam_size, max_len, length_penalty=1.0, use_cache=True, *, cuda_graph=None):
        """The best hypothesis per row by sum(log p) / length**length_penalty; see
        decoding.beam_search."""
        return decoding.beam_search(self, src, beam_size, max_len, length_penalty, use_cache=use_cache,
                                    cuda_graph=cuda_graph)

    def sample(self, src, max_len, temperature=1.0, top_k=None, generator=None, use_cache=True, *,
               cuda_graph=None):
        """Ancestral sampling with temperature and top-k; see decoding.sample."""
        return decoding.sample(self, src, max_len, temperature, top_k, generator, use_cache=use_cache,
                               cuda_graph=cuda_graph)
