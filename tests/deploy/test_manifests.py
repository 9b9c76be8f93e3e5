"""The deployment files are valid and agree with each other and with the agent's code.

systemd: `systemd-analyze verify` and its offline security score; Kubernetes and the collector:
parsed YAML checked for structure and cross-references; every `agent start` command line in them
parsed by the agent's own argument parser, every OTLP setting resolved by the agent's own export
config; the capability set equal everywhere to deploy/capabilities.txt.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_files import (
    DEPLOY,
    DEPLOYMENT_DOC,
    ENV_EXAMPLE,
    GATEWAY_CONFIG,
    K8S,
    KUSTOMIZATION,
    REPO,
    SECURITY_DOC,
    UNIT_FILE,
    capabilities,
    capability_names,
    env_file,
    exec_start_argv,
    k8s_bytes,
    k8s_cores,
    k8s_object,
    k8s_objects,
    systemd_bytes,
    unit_entries,
    unit_value,
    yaml_documents,
)

from moescope import errors
from moescope.agent import start as agent_start
from moescope.agent.cli import build_parser
from moescope.agent.export.config import ExportFlags, resolve_export_config
from moescope.agent.metrics import DEFAULT_METRICS_PORT
from moescope.agent.policy.config import load_policy
from moescope.collectors.nvtx import LIBRARY_NAME

AGENT_BIN = Path(sys.executable).parent / "agent"
# The bars (DESIGN.md): the agent uses at most 5 % of a core and 100 MB.
CPU_BAR_CORES = 0.05
RSS_BAR_BYTES = 100 * 1000 * 1000


def start_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices["start"]
    raise AssertionError("agent has no 'start' subcommand")


def parse_agent_argv(argv: list[str], capsys: pytest.CaptureFixture[str]) -> argparse.Namespace:
    """Parse `agent ARGS` exactly as the console script would; a rejected flag fails the test."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"`agent {' '.join(argv)}` rejected by agent's parser: {capsys.readouterr().err.strip()} ({exc})")
    return args


def assert_start_command(argv: list[str], capsys: pytest.CaptureFixture[str], *, port: int) -> argparse.Namespace:
    args = parse_agent_argv(argv, capsys)
    assert args._run is agent_start.run, f"not an `agent start` command: {argv}"
    assert args.port == [port]
    assert args.pid is None
    # no stray words: a positional would be taken as a command to launch
    assert args.command == []
    return args


# --- the capability set -------------------------------------------------------------------------


def test_capability_file_names_real_capabilities_once_each() -> None:
    caps = capabilities()
    names = [c.name for c in caps]
    assert len(names) == len(set(names)) >= 2
    assert {"CAP_BPF", "CAP_PERFMON"} <= set(names)
    assert "CAP_SYS_ADMIN" not in names
    for cap in caps:
        assert re.fullmatch(r"CAP_[A-Z_]+", cap.name), cap.name
        assert len(cap.why) > 20, f"{cap.name}: say why"
    capsh = shutil.which("capsh")
    assert capsh, "capsh (libcap2-bin) is needed to check capability names"
    for cap in caps:
        # capsh knows every capability of this libcap; it exits non-zero for an unknown name
        proc = subprocess.run([capsh, f"--supports={cap.name.lower()}"], capture_output=True, text=True)
        assert proc.returncode == 0, f"{cap.name}: {proc.stderr.strip()}"


def test_security_doc_table_lists_exactly_the_capabilities() -> None:
    text = SECURITY_DOC.read_text()
    rows = set(re.findall(r"^\|\s*`?(CAP_[A-Z_]+)`?\s*\|", text, re.M))
    # the first table under "## Capabilities" is the set in force; later tables list rejected ones
    section = text.split("\n## Capabilities\n", 1)[1].splitlines()
    start = next(i for i, line in enumerate(section) if line.startswith("|"))
    end = next((i for i in range(start, len(section)) if not section[i].startswith("|")), len(section))
    table = "\n".join(section[start:end])
    listed = set(re.findall(r"^\|\s*`(CAP_[A-Z_]+)`\s*\|", table, re.M))
    assert listed == capability_names()
    assert capability_names() <= rows


# --- systemd ------------------------------------------------------------------------------------


@pytest.fixture
def unit() -> dict[str, list[tuple[str, str]]]:
    return unit_entries(UNIT_FILE.read_text())


def test_unit_verifies_with_systemd_analyze(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze (package systemd) is needed to verify the unit"
    # verify checks that ExecStart's binary exists: point it at this checkout's console script
    text = UNIT_FILE.read_text().replace("/usr/local/bin/agent", str(AGENT_BIN))
    copy = tmp_path / UNIT_FILE.name
    copy.write_text(text)
    proc = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # unknown keys and misplaced ones are only warnings for verify: none allowed here
    assert proc.stderr.strip() == "", proc.stderr

    security = subprocess.run(
        [analyze, "security", "--offline=yes", str(copy)], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", security.stdout + security.stderr)
    assert match, security.stdout + security.stderr
    # 10 is an unconfined root service; 3.5 when written. The rest is explained in the unit.
    assert float(match.group(1)) <= 4.0, security.stdout


def test_unit_capabilities_and_sandbox(unit: dict[str, list[tuple[str, str]]]) -> None:
    service = "Service"
    for key in ("CapabilityBoundingSet", "AmbientCapabilities"):
        value = unit_value(unit, service, key)
        assert value is not None and set(value.split()) == capability_names(), key
    expected = {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "RuntimeDirectory": "moescope",
        "RuntimeDirectoryPreserve": "yes",
        "StateDirectory": "moescope",
        "Restart": "on-failure",
        "PrivateTmp": "no",
        "PrivateDevices": "no",
        "User": "root",
    }
    for key, value in expected.items():
        assert unit_value(unit, service, key) == value, key
    # these would break the agent (docs/security.md says why)
    assert unit_value(unit, service, "ProtectKernelModules") in (None, "no")
    assert unit_value(unit, service, "MemoryDenyWriteExecute") in (None, "no")
    assert unit_value(unit, service, "ProtectProc") in (None, "default")
    assert "/dev/shm" in (unit_value(unit, service, "ReadWritePaths") or "").split()
    # the restart loop stops for what a restart cannot fix
    no_restart = {int(code) for code in (unit_value(unit, service, "RestartPreventExitStatus") or "").split()}
    assert no_restart == {
        errors.UsageError.exit_code,
        errors.NotPermitted.exit_code,
        errors.BccMissing.exit_code,
        errors.ProbeLoadError.exit_code,
    }
    assert errors.TargetExited.exit_code not in no_restart  # exit 8: restart finds the new server
    assert errors.PortNotListening.exit_code not in no_restart


def test_unit_exec_start_is_a_valid_agent_command(
    unit: dict[str, list[tuple[str, str]]], capsys: pytest.CaptureFixture[str]
) -> None:
    exec_start = unit_value(unit, "Service", "ExecStart")
    assert exec_start is not None
    env = env_file(ENV_EXAMPLE.read_text())
    argv = exec_start_argv(exec_start, env)
    assert argv[0] == "/usr/local/bin/agent"
    assert_start_command(argv[1:], capsys, port=8000)
    # the env file's documented example for extra flags parses too
    example = re.search(r"^#\s+MOESCOPE_AGENT_ARGS=(.+)$", ENV_EXAMPLE.read_text(), re.M)
    assert example, "agent.env.example shows an example of MOESCOPE_AGENT_ARGS"
    argv = exec_start_argv(exec_start, {**env, "MOESCOPE_AGENT_ARGS": example.group(1)})
    args = parse_agent_argv(argv[1:], capsys)
    assert args.port == [8000, int(example.group(1).split()[-1])]


def test_unit_environment_file_resolves_to_the_gateway() -> None:
    env = env_file(ENV_EXAMPLE.read_text())
    config = resolve_export_config(ExportFlags(), env)
    assert config.otlp is not None
    assert config.otlp.protocol == "grpc"
    assert config.otlp.endpoint.endswith(":4317")
    assert config.otlp.source == "OTEL_EXPORTER_OTLP_ENDPOINT"


# --- Kubernetes ---------------------------------------------------------------------------------


@pytest.fixture
def daemonset() -> dict[str, Any]:
    return k8s_object("DaemonSet", "moescope-agent")


def agent_container(daemonset: dict[str, Any]) -> dict[str, Any]:
    containers = daemonset["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "agent")


def test_every_object_parses_and_sits_in_one_namespace() -> None:
    objects = k8s_objects()
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted(["Namespace", "ServiceAccount", "DaemonSet", "Service", "Deployment", "Service"])
    kustomization = yaml.safe_load(KUSTOMIZATION.read_text())
    namespace = kustomization["namespace"]
    for obj in objects:
        assert obj["apiVersion"] and obj["metadata"]["name"]
        if obj["kind"] == "Namespace":
            assert obj["metadata"]["name"] == namespace
        else:
            assert obj["metadata"]["namespace"] == namespace, obj["metadata"]["name"]
    # every file under deploy/kubernetes is applied (or generated into a ConfigMap)
    generated = {f.split("=", 1)[1] for g in kustomization["configMapGenerator"] for f in g["files"]}
    used = set(kustomization["resources"]) | generated
    for path in K8S.iterdir():
        assert str(path.relative_to(DEPLOY)) in used, f"{path.name} is not in kustomization.yaml"
    for rel in used:
        assert (DEPLOY / rel).is_file(), rel


def test_daemonset_privileges_are_the_minimal_set(daemonset: dict[str, Any]) -> None:
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    assert pod.get("hostNetwork", False) is False
    assert pod["automountServiceAccountToken"] is False
    context = agent_container(daemonset)["securityContext"]
    assert context["privileged"] is False
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True
    assert context["runAsUser"] == 0
    assert context["capabilities"]["drop"] == ["ALL"]
    assert set(context["capabilities"]["add"]) == {c.k8s_name for c in capabilities()}
    assert len(context["capabilities"]["add"]) == len(capabilities())
    for init in pod.get("initContainers", []):
        init_context = init["securityContext"]
        assert init_context["capabilities"] == {"drop": ["ALL"]}, init["name"]
        assert init_context["privileged"] is False and init_context["allowPrivilegeEscalation"] is False


def test_daemonset_mounts(daemonset: dict[str, Any]) -> None:
    pod = daemonset["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounted: set[str] = set()
    for container in pod["containers"] + pod.get("initContainers", []):
        for mount in container.get("volumeMounts", []):
            assert mount["name"] in volumes, f"{container['name']}: mount of undefined volume {mount['name']}"
            mounted.add(mount["name"])
    assert mounted == set(volumes), f"volumes never mounted: {set(volumes) - mounted}"

    mounts = {m["mountPath"]: m for m in agent_container(daemonset)["volumeMounts"]}
    host_paths = {name: v["hostPath"]["path"] for name, v in volumes.items() if "hostPath" in v}
    # path in the container -> (host path, read-only)
    expected = {
        "/sys/kernel/tracing": ("/sys/kernel/tracing", True),
        "/lib/modules": ("/lib/modules", True),
        "/usr/src": ("/usr/src", True),
        "/dev/shm": ("/dev/shm", False),
        "/run/moescope": ("/run/moescope", False),
        "/var/lib/moescope": ("/var/lib/moescope", False),
    }
    for path, (host_path, read_only) in expected.items():
        assert path in mounts, f"agent does not mount {path}"
        assert host_paths[mounts[path]["name"]] == host_path
        assert bool(mounts[path].get("readOnly", False)) is read_only, path


def test_daemonset_command_env_and_resources(daemonset: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    container = agent_container(daemonset)
    assert container["command"] == ["agent"]
    assert_start_command(container["args"], capsys, port=8000)

    env = {e["name"]: e.get("value", "") for e in container["env"]}
    config = resolve_export_config(ExportFlags(), env)
    assert config.otlp is not None and config.otlp.protocol == "grpc"
    service = k8s_object("Service", "otel-gateway")
    host_port = config.otlp.endpoint.removeprefix("http://")
    assert host_port == f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc:4317"
    assert 4317 in [p["port"] for p in service["spec"]["ports"]]

    resources = container["resources"]
    assert k8s_cores(resources["requests"]["cpu"]) == CPU_BAR_CORES
    assert k8s_bytes(resources["requests"]["memory"]) == RSS_BAR_BYTES
    assert k8s_cores(resources["limits"]["cpu"]) > CPU_BAR_CORES
    assert k8s_bytes(resources["limits"]["memory"]) > RSS_BAR_BYTES
    # the same ceilings as the systemd unit's
    unit = unit_entries(UNIT_FILE.read_text())
    assert k8s_bytes(resources["limits"]["memory"]) == systemd_bytes(unit_value(unit, "Service", "MemoryMax") or "0")
    quota = unit_value(unit, "Service", "CPUQuota") or "0%"
    assert k8s_cores(resources["limits"]["cpu"]) == int(quota.rstrip("%")) / 100


def test_daemonset_scheduling_and_metrics(daemonset: dict[str, Any]) -> None:
    template = daemonset["spec"]["template"]
    pod = template["spec"]
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    assert any(t["key"] == "nvidia.com/gpu" and t["effect"] == "NoSchedule" for t in pod["tolerations"])
    assert pod["nodeSelector"]
    k8s_object("ServiceAccount", pod["serviceAccountName"])

    ports = {p["name"]: p["containerPort"] for p in agent_container(daemonset)["ports"]}
    assert ports["metrics"] == DEFAULT_METRICS_PORT
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == DEFAULT_METRICS_PORT
    metrics_service = k8s_object("Service", "moescope-agent-metrics")
    assert metrics_service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    assert metrics_service["spec"]["ports"][0]["targetPort"] == "metrics"


def test_daemonset_installs_the_nvtx_library_that_nvtx_env_names(daemonset: dict[str, Any]) -> None:
    pod = daemonset["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["image"] == agent_container(daemonset)["image"]
    script = " ".join(init["command"])
    assert "agent nvtx-env" in script
    assert f"/host-lib/{LIBRARY_NAME}" in script
    # the line the script parses is the one `agent nvtx-env` prints
    proc = subprocess.run([str(AGENT_BIN), "nvtx-env"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(rf"NVTX_INJECTION64_PATH=/\S+/{re.escape(LIBRARY_NAME)}\n", proc.stdout)
    host_lib = next(v for v in pod["volumes"] if v["name"] == "nvtx-lib")["hostPath"]["path"]
    assert host_lib in DEPLOYMENT_DOC.read_text(), "docs/deployment.md tells serving pods where the library is"


def test_configmaps_are_generated_from_the_checked_files(daemonset: dict[str, Any]) -> None:
    kustomization = yaml.safe_load(KUSTOMIZATION.read_text())
    assert kustomization["generatorOptions"]["disableNameSuffixHash"] is True
    generated = {g["name"]: dict(f.split("=", 1) for f in g["files"]) for g in kustomization["configMapGenerator"]}

    policy_volume = next(v for v in daemonset["spec"]["template"]["spec"]["volumes"] if v["name"] == "policy")
    policy_files = generated[policy_volume["configMap"]["name"]]
    policy = load_policy(DEPLOY / policy_files["policy.toml"])  # the agent's own loader
    defaults = load_policy(None)
    assert policy.rules != defaults.rules  # the example overrides something
    tomllib.loads((DEPLOY / policy_files["policy.toml"]).read_text())

    gateway = k8s_object("Deployment", "otel-gateway")
    pod = gateway["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    config_volume = next(v for v in pod["volumes"] if v["name"] == "config")
    files = generated[config_volume["configMap"]["name"]]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    (config_arg,) = [a for a in container["args"] if a.startswith("--config=")]
    key = Path(config_arg.removeprefix("--config=")).relative_to(mount["mountPath"])
    assert DEPLOY / files[str(key)] == GATEWAY_CONFIG


# --- the collector gateway ----------------------------------------------------------------------


def test_gateway_pipeline_otlp_in_jaeger_out() -> None:
    (config,) = yaml_documents(GATEWAY_CONFIG)
    protocols = config["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"].endswith(":4317")
    assert protocols["http"]["endpoint"].endswith(":4318")

    pipeline = config["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"]
    # memory_limiter first: refuse data before the gateway is OOM-killed
    assert pipeline["processors"] == ["memory_limiter", "batch"]
    (exporter,) = pipeline["exporters"]
    assert exporter.split("/")[0] == "otlp"
    settings = config["exporters"][exporter]
    assert settings["endpoint"] == "jaeger:4317"
    assert settings["tls"]["insecure"] is True

    # every component a pipeline names is defined, and every defined one is used
    for section in ("receivers", "processors", "exporters"):
        used = {name for p in config["service"]["pipelines"].values() for name in p.get(section, [])}
        assert used == set(config[section]), section
    for name in config["service"].get("extensions", []):
        assert name in config.get("extensions", {})

    limiter = config["processors"]["memory_limiter"]
    gateway = k8s_object("Deployment", "otel-gateway")
    limit_bytes = k8s_bytes(gateway["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"])
    assert limiter["limit_mib"] * 1024**2 < limit_bytes
    ports = {p["containerPort"] for p in gateway["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert ports == {4317, 4318}


def test_deployment_doc_covers_each_file() -> None:
    text = DEPLOYMENT_DOC.read_text()
    for path in (UNIT_FILE, ENV_EXAMPLE, GATEWAY_CONFIG, KUSTOMIZATION, K8S / "daemonset.yaml"):
        assert str(path.relative_to(REPO)) in text, f"docs/deployment.md does not mention {path.relative_to(REPO)}"
    assert "NVTX_INJECTION64_PATH" in text and "agent nvtx-env" in text
