"""The demo app as a served page: driven through its HTTP API with `gradio_client`, and started from the command
line. Everything listens on 127.0.0.1 only."""

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

pytest.importorskip("gradio", reason="the demo app needs the `app` extra: pip install 'hf-budgetdraft[app]'")
gradio_client = pytest.importorskip("gradio_client", reason="pip install 'hf-budgetdraft[app]'")

from app_inputs import run_values  # noqa: E402

from hf_budgetdraft.app import AppArguments  # noqa: E402
from hf_budgetdraft.app.app import RUN_OUTPUTS, build_app, launch_app  # noqa: E402
from hf_budgetdraft.app.backend import MODEL_SMOKE  # noqa: E402
from hf_budgetdraft.cli import main  # noqa: E402

ARGS = AppArguments(port=0, threads=1, max_context_length=1024, max_new_tokens=64, max_gamma=8)


@pytest.fixture(scope="module")
def server():
    blocks = build_app(ARGS)
    _, url, _ = launch_app(blocks, ARGS, prevent_thread_lock=True, quiet=True)
    yield blocks, url
    blocks.close()
    blocks.hf_budgetdraft_store.close()


@pytest.fixture(scope="module")
def client(server):
    return gradio_client.Client(server[1], verbose=False, analytics_enabled=False, download_files=False)


def values(**overrides):
    return run_values(**{"max_new_tokens": 32, **overrides})


def named(outputs) -> dict:
    return dict(zip(RUN_OUTPUTS, outputs, strict=True))


def test_binds_localhost_only(server):
    blocks, url = server
    assert blocks.server_name == "127.0.0.1" and url.startswith("http://127.0.0.1:")
    port = blocks.server_port
    addresses = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    # the outgoing interface's address (a UDP connect sends nothing)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as route, contextlib.suppress(OSError):
        route.connect(("10.255.255.255", 9))
        addresses.add(route.getsockname()[0])
    addresses = {a for a in addresses if not a.startswith("127.") and a != "0.0.0.0"}
    if not addresses:
        pytest.skip("this machine has no non-loopback IPv4 address to probe")
    for address in addresses:  # reachable on loopback only
        with socket.socket() as probe:
            probe.settimeout(2)
            assert probe.connect_ex((address, port)) != 0, f"the app answered on {address}:{port}"
    with pytest.raises(ValueError, match="binds 127.0.0.1 only"):
        launch_app(blocks, ARGS, server_name="0.0.0.0")


def test_run_through_the_api_streams_and_is_lossless(client):
    job = client.submit(*values(), api_name="/run")
    last = named(job.result(timeout=120))
    assert len(job.outputs()) > 2, "the run streams intermediate updates"
    assert last["status"].startswith("Done"), last["status"]
    assert "Identical to the target's own greedy output" in last["verdict"]
    assert "speed-up vs AR" in last["stats"] and "acceptance rate" in last["stats"]
    assert last["ar_output"].count('data-origin="ar"') == 32
    spec = last["spec_output"]
    assert spec.count('data-origin="draft"') + spec.count('data-origin="target"') == 32
    assert last["raw"]["greedy_check"]["identical"] is True
    assert last["plot"] is not None


def test_bad_input_through_the_api(client):
    status = named(client.predict(*values(source="text", text=""), api_name="/run"))["status"]
    assert "the text is empty" in status
    # the sliders' own bounds are checked by Gradio before the app sees the value: a clear error, no run
    with pytest.raises(gradio_client.exceptions.AppError, match="greater than maximum value 1024"):
        client.predict(*values(context_length=50_000), api_name="/run")
    status = named(client.predict(*values(model="local", target_path="/no/such/model"), api_name="/run"))[
        "status"
    ]
    assert "neither a folder on the server nor a model in its Hugging Face cache" in status


def test_one_run_at_a_time(server, client):
    """Three visitors at once (a bounded load on localhost): all are served, one generate() at a time."""
    blocks, _ = server
    target = blocks.hf_budgetdraft_store.get(MODEL_SMOKE).target
    original, lock = target.generate, threading.Lock()
    active, peak = [0], [0]

    def counting_generate(*args, **kwargs):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            time.sleep(0.05)
            return original(*args, **kwargs)
        finally:
            with lock:
                active[0] -= 1

    target.generate = counting_generate
    try:
        jobs = [client.submit(*values(seed=i, max_new_tokens=16), api_name="/run") for i in range(3)]
        results = [named(job.result(timeout=180)) for job in jobs]
    finally:
        del target.generate
    assert all(r["status"].startswith("Done") for r in results), [r["status"] for r in results]
    assert peak[0] == 1
    run = next(fn for fn in blocks.fns.values() if fn.api_name == "run")
    assert run.concurrency_limit == 1
    assert blocks._queue.max_size == ARGS.queue_size


def test_cli_help_and_errors(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0
    assert "--share" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["demo", "--port", "70000"])
    assert "--port must be in [0, 65535]" in capsys.readouterr().err


def test_python_m_hf_budgetdraft_app_serves_on_localhost():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    process = subprocess.Popen(
        [sys.executable, "-m", "hf_budgetdraft.app", "--port", str(port), "--threads", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        deadline, lines = time.monotonic() + 120, []
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Running on local URL" in line:
                break
        assert f"http://127.0.0.1:{port}" in "".join(lines), "".join(lines)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as response:
            assert response.status == 200 and b"hf-budgetdraft demo" in response.read()
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_cancelling_a_run_stops_its_generation(server, client):
    """Stop (or a visitor leaving) cancels the job: the generation stops at its next step, the worker ends."""
    from transformers import LogitsProcessorList

    blocks, _ = server
    target = blocks.hf_budgetdraft_store.get(MODEL_SMOKE).target
    original, steps = target.generate, [0]

    def slow_step(input_ids, scores):
        steps[0] += 1
        time.sleep(0.02)
        return scores

    def slow_generate(*args, **kwargs):
        return original(*args, logits_processor=LogitsProcessorList([slow_step]), **kwargs)

    target.generate = slow_generate
    try:
        job = client.submit(*values(method="ar", max_new_tokens=64), api_name="/run")
        deadline = time.monotonic() + 60
        while steps[0] < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        job.cancel()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
            t.name == "hf_budgetdraft-app-generate" for t in threading.enumerate()
        ):
            time.sleep(0.05)
    finally:
        del target.generate
    assert not any(t.name == "hf_budgetdraft-app-generate" for t in threading.enumerate())
    assert 5 <= steps[0] < 64, "the generation stopped early"
