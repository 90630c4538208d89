"""A torchtitan-style decoder whose attention keeps one fused ``wqkv`` projection and saves it as
the stock ``wq``/``wk``/``wv`` through state-dict hooks, as torchtitan's ``FusedQKVLinear``
(torchtitan/models/common/attention.py) does: a state-dict post-hook splits ``wqkv`` (gathered
to ``Replicate`` first when it is a DTensor), a load_state_dict pre-hook fuses the three back.

Variants: ``fused`` (both hooks, as torchtitan), ``split-only`` (saves split, has no load hook:
nothing can place ``wq``/``wk``/``wv``), ``extra-entry`` (both hooks, and the save hook also
writes an ``r_dim`` entry that no tensor takes), ``plain`` (three separate projections, no hooks:
the clean twin)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

VARIANTS = ("fused", "split-only", "extra-entry", "plain")
DIM, N_HEADS, N_KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 32, 4, 2, 8, 64, 2


class FusedQKVLinear(nn.Module):
    def __init__(self, variant: str):
        super().__init__()
        self.head_dim, self.heads_per_kv = HEAD_DIM, N_HEADS // N_KV_HEADS
        self.r_dim = self.heads_per_kv + 2
        self.wqkv = nn.Linear(DIM, N_KV_HEADS * self.r_dim * HEAD_DIM, bias=True)
        self.extra = variant == "extra-entry"
        self.register_state_dict_post_hook(self._split_qkv_on_save)
        if variant != "split-only":
            self.register_load_state_dict_pre_hook(self._merge_qkv_on_load)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = self.wqkv(x).unflatten(-1, (N_KV_HEADS, self.r_dim, HEAD_DIM))
        q, k, v = torch.split(qkv, [self.heads_per_kv, 1, 1], dim=-2)
        return q.flatten(-3), k.flatten(-3), v.flatten(-3)

    @staticmethod
    def _split_qkv_on_save(module, state_dict, prefix, local_metadata) -> None:
        hd, hpk, r = module.head_dim, module.heads_per_kv, module.r_dim
        for param, ndim in (("weight", 4), ("bias", 3)):
            key = f"{prefix}wqkv.{param}"
            if key not in state_dict:
                continue
            tensor = state_dict.pop(key)
            if isinstance(tensor, DTensor):
                tensor = tensor.redistribute(
                    tensor.device_mesh, [Replicate()] * tensor.device_mesh.ndim
                )
            n_kv = tensor.shape[0] // (r * hd)
            tail = (tensor.shape[1],) if ndim == 4 else ()
            w = tensor.reshape(n_kv, r, hd, *tail)
            state_dict[f"{prefix}wq.{param}"] = w[:, :hpk].reshape(-1, *tail).contiguous()
            state_dict[f"{prefix}wk.{param}"] = w[:, hpk].reshape(-1, *tail).contiguous()
            state_dict[f"{prefix}wv.{param}"] = w[:, hpk + 1].reshape(-1, *tail).contiguous()
        if module.extra:
            state_dict[f"{prefix}r_dim"] = torch.tensor([float(r)])

    @staticmethod
    def _merge_qkv_on_load(module, state_dict, prefix, *args) -> None:
        hd, hpk = module.head_dim, module.heads_per_kv
        for param, ndim in (("weight", 4), ("bias", 3)):
            keys = [f"{prefix}{w}.{param}" for w in ("wq", "wk", "wv")]
            if not all(k in state_dict for k in keys):
                continue
            wq, wk, wv = (state_dict.pop(k) for k in keys)
            if isinstance(wq, DTensor):
                wq, wk, wv = (
                    t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim)
                    for t in (wq, wk, wv)
                )
            n_kv = wk.shape[0] // hd
            tail = (wq.shape[1],) if ndim == 4 else ()
            q = wq.reshape(n_kv, hpk, hd, *tail)
            k = wk.reshape(n_kv, 1, hd, *tail)
            v = wv.reshape(n_kv, 1, hd, *tail)
            state_dict[f"{prefix}wqkv.{param}"] = torch.cat([q, k, v], dim=1).reshape(-1, *tail)


class QKVLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(DIM, N_HEADS * HEAD_DIM, bias=True)
        self.wk = nn.Linear(DIM, N_KV_HEADS * HEAD_DIM, bias=True)
        self.wv = nn.Linear(DIM, N_KV_HEADS * HEAD_DIM, bias=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.wq(x), self.wk(x), self.wv(x)


class Attention(nn.Module):
    def __init__(self, variant: str):
        super().__init__()
        self.qkv = QKVLinear() if variant == "plain" else FusedQKVLinear(variant)
        self.wo = nn.Linear(N_HEADS * HEAD_DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x)
        k = k.repeat_interleave(N_HEADS // N_KV_HEADS, dim=-1)
        v = v.repeat_interleave(N_HEADS // N_KV_HEADS, dim=-1)
        return self.wo(q * k.sigmoid() + v)


class Block(nn.Module):
    def __init__(self, variant: str):
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.attention = Attention(variant)
        self.feed_forward = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(x)


class Decoder(nn.Module):
    def __init__(self, variant: str = "fused"):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(variant) for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        # Not in the state dict: the loader broadcasts it by name.
        self.register_buffer("freqs", torch.arange(HEAD_DIM // 2, dtype=torch.float32), False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def build(variant: str, *, seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    model = Decoder(variant)
    with torch.no_grad():
        for param in model.parameters():  # RMSNorm's ones too: every value comes from the seed
            param.copy_(torch.randn_like(param))
    return model
