"""Readers for the deployment files under deploy/, shared by the tests in this folder.

deploy/capabilities.txt is the single source of the capability set; the systemd unit, the
DaemonSet and docs/security.md are each compared with it.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CAPABILITIES_FILE = DEPLOY / "capabilities.txt"
UNIT_FILE = DEPLOY / "systemd" / "moescope-agent.service"
ENV_EXAMPLE = DEPLOY / "systemd" / "agent.env.example"
K8S = DEPLOY / "kubernetes"
GATEWAY_CONFIG = DEPLOY / "otel-collector" / "gateway.yaml"
KUSTOMIZATION = DEPLOY / "kustomization.yaml"
SECURITY_DOC = REPO / "docs" / "security.md"
DEPLOYMENT_DOC = REPO / "docs" / "deployment.md"


@dataclass(frozen=True, slots=True)
class Capability:
    name: str  # CAP_BPF
    why: str

    @property
    def k8s_name(self) -> str:
        """Kubernetes spells them without the prefix: BPF."""
        return self.name.removeprefix("CAP_")

    @property
    def setpriv_name(self) -> str:
        return self.name.removeprefix("CAP_").lower()


def capabilities() -> list[Capability]:
    caps: list[Capability] = []
    for line in CAPABILITIES_FILE.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, _, why = line.strip().partition(" ")
        caps.append(Capability(name=name, why=why.strip()))
    return caps


def capability_names() -> set[str]:
    return {c.name for c in capabilities()}


# --- systemd ------------------------------------------------------------------------------------


def unit_entries(text: str) -> dict[str, list[tuple[str, str]]]:
    """systemd unit text -> {section: [(key, value), ...]} in order; keys may repeat."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        assert current is not None, f"key outside a section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not KEY=VALUE: {line!r}"
        current.append((key.strip(), value.strip()))
    return sections


def unit_value(sections: dict[str, list[tuple[str, str]]], section: str, key: str) -> str | None:
    """The effective value (the last assignment), or None when the key is absent."""
    values = [v for k, v in sections.get(section, []) if k == key]
    return values[-1] if values else None


def env_file(text: str) -> dict[str, str]:
    """A systemd EnvironmentFile: KEY=VALUE lines, '#' comments, no shell."""
    env: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not KEY=VALUE: {line!r}"
        env[key.strip()] = value.strip()
    return env


def exec_start_argv(exec_start: str, env: dict[str, str]) -> list[str]:
    """ExecStart split as systemd does: `$VAR` becomes the variable's words (none when empty)."""
    argv: list[str] = []
    for word in shlex.split(exec_start):
        match = re.fullmatch(r"\$(\w+)", word)
        if match:
            argv.extend(env.get(match.group(1), "").split())
        else:
            argv.append(word)
    return argv


# --- sizes: systemd and Kubernetes spellings to bytes / cores -----------------------------------

_SYSTEMD_UNITS = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_K8S_UNITS = {
    "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4,
    "k": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
}


def systemd_bytes(text: str) -> int:
    """systemd sizes are base 1024: 256M is 256 MiB (systemd.resource-control(5))."""
    if text[-1] in _SYSTEMD_UNITS:
        return int(float(text[:-1]) * _SYSTEMD_UNITS[text[-1]])
    return int(text)


def k8s_bytes(value: str | int) -> int:
    text = str(value)
    for suffix in sorted(_K8S_UNITS, key=len, reverse=True):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * _K8S_UNITS[suffix])
    return int(text)


def k8s_cores(value: str | int | float) -> float:
    text = str(value)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


# --- YAML ---------------------------------------------------------------------------------------


def yaml_documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def k8s_objects() -> list[dict[str, Any]]:
    """Every object the kustomization applies (its resources, not the generated ConfigMaps)."""
    kustomization = yaml.safe_load(KUSTOMIZATION.read_text())
    objects: list[dict[str, Any]] = []
    for resource in kustomization["resources"]:
        objects.extend(yaml_documents(DEPLOY / resource))
    return objects


def k8s_object(kind: str, name: str) -> dict[str, Any]:
    found = [o for o in k8s_objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]
