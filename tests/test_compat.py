"""The compatibility module's choices match the installed transformers (CI runs this on the newest and the oldest
tested release), and a transformers whose patch points moved gets a clear refusal, plain calls untouched."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import transformers
from tiny_models import model_pair, random_prompt
from transformers import LlamaForCausalLM

from hf_budgetdraft import compat


def test_the_cache_argument_is_the_one_the_installed_models_take():
    parameters = inspect.signature(LlamaForCausalLM.forward).parameters
    assert compat.CACHE_KWARG in parameters
    assert ("cache" in parameters) == (compat.CACHE_KWARG == "cache")
    target, _ = model_pair("llama")
    cache = transformers.DynamicCache(config=target.config)
    out = target(random_prompt(8), **compat.cache_kwargs(cache), use_cache=True)
    assert compat.output_cache(out) is cache and cache.get_seq_length() == 8


def test_the_installed_transformers_has_every_patch_point_and_is_tested():
    assert compat.patch_point_problems() == []
    assert compat.installed_is_tested(), f"transformers {transformers.__version__} is outside {compat.TESTED}"


def test_draft_inputs_grow_to_the_round_length():
    kwargs = compat.prepare_draft_inputs({"attention_mask": torch.ones(1, 5, dtype=torch.long)}, 7, False)
    assert kwargs["attention_mask"].shape == (1, 7)


def test_a_changed_signature_is_named(monkeypatch):
    from transformers.generation.utils import GenerationMixin

    monkeypatch.setattr(
        GenerationMixin, "_get_candidate_generator", lambda self, generation_config, **kw: None
    )
    problems = compat.patch_point_problems()
    assert len(problems) == 1 and "GenerationMixin._get_candidate_generator no longer takes" in problems[0]
    assert f"transformers {transformers.__version__} (tested: {compat.TESTED[0]} to" in compat.refusal(
        problems
    )


_CHANGED_TRANSFORMERS = """
import torch
from transformers.generation.utils import GenerationMixin

def _get_candidate_generator(self, generation_config, input_ids, **changed):  # a release that renamed arguments
    raise AssertionError("the refused integration must never reach transformers' internals")

GenerationMixin._get_candidate_generator = _get_candidate_generator
import hf_budgetdraft  # noqa: E402
from tiny_models import model_pair, random_prompt  # noqa: E402

target, drafter = model_pair("llama", num_assistant_tokens=None)
ids = random_prompt(32)
plain = target.generate(ids, do_sample=False, max_new_tokens=6)
assert plain.shape == (1, 38)
try:
    target.generate(ids, assistant_model=drafter, cache_implementation="budgeted", max_new_tokens=6)
except RuntimeError as error:
    print("REFUSED:", error)
"""


def test_a_transformers_with_moved_patch_points_refuses_speculative_calls_only():
    tests = str(Path(__file__).parent)  # where tiny_models lives
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CHANGED_TRANSFORMERS)],
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])),
        },
    )
    assert result.returncode == 0, result.stderr[-2000:]
    refused = result.stdout.strip().splitlines()[-1]
    assert refused.startswith("REFUSED: hf-budgetdraft cannot speculate on transformers"), result.stdout
    assert "GenerationMixin._get_candidate_generator no longer takes" in refused
    assert "Plain generate() calls are unaffected" in refused


def test_the_pin_admits_exactly_the_tested_range():
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    pin = re.search(r'"transformers(>=[\d.]+,<[\d.]+)"', pyproject).group(1)
    low, high = compat.TESTED
    assert pin == f">={low},<{high.split('.')[0]}.{int(high.split('.')[1]) + 1}"
