"""A float64 GPT block and model written from the formulas, for the transformer tests.

Independent of fusedlib's modules: it reads only a state dict (Megatron-core's parameter names)
and the config's numbers, and computes with plain torch ops in float64: the oracle the fused
and the unfused blocks are both measured against. Pre-norm GPT layers; grouped-query attention
with Megatron-core's QKV layout; causal (and optional sliding-window) masks aligned bottom-right;
RoPE from its definition (angles p·base^(-2i/d)); gated or plain MLP.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def norm(x, sd, name, cfg):
    """LayerNorm or RMSNorm over the last dim with the state dict's weight (and bias)."""
    w = sd[f"{name}.weight"].double()
    if cfg.normalization == "RMSNorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.layernorm_epsilon) * w
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + cfg.layernorm_epsilon) * w + sd[f"{name}.bias"].double()


def linear(x, sd, name):
    y = x @ sd[f"{name}.weight"].double().t()
    b = sd.get(f"{name}.bias")
    return y if b is None else y + b.double()


def rope(t, positions, rot_dim, base=10000.0, interleaved=False):
    """Rotate channel pairs of t [s, b, n, d] by angle p·base^(-2i/rot_dim) (p the position)."""
    i = torch.arange(rot_dim // 2, dtype=torch.float64, device=t.device)
    theta = positions.double()[:, None] * base ** (-2 * i / rot_dim)  # [s, rot/2]
    cos, sin = torch.cos(theta)[:, None, None, :], torch.sin(theta)[:, None, None, :]
    r, rest = t[..., :rot_dim], t[..., rot_dim:]
    if interleaved:
        x1, x2 = r[..., 0::2], r[..., 1::2]
        r = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = r[..., : rot_dim // 2], r[..., rot_dim // 2:]
        r = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((r, rest), dim=-1)


def keep_mask(sq, sk, causal=True, window=None, device=None):
    """bool [sq, sk], True = attend: bottom-right causal, or the sliding window (left, right)."""
    q = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    if window is not None:
        left, right = window
        keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
        if left >= 0:
            keep &= j >= q - left
        if right >= 0:
            keep &= j <= q + right
        return keep
    return j <= q if causal else torch.ones(sq, sk, dtype=torch.bool, device=device)


def attention(q, k, v, keep, scale):
    """q [sq, b, np, hn], k/v [sk, b, np, hn], keep broadcastable to [b, np, sq, sk] -> [sq, b, np·hn].
    A row with nothing to attend to gives zeros."""
    scores = torch.einsum("qbnd,kbnd->bnqk", q, k) * scale
    scores = scores.masked_fill(~keep, float("-inf"))
    empty = ~keep.any(-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    ctx = torch.einsum("bnqk,kbnd->qbnd", probs, v)
    return ctx.reshape(ctx.shape[0], ctx.shape[1], -1)


def self_attention(h, sd, pre, cfg, keep, positions=None, rot_dim=None, rotary_base=10000.0):
    s, b, _ = h.shape
    np_, ng, hn = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    per = np_ // ng
    qkv = linear(h, sd, f"{pre}linear_qkv").view(s, b, ng, (per + 2) * hn)
    q, k, v = torch.split(qkv, [per * hn, hn, hn], dim=-1)
    q = q.reshape(s, b, np_, hn)
    if cfg.qk_layernorm:
        q, k = norm(q, sd, f"{pre}q_layernorm", cfg), norm(k, sd, f"{pre}k_layernorm", cfg)
    if positions is not None:
        q = rope(q, positions, rot_dim, rotary_base, cfg.rotary_interleaved)
        k = rope(k, positions, rot_dim, rotary_base, cfg.rotary_interleaved)
    k, v = k.repeat_interleave(per, dim=2), v.repeat_interleave(per, dim=2)
    scale = cfg.softmax_scale if cfg.softmax_scale is not None else 1.0 / math.sqrt(hn)
    return linear(attention(q, k, v, keep, scale), sd, f"{pre}linear_proj")


def mlp(h, sd, pre, cfg, act):
    f = linear(h, sd, f"{pre}linear_fc1")
    if cfg.gated_linear_unit:
        a, lin = torch.chunk(f, 2, dim=-1)
        if cfg.activation_func_clamp_value is not None:
            c = cfg.activation_func_clamp_value
            a, lin = a.clamp(max=c), lin.clamp(-c, c)
        f = act(a) * (lin + cfg.glu_linear_offset)
    else:
        f = act(f)
    return linear(f, sd, f"{pre}linear_fc2")


def block(x, sd, cfg, *, act=None, mask=None, window=None, positions=None, rot_dim=None, prefix=""):
    """The GPT block in float64: x [s, b, h] -> [s, b, h]. mask: extra bool mask, True = masked.

    act: the activation in float64 (default config.activation_func); positions: RoPE positions [s]
    (None: no RoPE)."""
    act = act or cfg.activation_func
    x = x.double()
    sd = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    s = x.shape[0]
    keep = keep_mask(s, s, True, window, device=x.device)
    if mask is not None:
        keep = keep & ~mask
    post_ln = cfg.apply_residual_connection_post_layernorm
    for i in range(cfg.num_layers):
        pre = f"{prefix}layers.{i}."
        h = norm(x, sd, f"{pre}input_layernorm", cfg)
        x = (h if post_ln else x) + self_attention(h, sd, f"{pre}self_attention.", cfg, keep, positions, rot_dim)
        h = norm(x, sd, f"{pre}pre_mlp_layernorm", cfg)
        x = (h if post_ln else x) + mlp(h, sd, f"{pre}mlp.", cfg, act)
    return norm(x, sd, f"{prefix}final_layernorm", cfg)


def gpt_loss(input_ids, labels, sd, cfg, *, position_embedding_type="learned_absolute", tied=False, act=None,
             rot_dim=None):
    """Per-token cross entropy [b, s] of the GPT model in float64."""
    emb = sd["embedding.word_embeddings.weight"].double()
    x = emb[input_ids]  # [b, s, h]
    s = input_ids.shape[1]
    positions = torch.arange(s, device=input_ids.device)
    if position_embedding_type == "learned_absolute":
        x = x + sd["embedding.position_embeddings.weight"].double()[positions]
    x = x.transpose(0, 1)  # [s, b, h]
    rope_pos = positions if position_embedding_type == "rope" else None
    h = block(x, sd, cfg, act=act, positions=rope_pos, rot_dim=rot_dim, prefix="decoder.")
    w_out = emb if tied else sd["output_layer.weight"].double()
    logits = h @ w_out.t()  # [s, b, V]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.t().reshape(-1), reduction="none")
    return loss.view(s, -1).t()  # [s, b] -> [b, s]
