#!/usr/bin/env python3
"""Recomputes the logits of a reference folder with plain numpy (float64).

It reads model.safetensors and config.json exactly as tests/reference/README.md
says an importer should (weight layouts, head order, rotary pairs, GQA), and
compares with the logits transformers gave. scripts/reference runs it after
regenerating the tiny folders; by hand:

  .deps/reference-venv/bin/python tests/reference/layout_check.py [FOLDER...]

(default: the gpt2-tiny and llama-tiny folders next to this file).
"""

import json
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

HERE = Path(__file__).resolve().parent


def load(folder):
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    weights = {k: v.astype(np.float64) for k, v in load_file(str(folder / "model.safetensors")).items()}
    ref = load_file(str(folder / "reference.safetensors"))
    return config, weights, ref


def softmax(x):
    x = x - x.max(-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(-1, keepdims=True)


def causal_attention(q, k, v):
    """q, k, v: [B, heads, T, hd]. Softmax(q k^T / sqrt(hd)) v with a causal mask."""
    T, hd = q.shape[-2], q.shape[-1]
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
    scores[..., np.triu(np.ones((T, T), dtype=bool), 1)] = -np.inf
    return softmax(scores) @ v


def heads(x, n, hd):
    """[B, T, n*hd] -> [B, n, T, hd]: head j is columns j*hd .. (j+1)*hd - 1."""
    B, T, _ = x.shape
    return x.reshape(B, T, n, hd).transpose(0, 2, 1, 3)


def merge(x):
    """[B, n, T, hd] -> [B, T, n*hd], the inverse of heads()."""
    B, n, T, hd = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, n * hd)


def gpt2_logits(config, W, ids):
    B, T = ids.shape
    D, H, eps = config["n_embd"], config["n_head"], config["layer_norm_epsilon"]
    hd = D // H

    def layer_norm(x, w, b):
        m = x.mean(-1, keepdims=True)
        var = ((x - m) ** 2).mean(-1, keepdims=True)
        return (x - m) / np.sqrt(var + eps) * w + b

    def gelu_new(u):  # the tanh approximation
        return 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u ** 3)))

    def conv1d(x, name):  # Conv1D: weight is (in, out), y = x @ W + b
        return x @ W[name + ".weight"] + W[name + ".bias"]

    x = W["transformer.wte.weight"][ids] + W["transformer.wpe.weight"][:T]
    for l in range(config["n_layer"]):
        p = f"transformer.h.{l}."
        h = layer_norm(x, W[p + "ln_1.weight"], W[p + "ln_1.bias"])
        qkv = conv1d(h, p + "attn.c_attn")  # columns [Q | K | V], each D wide
        q, k, v = (heads(qkv[..., i * D:(i + 1) * D], H, hd) for i in range(3))
        x = x + conv1d(merge(causal_attention(q, k, v)), p + "attn.c_proj")
        h = layer_norm(x, W[p + "ln_2.weight"], W[p + "ln_2.bias"])
        x = x + conv1d(gelu_new(conv1d(h, p + "mlp.c_fc")), p + "mlp.c_proj")
    x = layer_norm(x, W["transformer.ln_f.weight"], W["transformer.ln_f.bias"])
    return x @ W["transformer.wte.weight"].T  # tied head: no lm_head.weight in the file


def llama_logits(config, W, ids):
    B, T = ids.shape
    D, H, KV = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    hd, eps = D // H, config["rms_norm_eps"]

    def rms_norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def linear(x, name):  # nn.Linear: weight is (out, in), y = x @ W^T, no bias
        return x @ W[name + ".weight"].T

    # Rotary: frequency i (i < hd/2) rotates the pair (i, i + hd/2), as rotate_half does.
    inv_freq = 1.0 / config["rope_theta"] ** (np.arange(0, hd, 2) / hd)
    angles = np.outer(np.arange(T), inv_freq)
    cos = np.cos(np.concatenate([angles, angles], -1))
    sin = np.sin(np.concatenate([angles, angles], -1))

    def rope(x):
        rotated = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1)
        return x * cos + rotated * sin

    x = W["model.embed_tokens.weight"][ids]
    for l in range(config["num_hidden_layers"]):
        p = f"model.layers.{l}."
        h = rms_norm(x, W[p + "input_layernorm.weight"])
        q = rope(heads(linear(h, p + "self_attn.q_proj"), H, hd))
        k = rope(heads(linear(h, p + "self_attn.k_proj"), KV, hd))
        v = heads(linear(h, p + "self_attn.v_proj"), KV, hd)
        # GQA: query head j reads KV head j // (H / KV).
        k, v = np.repeat(k, H // KV, axis=1), np.repeat(v, H // KV, axis=1)
        x = x + linear(merge(causal_attention(q, k, v)), p + "self_attn.o_proj")
        h = rms_norm(x, W[p + "post_attention_layernorm.weight"])
        gate = linear(h, p + "mlp.gate_proj")
        x = x + linear(gate / (1 + np.exp(-gate)) * linear(h, p + "mlp.up_proj"), p + "mlp.down_proj")
    x = rms_norm(x, W["model.norm.weight"])
    return x @ W["lm_head.weight"].T


def check(folder, tol=1e-5):
    """Max |numpy logits - transformers' logits| for a folder; raises past tol."""
    config, W, ref = load(folder)
    forward = {"gpt2": gpt2_logits, "llama": llama_logits}[config["model_type"]]
    logits = forward(config, W, ref["input_ids"])
    diff = float(np.abs(logits - ref["logits"]).max())
    if not diff <= tol:
        raise SystemExit(f"layout_check: {folder}: logits differ from transformers' by {diff:g} (> {tol:g})")
    return diff


if __name__ == "__main__":
    folders = sys.argv[1:] or [HERE / "gpt2-tiny", HERE / "llama-tiny"]
    for f in folders:
        print(f"layout_check: {f}: numpy logits within {check(f):.2e} of transformers'")
