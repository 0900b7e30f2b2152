import torch

from hf_budgetdraft.eval.machine import machine, machine_text, on_machine


def test_machine_names_the_cpu_and_the_vector_units_torch_dispatches_to():
    described = machine()
    assert described["cpu"] and described["logical_cpus"] >= 1
    assert described["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert set(described["cpu_flags"]) <= {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx_vnni"}


def test_a_table_header_names_its_machine_and_older_results_stay_as_they_were():
    described = {"cpu": "Some CPU", "cpu_capability": "AVX2", "logical_cpus": 2}
    assert machine_text(described) == "Some CPU (AVX2), 2 logical CPUs"
    assert on_machine({"machine": described}) == ", on Some CPU (AVX2), 2 logical CPUs"
    assert on_machine({"torch": "2.13.0"}) == ""
