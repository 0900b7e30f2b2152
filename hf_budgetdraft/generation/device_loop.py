"""The device round: one sequence's speculative decoding as device work with one host read a round (gpt-fast's
`speculative_decode`, around transformers' models and this package's draft caches).

transformers' assisted loop synchronises with the device several times a round (the accepted-token slice, the EOS
check, the finished flag) and verifies through an eager forward on a cache whose length it reads. Here, a round:

1. the drafter proposes γ tokens on its sparse cache (`DraftSteps`: the compiled one-token step on CUDA);
2. the target verifies `[newest token, γ drafts]`, padded to a bucket, on a static cache (its sliding layers as
   rollback rings) through a compiled forward (`static_verify.py`);
3. the acceptance runs on the device (greedy: the target's argmax; sampling: speculative sampling), the new tokens
   are written into a device buffer, and the host reads one pair, `(kept, first EOS)`: the round's only wait;
4. both caches roll back by moving their write index, never by copying: the target's on the device before the
   read (the rejected drafts and the padding), the draft's on the host after it (its rejected tail).

Greedy output is the target's own (it is the target's argmax at every position); sampling keeps its
distribution (Leviathan et al., arXiv 2211.17192). The loop does what most calls ask (greedy or sampling, the
blockwise logits processors, `max_length` and EOS, a streamer, a target cache passed to `generate()`: loaded into the
static cache, then given what the call added); a call asking for more (`unsupported`) runs transformers' loop
instead.
"""

from __future__ import annotations

import time

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..cache import is_full_attention_only
from ..compat import CACHE_KWARG, cache_kwargs
from . import draft_length, drafter_media
from .acceptance import accept_round, sample_on_device
from .batched_loop import PER_TOKEN_OUTPUTS
from .draft_length import RoundClock
from .draft_steps import DraftSteps
from .model_inputs import prompt_only_inputs, uncarried_inputs
from .plan import DraftPlan
from .prefilled import check_prompt_extends, is_given
from .processors import is_blockwise, process_block
from .static_verify import StaticVerify, give_back, ring_slack, take_cache


def unsupported(target, generation_config, kwargs: dict, input_ids) -> str | None:
    """Why this call of `target.generate` must run transformers' loop instead of the device round (`None`: it need
    not)."""
    if input_ids is None or input_ids.shape[0] != 1:
        return "the device round decodes one sequence"
    asked = [name for name in PER_TOKEN_OUTPUTS if getattr(generation_config, name, False)]
    if generation_config.return_dict_in_generate and asked:
        return f"it returns {asked}"
    processors = [p for p in kwargs.get("logits_processor") or [] if not is_blockwise(p)]
    if processors:
        return f"logits processors that read the ids ({[type(p).__name__ for p in processors]})"
    known = (MaxLengthCriteria, EosTokenCriteria)
    criteria = [c for c in kwargs.get("stopping_criteria") or [] if not isinstance(c, known)]
    if criteria:
        return f"stopping criteria besides max_length and EOS ({[type(c).__name__ for c in criteria]})"
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        return "a padded prompt"
    if kwargs.get("inputs_embeds") is not None:
        return "a prompt given as inputs_embeds"
    if kwargs.get("synced_gpus"):
        return "synced_gpus"
    prompt_only = prompt_only_inputs(kwargs, input_ids)
    extra = [name for name in uncarried_inputs(kwargs, input_ids) if name not in prompt_only]
    if extra:
        return f"model inputs it does not feed the target ({extra})"
    if prompt_only and is_given(kwargs.get(CACHE_KWARG)):
        return f"{sorted(prompt_only)} in a call continuing a cache it was given"
    if is_given(kwargs.get(CACHE_KWARG)) and not is_full_attention_only(target.config):
        return "a cache passed to a target with sliding layers (its windows are not loaded into the round's rings)"
    return None


class DeviceRound:
    """One call of the device round (see the module docstring). After `run`, `draft_length`, `draft_cache`,
    `draft_prefill_seconds` and `runtime()` describe it (read by `record_speculation`)."""

    def __init__(
        self,
        target,
        drafter,
        plan: DraftPlan,
        generation_config,
        logits_processor,
        prompt_inputs: dict | None = None,
        drafter_media: dict | None = None,
    ):
        self.target, self.drafter, self.plan = target, drafter, plan
        self.prompt_inputs = prompt_inputs or {}  # the target's prefill takes them (`prompt_only_inputs`)
        self.config = generation_config
        self.processors = list(logits_processor or [])
        self.sample = bool(generation_config.do_sample)
        self.draft_length = draft_length.for_plan(plan)
        length = plan.spec.draft_length
        self.most = length if isinstance(length, int) else plan.spec.max_draft_length
        self.draft_cache = plan.draft_cache(drafter)
        self.steps = DraftSteps.for_plan(plan, drafter, self.draft_cache, drafter_media)
        self._drafting = plan.drafting(drafter)
        eos = getattr(generation_config, "_eos_token_tensor", None)
        self.eos = None if eos is None else eos.to(target.device).reshape(-1)
        self.verify: StaticVerify | None = None

    @property
    def draft_prefill_seconds(self) -> float:
        return self.steps.prefill.seconds

    def runtime(self) -> dict:
        """What ran in this call: the loop, the verification and the draft step (compiled or not, and how often),
        and the inputs a multimodal drafter's prefill read besides the ids."""
        return {
            "loop": "device_round",
            "verify": None if self.verify is None else self.verify.record.as_dict(),
            "draft_step": self.steps.record(),
            "drafter_media": sorted(self.steps.prefill.media),
        }

    # -- a round -------------------------------------------------------------------------------------------------
    def _process(self, logits: torch.Tensor, first_length: int) -> torch.Tensor:
        """The call's processors on `(1, n, V)` logits whose first position follows `first_length` ids."""
        if not self.processors:
            return logits
        lengths = first_length + torch.arange(logits.shape[1], device=logits.device)[None]
        return process_block(self.processors, logits, lengths)

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        """`(1, n)` tokens from processed `(1, n, V)` logits: argmax, or a draw made on the device."""
        return sample_on_device(logits.softmax(-1)) if self.sample else logits.argmax(-1)

    def _next_draft(self, logits: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft token after the draft's `logits (1, V)` for `position`: `(token (1, 1), processed logits
        (1, 1, V))`; greedy without processors, an argmax alone (a round's host time is counted in such ops)."""
        if not (self.processors or self.sample):
            return logits.argmax(-1, keepdim=True), None
        processed = self._process(logits[:, None], position)
        return self._pick(processed), processed

    def _draft(
        self, tokens: torch.Tensor, length: int, gamma: int
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Draft `gamma` tokens after `tokens[:, :length]`: `(γ drafts (1, 1), processed draft logits (1, γ, V)
        when sampling)`."""
        # a copy with its own layout, not a strided view of `tokens`: a compiled step would see a (1, 1) slice's
        # stride as a new input and compile again
        feed = tokens[:, self.draft_seen : length].clone(memory_format=torch.contiguous_format)
        drafts, scores = [], []
        with self._drafting():
            logits = self.steps(feed, self.draft_seen, None)
            self.draft_seen = length
            for k in range(gamma):
                token, processed = self._next_draft(logits, length + k)
                drafts.append(token)
                scores.append(processed)
                if k + 1 < gamma:
                    logits = self.steps(token, length + k, None)
                    self.draft_seen += 1
        return drafts, (torch.cat(scores, 1) if self.sample else None)

    def _limits(self, gamma: int, device: torch.device) -> torch.Tensor:
        """`(1,)` long: `gamma` on the device, made once per call and length (never written)."""
        if gamma not in self.limits:
            self.limits[gamma] = torch.full((1,), gamma, dtype=torch.long, device=device)
        return self.limits[gamma]

    def _round(self, tokens: torch.Tensor, length: int, gamma: int) -> tuple[int, int]:
        """Draft, verify and accept after `tokens[:, :length]`; writes the new tokens from `length` on and returns
        `(kept, tokens up to and with the first EOS among the kept + 1, else 0)`: the round's one host read."""
        self.clock.start()
        drafts, draft_logits = self._draft(tokens, length, gamma) if gamma else ([], None)
        self.clock.drafted(gamma)
        fed = torch.cat([tokens[:, length - 1 : length], *drafts], 1)  # (1, γ + 1)
        logits = self._process(self.verify(fed, length - 1), length)
        limits = self._limits(gamma, fed.device)
        kept, new = accept_round(
            fed[:, 1:], draft_logits, logits, limits, self.sample, on_device=True
        )  # (1,), (1, γ + 1)
        kept = kept[0]
        self.verify.keep(kept)  # the target's rollback, queued before the read below
        tokens[:, length : length + gamma + 1] = new
        if self.eos is None:
            return int(kept), 0  # the round's one synchronisation
        leading = (~torch.isin(new[0], self.eos)).cumprod(0).sum()  # new tokens before the first EOS
        kept, leading = torch.stack([kept, leading]).tolist()  # the round's one synchronisation
        return kept, (leading + 1 if leading <= kept else 0)

    def _roll_back(self, length: int, gamma: int, kept: int) -> None:
        """The draft cache keeps at most `length + kept` tokens (the target's rolled back in `_round`)."""
        excess = self.draft_seen - (length + kept)
        if gamma and excess > 0:
            self.draft_cache.note_length(self.draft_seen)
            self.draft_cache.crop(-excess)
            self.draft_seen -= excess

    # -- the call ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def run(self, input_ids: torch.LongTensor, streamer=None, stats=None, given=None) -> torch.LongTensor:
        """Generate after `input_ids (1, P)`; `(1, P + n)`. `given`: a cache the caller passed, holding the prompt's
        first tokens: loaded into the static cache, then given what the call added (not if the call fails)."""
        cached = 0 if given is None else given.get_seq_length()
        check_prompt_extends(cached, input_ids)
        prompt = input_ids.shape[1]
        budget = self.config.max_length - prompt
        if budget <= 0:
            return input_ids
        slack = ring_slack(self.most + 1)
        cache = take_cache(self.target, prompt + budget + self.most + 1, slack)
        try:
            self.verify = StaticVerify(
                self.target,
                cache,
                self.plan.verify_compile_config,
                self.most + 1,
                coarse=self.plan.coarse_verify_buckets,
            )
            if cached:
                self.verify.load(given, cached)
            sequences = self._generate(input_ids, budget, streamer, stats, cached)
            if given is not None:
                self.verify.store(given, cached, sequences.shape[1] - 1)
            return sequences
        finally:
            give_back(self.target, cache, slack)

    def _generate(self, input_ids, budget: int, streamer, stats, cached: int) -> torch.LongTensor:
        prompt = input_ids.shape[1]
        # (1, capacity): the prompt, then the new tokens (a round writes up to γ + 1 past the budget)
        tokens = input_ids.new_zeros(1, prompt + budget + self.most + 1)
        tokens[:, :prompt] = input_ids
        self.clock = RoundClock(self.draft_length, input_ids.device)
        self.draft_seen, self.limits = 0, {}
        start = time.perf_counter()
        if self.prompt_inputs:
            logits = self.verify.prefill_with(input_ids, self.prompt_inputs)
        else:
            logits = self.verify.prefill(input_ids, cached, self.config.prefill_chunk_size)
        first = self._pick(self._process(logits[:, None], prompt))  # (1, 1)
        self.verify.capture(prompt)
        tokens[:, prompt : prompt + 1] = first
        stop = self.eos is not None and bool(torch.isin(first[0], self.eos).any())
        prefill = time.perf_counter() - start  # counted in the first round, as transformers' loop does
        length = prompt + 1
        self._stream(streamer, tokens, prompt, length)
        while not stop and length - prompt < budget:
            gamma = max(0, min(self.draft_length.next_length(), budget - (length - prompt) - 1, self.most))
            kept, eos_end = self._round(tokens, length, gamma)
            self._roll_back(length, gamma, kept)
            stop = eos_end > 0
            emitted = min(eos_end or kept + 1, budget - (length - prompt))
            self.clock.finish(kept)
            if stats is not None:
                stats.add_round(gamma, kept, self.clock.draft_seconds, self.clock.verify_seconds + prefill)
                prefill = 0.0
            self._stream(streamer, tokens, length, length + emitted)
            length += emitted
        if streamer is not None:
            streamer.end()
        return tokens[:, :length].clone()

    @staticmethod
    def _stream(streamer, tokens: torch.Tensor, begin: int, end: int) -> None:
        if streamer is not None and end > begin:
            streamer.put(tokens[0, begin:end].cpu())


def run_device_round(
    target, drafter, plan: DraftPlan, input_ids, generation_config, kwargs: dict, stats=None
):
    """`_assisted_decoding` as the device round: run it, shape the result as transformers would."""
    given = kwargs.get(CACHE_KWARG) if is_given(kwargs.get(CACHE_KWARG)) else None
    round_ = DeviceRound(
        target,
        drafter,
        plan,
        generation_config,
        kwargs.get("logits_processor"),
        prompt_inputs=prompt_only_inputs(kwargs, input_ids),
        drafter_media=drafter_media.for_drafter(drafter, kwargs),
    )
    if stats is not None:
        stats.candidate_generator = round_
    sequences = round_.run(input_ids, kwargs.get("streamer"), stats, given)
    if stats is not None:
        stats.draft_prefill_seconds += round_.draft_prefill_seconds
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(
            sequences=sequences, **({} if given is None else cache_kwargs(given))
        )
    return sequences
