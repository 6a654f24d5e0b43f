"""``runtime.serve`` in YAML: the serving mode and HTTP settings, flags overriding them."""

from __future__ import annotations

import http.client
import json
import textwrap
from pathlib import Path

import pytest
from processes import Proc, run_ggufswap, status_of, wait_for

from ggufswap._cmd_runtime import serve_settings
from ggufswap.config import ConfigError, ServeConfig, ServeMode, load_config
from ggufswap.main import build_parser
from ggufswap.shards import tiny_dense, write_model


def load(text: str, tmp_path: Path) -> ServeConfig:
    path = tmp_path / "m.yaml"
    path.write_text(textwrap.dedent(text))
    return load_config(path, environ={"RUNTIME_DIRECTORY": str(tmp_path)}).require_runtime().serve


def test_serve_defaults_to_http_on_loopback(tmp_path: Path) -> None:
    """A runtime section without ``serve`` serves HTTP on 127.0.0.1:8000."""
    serve = load("runtime: {model: /m/x.gguf}", tmp_path)
    assert serve == ServeConfig()
    assert (serve.mode, serve.host, serve.port) == (ServeMode.HTTP, "127.0.0.1", 8000)


def test_serve_keys_are_read_and_checked(tmp_path: Path) -> None:
    """Every ``serve`` key is read; a misspelt key and a port clash are reported with lines."""
    serve = load(
        """
        runtime:
          model: /m/x.gguf
          serve: {mode: probe, host: 0.0.0.0, port: 9000, max_batch: 3, max_queue: 5,
                  request_timeout_s: 2.5, batch_interval_s: 0}
        """,
        tmp_path,
    )
    assert serve == ServeConfig(
        mode=ServeMode.PROBE,
        host="0.0.0.0",
        port=9000,
        max_batch=3,
        max_queue=5,
        request_timeout_s=2.5,
        batch_interval_s=0.0,
    )
    try:
        load(
            """
            runtime:
              model: /m/x.gguf
              metrics_port: 9100
              serve: {prot: 1, port: 9100}
            """,
            tmp_path,
        )
    except ConfigError as exc:
        text = str(exc)
    else:
        raise AssertionError("a misspelt serve key was accepted")
    assert "runtime.serve.prot: unknown key 'prot'; did you mean 'port'?" in text
    assert "runtime.serve.port: port 9100 is also used by runtime.metrics_port" in text


@pytest.mark.process
def test_flags_override_the_yaml_and_help_shows_defaults(tmp_path: Path) -> None:
    """A given flag replaces its key of ``runtime.serve``; absent flags leave the file's value."""
    from_file = ServeConfig(mode=ServeMode.HTTP, port=9000, max_batch=3)
    args = build_parser().parse_args(
        ["runtime", "--config", "x.yaml", "--http-port", "0", "--mode", "probe"]
    )
    assert serve_settings(from_file, args) == ServeConfig(mode=ServeMode.PROBE, port=0, max_batch=3)
    helptext = run_ggufswap("runtime", "--help").stdout
    for shown in ("else http", "(default: 8000)", "(default: 127.0.0.1)", "(default: 8)"):
        assert shown in " ".join(helptext.split()), shown


@pytest.mark.process
def test_runtime_with_only_a_model_serves_http(tmp_path: Path) -> None:
    """``ggufswap runtime --config m.yaml`` with no flag (the unit's command line) serves HTTP on
    the port its file names."""
    first = write_model(tiny_dense(), tmp_path / "model")[0]
    config = tmp_path / "m.yaml"
    config.write_text(f"runtime:\n  model: {first}\n  serve: {{port: 0}}\n")
    run_dir = tmp_path / "run"
    proc = Proc(
        ["runtime", "--config", str(config)],
        log=tmp_path / "runtime.log",
        env={"RUNTIME_DIRECTORY": str(run_dir), "OMP_NUM_THREADS": "1"},
    )
    try:
        status = wait_for(
            lambda: (s := status_of(f"ipc://{run_dir}/m.status.sock")) is not None and s,
            timeout=60,
            what="the runtime to answer status",
        )
        assert status["serve"]["mode"] == "http"
        conn = http.client.HTTPConnection("127.0.0.1", status["http"]["port"], timeout=30)
        conn.request("GET", "/health")
        assert json.loads(conn.getresponse().read())["model"] == "m"
        conn.close()
    finally:
        assert proc.stop() == 0, proc.log()


def health(port: int) -> tuple[int, dict[str, object]] | None:
    """``GET /health``: the status and body, or None while nothing listens."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/health")
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    except ConnectionRefusedError:
        return None
    finally:
        conn.close()


@pytest.mark.process
def test_health_answers_503_loading_before_the_model_is_loaded(tmp_path: Path) -> None:
    """The port opens before torch and the model load: the first answer of /health is 503
    with status "loading" and the start's phase, and the runtime then turns to 200, having
    built the tokenizer before torch's import (while torch's library loaded) and logged every
    phase."""
    import socket
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    first = write_model(tiny_dense(), tmp_path / "model")[0]
    config = tmp_path / "m.yaml"
    config.write_text(f"runtime:\n  model: {first}\n  serve: {{port: {port}}}\n")
    started = time.monotonic()
    proc = Proc(
        ["runtime", "--config", str(config)],
        log=tmp_path / "runtime.log",
        env={"RUNTIME_DIRECTORY": str(tmp_path / "run"), "OMP_NUM_THREADS": "1"},
    )
    try:
        answer = wait_for(lambda: health(port), timeout=60, what="the port to open")
        opened = time.monotonic() - started
        status, body = answer
        assert (status, body["status"]) == (503, "loading"), body
        phases = ["starting", "tokenizer", "import", "load", "model", "warmup"]
        assert body["phase"] in phases, body
        ready = wait_for(
            lambda: (h := health(port)) is not None and h[0] == 200 and h,
            timeout=60,
            what="the runtime to be ready",
        )
        assert ready[1]["weight_version"] == 0
        events = [json.loads(line) for line in proc.log().splitlines() if line.startswith("{")]
        done = next(e for e in events if e["event"] == "startup.ready")
        assert list(done["phases"]) == phases, done
        preloaded = next(e for e in events if e["event"] == "startup.torch_preloaded")
        assert preloaded["loaded"] is True, preloaded
        print(
            f"\n/health answered 503 loading {opened:.2f} s after the process started "
            f"(phase {body['phase']}); 200 after {time.monotonic() - started:.2f} s"
        )
    finally:
        assert proc.stop() == 0, proc.log()
