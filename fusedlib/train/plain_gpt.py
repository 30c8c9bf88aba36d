"""A nanoGPT-style GPT in plain PyTorch: the baseline of the training chapter.

The same function as fusedlib's ``GPTModel`` built by :func:`fusedlib.train.model.build_gpt`
(learned positions, pre-LN layers: LayerNorm, causal self-attention, LayerNorm, tanh-GeLU
MLP; a bias in every linear layer; the final LayerNorm; the output layer tied to the token
embedding), written the way nanoGPT writes it: ``torch.nn`` modules on [b, s, h] activations,
one ``scaled_dot_product_attention`` call with ``is_causal=True`` per layer, and ``F.cross_entropy``
for the loss. It is the model a PyTorch user would write and then ``torch.compile``.

:func:`plain_state_dict_from_gpt` converts a ``GPTModel`` state dict into this model's, so all
the models of a comparison start from the same weights: the only layout difference is the
QKV projection's rows, [np, 3, hn] (Megatron-core: per head, its query, key and value) against
[3, np, hn] (nanoGPT: all queries, then all keys, then all values).

Source: Karpathy, nanoGPT ``model.py`` (2022); Radford et al., "Language Models are
Unsupervised Multitask Learners" (2019) for the pre-LN layer and the tanh GeLU.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["PlainGPT", "plain_state_dict_from_gpt"]


class _Layer(torch.nn.Module):
    def __init__(self, h: int, heads: int, ffn: int, dropout: float, device=None, dtype=None) -> None:
        super().__init__()
        f = dict(device=device, dtype=dtype)
        self.heads, self.dropout = heads, dropout
        self.ln_1 = torch.nn.LayerNorm(h, **f)
        self.c_attn = torch.nn.Linear(h, 3 * h, **f)
        self.c_proj = torch.nn.Linear(h, h, **f)
        self.ln_2 = torch.nn.LayerNorm(h, **f)
        self.c_fc = torch.nn.Linear(h, ffn, **f)
        self.mlp_proj = torch.nn.Linear(ffn, h, **f)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        p = self.dropout if self.training else 0.0
        # [b, s, 3h] -> [b, s, 3, np, hn] -> 3 x [b, np, s, hn]
        q, k, v = self.c_attn(self.ln_1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # [b, np, s, hn]
        a = a.transpose(1, 2).reshape(b, s, h)  # [b, np, s, hn] -> [b, s, h]
        x = x + F.dropout(self.c_proj(a), p, self.training)
        y = F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")  # [b, s, ffn]
        return x + F.dropout(self.mlp_proj(y), p, self.training)


class PlainGPT(torch.nn.Module):
    """GPT in plain PyTorch: token ids [b, s] -> logits [b, s, V], or with labels the loss [b, s].

    Args:
        vocab_size: V. max_sequence_length: rows of the position table (s <= it).
        layers, hidden, heads, ffn: the shape (hidden divisible by heads).
        dropout: of the embedding, the attention probabilities and both residual branches.
        init_std: the weights' N(0, std) init; the two output projections of each layer use
            std / sqrt(2·layers) (GPT-2's, and Megatron-core's default); biases 0, norms 1.
        device, dtype: the parameters'.

    ``forward(input_ids, position_ids=None, attention_mask=None, labels=None)`` (``GPTModel``'s
    argument order; ``attention_mask`` must be None: the attention is causal): input_ids,
    labels int [b, s]. Returns logits [b, s, V] in the parameters' dtype, or the float32
    per-token cross entropy [b, s] when labels are given.

    Raises:
        ValueError: a bad shape argument; s > max_sequence_length; an attention mask given.

    Source: Karpathy, nanoGPT ``model.py`` (``GPT``).
    """

    def __init__(self, vocab_size: int, max_sequence_length: int, layers: int, hidden: int, heads: int,
                 ffn: Optional[int] = None, dropout: float = 0.0, init_std: float = 0.02, device=None,
                 dtype=None) -> None:
        super().__init__()
        for name, v in (("vocab_size", vocab_size), ("max_sequence_length", max_sequence_length),
                        ("layers", layers), ("hidden", hidden), ("heads", heads)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        ffn = 4 * hidden if ffn is None else ffn
        f = dict(device=device, dtype=dtype)
        self.vocab_size, self.max_sequence_length, self.dropout = vocab_size, max_sequence_length, dropout
        self.wte = torch.nn.Embedding(vocab_size, hidden, **f)
        self.wpe = torch.nn.Embedding(max_sequence_length, hidden, **f)
        self.h = torch.nn.ModuleList(_Layer(hidden, heads, ffn, dropout, **f) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(hidden, **f)
        self.lm_head = torch.nn.Linear(hidden, vocab_size, bias=False, **f)
        self.lm_head.weight = self.wte.weight  # tied
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("c_proj.weight") or name.endswith("mlp_proj.weight"):
                    p.normal_(0.0, init_std / (2 * layers) ** 0.5)
                elif p.dim() == 2:
                    p.normal_(0.0, init_std)
                elif ".ln_" in name or name.startswith("ln_"):
                    p.fill_(1.0 if name.endswith("weight") else 0.0)
                else:
                    p.zero_()

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits [b, s, V], or with labels the loss [b, s] float32 (see the class docstring)."""
        if attention_mask is not None:
            raise ValueError("attention_mask must be None: PlainGPT's attention is causal")
        b, s = input_ids.shape
        if s > self.max_sequence_length:
            raise ValueError(f"input_ids has {s} positions, more than max_sequence_length {self.max_sequence_length}")
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device, dtype=torch.int64)
        x = F.dropout(self.wte(input_ids) + self.wpe(position_ids), self.dropout, self.training)  # [b, s, h]
        for layer in self.h:
            x = layer(x)
        logits = self.lm_head(self.ln_f(x))  # [b, s, V]
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view(b, s)


def plain_state_dict_from_gpt(state: dict, heads: int) -> dict:
    """A ``GPTModel`` state dict (learned positions, tied output layer, MHA, biases, LayerNorm,
    as :func:`fusedlib.train.model.build_gpt` builds it) renamed and reordered for :class:`PlainGPT`.

    The QKV rows: Megatron-core [np, 3, hn] (per head q, k, v) -> [3, np, hn]. Every tensor is
    copied, none aliased to the input. ``_extra_state`` entries are dropped.

    Raises:
        KeyError: an entry this conversion does not know (the model has a part PlainGPT lacks).

    Source: fusedlib's own (Megatron-core's QKV rows [np, 3, hn] to nanoGPT's [3, np, hn]).
    """
    out = {}
    layer_names = {"input_layernorm.weight": "ln_1.weight", "input_layernorm.bias": "ln_1.bias",
                   "self_attention.linear_proj.weight": "c_proj.weight",
                   "self_attention.linear_proj.bias": "c_proj.bias",
                   "pre_mlp_layernorm.weight": "ln_2.weight", "pre_mlp_layernorm.bias": "ln_2.bias",
                   "mlp.linear_fc1.weight": "c_fc.weight", "mlp.linear_fc1.bias": "c_fc.bias",
                   "mlp.linear_fc2.weight": "mlp_proj.weight", "mlp.linear_fc2.bias": "mlp_proj.bias"}
    for key, t in state.items():
        if key.endswith("_extra_state"):
            continue
        t = t.detach().clone()
        if key == "embedding.word_embeddings.weight":
            out["wte.weight"] = t
            out["lm_head.weight"] = t
        elif key == "embedding.position_embeddings.weight":
            out["wpe.weight"] = t
        elif key.startswith("decoder.final_layernorm."):
            out["ln_f." + key.rsplit(".", 1)[1]] = t
        elif key.startswith("decoder.layers."):
            i, rest = key[len("decoder.layers."):].split(".", 1)
            if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
                rows = t.shape[0]
                hn = rows // (3 * heads)
                # [np·3·hn, ...] -> [np, 3, hn, ...] -> [3, np, hn, ...] -> [3·np·hn, ...]
                t = t.view(heads, 3, hn, *t.shape[1:]).transpose(0, 1).reshape(t.shape).clone()
                out[f"h.{i}.c_attn.{rest.rsplit('.', 1)[1]}"] = t
            elif rest in layer_names:
                out[f"h.{i}.{layer_names[rest]}"] = t
            else:
                raise KeyError(f"state: no PlainGPT entry for {key!r}")
        else:
            raise KeyError(f"state: no PlainGPT entry for {key!r}")
    return out
