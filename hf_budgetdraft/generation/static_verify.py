"""The target's side of the device round: a static cache, and a verification forward compiled once per
verification-length bucket (gpt-fast's `model_forward` on a fixed-size cache; transformers' static-cache decode).

The cache is transformers' `StaticCache` with each sliding-window layer a rollback ring (`RingSlidingLayer`:
transformers' static sliding layer shifts its oldest positions out and cannot take a rejected draft back).

A verification of `n` tokens is padded to its bucket, so a call compiles a handful of shapes, once per process: two
(1 token, a plain step; and the call's longest round) where the device rules say so (`coarse_verify_buckets`:
CUDA), else 1, 2, 4, 8, ... up to the longest round; the compiled calls and the static caches are kept per target in
`model_state.py` (keyed weakly by the model; transformers keeps its own static cache on the model itself), and reused
by every later call of the same size. The padding writes past the verified tokens into the static cache, where
causal masking hides it and the next round overwrites it; rollback moves the cache's write index back (a ring's
too: its slack exceeds the longest bucket).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from transformers import Cache, CompileConfig, StaticCache
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer, get_layer_types_and_kwargs
from transformers.utils import logging

from ..cache.ring_sliding_layer import RingSlidingLayer
from ..cache.windowed_prefill import fill_from_prefix
from ..compat import cache_kwargs
from .compile_lock import COMPILE_LOCK
from .compiled_call import call_model, compiled_call, module_guards_dropped
from .compiled_step import (
    compiling_again_failed,
    cuda_graph_skips_so_far,
    draft_step_compile_config,
    dynamo_graphs_so_far,
)
from .model_inputs import position_offset
from .model_state import model_state

logger = logging.get_logger(__name__)
CACHE_SIZE_STEP = 256  # static caches are sized in multiples of this, so calls of nearby lengths share one
PREFILL_CHUNK = 2048  # prompt tokens per eager prefill forward (bounds the (chunk, cache size) mask)
RING_SLACK = 64  # least rollback slack of a sliding layer's ring (positions beyond its window)


def verify_compile_config(device: torch.device | str) -> CompileConfig:
    """How the verification forward compiles: fixed shapes, one whole graph; on CUDA the draft step's setting
    (`compiled_step.draft_step_compile_config`: replayed as a CUDA graph, without inductor's graph partitions)."""
    if torch.device(device).type == "cuda":
        return draft_step_compile_config(device)
    return CompileConfig(fullgraph=True, dynamic=False, mode=None)


def buckets(longest: int, coarse: bool = False) -> tuple[int, ...]:
    """Verification lengths a call compiles for: powers of two below `longest`, and `longest` itself; `coarse`:
    only 1 and `longest`."""
    if coarse:
        return (1, longest) if longest > 1 else (1,)
    sizes, size = [], 1
    while size < longest:
        sizes.append(size)
        size *= 2
    return (*sizes, longest)


def bucket_of(n: int, sizes: tuple[int, ...]) -> int:
    """The smallest bucket that holds `n` tokens."""
    for size in sizes:
        if n <= size:
            return size
    raise ValueError(f"a verification of {n} tokens exceeds the call's longest bucket ({sizes[-1]})")


def _cache_key(size: int, slack: int, target) -> tuple:
    # a cache first filled under inference mode holds inference tensors, which only inference mode may update
    return size, slack, target.dtype, str(target.device), torch.is_inference_mode_enabled()


def ring_slack(longest: int) -> int:
    """Rollback slack of a sliding layer's ring for verifications of up to `longest` tokens."""
    return max(RING_SLACK, longest)


def static_target_cache(config, size: int, slack: int) -> StaticCache:
    """transformers' `StaticCache` of `size` positions for a target of `config`, each sliding layer a ring that a
    rollback of up to `slack` tokens undoes (`RingSlidingLayer`; a plain static layer where the ring would hold the
    whole cache: transformers' sliding mask over absolute positions is exact on it)."""
    cache = StaticCache(config=config, max_cache_len=size)
    _, layer_kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    for index, (layer, kwargs) in enumerate(zip(cache.layers, layer_kwargs, strict=True)):
        if isinstance(layer, StaticSlidingWindowLayer):
            window = kwargs["sliding_window"]
            ring = window - 1 + slack < size
            cache.layers[index] = (
                RingSlidingLayer(size, window, slack) if ring else StaticLayer(max_cache_len=size)
            )
    return cache


def take_cache(target, tokens: int, slack: int) -> StaticCache:
    """A static cache of at least `tokens` positions (sliding layers: rings of `slack`) from `target`'s free ones
    (length reset), or a new one; a cache is never shared by two calls at once."""
    size = -(-tokens // CACHE_SIZE_STEP) * CACHE_SIZE_STEP
    state = model_state(target)
    with state.lock:
        free = state.free_caches.setdefault(_cache_key(size, slack, target), [])
        cache = free.pop() if free else None
    if cache is None:
        return static_target_cache(target.config, size, slack)
    for layer in _written(cache):
        layer.cumulative_length.zero_()
    return cache


def _written(cache: StaticCache) -> list[StaticLayer]:
    """The layers of `cache` holding keys (not those reusing another layer's: Gemma 3n / Gemma 4)."""
    return [layer for layer in cache.layers if isinstance(layer, StaticLayer) and layer.is_initialized]


def roll_back(cache: StaticCache, tokens: int | torch.Tensor) -> None:
    """Move every written layer's count of `cache` back by `tokens` (a 0-dim device tensor needs no host read):
    one fused subtraction, one kernel on CUDA however many layers (transformers 5.22's static layers have no
    `crop`). The positions past the count are overwritten by the next write (a ring's too: within its slack)."""
    lengths = [layer.cumulative_length for layer in _written(cache)]
    if torch.is_tensor(tokens):
        torch._foreach_add_(lengths, tokens, alpha=-1)
    else:
        torch._foreach_add_(lengths, -tokens)


def give_back(target, cache: StaticCache, slack: int) -> None:
    """Return a call's cache (taken with `slack`) to `target`'s free ones, for the next call of its size."""
    state = model_state(target)
    with state.lock:
        state.free_caches.setdefault(_cache_key(cache.layers[0].max_cache_len, slack, target), []).append(
            cache
        )


@dataclass
class VerifyRecord:
    """What the verification forward did in one call: calls compiled and eager, buckets, graphs compiled, the
    cache's rings."""

    compiled: bool = False
    compiled_calls: int = 0
    eager_calls: int = 0
    buckets: dict = field(default_factory=dict)  # bucket -> verifications
    new_shapes: int = 0  # (bucket, cache size and rings) shapes this call compiled first in this process
    graphs_compiled: int = 0  # dynamo graphs compiled during this call's compiled verifications
    cuda_graph_skips: int = 0  # of those, graphs run without the CUDA graphs their compile config asked for
    ring_layers: int = 0  # sliding layers verifying on rollback rings (`RingSlidingLayer`)
    module_guards_per_call: bool = False  # module guards checked once per call, not every verification
    failure: str | None = None

    @property
    def recompiles(self) -> int:
        """Graphs compiled beyond the first of each new shape (0 when nothing recompiles)."""
        return max(0, self.graphs_compiled - self.new_shapes)

    def as_dict(self) -> dict:
        return {**asdict(self), "buckets": dict(sorted(self.buckets.items())), "recompiles": self.recompiles}


class StaticVerify:
    """The target's forward on its static cache: `prefill(ids)` eagerly in chunks, then `__call__(tokens, start)`
    for each verification, padded to its bucket (`buckets(longest, coarse)`) and compiled (`compile_config`,
    `None`: eager). A compilation that fails warns once, is recorded, and the call verifies eagerly (the same
    computation) from then on."""

    def __init__(
        self,
        target,
        cache: StaticCache,
        compile_config: CompileConfig | None,
        longest: int,
        coarse: bool = False,
    ):
        self.target, self.cache = target, cache
        self.sizes = buckets(longest, coarse)
        rings = [layer.ring_size for layer in cache.layers if isinstance(layer, RingSlidingLayer)]
        self.record = VerifyRecord(
            compiled=compile_config is not None,
            ring_layers=len(rings),
            module_guards_per_call=compile_config is not None and module_guards_dropped(compile_config),
        )
        # what a compiled forward's shapes depend on besides its bucket: the cache's size and its rings'
        self.cache_shape = (cache.layers[0].max_cache_len, *sorted(set(rings)))
        self.compiled_fn, self.shapes, self.padded_to = None, None, 0
        # how far positions run past the cache's count (after an image: `prefill_with`)
        self.position_offset = 0
        if compile_config is not None:
            # one function per cache shape: each compiles only its buckets, within dynamo's recompile limit
            self.compiled_fn, self.shapes = compiled_call(target, compile_config, variant=self.cache_shape)

    @COMPILE_LOCK.shared()
    def _forward(self, fn, ids: torch.Tensor, start: int, **kwargs):
        """`fn(target, ...)` (`call_model` or its compiled form) on `ids (1, n)` at positions `start ...`."""
        start += self.position_offset
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
        return fn(
            self.target,
            input_ids=ids,
            position_ids=positions,
            **cache_kwargs(self.cache),
            use_cache=True,
            **kwargs,
        ).logits

    def _last_logits_only(self) -> dict:
        """`logits_to_keep=1` where the target takes it: a prefill reads only its last position's logits, and the
        prompt's `(P, V)` would dwarf its cache."""
        return {"logits_to_keep": 1} if self.target._supports_logits_to_keep() else {}

    def prefill(self, ids: torch.Tensor, cached: int = 0, chunk: int | None = None) -> torch.Tensor:
        """Feed the prompt `ids (1, P)` past its first `cached` tokens (already `load`ed) eagerly, `chunk` tokens
        (default `PREFILL_CHUNK`) a forward; the last position's logits `(1, V)` float32."""
        chunk = chunk or PREFILL_CHUNK
        logits = None
        for start in range(cached, ids.shape[1], chunk):
            logits = self._forward(
                call_model, ids[:, start : start + chunk], start, **self._last_logits_only()
            )[:, -1]
        return logits.float()

    @COMPILE_LOCK.shared()
    def prefill_with(self, ids: torch.Tensor, inputs: dict) -> torch.Tensor:
        """Feed the prompt `ids (1, P)` in one forward with `inputs`, those transformers' loop feeds its first
        forward only (`model_inputs.prompt_only_inputs`: an image or its encoding, the prompt's token types and
        multimodal positions), built as that loop builds them; later positions then continue from the prompt's
        last. The last position's logits `(1, V)` float32."""
        model_inputs = self.target.prepare_inputs_for_generation(
            ids, **cache_kwargs(self.cache), use_cache=True, is_first_iteration=True, **inputs
        )
        model_inputs.update(self._last_logits_only())
        logits = self.target(**model_inputs).logits[:, -1]
        self.position_offset = position_offset(inputs, ids.shape[1])
        return logits.float()

    def load(self, given: Cache, tokens: int) -> None:
        """Copy the first `tokens` positions of every layer of `given` (a cache the caller passed) into the static
        cache, which then holds them."""
        keys = [layer.keys[:, :, :tokens] for layer in given.layers]
        fill_from_prefix(self.cache, keys, [layer.values[:, :, :tokens] for layer in given.layers])

    def store(self, given: Cache, begin: int, end: int) -> None:
        """Append positions `[begin, end)` of the static cache to `given`, which held `begin` tokens: it then holds
        what the target's own call would have left in it."""
        for index, layer in enumerate(self.cache.layers):
            given.update(layer.keys[:, :, begin:end], layer.values[:, :, begin:end], index)

    def capture(self, start: int) -> None:
        """Compile every bucket this process has not compiled yet, now (after the prefill, before the first round):
        one forward each at `start`, rolled back after. Rounds then never compile."""
        if self.compiled_fn is None:
            return
        for bucket in self.sizes:
            if (bucket, *self.cache_shape) not in self.shapes and self.record.failure is None:
                ids = torch.zeros(1, bucket, dtype=torch.long, device=self.target.device)
                self._compiled(ids, start, bucket, counted=False)
                roll_back(self.cache, bucket)

    def __call__(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Verify `tokens (1, n)` at positions `start ...`; `(1, n, V)` float32 logits (a copy: a CUDA graph's output
        is overwritten by its next replay). The cache then holds `bucket(n)` more positions: `keep` what is
        accepted."""
        n = tokens.shape[1]
        size = self.padded_to = bucket_of(n, self.sizes)
        self.record.buckets[size] = self.record.buckets.get(size, 0) + 1
        padded = torch.nn.functional.pad(tokens, (0, size - n)) if size > n else tokens
        if self.compiled_fn is None or self.record.failure is not None:
            self.record.eager_calls += 1
            return self._forward(call_model, padded, start)[:, :n].float()
        logits = self._compiled(padded, start, size)[:, :n]
        return logits.float() if logits.dtype != torch.float32 else logits.clone()

    def keep(self, kept: torch.Tensor) -> None:
        """After a verification, keep its newest token and `kept (0-dim, device)` drafts: the rejected drafts and
        the padding leave the cache. Device work queued behind the verification, so it needs no host read and, on
        CUDA, runs while the host waits for the round's accepted count."""
        roll_back(self.cache, (self.padded_to - 1) - kept)

    def _compiled(self, padded: torch.Tensor, start: int, size: int, counted: bool = True) -> torch.Tensor:
        """The compiled forward of `padded (1, size)`; a shape new to this process compiles first, alone
        (`compile_lock.py`; `counted`: recorded as a verification, not a capture)."""
        shape = (size, *self.cache_shape)
        if shape not in self.shapes:
            with COMPILE_LOCK.alone():
                if shape not in self.shapes:  # else another thread compiled it while this one waited
                    return self._first_of_shape(padded, start, shape, counted)
        try:
            with COMPILE_LOCK.shared():
                logits = self._counted(padded, start)
        except compiling_again_failed() as error:  # its guards failed and it could not compile again
            return self._fall_back(error, padded, start, counted)
        self.record.compiled_calls += counted
        return logits

    def _first_of_shape(self, padded: torch.Tensor, start: int, shape: tuple, counted: bool) -> torch.Tensor:
        graphs = self.record.graphs_compiled
        try:
            logits = self._counted(padded, start)
        except Exception as error:  # any compiler failure; the eager forward is the same computation
            return self._fall_back(error, padded, start, counted)
        # no graph for a new shape: dynamo ran the frame eagerly (its recompile limit, say)
        if self.record.graphs_compiled == graphs:
            self.record.failure = "torch.compile compiled no graph for a new shape (its recompile limit?)"
            logger.warning_once(f"the target's verification runs eagerly: {self.record.failure}")
            self.record.eager_calls += counted
            return logits
        self.shapes.add(shape)
        self.record.new_shapes += 1
        self.record.compiled_calls += counted
        return logits

    def _counted(self, padded: torch.Tensor, start: int) -> torch.Tensor:
        graphs, skips = dynamo_graphs_so_far(), cuda_graph_skips_so_far()
        logits = self._forward(self.compiled_fn, padded, start)
        self.record.graphs_compiled += dynamo_graphs_so_far() - graphs
        self.record.cuda_graph_skips += cuda_graph_skips_so_far() - skips
        return logits

    def _fall_back(self, error: Exception, padded: torch.Tensor, start: int, counted: bool) -> torch.Tensor:
        if int(self.cache.get_seq_length()) != start:  # the failed call wrote to the cache: no safe retry
            raise error
        self.record.failure = f"{type(error).__name__}: {error}"
        logger.warning_once(
            f"compiling the target's verification failed ({self.record.failure}); verifying eagerly instead "
            "(lossless). Pass cache_config={'compile_verify': False} or generate(disable_compile=True) to skip it. "
            "Each cache size compiles its verification buckets as a function of its own, within "
            "torch._dynamo.config.recompile_limit; torch._dynamo.config.accumulated_recompile_limit bounds them all."
        )
        logger.debug("the verification's compilation failed", exc_info=True)
        self.record.eager_calls += counted
        return self._forward(call_model, padded, start)
