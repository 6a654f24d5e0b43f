"""Tests of ggufswap.config: schema, defaults, every kind of error with its line, the CLI."""

from __future__ import annotations

import json
import os
import re
import textwrap
from pathlib import Path

import fuzz_budget
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from processes import run_ggufswap

from ggufswap.config import (
    ComputeDtype,
    Config,
    ConfigError,
    ConfigProblem,
    LogLevel,
    MapShards,
    MissingSectionError,
    Storage,
    VerifyMode,
    WatchBackend,
    default_runtime_dir,
    load_config,
    load_config_text,
    parse_size,
)

GiB = 1024**3

FULL = r"""
version: 1
agent:
  status_endpoint: ipc:///run/ggufswap/agent.sock
  rescan_interval_s: 120
  metrics_port: 9101
  log_level: debug
models:
  - name: demo-moe
    runtime: ipc:///run/ggufswap/demo-moe.sock
    watch:
      - path: /srv/models/demo-moe
        glob: "*.gguf"
        recursive: true
        backend: polling
        poll_interval_s: 0.5
    ignore: ["*.tmp", ".*"]
    settle_ms: 400
    tensors:
      include: ['^blk\.\d+\.ffn_(gate|up|down)_exps\.weight$']
      exclude: ['^blk\.0\.']
    verify: stat
    request_timeout_s: 2.5
    retries: 5
runtime:
  name: demo-moe
  model: /srv/models/demo-moe/demo-moe-00001-of-00004.gguf
  control_endpoint: ipc:///run/ggufswap/demo-moe.sock
  status_endpoint: ipc:///run/ggufswap/demo-moe-status.sock
  events_endpoint: tcp://*:7001
  allowed_roots: [/srv/models/demo-moe, /srv/models/shared]
  storage: native
  compute_dtype: bfloat16
  strict_types: true
  pools:
    - {name: gpu0, device: "cuda:0", budget: 70GiB}
    - {name: host, device: cpu}
  placement:
    gpu_layers: 20
    experts_pool: host
    split_experts: true
  metrics_port: 9102
  log_level: warning
  threads: 6
security:
  curve:
    server_secret_key: /etc/ggufswap/server.key_secret
    server_public_key: /etc/ggufswap/server.key
    client_secret_key: /etc/ggufswap/client.key_secret
    authorized_keys_dir: /etc/ggufswap/authorized
  allow_insecure_tcp: false
"""


def load(text: str, tmp_path: Path, *, check_paths: bool = False) -> Config:
    """Write ``text`` to ``tmp_path/ggufswap.yaml`` and load it with a fixed runtime dir."""
    path = tmp_path / "ggufswap.yaml"
    path.write_text(textwrap.dedent(text))
    environ = {"RUNTIME_DIRECTORY": str(tmp_path / "run")}
    return load_config(path, environ=environ, check_paths=check_paths)


def problems(text: str, tmp_path: Path, *, check_paths: bool = False) -> list[ConfigProblem]:
    with pytest.raises(ConfigError) as info:
        load(text, tmp_path, check_paths=check_paths)
    return list(info.value.problems)


# --- good configurations -------------------------------------------------------------------


def test_minimal_agent_config_gets_defaults(tmp_path: Path) -> None:
    """A model with only a name and a watch path gets every documented default."""
    config = load("models: [{name: m, watch: [{path: /data/m}]}]", tmp_path)
    (model,) = config.require_models()
    run = tmp_path / "run"
    assert config.runtime is None
    assert config.agent.status_endpoint == f"ipc://{run}/agent.sock"
    assert config.agent.rescan_interval_s == 300.0
    assert config.agent.metrics_port is None
    assert config.agent.log_level is LogLevel.INFO
    assert model.runtime == f"ipc://{run}/m.sock"
    assert model.ignore == ("*.tmp", ".*", "*.incomplete")
    assert (model.settle_ms, model.verify, model.request_timeout_s, model.retries) == (
        250,
        VerifyMode.CHECKSUM,
        5.0,
        3,
    )
    (watch,) = model.watch
    assert (watch.path, watch.glob, watch.recursive) == (Path("/data/m"), "*.gguf", False)
    assert (watch.backend, watch.poll_interval_s) == (WatchBackend.AUTO, 1.0)
    assert model.tensors.admits("anything")


def test_minimal_runtime_config_gets_defaults(tmp_path: Path) -> None:
    """A runtime with only a model is named after its file (ggufswap.yaml) and gets derived
    endpoints, its directory as root, one CPU pool."""
    config = load("runtime: {model: /m/x-00001-of-00002.gguf}", tmp_path)
    runtime = config.require_runtime()
    run = tmp_path / "run"
    assert runtime.name == "ggufswap"
    assert runtime.control_endpoint == f"ipc://{run}/ggufswap.sock"
    assert runtime.status_endpoint == f"ipc://{run}/ggufswap.status.sock"
    assert runtime.events_endpoint == f"ipc://{run}/ggufswap.events.sock"
    assert runtime.allowed_roots == (Path("/m"),)
    assert [(p.name, p.device, p.budget) for p in runtime.pools] == [("host", "cpu", None)]
    assert (runtime.storage, runtime.compute_dtype) == (Storage.AUTO, ComputeDtype.FLOAT32)
    assert (runtime.placement.gpu_layers, runtime.placement.experts_pool) == (None, None)
    assert runtime.placement.split_experts is False
    assert runtime.strict_types is False
    assert runtime.threads is None  # auto: one thread per CPU of the affinity mask


def test_full_config_keeps_every_value(tmp_path: Path) -> None:
    """Every key of the full example arrives in the records with its written value."""
    config = load(FULL, tmp_path)
    agent, (model,), runtime = config.agent, config.models, config.require_runtime()
    assert (agent.rescan_interval_s, agent.metrics_port, agent.log_level) == (
        120.0,
        9101,
        LogLevel.DEBUG,
    )
    assert model.watch[0].backend is WatchBackend.POLLING
    assert model.watch[0].recursive
    assert model.watch[0].poll_interval_s == 0.5
    assert (model.settle_ms, model.verify, model.retries) == (400, VerifyMode.STAT, 5)
    assert model.tensors.admits("blk.3.ffn_up_exps.weight")
    assert not model.tensors.admits("blk.0.ffn_up_exps.weight")  # excluded
    assert not model.tensors.admits("token_embd.weight")  # not included
    assert runtime.status_endpoint == "ipc:///run/ggufswap/demo-moe-status.sock"
    assert runtime.events_endpoint == "tcp://*:7001"
    assert runtime.pool("gpu0").budget == 70 * GiB
    assert runtime.pool("host").budget is None
    assert (runtime.storage, runtime.compute_dtype, runtime.strict_types) == (
        Storage.NATIVE,
        ComputeDtype.BFLOAT16,
        True,
    )
    assert (runtime.placement.gpu_layers, runtime.placement.experts_pool) == (20, "host")
    assert runtime.placement.split_experts is True
    assert runtime.threads == 6
    assert config.security.curve is not None
    assert config.security.curve.authorized_keys_dir == Path("/etc/ggufswap/authorized")


@pytest.mark.parametrize(("written", "threads"), [("auto", None), ("null", None), ("1", 1)])
def test_runtime_threads_takes_a_count_or_auto(
    tmp_path: Path, written: str, threads: int | None
) -> None:
    """runtime.threads is an integer >= 1, or auto (also written as null) for the affinity."""
    config = load(RUNTIME + f"  threads: {written}\n", tmp_path)
    assert config.require_runtime().threads == threads


def test_storage_and_map_shards_default_to_auto(tmp_path: Path) -> None:
    """A runtime without storage or map_shards gets auto for both (GGUF-size memory and mapped
    loading where they fit); each still takes an explicit value."""
    runtime = load(RUNTIME, tmp_path).require_runtime()
    assert runtime.storage is Storage.AUTO
    assert runtime.map_shards is MapShards.AUTO
    explicit = load(RUNTIME + "  storage: dequantized\n  map_shards: false\n", tmp_path)
    assert explicit.require_runtime().storage is Storage.DEQUANTIZED
    assert explicit.require_runtime().map_shards is MapShards.OFF


@pytest.mark.parametrize(("written", "size"), [(None, 1 << 30), ("0", 0), ("512MiB", 512 << 20)])
def test_runtime_decoded_cache_is_a_size(tmp_path: Path, written: str | None, size: int) -> None:
    """runtime.decoded_cache is a byte size (units allowed), 1 GiB when absent, 0 to disable."""
    text = RUNTIME if written is None else RUNTIME + f"  decoded_cache: {written}\n"
    assert load(text, tmp_path).require_runtime().decoded_cache == size


def test_runtime_decoded_cache_refuses_what_is_not_a_size(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="decoded_cache"):
        load(RUNTIME + "  decoded_cache: lots\n", tmp_path)


def test_combined_file_defaults_model_endpoint_to_runtime(tmp_path: Path) -> None:
    """With one model and a runtime, the model connects where the runtime binds (* → localhost)."""
    config = load(
        """
        models: [{name: m, watch: [{path: /d}]}]
        runtime: {model: /d/m.gguf, control_endpoint: "tcp://*:6000"}
        security: {allow_insecure_tcp: true}
        """,
        tmp_path,
    )
    runtime = config.require_runtime()
    assert runtime.name == "m"
    assert config.models[0].runtime == "tcp://127.0.0.1:6000"
    assert (runtime.status_endpoint, runtime.events_endpoint) == ("tcp://*:6001", "tcp://*:6002")


def test_merge_keys_share_settings_and_own_keys_win(tmp_path: Path) -> None:
    """``<<: *anchor`` merges shared settings; a model's own key overrides the merged one."""
    config = load(
        """
        models:
          - &base {name: a, watch: [{path: /a}], settle_ms: 900, retries: 7}
          - <<: *base
            name: b
            settle_ms: 10
        """,
        tmp_path,
    )
    a, b = config.models
    assert (b.name, b.settle_ms, b.retries, b.watch) == ("b", 10, 7, a.watch)


def test_require_sections_name_what_is_missing(tmp_path: Path) -> None:
    """An agent-only file cannot serve the runtime command and says so, and vice versa."""
    agent_only = load("models: [{name: m, watch: [{path: /d}]}]", tmp_path)
    with pytest.raises(MissingSectionError, match="needs a 'runtime' section"):
        agent_only.require_runtime()
    runtime_only = load("runtime: {model: /d/m.gguf}", tmp_path)
    with pytest.raises(MissingSectionError, match="needs a 'models' section") as info:
        runtime_only.require_models()
    assert str(info.value).startswith(str(tmp_path / "ggufswap.yaml"))


# --- one test per kind of error, with its line --------------------------------------------

MODEL = "models:\n  - name: m\n    watch: [{path: /d}]\n"
RUNTIME = "runtime:\n  model: /d/m.gguf\n"

ERRORS = [
    pytest.param(
        MODEL.replace("[{path: /d}]", "[{path: /d, backend: inotfy}]"),
        3,
        "models[0].watch[0].backend",
        "expected one of auto|watchdog|pyinotify|polling, found 'inotfy'",
        id="bad-choice",
    ),
    pytest.param(
        MODEL + "    settle_msec: 5\n",
        4,
        "models[0].settle_msec",
        "unknown key 'settle_msec'; did you mean 'settle_ms'?",
        id="unknown-key",
    ),
    pytest.param(
        MODEL + "    tensors:\n      include: ['blk(']\n",
        5,
        "models[0].tensors.include[0]",
        "bad regular expression 'blk(': missing ), unterminated subpattern",
        id="bad-regex",
    ),
    pytest.param(
        RUNTIME + "  pools:\n    - {name: g, device: cpu, budget: 70GB2}\n",
        4,
        "runtime.pools[0].budget",
        "expected a size such as 70GiB",
        id="bad-size",
    ),
    pytest.param(
        RUNTIME + "  pools:\n    - {name: g, device: cpu, budget: 0GiB}\n",
        4,
        "runtime.pools[0].budget",
        "a budget must be > 0 bytes, found '0GiB'",
        id="zero-budget",
    ),
    pytest.param(
        MODEL + "  - name: m\n    watch: [{path: /e}]\n",
        4,
        "models[1].name",
        "duplicate model name 'm' (also used by models[0].name at line 2)",
        id="duplicate-model",
    ),
    pytest.param(
        RUNTIME + "  pools:\n    - {name: p, device: cpu}\n    - {name: p, device: cpu}\n",
        5,
        "runtime.pools[1].name",
        "duplicate pool name 'p'",
        id="duplicate-pool",
    ),
    pytest.param(
        RUNTIME + "  pools: [{name: host, device: cpu}]\n  placement: {experts_pool: hots}\n",
        4,
        "runtime.placement.experts_pool",
        "no pool named 'hots'; pools: host; did you mean 'host'?",
        id="unknown-pool",
    ),
    pytest.param(
        RUNTIME + "  pools:\n    - {name: g, device: 'cuda0'}\n",
        4,
        "runtime.pools[0].device",
        "expected a torch device (cpu, cpu:N, cuda, cuda:N",
        id="bad-device",
    ),
    pytest.param(
        RUNTIME + "  control_endpoint: http://localhost:80\n",
        3,
        "runtime.control_endpoint",
        "expected an ipc://PATH or tcp://HOST:PORT endpoint, found 'http://localhost:80'",
        id="bad-scheme",
    ),
    pytest.param(
        RUNTIME + "  control_endpoint: tcp://*:99999\n",
        3,
        "runtime.control_endpoint",
        "tcp:// port must be in 1..65535, found 99999",
        id="bad-port",
    ),
    pytest.param(
        MODEL.replace("name: m\n", "name: m\n    runtime: tcp://*:5555\n"),
        3,
        "models[0].runtime",
        "tcp://*:5555 is a bind address; name the host to connect to",
        id="connect-to-wildcard",
    ),
    pytest.param(
        RUNTIME + "  control_endpoint: tcp://*:5555\n",
        3,
        "runtime.control_endpoint",
        "is tcp:// without CURVE keys: set security.curve.server_secret_key and "
        "security.curve.authorized_keys_dir",
        id="tcp-without-curve",
    ),
    pytest.param(
        MODEL.replace("name: m\n", "name: m\n    runtime: tcp://gpu-host:5555\n"),
        3,
        "models[0].runtime",
        "set security.curve.client_secret_key and security.curve.server_public_key",
        id="tcp-client-without-curve",
    ),
    pytest.param(
        MODEL.replace("name: m", "name: 42"),
        2,
        "models[0].name",
        "expected a string, found an integer '42' (quote it to make it a string)",
        id="wrong-type",
    ),
    pytest.param(
        MODEL + "    retries: yes\n",
        4,
        "models[0].retries",
        "expected an integer, found a boolean 'yes'",
        id="bool-for-int",
    ),
    pytest.param(
        MODEL + "    settle_ms: -1\n",
        4,
        "models[0].settle_ms",
        "expected an integer >= 0, found -1",
        id="negative",
    ),
    pytest.param(
        MODEL + "    request_timeout_s: .nan\n",
        4,
        "models[0].request_timeout_s",
        "expected a number of seconds > 0, found nan",
        id="nan-seconds",
    ),
    pytest.param(
        "models:\n  - name: m\n", 2, "models[0].watch", "missing required key 'watch'", id="missing"
    ),
    pytest.param(
        MODEL + "    settle_ms: 1\n    settle_ms: 2\n",
        5,
        "models[0].settle_ms",
        "duplicate key 'settle_ms' (first at line 4)",
        id="duplicate-key",
    ),
    pytest.param(MODEL + "    ignore: [a, b\n", 5, "", "YAML syntax: ", id="yaml-syntax"),
    pytest.param(
        RUNTIME + "  allowed_roots: [/other]\n",
        2,
        "runtime.model",
        "'/d/m.gguf' is outside allowed_roots (/other)",
        id="outside-roots",
    ),
    pytest.param("version: 2\n" + MODEL, 1, "version", "expected version 1, found 2", id="version"),
    pytest.param("agent: {log_level: info}\n", 1, "", "nothing to configure", id="nothing"),
    pytest.param(
        "models: []\n", 1, "models", "expected at least 1 item(s), found 0", id="empty-models"
    ),
    pytest.param("- a\n- b\n", 1, "", "the top level must be a mapping", id="top-level-list"),
    pytest.param(
        "agent: {metrics_port: 9100}\n" + MODEL + RUNTIME + "  metrics_port: 9100\n",
        7,
        "runtime.metrics_port",
        "duplicate metrics port 9100 (also used by agent.metrics_port at line 1)",
        id="port-clash",
    ),
    pytest.param(
        RUNTIME + "  status_endpoint: ipc:///run/x.sock\n  events_endpoint: ipc:///run/x.sock\n",
        4,
        "runtime.events_endpoint",
        "duplicate endpoint 'ipc:///run/x.sock' (also used by runtime.status_endpoint at line 3)",
        id="endpoint-clash",
    ),
    pytest.param(
        RUNTIME + "  control_endpoint: ipc:///" + "d" * 120 + ".sock\n",
        3,
        "runtime.control_endpoint",
        "Unix sockets allow at most 107",
        id="ipc-too-long",
    ),
    pytest.param(
        RUNTIME + "  threads: 0\n",
        3,
        "runtime.threads",
        "expected an integer between 1 and 1024 or 'auto', found 0",
        id="zero-threads",
    ),
    pytest.param(
        RUNTIME + "  threads: 4096\n",
        3,
        "runtime.threads",
        "expected an integer between 1 and 1024 or 'auto', found 4096",
        id="too-many-threads",
    ),
    pytest.param(
        RUNTIME + "  threads: all\n",
        3,
        "runtime.threads",
        "expected an integer >= 1 or 'auto', found 'all'",
        id="threads-word",
    ),
    pytest.param(
        RUNTIME + "  threads: 1.5\n",
        3,
        "runtime.threads",
        "expected an integer >= 1 or 'auto', found a number '1.5'",
        id="threads-fraction",
    ),
    pytest.param(
        RUNTIME + "  threads: yes\n",
        3,
        "runtime.threads",
        "expected an integer >= 1 or 'auto', found a boolean 'yes'",
        id="threads-bool",
    ),
    pytest.param(
        RUNTIME + "  storage: automatic\n",
        3,
        "runtime.storage",
        "expected one of dequantized|native|auto, found 'automatic'",
        id="bad-storage",
    ),
    pytest.param(
        MODEL.replace("[{path: /d}]", "[{path: /d, glob: 'sub/*.gguf'}]"),
        3,
        "models[0].watch[0].glob",
        "cannot contain '/'",
        id="glob-with-dir",
    ),
    pytest.param(
        MODEL.replace("name: m", "name: 'bad name'"),
        2,
        "models[0].name",
        "a name is 1-64 letters, digits",
        id="bad-name",
    ),
    pytest.param(
        MODEL + "    tensors: [a]\n",
        4,
        "models[0].tensors",
        "expected a mapping of keys, found a list",
        id="list-for-mapping",
    ),
]


@pytest.mark.parametrize(("text", "line", "key_path", "message"), ERRORS)
def test_each_error_names_its_line_and_key(
    tmp_path: Path, text: str, line: int, key_path: str, message: str
) -> None:
    """Each kind of mistake is reported once, at its line and key path, with what was found."""
    found = problems(text, tmp_path)
    assert len(found) == 1, found
    (problem,) = found
    assert (problem.line, problem.key_path) == (line, key_path)
    assert message in problem.message
    file = str(tmp_path / "ggufswap.yaml")
    prefix = f"{file}:{line}: {key_path}: " if key_path else f"{file}:{line}: "
    assert str(problem).startswith(prefix)


def test_insecure_tcp_is_allowed_only_by_explicit_opt_out(tmp_path: Path) -> None:
    """The tcp:// endpoint refused without keys loads once allow_insecure_tcp is true."""
    text = RUNTIME + "  control_endpoint: tcp://*:5555\nsecurity: {allow_insecure_tcp: true}\n"
    assert load(text, tmp_path).require_runtime().control_endpoint == "tcp://*:5555"


def test_tcp_with_curve_keys_loads(tmp_path: Path) -> None:
    """tcp:// endpoints with the needed CURVE key files configured are accepted."""
    config = load(FULL.replace("ipc:///run/ggufswap/demo-moe.sock", "tcp://h:5000"), tmp_path)
    assert config.models[0].runtime == "tcp://h:5000"


def test_all_problems_are_reported_at_once_in_file_order(tmp_path: Path) -> None:
    """One load reports every problem, sorted by line, one per line of str()."""
    text = """\
        models:
          - name: m
            watch: [{path: /d, backend: inotfy}]
            settle_msec: 1
            tensors: {include: ['(']}
        runtime:
          model: /d/m.gguf
          pools: [{name: g, device: gpu, budget: -3}]
          placement: {experts_pool: nope}
        """
    with pytest.raises(ConfigError) as info:
        load(text, tmp_path)
    lines = [(p.line, p.key_path) for p in info.value.problems]
    assert lines == [
        (3, "models[0].watch[0].backend"),
        (4, "models[0].settle_msec"),
        (5, "models[0].tensors.include[0]"),
        (8, "runtime.pools[0].device"),
        (8, "runtime.pools[0].budget"),
    ]
    text_lines = str(info.value).splitlines()
    assert len(text_lines) == 5
    assert all(re.match(rf"{re.escape(str(tmp_path))}/ggufswap.yaml:\d+: ", s) for s in text_lines)


def test_documented_example_loads(tmp_path: Path) -> None:
    """The example in docs/configuration.md is a valid configuration."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    example = doc.split("```yaml\n", 1)[1].split("```", 1)[0]
    config = load(example, tmp_path)
    assert config.require_models()[0].name == "demo-moe"
    assert config.require_runtime().pool("gpu0").budget == 70 * GiB


# --- hostile YAML --------------------------------------------------------------------------


def test_python_tags_are_refused_and_never_run(tmp_path: Path) -> None:
    """``!!python/object/apply`` is refused with its line and the call is never made."""
    marker = tmp_path / "pwned"
    text = MODEL + f"    settle_ms: !!python/object/apply:os.system ['touch {marker}']\n"
    (problem,) = problems(text, tmp_path)
    assert problem.line == 4
    assert "unsafe YAML tag '!!python/object/apply:os.system' refused" in problem.message
    assert not marker.exists()


def test_unknown_tags_anywhere_are_refused(tmp_path: Path) -> None:
    """Local and non-plain tags are refused even under keys that are otherwise valid."""
    text = MODEL + "    ignore: !custom [a]\n    tensors: {include: !!binary aGk=}\n"
    found = problems(text, tmp_path)
    assert [(p.line, p.message.split(":")[0]) for p in found] == [
        (4, "unsupported YAML tag '!custom'"),
        (5, "unsupported YAML tag '!!binary'"),
    ]


def test_control_characters_are_reported_with_their_line(tmp_path: Path) -> None:
    """A byte YAML forbids is a problem at its line, and str() stays one line per problem."""
    (problem,) = problems(MODEL + "    ignore: ['a\x01']\n", tmp_path)
    assert problem.line == 4
    assert "unacceptable character #x0001" in problem.message
    assert "\n" not in str(problem)


def test_recursive_alias_is_an_error_not_a_crash(tmp_path: Path) -> None:
    """A self-referencing alias yields a ConfigError instead of unbounded recursion."""
    found = problems("models: &m [*m]\n", tmp_path)
    assert found[0].key_path == "models[0]"


def test_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    """A missing file is reported as a problem of that file, without a line."""
    with pytest.raises(ConfigError, match=r"missing\.yaml: cannot read: No such file"):
        load_config(tmp_path / "missing.yaml")


# --- paths ----------------------------------------------------------------------------------


def test_relative_paths_resolve_against_the_config_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Relative paths and ipc:// sockets are taken from the file's directory, not the cwd."""
    conf_dir = tmp_path / "etc"
    conf_dir.mkdir()
    (conf_dir / "c.yaml").write_text(
        textwrap.dedent(
            """
            models: [{name: m, watch: [{path: ../models/m}], runtime: ipc://run/m.sock}]
            runtime:
              model: ../models/m/m.gguf
              allowed_roots: [../models]
            security: {curve: {server_secret_key: keys/s.key_secret}}
            """
        )
    )
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_config("../etc/c.yaml")
    assert config.models[0].watch[0].path == tmp_path / "models" / "m"
    assert config.models[0].runtime == f"ipc://{conf_dir}/run/m.sock"
    runtime = config.require_runtime()
    assert runtime.model == tmp_path / "models" / "m" / "m.gguf"
    assert runtime.allowed_roots == (tmp_path / "models",)
    assert config.security.curve is not None
    assert config.security.curve.server_secret_key == conf_dir / "keys" / "s.key_secret"
    assert config.source == conf_dir / "c.yaml"


def test_missing_paths_are_reported_only_when_checked(tmp_path: Path) -> None:
    """Loading ignores absent paths; check_paths reports the watch path and the model by line."""
    text = MODEL + RUNTIME
    load(text, tmp_path)  # does not raise
    found = problems(text, tmp_path, check_paths=True)
    assert [(p.line, p.key_path) for p in found] == [
        (3, "models[0].watch[0].path"),
        (5, "runtime.model"),
    ]
    assert "directory '/d' does not exist" in found[0].message
    assert "file '/d/m.gguf' does not exist" in found[1].message


def test_existing_paths_pass_the_check(tmp_path: Path) -> None:
    """The same checks accept a watch directory and a model file that exist."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.gguf").write_bytes(b"GGUF")
    text = "models: [{name: m, watch: [{path: models}]}]\nruntime: {model: models/m.gguf}\n"
    config = load(text, tmp_path, check_paths=True)
    assert config.require_runtime().model == tmp_path / "models" / "m.gguf"


# --- units and defaults ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("70GiB", 70 * GiB),
        ("512MiB", 512 * 1024**2),
        ("1.5GB", 1_500_000_000),
        ("1.5 gib", 3 * GiB // 2),
        ("4096", 4096),
        (4096, 4096),
        ("10kb", 10_000),
        ("2 B", 2),
    ],
)
def test_parse_size_accepts_decimal_and_binary_units(text: str | int, expected: int) -> None:
    """Sizes take decimal (GB) and binary (GiB) units, a decimal part, or plain bytes."""
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "1.5 GiBs", "-1GiB", "1e9", "1,5GB", "ten"])
def test_parse_size_rejects_malformed_sizes(text: str) -> None:
    """Anything that is not a number and a known unit raises ValueError naming the text."""
    with pytest.raises(ValueError, match=re.escape(repr(text))):
        parse_size(text)


def test_default_runtime_dir_prefers_systemd_then_xdg(tmp_path: Path) -> None:
    """$RUNTIME_DIRECTORY wins; without it and without /run/ggufswap, $XDG_RUNTIME_DIR is used."""
    assert default_runtime_dir(environ={"RUNTIME_DIRECTORY": "/a:/b"}) == Path("/a")
    fallback = default_runtime_dir(environ={"XDG_RUNTIME_DIR": str(tmp_path)})
    run = Path("/run/ggufswap")
    if not (run.is_dir() and os.access(run, os.W_OK | os.X_OK)):
        assert fallback == tmp_path / "ggufswap"
    assert default_runtime_dir(environ={}).is_absolute()


def test_load_config_text_without_source() -> None:
    """Text without a file is named <config> in messages."""
    with pytest.raises(ConfigError, match=r"^<config>:1: models\[0\]: "):
        load_config_text("models: [3]\n")


# --- the command ----------------------------------------------------------------------------


@pytest.mark.process
def test_check_config_summarizes_a_valid_file(tmp_path: Path) -> None:
    """check-config exits 0 and lists the models, watch paths with backends and pools."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.gguf").write_bytes(b"GGUF")
    path = tmp_path / "c.yaml"
    path.write_text(
        "models: [{name: mymodel, watch: [{path: models, backend: polling}]}]\n"
        "runtime:\n  model: models/m.gguf\n"
        "  pools: [{name: gpu0, device: 'cuda:1', budget: 2GiB}]\n"
    )
    result = run_ggufswap("check-config", str(path))
    assert result.returncode == 0, result.stderr
    assert "model mymodel" in result.stdout
    assert f"watch {tmp_path / 'models'} *.gguf (backend polling" in result.stdout
    assert "pool gpu0 on cuda:1, budget 2.0 GiB" in result.stdout
    assert "(storage auto, float32, threads auto)" in result.stdout
    as_json = run_ggufswap("check-config", "--json", str(path))
    data = json.loads(as_json.stdout)
    assert as_json.returncode == 0
    assert data["ok"] is True
    assert data["config"]["runtime"]["pools"][0]["budget"] == 2 * GiB
    assert data["config"]["runtime"]["threads"] is None


@pytest.mark.process
def test_check_config_lists_problems_and_exits_1(tmp_path: Path) -> None:
    """check-config exits 1 and prints every problem as FILE:LINE: key: message, paths too."""
    path = tmp_path / "c.yaml"
    path.write_text("models:\n  - name: m\n    watch: [{path: nowhere, backend: inotfy}]\n")
    result = run_ggufswap("check-config", str(path))
    assert result.returncode == 1
    assert f"{path}:3: models[0].watch[0].path: directory '{tmp_path / 'nowhere'}'" in (
        result.stderr
    )
    assert f"{path}:3: models[0].watch[0].backend: expected one of" in result.stderr
    as_json = run_ggufswap("check-config", "--json", str(path))
    data = json.loads(as_json.stdout)
    assert as_json.returncode == 1
    assert data["ok"] is False
    assert {(p["line"], p["key"]) for p in data["problems"]} == {
        (3, "models[0].watch[0].path"),
        (3, "models[0].watch[0].backend"),
    }


# --- fuzzing --------------------------------------------------------------------------------

FUZZ_EXAMPLES = fuzz_budget.examples(200)
FRAGMENTS = [
    ": ", "- ", "[", "]", "{", "}", ",", "&a ", "*a", "<<: *a\n", "!!python/object:os.system ",
    "!!binary ", "!x ", "? ", "|\n", ">", "#", "'", '"', "\n", "  ", "\t", "---\n", "...\n",
    "%YAML 1.1\n", "0x1F", "1e5", "~", "null", ".inf", "-.nan", "-1", "99999999999999999999",
    "tcp://*:0", "ipc://", "GiB", "cuda:", "\x00", "\ufeff", "\x85", "é", "\\", "%",
]  # fmt: skip
# Values that keep the YAML well-formed, so that the fuzz reaches the schema, not only the parser.
VALUES = [
    "0", "-1", "3.5", ".nan", "-.inf", "true", "null", "~", "''", "x", "'70GiB'", "0GiB",
    "[]", "[a, 1]", "{}", "{a: 1}", "{name: host, device: cpu}", "!!python/name:os.system ''",
    "!x y", "!!binary aGk=", "!!int 0xZZ", "!!float nope", "!!str 5", "2024-01-01", "cuda:9",
    "tcp://*:5555", "tcp://h:0", "ipc://", "ipc://rel.sock", "'('", "'*.tmp'", "&a [*a]",
    "99999999999999999999999", "/abs/path", "../rel", "'a\\x01'",
]  # fmt: skip
KEYS = ["name", "watch", "path", "pools", "budget", "device", "<<", "tensors", "x", "models"]


@st.composite
def mutated_configs(draw: st.DrawFn) -> str:
    text = FULL
    for _ in range(draw(st.integers(1, 4))):
        kinds = ["revalue", "revalue", "rekey", "insert", "delete", "replace", "duplicate", "swap"]
        kind = draw(st.sampled_from(kinds))
        at = draw(st.integers(0, len(text)))
        if kind in {"revalue", "rekey"}:
            lines = text.splitlines(keepends=True)
            keyed = [i for i, line in enumerate(lines) if ": " in line]
            if not keyed:
                continue
            i = draw(st.sampled_from(keyed))
            key, _, value = lines[i].partition(": ")
            if kind == "revalue":
                value = draw(st.sampled_from(VALUES)) + "\n"
            else:
                key = key[: len(key) - len(key.lstrip(" -"))] + draw(st.sampled_from(KEYS))
            lines[i] = f"{key}: {value}"
            text = "".join(lines)
        elif kind == "insert":
            piece = draw(st.sampled_from(FRAGMENTS) | st.text(max_size=4))
            text = text[:at] + piece + text[at:]
        elif kind == "delete":
            text = text[:at] + text[at + draw(st.integers(1, 12)) :]
        elif kind == "replace":
            end = at + draw(st.integers(1, 6))
            text = text[:at] + draw(st.sampled_from(FRAGMENTS)) + text[end:]
        else:
            lines = text.splitlines(keepends=True) or [""]
            i = draw(st.integers(0, len(lines) - 1))
            j = draw(st.integers(0, len(lines) - 1))
            if kind == "duplicate":
                lines.insert(j, lines[i])
            else:
                lines[i], lines[j] = lines[j], lines[i]
            text = "".join(lines)
    return text


@pytest.mark.reliability(
    "bad input",
    "mutated YAML configuration text, keys and values (hypothesis)",
    tries=FUZZ_EXAMPLES,
    outcome="a Config or a ConfigError listing problems with lines; nothing else",
)
@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(text=mutated_configs(), as_bytes=st.booleans(), check_paths=st.booleans())
def test_fuzz_mutated_yaml_only_ever_raises_config_error(
    text: str, as_bytes: bool, check_paths: bool
) -> None:
    """However the YAML text is mangled, loading returns a Config or raises ConfigError."""
    data: str | bytes = text.encode("utf-8", "surrogatepass") if as_bytes else text
    try:
        load_config_text(
            data,
            source="/nonexistent/ggufswap-fuzz/c.yaml",
            check_paths=check_paths,
            environ={"RUNTIME_DIRECTORY": "/nonexistent/run"},
        )
    except ConfigError as exc:
        error = exc
    else:
        return
    assert error.problems
    assert all(isinstance(p, ConfigProblem) for p in error.problems)
    assert str(error)


def test_scrub_rate_zero_turns_the_scrub_off() -> None:
    """``scrub_rate: 0`` is accepted (docs/configuration.md: it turns the scrub off); a
    negative rate is not."""
    config = load_config_text(MODEL + "    scrub_rate: 0\n")
    assert config.models[0].scrub_bytes_per_s == 0
    rated = load_config_text(MODEL + "    scrub_rate: 4MB\n")
    assert rated.models[0].scrub_bytes_per_s == 4_000_000
    with pytest.raises(ConfigError, match="scrub_rate"):
        load_config_text(MODEL + "    scrub_rate: -1\n")
