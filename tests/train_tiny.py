"""Tiny target + EAGLE-3 head + data shared by the training tests and the DDP worker script."""
from __future__ import annotations

import torch

from verispec.models.config import ModelConfig
from verispec.models.transformer import Transformer
from verispec.train.data import TokenizedExample
from verispec.train.eagle3 import Eagle3Task, init_eagle3_head, new_head_config
from verispec.train.vocab import build_draft_vocab, token_counts

VOCAB = 48


def tiny_target(seed: int = 0) -> Transformer:
    cfg = ModelConfig(arch="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=6,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():                     # a peaked, learnable next-token distribution
        model.lm_head.weight.mul_(8.0)
    return model.eval().requires_grad_(False)


def tiny_examples(n: int, length: int = 20, seed: int = 0) -> list[TokenizedExample]:
    """Repetitive sequences (period 5 with noise) so a head can learn them quickly."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        base = torch.randint(0, VOCAB, (5,), generator=g)
        ids = base.repeat(length // 5 + 1)[: length - k % 3]
        flip = torch.rand(ids.shape, generator=g) < 0.1
        ids = torch.where(flip, torch.randint(0, VOCAB, ids.shape, generator=g), ids)
        mask = [0] * 4 + [1] * (len(ids) - 4)
        out.append(TokenizedExample(f"ex{k}", tuple(ids.tolist()), tuple(mask)))
    return out


def tiny_task(target: Transformer, examples, draft_vocab: int = 32, ttt_length: int = 3, seed: int = 0,
              eagle31: bool = False, init: str = "target"):
    counts = token_counts(((e.input_ids, e.loss_mask) for e in examples), VOCAB)
    vocab = build_draft_vocab(counts, draft_vocab)
    cfg = new_head_config(target.cfg, vocab.size, fc_norm=eagle31, norm_output=eagle31)
    head = init_eagle3_head(cfg, target, vocab, seed=seed, init=init)
    return Eagle3Task(target, head, ttt_length=ttt_length)
