"""Issue 42, acceptance 9 (pins): every install in deploy/README.md's shell names its version:
`helm install|upgrade` a `--version X.Y.Z`, `kubectl apply|create -f <url>` a URL with a release
tag, `kubectl apply -k <url>` a `?ref=` that is a release (directly or through a variable every
assignment of which is one). An unpinned install runs whatever is newest the day it is typed,
while the code relies on one release's behaviour (Volcano 1.15's job policies, KFP's IR)."""

from __future__ import annotations

import re

import pytest

from tests import guide

RELEASE = re.compile(r"v?\d+\.\d+\.\d+")
URL_RELEASE = re.compile(r"/v?\d+\.\d+\.\d+/|[?&]ref=(\S+)")


def _option(words: list[str], *names: str) -> list[str]:
    """The values of `--name value` and `--name=value` options."""
    found = []
    for i, word in enumerate(words):
        for name in names:
            if word == name and i + 1 < len(words):
                found.append(words[i + 1])
            elif word.startswith(f"{name}="):
                found.append(word.partition("=")[2])
    return found


def _pinned_ref(ref: str, text: str | None) -> bool:
    if ref.startswith("$"):
        values = guide.assignments(ref.strip("${}"), text)
        return bool(values) and all(RELEASE.fullmatch(v) for v in values)
    return bool(RELEASE.fullmatch(ref))


def unpinned(text: str | None = None) -> list[str]:
    """The install commands of the guide's (or `text`'s) bash blocks that name no release."""
    out = []
    for words in guide.commands(text):
        line = " ".join(words)
        if words[:1] == ["helm"] and len(words) > 1 and words[1] in ("install", "upgrade"):
            versions = _option(words, "--version")
            if not versions or not all(RELEASE.fullmatch(v) for v in versions):
                out.append(line)
        elif words[:1] == ["kubectl"] and len(words) > 1 and words[1] in ("apply", "create", "replace"):
            for url in _option(words, "-f", "--filename", "-k", "--kustomize"):
                if not re.match(r"https?://|github\.com/", url):
                    continue  # a file of this repository or stdin
                match = URL_RELEASE.search(url)
                if not match or match.group(1) is not None and not _pinned_ref(match.group(1), text):
                    out.append(line)
    return out


def test_every_install_in_the_guide_names_its_release():
    installs = [w for w in guide.commands() if w[:2] in (["helm", "install"], ["helm", "upgrade"]) or "-k" in w[:3]]
    assert len(installs) >= 5, installs  # gpu-operator, volcano, minio, KFP's two kustomizations
    assert unpinned() == []


def test_the_guide_installs_the_volcano_release_the_code_was_checked_against():
    """components/k8s.py's job policies and events are Volcano 1.15's."""
    (volcano,) = [w for w in guide.commands() if w[:2] == ["helm", "install"] and "volcano-sh/volcano" in w]
    assert _option(volcano, "--version") == ["1.15.1"]


@pytest.mark.parametrize(
    "shell",
    [
        "helm install volcano volcano-sh/volcano -n volcano-system",
        "helm upgrade --install x repo/x --version 1.x",
        "helm repo update && helm install --wait x repo/x \\\n    --set a=b",
        "kubectl apply -f https://raw.githubusercontent.com/volcano-sh/volcano/master/installer/volcano-development.yaml",
        "kubectl apply -k 'github.com/kubeflow/pipelines/manifests/kustomize/env/platform-agnostic?ref=master'",
        "export V=2.14.0\n# export V=latest\nkubectl apply -k github.com/kubeflow/pipelines/x?ref=$V",
        "kubectl apply -k github.com/kubeflow/pipelines/x?ref=$UNSET",
    ],
)
def test_an_unpinned_install_is_found(shell):
    assert unpinned(f"```bash\n{shell}\n```\n"), shell


@pytest.mark.parametrize(
    "shell",
    [
        "helm install volcano volcano-sh/volcano --version 1.15.1 -n volcano-system",
        "helm upgrade --install x repo/x --version=v25.3.4",
        "kubectl apply -f https://github.com/cert-manager/cert-manager/releases/download/v1.15.0/cert-manager.yaml",
        "export V=2.14.0\n# export V=2.16.1\nkubectl apply -k github.com/kubeflow/pipelines/x?ref=$V",
        "kubectl apply -f deploy/rbac.yaml && helm repo add a https://a.example",
    ],
)
def test_a_pinned_install_passes(shell):
    assert unpinned(f"```bash\n{shell}\n```\n") == [], shell
