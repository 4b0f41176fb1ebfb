"""Test helpers: greedy comparison that reports numerical ties instead of hiding them."""
from __future__ import annotations

import pytest
import torch

TIE_MARGIN = 1e-4

HEAD_PROMPTS = (0, 4, 8, 16)      # chat_prompts indices: writing, reasoning, coding, translation (short)
HEAD_TOKENS = 32                  # new tokens per head-test prompt


def top2_margin(model, ids: list[int]) -> float:
    """Target top-2 logit margin for the next token after ``ids`` (plain full forward)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None]).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def assert_same_or_tie(model, prompt: list[int], got: list[int], want: list[int], label: str = "") -> str | None:
    """Equal token for token, or the first difference is a numerical tie (reported, returned)."""
    n = min(len(got), len(want))
    diff = next((i for i in range(n) if got[i] != want[i]), None)
    if diff is None:
        assert len(got) == len(want), f"{label}: lengths differ {len(got)} vs {len(want)} with equal prefix"
        return None
    margin = top2_margin(model, prompt + want[:diff])
    msg = f"{label}: first difference at token {diff} (got {got[diff]}, want {want[diff]}), top-2 margin {margin:.2e}"
    assert margin < TIE_MARGIN, "not a numerical tie: " + msg
    print("numerical tie reported:", msg)
    return msg


def accept_first_children(tree, logits, params, g):
    """A deliberately broken verifier (accepts every first child, then samples the target at the
    last node): statistical tests must reject it, which shows they can fail."""
    from verispec.core.sampling import target_probs
    from verispec.core.verify import AcceptResult
    kids = tree.children()
    cur, nodes = -1, []
    while kids[cur + 1]:
        cur = kids[cur + 1][0]
        nodes.append(cur)
    final = int(torch.multinomial(target_probs(logits[cur + 1], params), 1, generator=g))
    return AcceptResult(nodes, [int(tree.tokens[i]) for i in nodes] + [final], True)


class BrokenAcceptance:
    """``accept_first_children`` in the engine's acceptance slot (``Engine(acceptance=...)``)."""
    name = "broken_for_tests"
    lossy = True

    def __call__(self, tree, logits, params, g):
        return accept_first_children(tree, logits, params, g)


def tiny_llama(vocab: int, hidden: int, layers: int, seed: int = 0):
    """A random tiny Llama-family ``Transformer`` (4 heads of 8, 2 KV heads), eval, no grad."""
    from verispec.models.config import ModelConfig
    from verispec.models.transformer import Transformer
    cfg = ModelConfig(arch="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=64,
                      num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=8)
    torch.manual_seed(seed)
    return Transformer(cfg).eval().requires_grad_(False)


def randomise(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter of ``module`` random (norm weights in [0.5, 1.5), others N(0, 0.3)), eval:
    tensors no two checkpoints share by chance, so a misplaced tensor changes the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.rand(p.shape, generator=g) + 0.5 if "norm" in name
                    else torch.randn(p.shape, generator=g) * 0.3)
    return module.eval()


def save_random_hf(model, folder, vocab: int):
    """Save a transformers ``model`` with random weights (seeded 0: norms in [0.5, 1.5), others
    N(0, 0.2)) and a word-level tokenizer of ``vocab`` words (``t0`` unknown and padding, ``t1``
    BOS, ``t2`` EOS) to ``folder``, as a Hugging Face folder that consumers and our loader read."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.2)
    model.save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2",
                            pad_token="t0").save_pretrained(folder)
    return folder


def tiny_head_config(kind, vocab: int, hidden: int, layers: int, **overrides):
    """An ``EagleHeadConfig`` for a ``tiny_llama`` target (4 heads of 8, 2 KV heads; EAGLE-3: the
    default aux layers), with ``overrides``."""
    from verispec.drafting.eagle_head import EagleHeadConfig, HeadKind
    eagle3 = HeadKind(kind) is HeadKind.EAGLE3
    base = dict(kind=kind, hidden_size=hidden, intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=8,
                vocab_size=vocab, draft_vocab_size=vocab, target_hidden_size=hidden, target_num_layers=layers,
                aux_layer_ids=EagleHeadConfig.default_aux_layer_ids(layers) if eagle3 else ())
    return EagleHeadConfig(**(base | overrides))


def assert_packed_twin(pack: str, kind: type, tol: float) -> None:
    """A tiny model packed by ``Transformer.<pack>`` (decoder matmuls of type ``kind``, the LM head
    fp16-packed) computes its dense twin's logits (the same, dequantised weights) within ``tol``."""
    import copy
    from verispec.models.packed import PackedFP16Linear
    dense = tiny_llama(64, 32, 3).fuse_()
    packed = getattr(copy.deepcopy(dense), pack)()
    kinds = {name: type(m) for name, m in packed.named_modules() if isinstance(m, (kind, PackedFP16Linear))}
    assert kinds["lm_head"] is PackedFP16Linear
    assert sum(k is kind for k in kinds.values()) == 4 * len(dense.layers)
    with torch.no_grad():
        for name, m in packed.named_modules():          # the dense twin: the same (dequantised) weights
            if isinstance(m, (kind, PackedFP16Linear)):
                dense.get_submodule(name).weight.copy_(m.weight)
        ids = torch.randint(0, 64, (2, 12))
        pos = torch.arange(12).expand(2, 12)
        torch.testing.assert_close(packed(ids, pos).logits, dense(ids, pos).logits, rtol=tol, atol=tol)


def assert_cpu_fp32_only(weights: str) -> None:
    """``load_model`` refuses ``weights`` with a non-fp32 dtype or a non-CPU device before loading."""
    import pytest
    from verispec.models.loading import load_model
    from verispec.models.packed import WeightFormat
    with pytest.raises(ValueError, match="fp32"):
        load_model("smollm2-135m", dtype="bfloat16", weights=weights)
    with pytest.raises(ValueError, match="CPU only"):
        load_model("smollm2-135m", weights=weights, device="cuda")
    assert WeightFormat.parse(weights).value == weights


def verify_and_decode_logits(model, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [8, V] of ``prompt[32:40]`` after ``prompt[:32]``: from one 8-token (verify-shaped)
    forward, and from eight one-token decodes on the same cache."""
    from verispec.models.kv_cache import KVCache
    ids = torch.tensor([prompt[:40]])
    with torch.inference_mode():
        cache = KVCache.for_model(model.cfg, 1, 128)
        model(ids[:, :32], torch.arange(32)[None], cache)
        cache.advance([0], 32)
        verify = model(ids[:, 32:40], torch.arange(32, 40)[None], cache, kv_len=64).logits[0]
        decode = []
        for i in range(32, 40):
            decode.append(model(ids[:, i:i + 1], torch.tensor([[i]]), cache, kv_len=64).logits[0, 0])
            cache.advance([0], 1)
    return verify, torch.stack(decode)


def assert_speculation_equals_vanilla(target, prompts, spec, max_tokens: int) -> None:
    """Greedy speculation on ``target`` gives its vanilla tokens, and a vanilla batch equals each
    prompt alone."""
    from verispec import LLM, SamplingParams
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    batch = [{"prompt_token_ids": p} for p in prompts]
    alone = LLM(loaded=target, max_num_seqs=1).generate(batch, greedy)
    want = LLM(loaded=target, max_num_seqs=len(batch)).generate(batch, greedy)
    got = LLM(loaded=target, max_num_seqs=len(batch), speculative_config=spec).generate(batch, greedy)
    assert [o.token_ids for o in want] == [o.token_ids for o in alone]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(o.metrics.num_drafts for o in got) > 0


def int8_group_quantised(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """``x`` as W4A8 multiplies it (fp64): per group of ``group`` columns,
    round(x * 127 / max|x|) * max|x| / 127, codes clamped to +-127."""
    g = x.double().reshape(*x.shape[:-1], -1, group)
    amax = g.abs().amax(-1, keepdim=True)
    q = torch.round(g * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))).clamp(-127, 127)
    return (q * amax / 127).reshape(x.shape)


def dense_module_fixtures():
    """``target`` and ``llm`` fixtures on the dense fp32 weights, for a test module to bind
    (``target, llm = dense_module_fixtures()``): modules that compare against HF transformers,
    server processes or llama.cpp, or whose answers must not change with the batch or a prefix-cache
    hit (the int4 path rounds activations to bf16, so two float paths that differ in the last bit
    can move a logit by 1e-2; the engine's own decode and verify forwards give the same bits)."""
    @pytest.fixture(scope="module")
    def target(dense_target):
        return dense_target

    @pytest.fixture(scope="module")
    def llm(dense_llm):
        return dense_llm
    return target, llm
