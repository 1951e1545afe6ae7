"""The stage image as a pod runs it (findings 1 and 11 of issue 12): a non-root user in a
writable home that the relative config paths land in, the git commit it was built from in
its tag and in every manifest's code version, and a pull policy that makes driver and
workers run one code."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "images" / "Dockerfile"


def _instructions(text: str) -> list[tuple[str, str]]:
    """The final stage's (INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    joined, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):  # a comment inside a continued instruction
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    parsed = [(ins.upper(), args.strip()) for ins, _, args in (line.strip().partition(" ") for line in joined)]
    last_from = max(i for i, (ins, _) in enumerate(parsed) if ins == "FROM")
    return parsed[last_from:]


def _env(args: str) -> dict[str, str]:
    """An ENV instruction's settings: `K=V K2=V2` or the legacy `K V`."""
    words = shlex.split(args)
    if "=" not in words[0]:
        return {words[0]: " ".join(words[1:])}
    return dict(w.split("=", 1) for w in words)


def _last(parsed: list[tuple[str, str]], instruction: str) -> tuple[int, str]:
    return max((i, args) for i, (ins, args) in enumerate(parsed) if ins == instruction)


USERADD_VALUES = {"-u": "uid", "--uid": "uid", "-d": "home", "--home-dir": "home", "-s": "", "--shell": "", "-g": ""}
USERADD_VALUES |= {"--gid": "", "-G": "", "--groups": ""}
SEPARATORS = ("&&", ";", "||")


def _command(words: list[str], name: str) -> list[str] | None:
    """The arguments of `name` in a RUN's shell words, up to the next separator."""
    if name not in words:
        return None
    rest = words[words.index(name) + 1 :]
    return rest[: next((i for i, w in enumerate(rest) if w in SEPARATORS), len(rest))]


def _useradd(words: list[str]) -> tuple[str, str, str] | None:
    """(uid, login, home) of a `useradd` that creates the home, else None."""
    args = _command(words, "useradd")
    if args is None or not {"--create-home", "-m"} & set(args):
        return None
    opts, login, i = {}, None, 0
    while i < len(args):
        if args[i] in USERADD_VALUES:
            opts[USERADD_VALUES[args[i]]] = args[i + 1]
            i += 1
        elif not args[i].startswith("-"):
            login = args[i]
        i += 1
    return opts.get("uid", ""), login, opts.get("home", f"/home/{login}")


def _chowned(words: list[str]) -> tuple[str, list[str]] | None:
    """(owner, paths) of a `chown` in a RUN, else None."""
    args = [a for a in _command(words, "chown") or [] if not a.startswith("-")]
    return (args[0].split(":")[0], args[1:]) if len(args) > 1 else None


def test_the_image_runs_as_uid_1000_in_a_home_it_can_write():
    """Finding 1: pods run as uid 1000; the work directory (where relative store.cache_dir
    and train.run_dir land) is that user's HOME, which useradd creates before WORKDIR names it
    (a WORKDIR first would create it root-owned, and useradd leaves it so) or a chown gives it."""
    parsed = _instructions(DOCKERFILE.read_text())
    runs = [(i, shlex.split(args)) for i, (ins, args) in enumerate(parsed) if ins == "RUN"]
    users = {login: (i, uid, home) for i, words in runs if (u := _useradd(words)) for uid, login, home in [u]}
    _, user = _last(parsed, "USER")
    user = user.split(":")[0]
    uid = user if user.isdigit() else users.get(user, (None, None))[1]
    assert uid == "1000", f"USER {user} is uid {uid}, not 1000"
    env = {}
    for ins, args in parsed:
        if ins == "ENV":
            env.update(_env(args))
    _, workdir = _last(parsed, "WORKDIR")
    assert env.get("HOME") == workdir, (env.get("HOME"), workdir)
    first_workdir = min(i for i, (ins, args) in enumerate(parsed) if ins == "WORKDIR" and args == workdir)
    created = [i for i, u, home in users.values() if home == workdir and u == uid]
    chowned = [i for i, words in runs if (c := _chowned(words)) and c[0] in (uid, user) and workdir in c[1]]
    assert (created and min(created) < first_workdir) or chowned, f"{workdir} is not created writable by uid {uid}"


def test_the_image_takes_its_code_version_from_the_git_commit_build_arg():
    """Finding 11: `ARG GIT_COMMIT` in the final stage, before the ENV that reads it into
    LIFTOFF_CODE_VERSION (an ARG declared later, or in another stage, expands to nothing)."""
    parsed = _instructions(DOCKERFILE.read_text())
    args = [i for i, (ins, a) in enumerate(parsed) if ins == "ARG" and a.split("=")[0] == "GIT_COMMIT"]
    env = [(i, _env(a)) for i, (ins, a) in enumerate(parsed) if ins == "ENV"]
    sets = [i for i, e in env if e.get("LIFTOFF_CODE_VERSION") in ("$GIT_COMMIT", "${GIT_COMMIT}")]
    assert args and sets, "LIFTOFF_CODE_VERSION is not set from ARG GIT_COMMIT in the final stage"
    assert min(args) < max(sets)


def test_make_images_passes_the_commit_and_tags_the_image_with_it(tmp_path):
    """Finding 11: the docker build `make images` runs gets GIT_COMMIT=<HEAD> and a tag that
    names the commit (run with a recording `docker`, the shell substitutions evaluated)."""
    assert shutil.which("make") and (ROOT / ".git").exists(), "make test runs from a git checkout, with make"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    image = "registry.example.com/liftoff"
    dry = subprocess.run(
        ["make", "-s", "-n", "images", f"IMAGE={image}"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    build = next(c for c in dry.stdout.replace("\\\n", " ").splitlines() if c.lstrip().startswith("docker build"))
    argv_file = tmp_path / "argv"
    docker = tmp_path / "bin" / "docker"
    docker.parent.mkdir()
    docker.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {argv_file}\n")
    docker.chmod(0o755)
    subprocess.run(["bash", "-c", build], cwd=ROOT, check=True, env={"PATH": f"{docker.parent}:/usr/bin:/bin"})
    argv = argv_file.read_text().splitlines()
    build_args = [argv[i + 1] for i, a in enumerate(argv) if a == "--build-arg"]
    assert f"GIT_COMMIT={head.strip()}" in build_args, argv
    tag = argv[argv.index("-t") + 1]
    name, _, version = tag.rpartition(":")
    assert name == image and len(version) >= 7 and head.startswith(version), tag


def test_default_paths_are_relative_so_they_land_in_the_writable_home():
    """Finding 1: relative paths resolve against the pod's working directory, the home."""
    from components.config import compose

    for path in sorted((ROOT / "conf" / "store").glob("*.yaml")):
        cache_dir = yaml.safe_load(path.read_text())["cache_dir"]
        assert not Path(cache_dir).is_absolute(), f"{path.name}: cache_dir {cache_dir}"
    assert not Path(yaml.safe_load((ROOT / "conf" / "train" / "default.yaml").read_text())["run_dir"]).is_absolute()
    cfg = compose(["cluster=kubernetes", "store=minio"])
    assert not Path(cfg.store.cache_dir).is_absolute() and not Path(cfg.train.run_dir).is_absolute()


def test_code_version_is_the_images_and_every_manifest_records_it(tmp_path, monkeypatch):
    """Finding 11: in an image $LIFTOFF_CODE_VERSION (the build's GIT_COMMIT) is the code
    version, and a published artifact's manifest says so."""
    from components.store import MANIFEST, code_version, open_store
    from tests.conftest import store_config

    commit = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("LIFTOFF_CODE_VERSION", commit)
    assert code_version() == commit
    (tmp_path / "artifact.txt").write_text("weights\n")
    open_store(store_config("local", tmp_path)).publish("model", "tiny", "v1", tmp_path / "artifact.txt")
    (manifest,) = (tmp_path / "store").rglob(MANIFEST)
    assert json.loads(manifest.read_text())["code_version"] == commit


def test_kfp_pods_pull_the_mutable_default_tag_always(tmp_path, monkeypatch):
    """Finding 11: with cluster=kubernetes' defaults (a mutable `:latest`), every KFP task
    pulls the image (IfNotPresent would let driver and replicas run different code)."""
    from pipelines.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["compile", "cluster=kubernetes"]) == 0
    pipeline, platform = yaml.safe_load_all((tmp_path / "build" / "pretrain.yaml").read_text())
    images = {c["container"]["image"] for c in pipeline["deploymentSpec"]["executors"].values()}
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert set(executors) == set(pipeline["deploymentSpec"]["executors"])
    assert {e.get("imagePullPolicy") for e in executors.values()} == {"Always"}, images


# What the image must carry for a GPU run, and why (the package each comes from, Debian bookworm):
#   cc (gcc): Triton builds its CUDA launcher stub with the C compiler it finds as $CC, `cc`,
#     `gcc` or `clang` at run time (triton/runtime/build.py); without one torch.compile fails
#     on the first compiled step ("Failed to find C compiler");
#   g++: inductor's CPU backend compiles the C++ it generates (the CPU image, CPU fallbacks);
#   libibverbs1 + ibverbs-providers (rdma-core): NCCL's IB/RoCE transport dlopens libibverbs and
#     a provider for the NIC (mlx5); without them NCCL falls back to TCP sockets, silently.
NEEDED_PACKAGES = {"gcc", "g++", "libc6-dev", "rdma-core", "ibverbs-providers", "libibverbs1"}


def _apt_installed(parsed: list[tuple[str, str]]) -> tuple[set[str], int | None]:
    """The packages the final stage's `apt-get install` lines name, and where the first one is."""
    found, first = set(), None
    for i, (ins, args) in enumerate(parsed):
        if ins != "RUN":
            continue
        words = shlex.split(args)
        for at in (j for j, w in enumerate(words) if w == "apt-get" and words[j + 1 : j + 2] == ["install"]):
            rest = words[at + 2 :]
            rest = rest[: next((k for k, w in enumerate(rest) if w in SEPARATORS), len(rest))]
            found |= {w for w in rest if not w.startswith("-")}
            first = i if first is None else first
    return found, first


def test_the_image_has_a_c_compiler_on_path_and_the_rdma_verbs_libraries():
    """Issue 22, point 4: the compiler Triton and inductor call at run time and the verbs
    libraries NCCL's RDMA transport loads are installed in the final stage, as root (before
    USER), with PATH still reaching /usr/bin where gcc installs `cc`."""
    parsed = _instructions(DOCKERFILE.read_text())
    installed, at = _apt_installed(parsed)
    assert NEEDED_PACKAGES <= installed, f"not installed: {sorted(NEEDED_PACKAGES - installed)}"
    first_user = min(i for i, (ins, _) in enumerate(parsed) if ins == "USER")
    assert at is not None and at < first_user, "apt-get install must run before USER drops root"
    for ins, args in parsed:
        if ins == "ENV" and "PATH" in _env(args):
            assert "/usr/bin" in _env(args)["PATH"].split(":"), "PATH no longer reaches /usr/bin/cc"
    runs = " ".join(args for ins, args in parsed if ins == "RUN")
    assert "rm -rf /var/lib/apt/lists" in runs  # the package index is not shipped in the image


def test_inductor_compiles_with_the_compiler_the_image_installs(tmp_path):
    """torch.compile's CPU backend compiles C++ with g++, the package the image installs:
    here, on this machine's g++ (the same Debian package), a compiled function runs and agrees
    with eager; with no compiler on PATH the same call fails, so the package is what makes it work."""
    import os
    import sys

    code = (
        "import torch\n"
        "f = torch.compile(lambda x: torch.sin(x) * 2 + 1, backend='inductor')\n"
        "x = torch.arange(16.0)\n"
        "assert torch.allclose(f(x), torch.sin(x) * 2 + 1)\n"
        "print('compiled')\n"
    )
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    assert shutil.which("g++"), "this machine lacks g++ (make test installs it: see the Makefile)"
    ok = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "compiled" in ok.stdout, ok.stderr[-2000:]
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python").symlink_to(sys.executable)
    env_bare = {**env, "PATH": str(bare), "CXX": "", "CC": "", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache2")}
    fails = subprocess.run([sys.executable, "-c", code], env=env_bare, capture_output=True, text=True, timeout=300)
    assert fails.returncode != 0, "compiled without any compiler on PATH: the test proves nothing"
