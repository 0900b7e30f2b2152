"""`using_attention(model, name)`: the model runs `name` inside the block only, in this thread only, with nothing
written to its config, also when its config class redefines the `_attn_implementation` property (as HRM-Text's
does), which would hide the wrapped one."""

import threading

from tiny_models import model_pair
from transformers import LlamaConfig, PreTrainedConfig

import hf_budgetdraft
from hf_budgetdraft.attention.scoped import ScopedAttnImplementation, using_attention


class OwnPropertyConfig(LlamaConfig):
    """A config class with a property of its own, delegating to `PreTrainedConfig`'s, like HRM-Text's."""

    @property
    def _attn_implementation(self):
        return self._attn_implementation_internal

    @_attn_implementation.setter
    def _attn_implementation(self, value):
        PreTrainedConfig._attn_implementation.__set__(self, value)


def seen_in_another_thread(config) -> str:
    seen = []
    thread = threading.Thread(target=lambda: seen.append(config._attn_implementation))
    thread.start()
    thread.join()
    return seen[0]


def test_a_config_class_with_its_own_property_is_scoped_too():
    target, _ = model_pair("llama", "sdpa", num_assistant_tokens=None)
    target.config.__class__ = OwnPropertyConfig
    try:
        with using_attention(target, "eager"):
            assert target.config._attn_implementation == "eager"
            assert seen_in_another_thread(target.config) == "sdpa"
        assert (
            target.config._attn_implementation == "sdpa"
            and target.config._attn_implementation_internal == "sdpa"
        )
        assert isinstance(OwnPropertyConfig.__dict__["_attn_implementation"], ScopedAttnImplementation)
        hf_budgetdraft.uninstall()
        assert not isinstance(OwnPropertyConfig.__dict__["_attn_implementation"], ScopedAttnImplementation)
    finally:
        hf_budgetdraft.install()
        target.config.__class__ = LlamaConfig
