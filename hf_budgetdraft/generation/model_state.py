"""State that outlives one `generate()` call, kept per model in one registry keyed weakly by the model object.

Nothing is written onto a user's model for it: dropping a model drops its state, and a copy (or an unpickled
model) starts with none. Calls on several threads share a model's state under its lock.

- `rent`: the eager static draft-step seconds a drafter has spent in this process, the rent of the compiled step's
  ski rental (`compiled_step.py`);
- `free_caches`: a target's static caches between calls (`static_verify.py`);
- `compiled`: the compile configs a model's forwards were compiled with (`compiled_call.py`, which keeps the
  compiled functions themselves per model state).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field


@dataclass
class ModelState:
    """One model's state (see the module docstring); read and change the containers under `lock`."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    rent: float = 0.0  # seconds
    free_caches: dict = field(default_factory=dict)  # (size, dtype, device, inference mode) -> [StaticCache]
    compiled: set = field(default_factory=set)  # compile config keys

    def add_rent(self, seconds: float) -> None:
        with self.lock:
            self.rent += seconds


_states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_states_lock = threading.Lock()


def model_state(model) -> ModelState:
    """`model`'s state, created on first use."""
    with _states_lock:
        state = _states.get(model)
        if state is None:
            state = _states[model] = ModelState()
        return state
