"""The target's decode/verify forward compiled by ``torch.compile`` (inductor's C++ backend on the
CPU): the per-layer small ops (RMSNorm, RoPE, residual adds, SiLU-and-mul, the K/V writes, the mask)
become a few fused loops instead of about a hundred ATen calls per layer; the matmuls stay the
packed kernels (``packed``'s fp16 op, the int4 kernel) and attention stays SDPA.

Contract
- ``CompiledForward(model)`` is called like the model on a cache, with a host ``kv_len``
  (``KVCache.kv_len``): ``(tokens, positions, cache, attn_mask=..., rows=..., hidden_layers=...,
  kv_len=..., logits_index=...) -> ModelOutput``. Same logits as the eager forward within float tolerance (fused
  loops sum in another order); greedy and sampled speculation stay exact with respect to the
  compiled forward, which every step (vanilla or speculative) then uses.
- Compiled are the forwards on rows ``0..B-1`` (a batch decoded together from its start) with a
  ``kv_len``; any other call (other rows, no ``kv_len``) runs the eager model, counted in
  ``eager_calls``. Shapes: ``dynamic=None`` (a size that changes is recompiled once as dynamic),
  with the token count of a forward over several tokens marked dynamic from the start (one graph
  for one token, one for every prefill and verify size), so a run compiles a handful of graphs;
  past torch's recompile limit dynamo itself falls back to eager. ``kv_len`` is a dynamic int
  from the first compile (``torch.compiler.config.dynamic_sources``), so the graph that serves
  every cache length is the first one: before, each shape compiled a static-``kv_len`` graph
  and then, one bucket later, its dynamic twin (9 graphs and 216 s of a cold ``make demo``,
  against 4 graphs in 131 s now). The K/V tensors' slot dimension is marked dynamic, so the next
  engine's cache (sized to its prompts) reuses the graphs.
- Compilation is paid once per process; inductor's on-disk caches (its FX graph and kernel
  caches, and AOTAutograd's) make a later process's compile cheaper: SmolLM2's one-token
  graph took 45 s on a cold cache, 7 s in the next process, 13 s with AOTAutograd's cache off.
  ``compile_s`` sums the wall time of the calls that compiled, ``graphs`` counts them.
  ``CompiledForward.shared(model)`` is the one instance per model that every ``LLM`` over it
  uses, so a second engine (another method in a benchmark, vanilla beside speculation) reuses the
  graphs instead of compiling them again. With ``speculative`` set (an ``LLM`` with a
  ``speculative_config`` sets it), compiling the one-token graph also compiles the multi-token
  (verify) graph and the other way round, so drafting never compiles in the middle of a run.
  ``kv_len`` never reaches the K/V tensors' slot count (``KVCache`` keeps a spare slot), so no
  graph is specialised on a read of the whole slot dimension.
- Generated kernels run on one thread (``cpp.threads=1``): on 2 cores, waking a second thread for
  a 576-wide loop cost more than the loop (measured: 16.5 vs 19.9 ms per SmolLM2 decode step).
- The compiled code does not re-check its inputs' sizes and strides on every call
  (``size_asserts`` off): with the parameters as graph inputs, SmolLM2's one-token graph ran 520
  ``assert_size_stride`` calls a step, 0.36 ms of it; without them vanilla int4 decoding ran
  1.07x, 1.02x and 1.05x as fast in three runs (two compiled copies in one process, interleaved,
  same tokens). Inductor's ``freezing`` gained nothing beyond that (1.03x, then 0.996x) and made
  a later process's compile twice as slow, so it stays off. What they checked is kept safe as the
  parameters are (below): dynamo guards the arguments, and ``shared`` re-compiles a changed model.
- The model's modules are not guarded (``guard_filter_fn`` drops the guards whose source is an
  ``nn.Module`` attribute): checking some 6,800 guards on every call cost 0.7 ms of a 5 ms SmolLM2
  int4 step, 0.23 ms without them (profiled, "TorchDynamo Cache Lookup"). The arguments (tokens,
  cache tensors, mask, ``kv_len``) stay guarded, and parameters are still read from the modules
  at each call. Two things keep that safe. Each ``CompiledForward`` compiles its own copy of the
  forward's code object, so dynamo's cache of graphs (kept per code object) is per model: a
  graph made for one model never serves another of other shapes. And ``shared(model)`` compares
  a signature of the model (module types, parameter and buffer shapes and dtypes) with the one
  taken when its compiled forward was made, and makes a new one when they differ (a model
  re-packed after compiling); an older ``CompiledForward`` of a model changed since must not be
  called again.
- The native ops the forward calls are loaded before the first trace (the packed matmuls' at
  packing, the attention op's in ``CompiledForward``):
  loading one inside the trace (a file ``stat``) broke the graph there and compiled each layer's
  pieces as separate frames (18 graphs instead of a handful).
"""
from __future__ import annotations

import time
import types
import weakref

import torch

from .transformer import ModelOutput, Transformer

INDUCTOR_OPTIONS = {"size_asserts": False}
CPU_OPTIONS = {**INDUCTOR_OPTIONS, "cpp.threads": 1}


def compile_options(device: torch.device) -> dict:
    """``torch.compile`` options of every verispec graph on ``device``: inductor's (the CPU's with
    one kernel thread) and no guards on the modules (see the module docstring)."""
    return {**(CPU_OPTIONS if device.type == "cpu" else INDUCTOR_OPTIONS),
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}


def _row_index(rows) -> torch.Tensor:
    """Rows as a fresh CPU long tensor (a graph input: its values are never guarded)."""
    if isinstance(rows, torch.Tensor):
        return rows.reshape(-1).clone()
    return torch.tensor(list(rows), dtype=torch.long)


def _rows_arg(rows: torch.Tensor | None, b: int) -> dict:
    """``rows=`` for the graph call (a paged cache's row index; its batch dimension dynamic like
    the tokens')."""
    if rows is None:
        return {}
    if b > 1:
        torch._dynamo.maybe_mark_dynamic(rows, 0)
    return {"rows": rows}


def _graphs() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


# dynamo's recompile limit counts the graphs of one code object, ``Transformer.forward``, over
# every model of the process: a target and two draft models (a benchmark's methods) with their
# one-token, multi-token and kv_len-twin graphs passed its default of 8, and the ninth shape ran
# eager in the middle of a run. A process holds a few models, each a handful of graphs.
RECOMPILE_LIMIT = 64


def signature(model: torch.nn.Module) -> tuple:
    """What the unguarded graphs assume of ``model``: its module types, parameter and buffer shapes
    and dtypes (taken once per ``shared`` call, not per forward)."""
    mods = tuple((n, type(m).__name__) for n, m in model.named_modules())
    tensors = tuple((n, tuple(t.shape), t.dtype) for n, t in (*model.named_parameters(), *model.named_buffers()))
    return mods, tensors


def _own_code(model: torch.nn.Module):
    """``model.forward`` bound over a fresh copy of its code object: dynamo keeps its graphs (and
    counts recompiles) per code object, so this forward's graphs are this model's alone."""
    f = type(model).forward
    fresh = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    fresh.__kwdefaults__ = f.__kwdefaults__
    return types.MethodType(fresh, model)


def dynamic_kv_len():
    """A context in which dynamo traces the forward's ``kv_len`` argument as a dynamic int from
    its first compile (added to any ``dynamic_sources`` the user set). Without it an int is
    specialised at first and only made dynamic when a second value arrives: one more compile of
    every graph, in the middle of a run."""
    sources = torch.compiler.config.dynamic_sources
    entry = "L['kv_len']"
    return torch.compiler.config.patch(dynamic_sources=f"{sources},{entry}" if sources else entry)


def _load_ops() -> None:
    """Build/load the native ops a forward may call, outside any trace."""
    from . import attention
    attention.kernel()


class CompiledForward:
    def __init__(self, model: Transformer):
        import torch._dynamo.config as dynamo_config
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
        _load_ops()
        self.model = model
        self.signature = signature(model)
        options = compile_options(next(model.parameters()).device)
        self._fn = torch.compile(_own_code(model), dynamic=None, options=options)
        self.compile_s = 0.0
        self.graphs = 0
        self.eager_calls = 0
        self.speculative = False      # set by an LLM that speculates: compile the verify graph early
        self._caches: weakref.WeakSet = weakref.WeakSet()

    _shared: "weakref.WeakKeyDictionary[Transformer, CompiledForward]" = weakref.WeakKeyDictionary()

    @classmethod
    def shared(cls, model: Transformer) -> "CompiledForward":
        """The process's compiled forward of ``model`` (made on first use, and again when the
        model's structure changed since: see ``signature``)."""
        if model not in cls._shared or cls._shared[model].signature != signature(model):
            cls._shared[model] = cls(model)
        return cls._shared[model]

    def _mark(self, cache) -> None:
        """Each engine sizes its cache to its prompts and batch: the slot and row dimensions of
        the K/V tensors are marked dynamic before the first compile, so a new cache does not
        recompile."""
        if cache not in self._caches:
            cache.mark_dynamic()          # and its rows: a server's engine reuses a warm-up's graphs
            self._caches.add(cache)

    @staticmethod
    def _mark_length(tokens, positions, attn_mask) -> None:
        """A forward over T > 1 tokens (prefill, verification) is compiled for any T at once, and a
        batch of B > 1 rows for any B: the next prompt, tree or batch of another size reuses the
        graph instead of recompiling it in the middle of a run or under a server's changing load
        (one token and one row stay their own, static graphs)."""
        b, t = int(tokens.shape[0]), int(tokens.shape[1])
        if b > 1:                    # any batch of two or more rows shares one graph
            for x in (tokens, positions, attn_mask):
                if x is not None:
                    torch._dynamo.maybe_mark_dynamic(x, 0)
        if t <= 1:
            return
        torch._dynamo.maybe_mark_dynamic(tokens, 1)
        torch._dynamo.maybe_mark_dynamic(positions, 1)
        if attn_mask is not None:
            for d in range(1, attn_mask.dim()):
                if attn_mask.shape[d] == t:
                    torch._dynamo.maybe_mark_dynamic(attn_mask, d)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache, *, attn_mask=None,
                 rows=None, hidden_layers: tuple[int, ...] = (), kv_len: int | None = None,
                 logits_index: torch.Tensor | None = None) -> ModelOutput:
        b = int(tokens.shape[0])
        if rows is not None and not isinstance(rows, torch.Tensor) and list(rows) == list(range(b)):
            rows = None
        if cache.paged and kv_len is not None:
            # any rows, in the graph: a paged cache's rows are table rows (a gather of a few ints),
            # so no row set falls back to the eager forward, whose sums round differently
            rows = _row_index(range(b) if rows is None else rows)
        elif kv_len is None or rows is not None:
            self.eager_calls += 1
            return self.model(tokens, positions, cache, attn_mask=attn_mask, rows=rows,
                              hidden_layers=hidden_layers, kv_len=kv_len, logits_index=logits_index)
        # no views: dynamo guards a view input on its base, so the same shapes passed once as a
        # view (a tree batch's expanded mask) and once not (a padded batch's) compiled twice
        tokens, positions, attn_mask = (x.clone() if x is not None and x._base is not None else x
                                        for x in (tokens, positions, attn_mask))
        self._mark(cache)
        self._mark_length(tokens, positions, attn_mask)
        before, t0 = _graphs(), time.perf_counter()
        with dynamic_kv_len():
            out = self._fn(tokens, positions, cache, attn_mask=attn_mask, hidden_layers=tuple(hidden_layers),
                           kv_len=kv_len, logits_index=logits_index, **_rows_arg(rows, b))
        if _graphs() != before:
            self.compile_s += time.perf_counter() - t0
            self.graphs += _graphs() - before
            if self.speculative and attn_mask is not None:
                if tokens.shape[1] == 1:
                    self._compile_verify_twin(tokens, positions, cache, attn_mask, tuple(hidden_layers))
                else:
                    self._compile_decode_twin(tokens, positions, cache, attn_mask, tuple(hidden_layers))
        return out

    def _compile_decode_twin(self, tokens, positions, cache, attn_mask, hidden_layers) -> None:
        """After a first verify graph, compile the one-token graph with the same mask and hidden
        layers: a step with an empty tree (the last token of a turn leaves no room for a draft)
        runs it, and compiled it inside a timed turn (EAGLE-3 on Spec-Bench's first category:
        13.5 tok/s). Its K/V land in a scratch slot past every row's length."""
        b = int(tokens.shape[0])
        one = torch.ones(b, 1, 1, dtype=attn_mask.dtype, device=attn_mask.device)
        first = lambda t: t.new_empty(b, 1).copy_(t[:, :1])       # noqa: E731 (fresh strides, as a step's)
        self(first(tokens), first(positions), cache, attn_mask=one, hidden_layers=hidden_layers,
             kv_len=cache.kv_len(list(range(b)), 1))

    def _compile_verify_twin(self, tokens, positions, cache, attn_mask, hidden_layers) -> None:
        """After the one-token graph, compile the multi-token (verify) graph at once, with a
        two-token chain on the same rows: the first draft is then not compiled inside a timed
        step. Its K/V land in scratch slots past every row's length, which the engine overwrites."""
        b = int(tokens.shape[0])
        if max(cache.lengths_of(list(range(b))), default=0) + 2 > cache.max_len:
            return
        mask = torch.ones(2, 2, dtype=attn_mask.dtype, device=attn_mask.device).tril().expand(b, 2, 2)
        self(tokens.repeat(1, 2), torch.cat([positions, positions + 1], dim=1), cache, attn_mask=mask,
             hidden_layers=hidden_layers, kv_len=cache.kv_len(list(range(b)), 2))

    def describe(self) -> str:
        return (f"compiled forward: {self.graphs} graph(s), {self.compile_s:.1f} s compiling "
                f"(once per process), {self.eager_calls} eager call(s)")
