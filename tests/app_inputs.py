"""The demo app's run-event inputs for the app tests (imports gradio: import it after `pytest.importorskip`)."""

from hf_budgetdraft.app.app import RUN_INPUTS
from hf_budgetdraft.app.backend import MODEL_SMOKE


def run_values(**overrides) -> list:
    """Run-event input values in `RUN_INPUTS` order (small, fast defaults on the smoke pair)."""
    chosen = dict(
        model=MODEL_SMOKE,
        target_path="",
        drafter_path="",
        device="cpu",
        dtype="float32",
        source="document",
        text="",
        upload=None,
        depth=0.5,
        context_length=256,
        method="sink_window",
        policy="chunk",
        num_sink_tokens=4,
        window_length=48,
        budget=48,
        gamma=4,
        max_new_tokens=24,
        decoding="greedy",
        temperature=1.0,
        seed=0,
    )
    chosen.update(overrides)
    assert set(chosen) == set(RUN_INPUTS)
    return [chosen[name] for name in RUN_INPUTS]
