"""Batched speculative decoding: every row of a left-padded batch drafts on its own rows of a sparse draft cache and
advances by its own accepted count each round (ragged acceptance; no row waits for the slowest).

`target.generate(batch, attention_mask=mask, assistant_model=drafter, cache_implementation=...)` with more than
one row lands here (transformers' assisted generation is single-sequence). A round, gpt-fast style:

1. draft G = max_b γ_b tokens for all rows: one forward feeds each row what its draft cache has not seen (ragged
   counts, at most `slack` a forward), then G - 1 one-token steps (a row keeps its first γ_b);
2. the target verifies `[last token, γ_b drafts]` of every row in one `(B, G + 1)` forward on its ragged full cache;
3. each row keeps its agreeing drafts plus the target's next token (greedy), or what speculative sampling accepts;
   stopping criteria end rows; both caches roll each row back by what it rejected (`crop_rows`);
4. finished rows leave the batch (their cache rows are dropped), so they cost nothing after.

Each row drafts its own γ_b (γ_b = 0: a plain AR step for that row in the same forward): the adaptive policy
(`RowDraftLength`) picks it from the row's own acceptance and the batch's measured costs; an explicit length
(fixed, heuristic) is shared by every row. The batch drafts max_b γ_b steps, and the target's row-by-row
attention (`ragged_rows`) verifies only the `1 + γ_b` tokens each row needs. Rows are prefilled one at a time
without their padding, so a row's outputs are computed from exactly its own tokens.
"""

from __future__ import annotations

import contextlib
import time

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..attention.query_capture import query_capture
from ..attention.ragged_rows import ragged_rows
from ..cache.ragged import RaggedCache
from ..cache.ragged_draft import RaggedDraftCache
from ..compat import CACHE_KWARG, cache_kwargs
from . import draft_prefix
from .acceptance import accept_round
from .compile_lock import COMPILE_LOCK
from .draft_length import FixedDraftLength, SharedDraftLength, for_rows
from .model_inputs import uncarried_inputs
from .plan import DraftPlan
from .prefilled import check_embeds, check_prompt_extends
from .processors import LENGTH_ONLY, SCORE_ONLY, suppress_eos
from .stats import active_recorder

MAX_BATCH_SIZE = 256


def left_padding(attention_mask: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """`(B,)` padding tokens per row of a left-padded `(B, P)` mask; anything else is refused."""
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids {tuple(input_ids.shape)}; pass the "
            "tokenizer's mask of the same batch"
        )
    mask = attention_mask.bool()
    if not bool(mask[:, -1].all()) or bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError(
            "batched speculative decoding needs left padding (each row: zeros, then ones, ending in a token); got a "
            "mask with padding on the right or inside a row. Tokenize with tokenizer.padding_side = 'left'"
        )
    return (~mask).sum(-1)


class BatchedSpeculation:
    """One batched speculative `generate()` call (see the module docstring)."""

    def __init__(
        self, target, drafter, plan: DraftPlan, generation_config, logits_processor, stopping_criteria
    ):
        self.target, self.drafter, self.plan = target, drafter, plan
        self.config = generation_config
        self.processors = list(logits_processor or [])
        self.criteria = list(stopping_criteria or [])
        self.sample = bool(generation_config.do_sample)
        self.slack = plan.spec.slack

    # -- setup ---------------------------------------------------------------------------------------------------
    def _setup(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        batch, width = input_ids.shape
        if batch > MAX_BATCH_SIZE:
            raise ValueError(f"batch of {batch} rows exceeds the bound of {MAX_BATCH_SIZE}; split it")
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        self.prompt = input_ids  # (B, P), left-padded: what stock generate()'s processors see
        self.pads = left_padding(mask, input_ids)
        self.prompt_lengths = width - self.pads
        self.max_new = self.config.max_length - width
        capacity = int(self.prompt_lengths.max()) + self.max_new + self.slack + 1
        self.tokens = input_ids.new_zeros(batch, capacity)  # (B, capacity): each row's tokens, no padding
        for row in range(batch):
            self.tokens[row, : self.prompt_lengths[row]] = input_ids[row, self.pads[row] :]
        self.generated = torch.zeros(batch, dtype=torch.long, device=input_ids.device)
        self.rows = torch.arange(batch, device=input_ids.device)  # original index of each active row
        if self.drafter is None:  # no draft: the target itself reads the sparse cache (lossy)
            self.target_cache = self.plan.spec.build_ragged_cache(self.target.config, batch, capacity)
            self.draft_cache = None
        else:
            self.target_cache = RaggedCache(self.target.config, batch, capacity)
            if self.plan.spec.full_draft_cache:  # the baseline: the drafter reads every past token
                self.draft_cache = RaggedCache(self.drafter.config, batch, capacity)
            else:
                self.draft_cache = self.plan.spec.build_ragged_cache(self.drafter.config, batch, capacity)

    # -- forwards ------------------------------------------------------------------------------------------------
    @COMPILE_LOCK.shared()
    def _prefill(
        self,
        model,
        cache: RaggedCache,
        capture: bool = False,
        embeds: torch.Tensor | None = None,
        chunk: int | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        """Prefill every row on its own, in forwards of at most `chunk` tokens (`None`: the whole prompt); `(B, V)`
        logits after each row's prompt. `embeds` `(B, P, H)`: the padded prompt as `inputs_embeds`, read in place of
        the ids (the target's, when the call was given them). `window`: the drafter's windowed prefill of a row
        longer than it (`cache/windowed_prefill.py`). A row whose prompt equals an earlier row's (the copies of
        `num_return_sequences`) copies that row's cache and logits instead."""
        logits = []
        for row, same in enumerate(self._earlier_equal_rows(embeds)):
            if same is not None:
                cache.copy_row(same, row)
                logits.append(logits[same])
                continue
            length, pad = int(self.prompt_lengths[row]), int(self.pads[row])
            windowed = window is not None and length > window
            if windowed or (model is self.drafter and draft_prefix.continues_full_prefill(model, capture)):
                cache.prefill_row(row, length, self.prompt.device)  # filled from the recorded keys/values
                ids, sink = self.tokens[row : row + 1, :length], self.plan.spec.num_sink_tokens
                last = draft_prefix.prefill_into(cache, model, ids, sink, window if windowed else None)
                logits.append(last[0].float())
                continue
            for start in range(int(cache.lengths[row]), length, chunk or length):  # past a seeded prefix
                end = length if chunk is None else min(start + chunk, length)
                cache.prefill_row(row, end, self.prompt.device, start)
                if embeds is None:
                    inputs = {"input_ids": self.tokens[row : row + 1, start:end]}
                else:
                    inputs = {"inputs_embeds": embeds[row : row + 1, pad + start : pad + end]}
                with query_capture(model) if capture else contextlib.nullcontext():
                    out = model(**inputs, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
            logits.append(out.logits[0, -1].float())
        return torch.stack(logits)

    def _seed_target(self, prefix, input_ids: torch.LongTensor) -> None:
        """Start the target's first row from `prefix` (the rows equal to it copy it at the prefill)."""
        check_prompt_extends(int(prefix.get_seq_length()), input_ids)
        if bool(self.pads.any()) or not bool((input_ids == input_ids[:1]).all()):
            raise ValueError(
                "a target cache passed to a batched call is the prefix of one prompt sampled several times "
                "(num_return_sequences); got rows that differ or are padded. Drop cache=, or pass one prompt"
            )
        self.target_cache.seed_row(0, prefix, self.target.device)

    def _earlier_equal_rows(self, embeds: torch.Tensor | None) -> list[int | None]:
        """For each row, the first earlier row whose prompt (its ids, and its `embeds` when given) equals it, or
        `None`."""
        first_with: dict[tuple[int, int], int] = {}
        earlier: list[int | None] = []
        for row in range(self.rows.shape[0]):
            length, pad = int(self.prompt_lengths[row]), int(self.pads[row])
            ids = self.tokens[row, :length]
            key = (length, hash(ids.cpu().numpy().tobytes()))
            same = first_with.setdefault(key, row)
            equal = same != row and torch.equal(ids, self.tokens[same, :length])
            if equal and embeds is not None:
                other = int(self.pads[same])
                equal = torch.equal(embeds[row, pad:], embeds[same, other : other + length])
            earlier.append(same if equal else None)
        return earlier

    @COMPILE_LOCK.shared()
    def _step(
        self, model, cache: RaggedCache, tokens: torch.Tensor, needed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Feed `(B, q)` tokens at each row's own next positions; `(B, q, V)` float logits. `needed` `(B,)`: the
        positions each row needs (the rest are filler: garbage logits, cropped by the caller)."""
        positions = cache.lengths[:, None] + torch.arange(tokens.shape[1], device=tokens.device)
        mask = cache.step_mask(tokens.shape[1], model.dtype, needed)
        with ragged_rows(cache):
            out = model(
                input_ids=tokens,
                attention_mask=mask,
                position_ids=positions,
                **cache_kwargs(cache),
                use_cache=True,
            )
        return out.logits.float()

    def _row_ids(self, index: int, extra: torch.Tensor) -> torch.Tensor:
        """`(1, L)`: active row `index` as stock generate() sees it (padded prompt + its tokens + `extra`)."""
        row = int(self.rows[index])
        start = int(self.prompt_lengths[row])
        new = self.tokens[row, start : start + int(self.generated[row])]
        return torch.cat([self.prompt[row], new, extra])[None]

    def _process(self, logits: torch.Tensor, drafts: torch.Tensor, first: int = 0) -> torch.Tensor:
        """Apply the call's logits processors, in order, to `(B, n, V)` logits; position k follows
        `drafts[:, : first + k]`. Length rules and score-only warpers run on the whole batch, anything else row by
        row on the ids stock `generate()` would pass it."""
        if not self.processors:
            return logits
        batch, n, vocab = logits.shape
        # the ids length stock generate() has at each position: padded prompt + new tokens so far
        offsets = torch.arange(n, device=self.generated.device)[None]
        lengths = self.prompt.shape[1] + self.generated[self.rows][:, None] + first + offsets
        out = logits
        for processor in self.processors:
            if isinstance(processor, LENGTH_ONLY):
                out = suppress_eos(out, processor, lengths)
            elif isinstance(processor, SCORE_ONLY):
                out = processor(drafts.new_zeros(batch * n, 1), out.reshape(batch * n, vocab)).reshape(
                    batch, n, vocab
                )
            else:
                out = self._per_row(processor, out, drafts, first)
        return out

    def _per_row(self, processor, logits: torch.Tensor, drafts: torch.Tensor, first: int) -> torch.Tensor:
        out = logits.clone()
        for b in range(logits.shape[0]):
            for k in range(logits.shape[1]):
                out[b, k] = processor(self._row_ids(b, drafts[b, : first + k]), logits[b, k][None])[0]
        return out

    # -- a round -------------------------------------------------------------------------------------------------
    def _catch_up_draft(self) -> torch.Tensor:
        """Feed every row what its draft cache has not seen, at most `slack` tokens a forward; `(B, V)` logits."""
        totals = self.prompt_lengths[self.rows] + self.generated[self.rows]
        logits = None
        while True:
            seen = self.draft_cache.lengths
            pending = totals - seen  # (B,)
            if not bool((pending > 0).any()):
                return logits
            width = min(int(pending.max()), self.slack)
            positions = (seen[:, None] + torch.arange(width, device=seen.device)).clamp(
                max=self.tokens.shape[1] - 1
            )
            feed = self.tokens[self.rows[:, None], positions]  # (B, w); past a row's count: ignored filler
            step = self._step(self.drafter, self.draft_cache, feed)
            count = pending.clamp(max=width)
            last = step[torch.arange(feed.shape[0]), (count - 1).clamp(min=0)]
            logits = last if logits is None else torch.where((count > 0)[:, None], last, logits)
            self.draft_cache.crop_rows(width - count)

    def _draft(self, gamma: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(drafts (B, γ), processed draft logits (B, γ, V), limits (B,))`; a row's limit is where its draft
        confidence fell below the plan's threshold (γ without one)."""
        logits = self._catch_up_draft()
        drafts, scores = [], []
        limits = torch.full((self.rows.shape[0],), gamma, dtype=torch.long, device=logits.device)
        threshold = self.plan.confidence_threshold
        for k in range(gamma):
            processed = self._process(logits[:, None], _stack(drafts, logits), first=k)[:, 0]  # (B, V)
            probs = processed.softmax(-1) if self.sample or threshold else None
            token = torch.multinomial(probs, 1)[:, 0] if self.sample else processed.argmax(-1)
            if threshold:
                unsure = probs.gather(-1, token[:, None])[:, 0] < threshold
                limits = torch.where(unsure & (limits == gamma), k + 1, limits)
            drafts.append(token)
            scores.append(processed)
            if k + 1 < gamma:
                logits = self._step(self.drafter, self.draft_cache, token[:, None])[:, 0]
        return torch.stack(drafts, 1), torch.stack(scores, 1), limits

    def _last_tokens(self) -> torch.Tensor:
        """`(B,)`: each active row's newest token (not yet in the target's cache)."""
        index = self.prompt_lengths[self.rows] + self.generated[self.rows] - 1
        return self.tokens[self.rows, index]

    def _verify(self, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft `lengths[b]` tokens for row b and verify them in one forward: `(kept (B,), new tokens (B, G + 1))`,
        G = max length; row b's new tokens are `new[b, : kept[b] + 1]`."""
        batch, gamma = self.rows.shape[0], int(lengths.max())
        lengths = lengths.to(self.tokens.device)
        if gamma:
            drafts, draft_logits, limits = self._draft(gamma)
            limits = torch.minimum(limits, lengths)
        else:
            drafts = self.tokens.new_zeros(batch, 0)
            draft_logits, limits = None, torch.zeros(batch, dtype=torch.long, device=self.tokens.device)
        self._round_draft_end = time.perf_counter()
        fed = torch.cat([self._last_tokens()[:, None], drafts], 1)
        logits = self._process(self._step(self.target, self.target_cache, fed, needed=limits + 1), drafts)
        kept, new = accept_round(drafts, draft_logits, logits, limits, self.sample)
        self.target_cache.crop_rows(gamma - kept)
        if gamma:
            self.draft_cache.crop_rows((gamma - 1) - kept.clamp(max=gamma - 1))
        return kept, new

    def _emit(self, kept: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Append each row's new tokens, cut by the stopping criteria; `(B,)` bool: rows that finished."""
        counts = kept + 1
        room = self.max_new - self.generated[self.rows]
        finished = counts >= room
        counts = torch.minimum(counts, room)
        eos = getattr(self.config, "_eos_token_tensor", None)
        if eos is not None:
            is_eos = torch.isin(new, eos.to(new.device)) & (
                torch.arange(new.shape[1], device=new.device)[None] < counts[:, None]
            )
            first = torch.where(is_eos.any(-1), is_eos.float().argmax(-1) + 1, counts)
            finished |= is_eos.any(-1)
            counts = torch.minimum(counts, first)
        others = [c for c in self.criteria if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
        for b in range(new.shape[0]):
            row, count = int(self.rows[b]), int(counts[b])
            start = int(self.prompt_lengths[row] + self.generated[row])
            self.tokens[row, start : start + count] = new[b, :count]
            for k in range(1, count + 1) if others else ():
                ids = self._row_ids(b, new[b, :k])  # what stock generate() has after the k-th new token
                if any(bool(c(ids, None).any()) for c in others):
                    counts[b], finished[b] = k, True
                    break
            self.generated[row] += int(counts[b])
        return finished

    def _drop(self, finished: torch.Tensor) -> None:
        if not bool(finished.any()):
            return
        keep = (~finished).nonzero()[:, 0]
        self.rows = self.rows[keep]
        for cache in (self.target_cache, self.draft_cache):
            if cache is not None:
                cache.keep_rows(keep)

    # -- the call ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def run(
        self, input_ids, attention_mask, draft_length, stats=None, inputs_embeds=None, prefix=None
    ) -> torch.LongTensor:
        """Generate for every row; `(B, P + n)` sequences, rows that stopped early padded with `pad_token_id`.
        `inputs_embeds` `(B, P, H)`: the target reads the prompt as these embeddings (the drafter reads the ids).
        `prefix`: a one-row target cache holding the first tokens of the prompt every row repeats (the copies of
        `num_return_sequences`); the target's prefill continues it, and it is read, never written."""
        check_embeds(inputs_embeds, input_ids)
        self._setup(input_ids, attention_mask)
        if prefix is not None and prefix.get_seq_length() > 0:
            self._seed_target(prefix, input_ids)
        self.draft_length = draft_length
        if stats is not None:
            stats.candidate_generator = self
        start = time.perf_counter()
        # transformers' prefill_chunk_size bounds the target's prefill forwards (its full cache: a sparse cache of
        # the lossy mode, like the draft's, selects from a row's whole prompt)
        chunk = self.config.prefill_chunk_size if self.drafter is not None else None
        logits = self._prefill(
            self.target,
            self.target_cache,
            capture=_scores_queries(self.target_cache),
            embeds=inputs_embeds,
            chunk=chunk,
        )
        first = self._process(logits[:, None], input_ids[:, :0])[:, 0]
        first = torch.multinomial(first.softmax(-1), 1)[:, 0] if self.sample else first.argmax(-1)
        prefill_end = time.perf_counter()
        if self.drafter is not None:
            self._prefill(
                self.drafter,
                self.draft_cache,
                capture=_scores_queries(self.draft_cache),
                window=self.plan.spec.prefill_window,
            )
        draft_prefill = time.perf_counter() - prefill_end
        self.cache_bytes = {
            "target": self.target_cache.nbytes(),
            "draft": self.draft_cache.nbytes() if self.draft_cache is not None else 0,
        }
        finished = self._emit(torch.zeros_like(first), first[:, None])
        if stats is not None:
            stats.begin_batch(input_ids.shape[0], prefill_end - start, draft_prefill)
            stats.finish_rows(self.rows[finished].tolist())
        self._drop(finished)
        while self.rows.numel():
            rows = self.rows
            remaining = self.max_new - self.generated[rows]
            lengths = draft_length.next_lengths(rows, remaining)  # (B,) per active row
            begin = time.perf_counter()
            kept, new = self._verify(lengths)
            finished = self._emit(kept, new)
            end = time.perf_counter()
            draft, verify = self._round_draft_end - begin, end - self._round_draft_end
            draft_length.update(rows, lengths, kept, draft, verify)
            if stats is not None:
                stats.add_batch_round(rows.tolist(), lengths.tolist(), kept.tolist(), draft, verify)
                stats.finish_rows(self.rows[finished].tolist())
            self._drop(finished)
        return self._sequences()

    def _sequences(self) -> torch.LongTensor:
        pad = self.config._pad_token_tensor
        pad = 0 if pad is None else int(pad)
        width = self.prompt.shape[1] + int(self.generated.max())
        out = self.prompt.new_full((self.prompt.shape[0], width), pad)
        out[:, : self.prompt.shape[1]] = self.prompt
        for row in range(self.prompt.shape[0]):
            start, count = int(self.prompt_lengths[row]), int(self.generated[row])
            out[row, self.prompt.shape[1] : self.prompt.shape[1] + count] = self.tokens[
                row, start : start + count
            ]
        return out


def _scores_queries(cache) -> bool:
    """Whether a cache's prefill needs the prefill queries (a query-scored budgeted policy)."""
    return isinstance(cache, RaggedDraftCache) and cache.selection.uses_queries


def _stack(drafts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    if not drafts:
        return torch.zeros(like.shape[0], 0, dtype=torch.long, device=like.device)
    return torch.stack(drafts, 1)


# the per-token outputs of generate() that a loop of this package does not return
PER_TOKEN_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


def _refuse_unsupported(generation_config, kwargs: dict, input_ids, what: str, only_with_dict: bool) -> None:
    """The options a batched loop cannot honour (`only_with_dict`: the outputs count only when a dict is returned)."""
    extra = uncarried_inputs(kwargs, input_ids)
    if extra:
        raise ValueError(
            f"{what} feeds the target the prompt's ids (or inputs_embeds) and positions counted along each row; this "
            f"call also gives the model {extra} (an image or other encoded input, token types, multimodal "
            "positions), which it would drop. Generate one sequence at a time: transformers' loop feeds them"
        )
    outputs = not only_with_dict or generation_config.return_dict_in_generate
    asked = [name for name in PER_TOKEN_OUTPUTS if outputs and getattr(generation_config, name, False)]
    if asked:
        raise ValueError(
            f"{asked} are not returned by {what} (its rounds emit ragged tokens per row); drop them, or generate one "
            "sequence at a time"
        )
    if kwargs.get("streamer") is not None:
        raise ValueError(f"a streamer takes one sequence; {what} has several rows. Drop streamer=")


def _output(sequences: torch.LongTensor, generation_config):
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def run_batched(target, drafter, plan: DraftPlan, input_ids, generation_config, kwargs: dict):
    """`_assisted_decoding` for a batch: check what the batched loop supports, run it, shape the result."""
    _refuse_unsupported(
        generation_config,
        kwargs,
        input_ids,
        "batched speculative decoding (a batch, or cache_config full_draft_cache=True)",
        only_with_dict=False,
    )
    if target.config.is_encoder_decoder:
        raise ValueError("batched speculative decoding supports decoder-only targets")
    speculation = BatchedSpeculation(
        target,
        drafter,
        plan,
        generation_config,
        kwargs.get("logits_processor"),
        kwargs.get("stopping_criteria"),
    )
    sequences = speculation.run(
        input_ids,
        kwargs.get("attention_mask"),
        for_rows(plan, input_ids.shape[0]),
        stats=active_recorder(),
        inputs_embeds=kwargs.get("inputs_embeds"),
        prefix=kwargs.get(CACHE_KWARG),
    )
    return _output(sequences, generation_config)


def run_sparse_batch(model, spec, input_ids, generation_config, kwargs: dict):
    """`_sample` for a left-padded batch on a sparse cache without a draft (the lossy mode): the target itself
    reads each row's sink + window or budgeted selection, one token a step."""
    _refuse_unsupported(
        generation_config, kwargs, input_ids, "a padded batch on a sparse cache", only_with_dict=True
    )
    plan = DraftPlan(spec=spec.replace(static=False, compile=False, draft_length=0))
    decoding = BatchedSpeculation(
        model, None, plan, generation_config, kwargs.get("logits_processor"), kwargs.get("stopping_criteria")
    )
    sequences = decoding.run(
        input_ids,
        kwargs.get("attention_mask"),
        SharedDraftLength(FixedDraftLength(0)),
        inputs_embeds=kwargs.get("inputs_embeds"),
    )
    return _output(sequences, generation_config)
