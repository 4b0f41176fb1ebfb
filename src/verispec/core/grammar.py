"""Grammar-constrained decoding with speculation, on llguidance.

``GrammarCompiler(tokenizer, vocab_size, eos_ids)`` turns ``StructuredOutputsParams`` into a
``GrammarConstraint``: one matcher per output, owned by the sequence's logits pipeline.

Lossless with respect to the constrained target (the target's distribution with the grammar's
forbidden tokens removed and the rest renormalised):
- ``prune(tree)`` walks the draft tree depth-first from the matcher's state, advancing on each
  node's token and rolling back after its subtree. A node whose token the grammar forbids after
  its path is dropped with its subtree. With draft distributions (``tree.q``, sampled drafts) the
  later siblings of a dropped node go too, and each kept node's ``q`` row is restricted to the
  tokens the grammar allows there and renormalised: a candidate presented to the verifier is then
  exactly a draw from its (restricted) ``q`` given the candidates before it, which is what
  recursive rejection sampling needs. Deterministic drafts (one-hot q) lose only the node.
- ``masks(tree)`` gives, for the rows (root, nodes...) of the pruned tree, the tokens allowed
  after each row's path: the verifier then samples every row from the constrained target.
- ``commit(tokens)`` advances the matcher on the tokens the engine emitted (accepted drafts and
  the bonus/recovered token); rejected branches were rolled back during the walk.
Masks are computed on the CPU (llguidance fills host memory); the logits pipeline moves them to
the logits' device, and ``prune`` keeps a tree's tensors on the tree's device.
End tokens are allowed exactly where the grammar is complete (and are then the only choice once
nothing else may follow). Mask cost on this CPU: benchmarks/results/grammar_backends.md.
"""
from __future__ import annotations

import threading

import torch

from .structured import StructuredOutputError, StructuredOutputsParams
from .tree import DraftTree

_BITS = torch.arange(32, dtype=torch.int32, device="cpu")
# JSON in one layout (as xgrammar's any_whitespace=False): ", " and ": ", no other whitespace.
_JSON_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_JSON_FLEXIBLE = {"whitespace_flexible": True}


def _unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 bitmask [R, ceil(V/32)] -> bool [R, V] (bit b of word w = token 32 w + b)."""
    bits = (bitmask.unsqueeze(-1) >> _BITS) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()


class GrammarCompiler:
    """Compiles structured-output params against one tokenizer (built once: about a second)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
        import llguidance
        import llguidance.hf
        if not eos_ids:
            raise StructuredOutputError("structured output needs the model's end token (none is known)")
        self._llg = llguidance
        self.vocab = vocab_size
        self.eos_ids = tuple(eos_ids)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids))
        self._grammars: dict[tuple, str] = {}
        self._lock = threading.Lock()

    def grammar(self, spec: StructuredOutputsParams) -> str:
        """llguidance's grammar text of ``spec``, checked (StructuredOutputError names the problem)."""
        key = spec.cache_key()
        with self._lock:
            if key in self._grammars:
                return self._grammars[key]
        m = self._llg.LLMatcher
        opts = _JSON_FLEXIBLE if spec.whitespace_flexible else _JSON_COMPACT
        if spec.kind == "json":
            text = m.grammar_from_json_schema(spec.json, defaults=opts)
        elif spec.kind == "json_object":
            text = m.grammar_from_json_schema({"type": "object"}, defaults=opts)
        elif spec.kind == "regex":
            text = m.grammar_from_regex(spec.regex)
        elif spec.kind == "choice":
            import json
            text = m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        else:
            text = m.grammar_from_lark(spec.grammar)
        err = m.validate_grammar(text, self.tokenizer)
        if err:
            raise StructuredOutputError(f"{spec.kind}: {err.strip().splitlines()[0][:500]}")
        with self._lock:
            self._grammars[key] = text
        return text

    def constraint(self, spec: StructuredOutputsParams) -> "GrammarConstraint":
        """A fresh matcher for one output."""
        matcher = self._llg.LLMatcher(self.tokenizer, self.grammar(spec))
        if matcher.is_error():
            raise StructuredOutputError(f"{spec.kind}: {matcher.get_error()[:500]}")
        return GrammarConstraint(matcher, self.vocab, self.eos_ids)


class GrammarConstraint:
    """One output's matcher and the tree walk around it (see the module docstring)."""

    def __init__(self, matcher, vocab: int, eos_ids: tuple[int, ...]):
        import llguidance.torch
        self._fill = llguidance.torch.fill_next_token_bitmask
        self.matcher = matcher
        self.vocab = vocab
        self.eos_ids = frozenset(eos_ids)
        self._last: tuple[DraftTree | None, torch.Tensor] | None = None   # (tree, masks) of the last walk

    # -- the walk --------------------------------------------------------------------------
    def _walk(self, tree: DraftTree) -> tuple[list[int], list[int], torch.Tensor]:
        """Depth-first from the current state: (kept node indices, their new parents, bitmask rows
        of (root, kept nodes...)). The matcher ends where it started."""
        kids = tree.children()
        toks = tree.tokens.tolist()
        keep, parents, rows = [], [], []
        # llguidance fills host memory
        bitmask = torch.empty(len(tree) + 1, (self.vocab + 31) // 32, dtype=torch.int32, device="cpu")

        def visit(node: int, new_index: int) -> None:
            row = len(rows)
            self._fill(self.matcher, bitmask, row)
            rows.append(row)
            words = bitmask[row]
            for c in kids[node + 1]:
                t = toks[c]
                if not (0 <= t < self.vocab and (int(words[t >> 5]) >> (t & 31)) & 1):
                    if tree.q is not None:
                        break                      # later siblings were drawn given this one
                    continue
                if t in self.eos_ids:             # the output ends here: nothing below is emitted,
                    keep.append(c)                 # and its row is never sampled from (any row will do)
                    parents.append(new_index)
                    bitmask[len(rows)].fill_(-1)
                    rows.append(len(rows))
                    continue
                if not self.matcher.consume_token(t):
                    raise RuntimeError(f"grammar matcher refused token {t} its own mask allowed: "
                                       f"{self.matcher.get_error()[:300]}")
                keep.append(c)
                parents.append(new_index)
                visit(c, len(keep) - 1)
                self.matcher.rollback(1)

        visit(-1, -1)
        return keep, parents, bitmask[rows]

    def prune(self, tree: DraftTree) -> DraftTree:
        """The tree without the drafts the grammar forbids (q rows restricted; module docstring)."""
        keep, parents, bits = self._walk(tree)
        allowed = _unpack(bits, self.vocab)
        q = None
        if tree.q is not None and tree.q.shape[1] != self.vocab:
            raise ValueError(f"draft q rows have {tree.q.shape[1]} entries, the grammar's vocabulary {self.vocab}")
        if tree.q is not None and keep:
            # row of each kept node's parent in ``allowed``: parent new index + 1 (root = row 0)
            rows = allowed[[p + 1 for p in parents]].to(tree.q.device, tree.q.dtype)
            q = tree.q[keep].float() * rows
            q = q / q.sum(-1, keepdim=True).clamp_min(1e-30)
        pruned = DraftTree(tree.tokens[keep], torch.tensor(parents, dtype=torch.long, device=tree.parents.device), q)
        self._last = (pruned, allowed)
        return pruned

    def masks(self, tree: DraftTree | None) -> torch.Tensor:
        """bool [N+1, V]: tokens the grammar allows after (root, nodes...) of ``tree`` (None: the
        next token only, [1, V]). ``tree`` must be one ``prune`` returned, or have no node the
        grammar forbids."""
        if tree is None:
            tree = DraftTree.empty()
        if self._last is not None and self._last[0] is tree:
            return self._last[1]
        keep, _, bits = self._walk(tree)
        if len(keep) != len(tree):
            raise ValueError("masks() of a tree with nodes the grammar forbids: prune() it first")
        return _unpack(bits, self.vocab)

    def commit(self, tokens: list[int]) -> None:
        """Advance on emitted tokens (each one the masks allowed)."""
        self._last = None
        for t in tokens:
            if not self.matcher.consume_token(t):
                raise RuntimeError(f"grammar matcher refused emitted token {t}: {self.matcher.get_error()[:300]}")

    @property
    def finished(self) -> bool:
        """True when the grammar is complete and nothing but an end token may follow."""
        return self.matcher.is_stopped()
