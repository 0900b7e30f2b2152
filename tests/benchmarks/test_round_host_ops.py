"""`benchmarks/round_host_ops.py`: the device round's eager ops a round outside its compiled forwards, counted."""

import torch
from repo_paths import load_benchmark
from torch_support import needs_traceable_transformers

host_ops = load_benchmark("round_host_ops")


@needs_traceable_transformers
def test_the_device_round_dispatches_few_ops_a_round_outside_its_compiled_forwards(fresh_dynamo):
    """The count runs the device round with both forwards compiled, and stays below the 67 ops a round the round
    dispatched in fp32 before the acceptance kept the target's argmax row and a greedy draft became its argmax alone
    (48 on torch 2.13)."""
    row = host_ops.count(torch.float32, new_tokens=12)
    assert row["loop"] == "device_round" and row["rounds"][1] > row["rounds"][0]
    assert 1 <= row["draft_steps_per_round"] <= 5  # draft length 4, plus a catch-up token
    assert 20 < row["eager_ops_per_round"] < 60
    assert not any("scatter" in op or "gather" in op for op in row["by_op"])
    table = host_ops.table({"meta": host_ops.run_record(threads=1), "dtypes": {"fp32": row}})
    assert "| fp32 | device_round |" in table
