"""infra/: the cluster files parse, their scripts are valid, and they cannot drift from the CLI.

Fast checks read the files: YAML parses, Kubernetes objects are complete and consistent with
each other (and with the object-storage component rendered onto them), scripts pass
``bash -n`` and are executable, every ``bertpipe <command>`` they run
exists and every option they pass is accepted by the real parser, images pin the versions the
project is tested with. The ``integration`` tests run the scripts: bertpipe-supervise under
DeepSpeed's real launcher (a SIGTERM reaches the training processes, not the launcher), and
pretrain.sbatch against stand-ins for ``srun``/``scontrol``/``deepspeed`` (plan gate, per-node
launch arguments, the time-limit notice -> checkpoint -> requeue path).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from bertpipe.app.cli import COMMANDS, build_parser
from tests.conftest import sqlite_uri

ROOT = Path(__file__).resolve().parent.parent
INFRA = ROOT / "infra"
K8S = INFRA / "k8s"
OBJECT_STORAGE = K8S / "object-storage"  # the kustomize Component: everything on S3, no PVC
BIN = INFRA / "bin"
VENV_BIN = Path(sys.executable).parent


def _infra_files() -> list[Path]:
    return sorted(
        p
        for p in INFRA.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.name != ".gitignore"
    )


def _is_shell_script(path: Path) -> bool:
    with path.open("rb") as f:
        first = f.readline()
    return first.startswith(b"#!") and (b"bash" in first or first.rstrip().endswith(b"/sh"))


def _yaml_files() -> list[Path]:
    return [p for p in _infra_files() if p.suffix in (".yaml", ".yml")]


def _load_all(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _kustomizations() -> list[Path]:
    return sorted(K8S.rglob("kustomization.yaml"))


def _generator_files(kustomization: dict[str, Any]) -> list[str]:
    out = []
    for gen in kustomization.get("configMapGenerator", []) + kustomization.get(
        "secretGenerator", []
    ):
        for item in gen.get("files", []):
            out.append(item.split("=", 1)[-1])
    return out


def _patch_files(kustomization: dict[str, Any]) -> list[str]:
    return [p["path"] for p in kustomization.get("patches", []) if "path" in p]


def _k8s_objects() -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for kust_path in _kustomizations():
        kust = yaml.safe_load(kust_path.read_text())
        for resource in kust.get("resources", []):
            path = kust_path.parent / resource
            out += [(path, doc) for doc in _load_all(path)]
    return out


def _object(kind: str, name: str) -> dict[str, Any]:
    for _, doc in _k8s_objects():
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind} {name} in infra/k8s")


# --------------------------------------------------------------------------- YAML, Kubernetes


def test_every_yaml_file_parses() -> None:
    files = _yaml_files()
    assert len(files) >= 8, files
    for path in files:
        docs = _load_all(path)
        assert docs, f"{path} holds no YAML document"


def test_kustomizations_list_existing_files_and_cover_every_manifest() -> None:
    referenced = set()
    assert _kustomizations(), "no kustomization.yaml under infra/k8s"
    for kust_path in _kustomizations():
        kust = yaml.safe_load(kust_path.read_text())
        assert kust["kind"] in ("Kustomization", "Component"), kust_path
        referenced.add(kust_path)
        for name in [*kust.get("resources", []), *_generator_files(kust), *_patch_files(kust)]:
            path = kust_path.parent / name
            assert path.is_file(), f"{kust_path} lists {name}, which does not exist"
            referenced.add(path)
    orphans = [p for p in K8S.rglob("*.yaml") if p not in referenced]
    assert not orphans, f"YAML under infra/k8s that no kustomization uses: {orphans}"


def test_k8s_objects_are_complete() -> None:
    objects = _k8s_objects()
    kinds = {doc["kind"] for _, doc in objects}
    assert {"Job", "Service", "PersistentVolumeClaim", "Deployment"} <= kinds, kinds
    for path, doc in objects:
        assert isinstance(doc, dict), path
        for key in ("apiVersion", "kind"):
            assert doc.get(key), f"{path}: object without {key}"
        assert doc.get("metadata", {}).get("name"), f"{path}: {doc['kind']} without metadata.name"


@pytest.mark.skipif(
    subprocess.run(["which", "kubectl"], capture_output=True).returncode != 0,
    reason="kubectl is not installed",
)
def test_kustomize_builds_offline() -> None:
    for kust_path in _kustomizations():
        if yaml.safe_load(kust_path.read_text())["kind"] == "Component":
            continue  # built with its base: test_object_storage_component_renders_...
        proc = subprocess.run(
            ["kubectl", "kustomize", str(kust_path.parent)], capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr
        kinds = [d["kind"] for d in yaml.safe_load_all(proc.stdout) if d]
        assert kinds, kust_path


def _job() -> dict[str, Any]:
    return _object("Job", "bertpipe-pretrain")


def _container_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_pretrain_job_is_consistent_with_its_service_and_world() -> None:
    job = _job()
    spec = job["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    env = _container_env(container)
    nodes, gpus = int(env["NUM_NODES"]), int(env["GPUS_PER_NODE"])
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == nodes
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == gpus
    service = _object("Service", env["SERVICE_NAME"])
    assert service["spec"]["clusterIP"] == "None"  # headless: per-pod DNS names
    assert pod["subdomain"] == env["SERVICE_NAME"]
    assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    assert int(env["MASTER_PORT"]) in {p["port"] for p in service["spec"]["ports"]}
    # preemption: SIGTERM -> checkpoint -> 143, which must be retried, not counted or fatal
    assert pod["restartPolicy"] == "Never"
    assert pod["terminationGracePeriodSeconds"] >= 300
    rules = spec["podFailurePolicy"]["rules"]
    ignored = [r for r in rules if r["action"] == "Ignore" and "onExitCodes" in r]
    assert any(143 in r["onExitCodes"]["values"] for r in ignored)
    assert any(r["onExitCodes"]["containerName"] == container["name"] for r in ignored)
    fatal = [r for r in rules if r["action"] == "FailJob"]
    assert all(143 not in r["onExitCodes"]["values"] for r in fatal)
    # the config volume is the generated ConfigMap
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    generated = {g["name"] for g in kust["configMapGenerator"]}
    config_volumes = [v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v]
    assert config_volumes and set(config_volumes) <= generated
    claims = [
        v["persistentVolumeClaim"]["claimName"]
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    ]
    pvc = _object("PersistentVolumeClaim", claims[0])
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]  # every node's pod mounts it
    # /dev/shm large enough for NCCL and the loader workers
    assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in pod["volumes"])


def test_k8s_config_runs_on_the_jobs_world_and_follows_the_shipped_recipe() -> None:
    from bertpipe.config import load_config, to_dict
    from bertpipe.training.pretrain.config import PretrainConfig

    env = _container_env(_job()["spec"]["template"]["spec"]["containers"][0])
    world = int(env["NUM_NODES"]) * int(env["GPUS_PER_NODE"])
    cfg = load_config(PretrainConfig, str(K8S / "config" / "pretrain.yaml"))
    cfg.check_world(world)  # raises ConfigError if the batch arithmetic does not fit
    assert cfg.checkpoint.dir is None or cfg.checkpoint.dir.startswith("/workspace")
    assert cfg.output.startswith("/workspace")  # on the shared volume
    recipe = ROOT / "configs" / "pretrain-bert-large-lamb.yaml"
    if not recipe.exists():
        pytest.skip("configs/pretrain-bert-large-lamb.yaml is not there")
    ours, theirs = to_dict(cfg), to_dict(load_config(PretrainConfig, str(recipe)))
    for d in (ours, theirs):
        d.pop("output")
        d.pop("tracking")
        for phase in d["phases"]:
            phase.pop("data")
    assert ours == theirs, (
        "infra/k8s/config/pretrain.yaml differs from configs/pretrain-bert-large-lamb.yaml "
        "beyond paths and tracking: update the Kubernetes copy"
    )


def test_k8s_args_hold_no_kubernetes_variable_references() -> None:
    """Kubernetes rewrites $(NAME) in command/args before the shell sees them."""
    for path, doc in _k8s_objects():
        spec = doc.get("spec", {})
        pod = spec.get("template", {}).get("spec", {})
        for container in pod.get("containers", []):
            for text in [*container.get("command", []), *container.get("args", [])]:
                found = re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", str(text))
                assert not found, f"{path}: $({found[0]}) would be expanded by Kubernetes"


# --------------------------------------------------------------------------- object storage

_CREDENTIAL = re.compile(r"SECRET|PASSWORD|TOKEN|ACCESS_KEY|CREDENTIALS", re.IGNORECASE)


def _render_with_object_storage(tmp_path: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize`` of infra/k8s with the object-storage component, included the way
    a site folder beside the checkout includes it (kustomize paths must be relative)."""
    site = tmp_path / "site"
    site.mkdir()
    kust = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(K8S, site)],
        "components": [os.path.relpath(OBJECT_STORAGE, site)],
    }
    (site / "kustomization.yaml").write_text(yaml.safe_dump(kust))
    proc = subprocess.run(["kubectl", "kustomize", str(site)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def test_object_storage_config_is_the_k8s_config_with_every_path_on_s3() -> None:
    from bertpipe.config import load_config, to_dict
    from bertpipe.training.pretrain.config import PretrainConfig

    env = _container_env(_job()["spec"]["template"]["spec"]["containers"][0])
    cfg = load_config(PretrainConfig, str(OBJECT_STORAGE / "config" / "pretrain.yaml"))
    cfg.check_world(int(env["NUM_NODES"]) * int(env["GPUS_PER_NODE"]))
    assert cfg.output.startswith("s3://")
    assert cfg.checkpoint.dir is None or cfg.checkpoint.dir.startswith("s3://")
    assert all(phase.data.startswith("s3://") for phase in cfg.phases)
    ours = to_dict(cfg)
    theirs = to_dict(load_config(PretrainConfig, str(K8S / "config" / "pretrain.yaml")))
    for d in (ours, theirs):
        d.pop("output")
        d["checkpoint"].pop("dir")
        for phase in d["phases"]:
            phase.pop("data")
    assert ours == theirs, (
        "infra/k8s/object-storage/config/pretrain.yaml differs from infra/k8s/config/"
        "pretrain.yaml beyond its paths: update the object-storage copy"
    )


def test_no_credentials_in_manifests_only_secret_references() -> None:
    """Keys and passwords come from Secrets (envFrom/secretKeyRef), never as literal values in
    a manifest, a patch or a generated ConfigMap."""
    checked = 0
    for path in K8S.rglob("*.yaml"):
        for doc in _load_all(path):
            if doc.get("kind") in ("Kustomization", "Component"):
                for gen in doc.get("configMapGenerator", []):
                    for literal in gen.get("literals", []):
                        key = literal.split("=", 1)[0]
                        assert not _CREDENTIAL.search(key), f"{path}: {key} in a ConfigMap"
                        checked += 1
                continue
            pod = doc.get("spec", {}).get("template", {}).get("spec", {})
            for c in pod.get("containers", []):
                for e in c.get("env", []):
                    if _CREDENTIAL.search(e["name"]):
                        assert "value" not in e, f"{path}: {e['name']} has a literal value"
                    checked += 1
    assert checked >= 15  # the scan does see the env lists and literals
    # the component requires the store's secret (a pod without it does not start)
    patch = yaml.safe_load((OBJECT_STORAGE / "job-patch.yaml").read_text())
    (container,) = patch["spec"]["template"]["spec"]["containers"]
    secrets = [r["secretRef"] for r in container["envFrom"] if "secretRef" in r]
    assert secrets == [{"name": "bertpipe-s3"}]
    # the MLflow server keeps nothing on a volume: runs in PostgreSQL, artifacts on S3
    pod = _object("Deployment", "bertpipe-mlflow")["spec"]["template"]["spec"]
    assert not [v for v in pod.get("volumes", []) if "persistentVolumeClaim" in v]
    assert {"secretRef": {"name": "bertpipe-mlflow"}} in pod["containers"][0]["envFrom"]


@pytest.mark.skipif(
    subprocess.run(["which", "kubectl"], capture_output=True).returncode != 0,
    reason="kubectl is not installed",
)
def test_object_storage_component_renders_a_job_without_a_shared_volume(tmp_path: Path) -> None:
    objects = _render_with_object_storage(tmp_path)
    assert "PersistentVolumeClaim" not in {d["kind"] for d in objects}
    (job,) = [d for d in objects if d["kind"] == "Job"]
    configmaps = {d["metadata"]["name"]: d for d in objects if d["kind"] == "ConfigMap"}
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert not [v for v in volumes.values() if "persistentVolumeClaim" in v]
    env = _container_env(container)
    # each pod stages its ranks' checkpoints on a local emptyDir of bounded, requested size
    staging = env["BERTPIPE_CHECKPOINT_LOCAL_DIR"]
    (mount,) = [
        m for m in container["volumeMounts"] if staging.startswith(m["mountPath"].rstrip("/") + "/")
    ]
    local = volumes[mount["name"]]["emptyDir"]
    assert local.get("medium") != "Memory" and local["sizeLimit"]
    assert container["resources"]["requests"]["ephemeral-storage"] == local["sizeLimit"]
    assert env["TORCH_EXTENSIONS_DIR"].startswith(mount["mountPath"])
    script = container["args"][0]
    assert '"checkpoint.local_dir=$BERTPIPE_CHECKPOINT_LOCAL_DIR"' in script
    assert 'pretrain --config "$CONFIG" "${STAGING_ARGS[@]}"' in script
    # credentials from the secret (required); endpoint and region from the generated ConfigMap
    refs = container["envFrom"]
    assert [r["secretRef"] for r in refs if "secretRef" in r] == [{"name": "bertpipe-s3"}]
    (store,) = [r["configMapRef"]["name"] for r in refs if "configMapRef" in r]
    assert "AWS_DEFAULT_REGION" in configmaps[store]["data"]
    # the mounted config is the object-storage one
    config = configmaps[volumes["config"]["configMap"]["name"]]["data"]["pretrain.yaml"]
    assert config == (OBJECT_STORAGE / "config" / "pretrain.yaml").read_text()
    # time after SIGTERM for the upload in flight and the final checkpoint's upload
    assert pod["terminationGracePeriodSeconds"] >= 600
    # everything else is the base Job: the same script, world, failure policy and MLflow login
    base = _job()
    (base_container,) = base["spec"]["template"]["spec"]["containers"]
    assert container["args"] == base_container["args"]
    assert job["spec"]["podFailurePolicy"] == base["spec"]["podFailurePolicy"]
    assert job["spec"]["completions"] == base["spec"]["completions"]
    assert _container_env(base_container)["BERTPIPE_CHECKPOINT_LOCAL_DIR"] == ""
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "NUM_NODES"):
        assert name in env


# --------------------------------------------------------------------------- shell


def _shell_scripts() -> list[Path]:
    return [p for p in _infra_files() if _is_shell_script(p)]


def test_shell_scripts_parse_and_are_executable() -> None:
    scripts = _shell_scripts()
    names = {p.name for p in scripts}
    assert {"pretrain.sbatch", "preprocess.sbatch", "bertpipe-supervise"} <= names, names
    for path in scripts:
        proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{path}: {proc.stderr}"
        assert os.access(path, os.X_OK), f"{path} is not executable (chmod +x)"


def _embedded_shell() -> Iterator[tuple[str, str, str]]:
    """(where, shell, script) for the shell scripts inside Kubernetes and compose YAML."""
    for path, doc in _k8s_objects():
        pod = doc.get("spec", {}).get("template", {}).get("spec", {})
        for c in pod.get("containers", []):
            command = [*c.get("command", []), *c.get("args", [])]
            if len(command) >= 3 and command[0].endswith("bash") and command[1] == "-c":
                yield f"{path}:{c['name']}", "bash", command[2]
    compose = yaml.safe_load((INFRA / "mlflow" / "docker-compose.yaml").read_text())
    for name, service in compose["services"].items():
        command = [*(service.get("entrypoint") or []), *(service.get("command") or [])]
        for i, part in enumerate(command[:-1]):
            if part == "-c":
                # compose turns $$ into $ before the container's shell sees it
                yield f"docker-compose.yaml:{name}", "sh", command[i + 1].replace("$$", "$")


def test_embedded_shell_scripts_parse() -> None:
    seen = list(_embedded_shell())
    assert len(seen) >= 3, seen
    for where, shell, script in seen:
        proc = subprocess.run([shell, "-n", "-c", script], capture_output=True, text=True)
        assert proc.returncode == 0, f"{where}: {proc.stderr}"


# --------------------------------------------------------------------------- the CLI


def _command_lines() -> Iterator[tuple[Path, str]]:
    """Lines of infra/ that are commands: code, examples in comments, README code blocks.

    Prose (a comment with one space after ``#``, README text) is left out, except inline
    `code`; examples in comments are indented (``#   bertpipe plan ...``). Backslash
    continuations are joined.
    """
    for path in _infra_files():
        if path.suffix not in ("", ".sh", ".sbatch", ".yaml", ".yml", ".md", ".example") and (
            not path.name.startswith("Dockerfile") or path.name.endswith(".dockerignore")
        ):
            continue
        text = path.read_text()
        lines: list[str] = []
        if path.suffix == ".md":
            in_block = False
            for line in text.splitlines():
                if line.lstrip().startswith("```"):
                    in_block = not in_block
                    continue
                if in_block:
                    lines.append(line)
                else:
                    lines += re.findall(r"`([^`]+)`", line)
        else:
            for line in text.splitlines():
                stripped = line.lstrip()
                if stripped.startswith("#"):
                    body = stripped.lstrip("#")
                    if body.startswith("  "):  # an indented example
                        lines.append(body)
                    else:
                        lines += re.findall(r"`([^`]+)`", body)
                else:
                    lines.append(line)
        joined: list[str] = []
        for line in lines:
            if joined and joined[-1].endswith("\\"):
                joined[-1] = joined[-1][:-1] + " " + line.strip()
            else:
                joined.append(line)
        for line in joined:
            yield path, line


_NAME = re.compile(r"(?<![\w.-])bertpipe(?:-preflight)?(?![\w.:/=-])")
# what may stand before a command: the line start, a shell operator, `exec`, `which`,
# `command -v`, `srun ...`, then optional VAR=value assignments
_COMMAND_POSITION = re.compile(
    r"(?:^|[;&|(`]|\bexec|\bwhich|\bcommand -v|\bsrun\b.*)\s*(?:\w+=\S*\s+)*$"
)


def _substitute(text: str) -> str:
    """Shell expansions -> a plain value ("1"); "$@"-style argument lists -> nothing."""
    text = re.sub(r"\"\$\{?[@*]\}?\"|\"\$\{\w+\[[@*]\]\}\"|\$[@*]", " ", text)
    out, i = [], 0
    while i < len(text):  # $( ... ) with nesting
        if text.startswith("$(", i):
            depth, j = 1, i + 2
            while j < len(text) and depth:
                depth += {"(": 1, ")": -1}.get(text[j], 0)
                j += 1
            out.append("1")
            i = j
        else:
            out.append(text[i])
            i += 1
    text = "".join(out)
    text = re.sub(r"\$\{[^}]*\}|\$\w+", "1", text)
    return text


def _split(text: str, where: str) -> list[str]:
    """shlex.split; a command inside `bash -c '...'` ends at the closing quote."""
    while True:
        try:
            return shlex.split(text)
        except ValueError as exc:
            if "'" not in text:
                raise AssertionError(f"{where}: cannot split: {exc}") from None
            text = text[: text.rindex("'")]


_BEAM_ARGS: list[tuple[Path, list[str]]] = []  # filled by _invocations


def _invocations() -> Iterator[tuple[Path, str, list[str]]]:
    """(file, program, arguments) of every bertpipe / bertpipe-preflight call in infra/."""
    for path, line in _command_lines():
        for match in _NAME.finditer(line):
            prefix = re.sub(r"\S*/$", "", line[: match.start()])  # .venv/bin/bertpipe
            if not _COMMAND_POSITION.search(prefix):
                continue
            rest = line[match.end() :].lstrip(')"')
            if rest and not rest[0].isspace():
                continue
            if line[: match.start()].rstrip().endswith("("):  # $(bertpipe ...)
                rest = rest.split(")")[0]
            rest = rest.split("`")[0]  # `bertpipe plan` in a comment
            # the command ends at a pipe, a list operator, a redirection or a comment
            rest = re.split(r"\s(?:\|\|?|&&|;|>|2>|#)\s?|;\s*$|\s&\s*$", rest)[0]
            rest, _, beam = rest.partition(" -- ")  # what follows `--` belongs to Beam
            _BEAM_ARGS.append((path, _split(_substitute(beam), f"{path}: {line!r}")))
            args = _split(_substitute(rest), f"{path}: {line!r}")
            # usage synopses: [optional] parts count, METAVARS stand for a value
            args = [a.removeprefix("[") for a in args]
            args = [a if "=" in a else a.rstrip("]") for a in args]
            args = [a for a in args if a not in ("", "...")]
            args = ["1" if re.fullmatch(r"[A-Z][A-Z0-9_]*", a) else a for a in args]
            yield path, match.group(0), args


def test_every_bertpipe_command_exists_and_takes_its_options() -> None:
    parser = build_parser()
    seen: dict[str, int] = {}
    for path, program, args in _invocations():
        if program == "bertpipe-preflight":
            args = ["plan", *args]  # bertpipe-preflight passes everything to `bertpipe plan`
        if not args or args[0].startswith("-"):
            continue  # `bertpipe --version`, `bertpipe` as an image name
        command = args[0]
        assert command in COMMANDS, (
            f"{path}: `bertpipe {command}` is not a bertpipe command ({', '.join(COMMANDS)})"
        )
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # `--help` prints and exits 0
                parser.parse_args(args)
        except SystemExit as exc:
            if exc.code:
                pytest.fail(f"{path}: `bertpipe {shlex.join(args)}` is rejected by the parser")
        seen[command] = seen.get(command, 0) + 1
    # the scripts and manifests do run these
    assert {"plan", "pretrain", "preprocess"} <= seen.keys(), seen
    assert seen["plan"] >= 4, seen


def test_plan_options_in_infra_are_real() -> None:
    """The options the cluster files give `bertpipe plan` exist with these spellings."""
    parser = build_parser()
    options = set()
    for _, program, args in _invocations():
        if program == "bertpipe-preflight" or args[:1] == ["plan"]:
            options |= {a.split("=")[0] for a in args if a.startswith("--")}
    assert {"--config", "--nodes", "--gpus-per-node", "--gpu"} <= options, options
    plan = parser._subparsers._group_actions[0].choices["plan"]  # type: ignore[union-attr]
    known = {s for action in plan._actions for s in action.option_strings}
    assert options <= known, options - known


def test_beam_options_in_infra_are_known_to_beam() -> None:
    """Every option given to Beam after `--` (scripts, sbatch, README) is a Beam option."""
    import argparse

    import apache_beam.runners.dask.dask_runner  # noqa: F401  (registers the Dask options)
    from apache_beam.options.pipeline_options import PipelineOptions

    _BEAM_ARGS.clear()
    for _ in _invocations():
        pass
    given = {
        (path, a.split("=")[0]) for path, args in _BEAM_ARGS for a in args if a.startswith("--")
    }
    assert {"--runner", "--dask_client_address", "--job_endpoint"} <= {o for _, o in given}
    todo, classes = [PipelineOptions], []
    while todo:
        cls = todo.pop()
        classes.append(cls)
        todo += cls.__subclasses__()
    known = set()
    for cls in classes:
        sub = argparse.ArgumentParser(conflict_handler="resolve")
        cls._add_argparse_args(sub)
        known |= {s for action in sub._actions for s in action.option_strings}
    unknown = sorted(f"{path.relative_to(ROOT)}: {o}" for path, o in given if o not in known)
    assert not unknown, unknown


# --------------------------------------------------------------------------- images


def _constraint(name: str) -> str:
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.lower().startswith(name.lower() + "=="):
            return line.split("==", 1)[1].strip()
    raise AssertionError(f"{name} is not pinned in constraints.txt")


def _arg(dockerfile: Path, name: str) -> str:
    match = re.search(rf"^ARG {name}=\"?([^\"\s]+)", dockerfile.read_text(), re.MULTILINE)
    assert match, f"{dockerfile} has no ARG {name}"
    return match.group(1)


def test_dockerfile_installs_cuda_torch_before_the_project_with_constraints() -> None:
    path = INFRA / "docker" / "Dockerfile"
    lines = path.read_text().splitlines()
    code = [(i, line) for i, line in enumerate(lines) if not line.lstrip().startswith("#")]
    torch_at = [i for i, line in code if "pip install" in line and "torch==" in line]
    project_at = [i for i, line in code if "pip install" in line and "constraints.txt" in line]
    project_at += [i for i, line in code if "--constraint constraints.txt" in line]
    assert torch_at, "no pinned `pip install torch==...` line"
    assert project_at, "the project is not installed with --constraint constraints.txt"
    assert max(torch_at) < min(project_at), "torch must be installed before the project"
    copies = [i for i, line in code if line.startswith("COPY") and "constraints.txt" in line]
    assert copies and copies[0] < min(project_at)
    assert any("--index-url" in line for _, line in code if "torch==" in line)
    assert re.search(r"^USER (?!root)\S+", path.read_text(), re.MULTILINE), "runs as root"
    assert re.search(r'^ENTRYPOINT \["bertpipe"\]', path.read_text(), re.MULTILINE)
    assert "TORCH_EXTENSIONS_DIR" in path.read_text()
    # the CUDA torch's version is the one the Makefile installs on CPU
    makefile = (ROOT / "Makefile").read_text()
    spec = re.search(r"^TORCH_SPEC \?= torch==(\S+)", makefile, re.MULTILINE)
    assert spec and _arg(path, "TORCH_VERSION") == spec.group(1)
    assert "devel" in _arg(path, "CUDA_IMAGE")  # nvcc for DeepSpeed's just-in-time ops
    # the project's extras, s3 among them (s3:// shards, checkpoints, exports), are real ones
    import tomllib

    extras = re.search(r'"\.\[([\w,]+)\]"', path.read_text())
    assert extras, "the image does not install the project with its extras"
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "s3" in extras.group(1).split(",")
    assert set(extras.group(1).split(",")) <= declared["optional-dependencies"].keys()


def test_images_pin_the_tested_versions() -> None:
    assert _arg(INFRA / "mlflow" / "Dockerfile", "MLFLOW_VERSION") == _constraint("mlflow")
    assert _arg(INFRA / "beam" / "Dockerfile.worker", "BEAM_VERSION") == _constraint("apache-beam")
    mlflow = _constraint("mlflow")
    compose = yaml.safe_load((INFRA / "mlflow" / "docker-compose.yaml").read_text())
    assert compose["services"]["mlflow"]["image"].endswith(":" + mlflow)
    deployment = _object("Deployment", "bertpipe-mlflow")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":" + mlflow)
    job_server = (INFRA / "beam" / "job-server.sh").read_text()
    assert f"BEAM_VERSION:-{_constraint('apache-beam')}" in job_server


def test_compose_has_healthchecks_and_volumes() -> None:
    compose = yaml.safe_load((INFRA / "mlflow" / "docker-compose.yaml").read_text())
    services = compose["services"]
    assert {"postgres", "minio", "mlflow"} <= services.keys()
    for name in ("postgres", "minio", "mlflow"):
        assert "healthcheck" in services[name], name
    command = " ".join(services["mlflow"]["command"])
    assert "--backend-store-uri" in command and "postgresql://" in command
    assert "--artifacts-destination" in command and "s3://" in command
    assert services["mlflow"]["environment"]["MLFLOW_S3_ENDPOINT_URL"]
    assert set(compose["volumes"]) >= {"postgres-data", "minio-data"}


def test_worker_image_installs_what_the_pipeline_imports() -> None:
    """The Beam worker image installs bertpipe without dependencies plus a short list; the
    modules the pipeline imports beyond Beam's own must be on it."""
    code = (
        "import sys, importlib.metadata as md\n"
        "import apache_beam, apache_beam.metrics, numpy, yaml\n"
        "before = {m.split('.')[0] for m in sys.modules}\n"
        "import bertpipe.preprocessing.pipeline, bertpipe.preprocessing.run\n"
        "dists = md.packages_distributions()\n"
        "new = {m.split('.')[0] for m in sys.modules} - before\n"
        "print(' '.join(sorted({d for m in new for d in dists.get(m, [])})))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    # what Beam itself requires is on Beam's SDK image (sortedcontainers, which Beam's worker
    # modules import once the runner's worker logging is set up)
    beam_requires = {
        re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0].lower().replace("_", "-")
        for r in importlib.metadata.requires("apache-beam") or []
        if "extra ==" not in r
    }
    needed = {d.lower() for d in proc.stdout.split()} - {"bertpipe"} - beam_requires
    dockerfile = (INFRA / "beam" / "Dockerfile.worker").read_text().lower()
    install = re.search(r"--constraint constraints.txt \\\s*\n(.*)\$\{extra_packages\}", dockerfile)
    assert install, "the worker image's dependency install line was not found"
    listed = set(install.group(1).split()) | {"gcsfs", "s3fs"}
    assert needed <= listed, f"the worker image lacks {needed - listed}"


# --------------------------------------------------------------------------- security


def _dockerfiles() -> list[Path]:
    return [
        p
        for p in _infra_files()
        if p.name.startswith("Dockerfile") and not p.name.endswith(".dockerignore")
    ]


def _resolve_defaults(text: str) -> str:
    """``${VAR:-default}`` / ``${VAR-default}`` -> default (what runs when nothing is set)."""
    previous = None
    while previous != text:
        previous = text
        text = re.sub(r"\$\{\w+:?-([^${}]*)\}", r"\1", text)
    return text


def _image_problem(ref: str) -> str | None:
    """Why an image reference is not pinned to a version, or None."""
    ref = ref.split("@", 1)[0]  # a digest pins on its own, but a tag must be there too
    name, _, tag = ref.rpartition(":")
    if not name or "/" in tag:  # no tag at all (a registry port is not a tag)
        return "no tag (means :latest)"
    if tag == "latest" or not re.search(r"\d+\.\d+|^RELEASE\.\d{4}-", tag):
        return f"tag {tag!r} is not a version (major.minor at least, or a dated release)"
    return None


def _images_in_infra() -> list[tuple[str, str]]:
    """(where, image) for every FROM, compose `image:`, k8s container image and kustomize
    image override under infra/, with ARG and ${VAR:-default} defaults filled in."""
    out = []
    for path in _dockerfiles():
        text = path.read_text()
        args = dict(re.findall(r"^ARG (\w+)=\"?([^\"\s]+)\"?", text, re.MULTILINE))
        for ref in re.findall(r"^FROM\s+(?:--\S+\s+)*(\S+)", text, re.MULTILINE):
            for name, value in args.items():
                ref = ref.replace("${" + name + "}", value).replace("$" + name, value)
            out.append((str(path.relative_to(ROOT)), ref))
    for path in _yaml_files():
        for doc in _load_all(path):
            if not isinstance(doc, dict):
                continue
            for name, service in (doc.get("services") or {}).items():
                if "image" in service:
                    out.append((f"{path.name}:{name}", _resolve_defaults(service["image"])))
            pod = doc.get("spec", {}).get("template", {}).get("spec", {}) if "kind" in doc else {}
            for c in [*pod.get("containers", []), *pod.get("initContainers", [])]:
                if "image" in c or "patch" not in path.name:  # a patch may leave the image be
                    out.append((f"{path.relative_to(ROOT)}:{c['name']}", c["image"]))
            for override in doc.get("images", []) if doc.get("kind") == "Kustomization" else []:
                name = override.get("newName", override["name"])
                out.append((f"{path.relative_to(ROOT)}:images", f"{name}:{override['newTag']}"))
    return out


def test_every_image_in_infra_is_pinned_to_a_version() -> None:
    images = _images_in_infra()
    where = {w.split(":")[0] for w, _ in images}
    assert len(images) >= 10 and len(where) >= 6, images  # the scan does see the files
    bad = [f"{w}: {ref} ({why})" for w, ref in images if (why := _image_problem(ref))]
    assert not bad, bad
    # the self-test of the check itself
    assert _image_problem("postgres") and _image_problem("minio/minio:latest")
    assert _image_problem("postgres:16") and not _image_problem("postgres:16.10")
    assert _image_problem("registry:5000/x") and not _image_problem("registry:5000/x:1.2")
    compose = (INFRA / "mlflow" / "docker-compose.yaml").read_text()
    assert not re.search(r"^[^#]*:latest\b", compose, re.MULTILINE)


def test_images_run_as_a_fixed_non_root_user() -> None:
    for path in (INFRA / "docker" / "Dockerfile", INFRA / "beam" / "Dockerfile.worker"):
        users = re.findall(r"^USER\s+(\S+)", path.read_text(), re.MULTILINE)
        assert users, f"{path} runs as root (no USER)"
        user = users[-1].split(":")[0]
        assert user not in ("root", "0"), f"{path} ends as root"
    # the Beam worker: a numeric uid, and the SDK harness can still write what it needs
    worker = (INFRA / "beam" / "Dockerfile.worker").read_text()
    (user,) = re.findall(r"^USER\s+(\S+)", worker, re.MULTILINE)
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) > 0
    assert re.search(rf"useradd\b.*--uid {uid}\b", worker)
    assert re.search(r"chown \S+ /opt/apache/beam-venv", worker), "boot's venv folder"
    assert re.search(r"^ENV HOME=/home/\w+", worker, re.MULTILINE)
    assert "semi_persist" in worker  # the comment on what the runner's folder needs
    assert not re.search(r"^ENTRYPOINT", worker, re.MULTILINE), "boot must stay the entrypoint"
    assert not re.search(r"^ENV RUN_PYTHON_SDK_IN_DEFAULT_ENVIRONMENT", worker, re.MULTILINE)
    mlflow = (INFRA / "mlflow" / "Dockerfile").read_text()
    assert re.findall(r"^USER\s+(\S+)", mlflow, re.MULTILINE)[-1].split(":")[0] not in ("0", "root")


def test_compose_publishes_ports_on_localhost_only() -> None:
    compose = yaml.safe_load((INFRA / "mlflow" / "docker-compose.yaml").read_text())
    published = []
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            spec = _resolve_defaults(port if isinstance(port, str) else str(port.get("host_ip")))
            published.append((name, spec))
            assert spec.startswith("127.0.0.1:"), f"{name} publishes {spec} on every interface"
    assert ("mlflow", "127.0.0.1:5000:5000") in published
    assert not compose["services"]["postgres"].get("ports")  # only the server talks to it


def test_mlflow_runs_with_basic_auth_from_secrets() -> None:
    start = (INFRA / "mlflow" / "start-server.sh").read_text()
    assert re.search(r"^exec mlflow server --app-name basic-auth \"\$@\"", start, re.MULTILINE)
    assert "MLFLOW_AUTH_CONFIG_PATH" in start and "mktemp -d" in start
    dockerfile = (INFRA / "mlflow" / "Dockerfile").read_text()
    assert re.search(r"COPY .*start-server\.sh /usr/local/bin/bertpipe-mlflow-server", dockerfile)
    assert '"mlflow[auth]==${MLFLOW_VERSION}"' in dockerfile  # Flask-WTF for the auth app
    # compose: the server goes through the wrapper; the secrets are required from .env
    compose = yaml.safe_load((INFRA / "mlflow" / "docker-compose.yaml").read_text())
    mlflow = compose["services"]["mlflow"]
    assert "exec bertpipe-mlflow-server" in " ".join(mlflow["command"])
    env = mlflow["environment"]
    for key in ("MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY"):
        assert re.fullmatch(rf"\$\{{{key}:\?[^}}]+\}}", env[key]), f"{key}: {env[key]}"
    example = dict(
        line.split("=", 1)
        for line in (INFRA / "mlflow" / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert example["MLFLOW_AUTH_ADMIN_PASSWORD"] == ""  # no shipped password that could stay
    assert ".env" in (INFRA / "mlflow" / ".dockerignore").read_text().split()
    # Kubernetes: the same wrapper, the secrets by reference, a ClusterIP Service
    deployment = _object("Deployment", "bertpipe-mlflow")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["bertpipe-mlflow-server"]
    refs = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in container["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    for key in ("MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY"):
        assert refs[key] == {"name": "bertpipe-mlflow", "key": key}
        assert "optional" not in refs[key]
    service = _object("Service", "bertpipe-mlflow")
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    for _, doc in _k8s_objects():
        if doc["kind"] == "Service":
            assert doc["spec"].get("type", "ClusterIP") not in ("LoadBalancer", "NodePort")


def test_start_server_writes_a_private_auth_config(tmp_path: Path) -> None:
    import configparser

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "mlflow").write_text(
        '#!/bin/sh\nprintf "%s\\n" "$@" >"$OUT/args"\n'
        'cp "$MLFLOW_AUTH_CONFIG_PATH" "$OUT/ini"\n'
        'stat -c %a "$MLFLOW_AUTH_CONFIG_PATH" >"$OUT/mode"\n'
        'stat -c %a "$(dirname "$MLFLOW_AUTH_CONFIG_PATH")" >"$OUT/dirmode"\n'
        'printf "%s" "$MLFLOW_AUTH_ADMIN_PASSWORD" >"$OUT/password"\n'
    )
    (fake / "mlflow").chmod(0o755)
    env = {
        "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}",
        "OUT": str(tmp_path),
        "TMPDIR": str(tmp_path),
        "MLFLOW_BACKEND_STORE_URI": "postgresql://mlflow:p%40ss@postgres:5432/mlflow",
    }
    script = str(INFRA / "mlflow" / "start-server.sh")
    missing = subprocess.run(["sh", script], env=env, capture_output=True, text=True)
    assert missing.returncode != 0 and "MLFLOW_AUTH_ADMIN_PASSWORD" in missing.stderr
    env |= {"MLFLOW_AUTH_ADMIN_PASSWORD": "s3cret", "MLFLOW_FLASK_SERVER_SECRET_KEY": "k"}
    proc = subprocess.run(["sh", script, "--host", "0.0.0.0"], env=env, capture_output=True)
    assert proc.returncode == 0, proc.stderr
    args = (tmp_path / "args").read_text().split()
    assert args == ["server", "--app-name", "basic-auth", "--host", "0.0.0.0"]
    assert (tmp_path / "mode").read_text().strip() == "600"
    assert (tmp_path / "dirmode").read_text().strip() == "700"
    ini = configparser.ConfigParser()  # MLflow reads it this way, with % interpolation
    ini.read(tmp_path / "ini")
    assert ini["mlflow"]["database_uri"] == env["MLFLOW_BACKEND_STORE_URI"]
    assert ini["mlflow"]["default_permission"] == "READ"
    assert "s3cret" not in (tmp_path / "ini").read_text()  # the password stays in the env
    assert (tmp_path / "password").read_text() == "s3cret"


def test_network_policies_admit_only_bertpipe_pods() -> None:
    policies = {
        doc["metadata"]["name"]: doc for _, doc in _k8s_objects() if doc["kind"] == "NetworkPolicy"
    }
    deployment = _object("Deployment", "bertpipe-mlflow")
    mlflow_labels = deployment["spec"]["template"]["metadata"]["labels"]
    job_labels = _job()["spec"]["template"]["metadata"]["labels"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    mlflow_port = container["ports"][0]["containerPort"]

    def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
        return selector.get("matchLabels", {}).items() <= labels.items()

    guarding_mlflow = [
        p for p in policies.values() if selects(p["spec"]["podSelector"], mlflow_labels)
    ]
    assert guarding_mlflow, "no NetworkPolicy selects the MLflow pods"
    for policy in guarding_mlflow:
        assert "Ingress" in policy["spec"]["policyTypes"]
        for rule in policy["spec"]["ingress"]:
            assert {p["port"] for p in rule["ports"]} == {mlflow_port}
            for peer in rule["from"]:
                assert set(peer) == {"podSelector"}, peer  # no ipBlock, no other namespaces
                assert selects(peer["podSelector"], job_labels)  # the Job's pods get in
                assert not selects(peer["podSelector"], mlflow_labels)
                assert peer["podSelector"]["matchLabels"]  # not "every pod"
    guarding_job = [
        p
        for p in policies.values()
        if selects(p["spec"]["podSelector"], job_labels)
        and p["spec"]["podSelector"].get("matchLabels")
    ]
    assert guarding_job, "no NetworkPolicy selects the pre-training pods"
    for policy in guarding_job:
        for rule in policy["spec"]["ingress"]:
            for peer in rule["from"]:
                assert set(peer) == {"podSelector"}
                assert peer["podSelector"]["matchLabels"] == job_labels  # its own pods only


def test_clients_log_in_from_a_secret_never_through_the_uri() -> None:
    (container,) = _job()["spec"]["template"]["spec"]["containers"]
    refs = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in container["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        assert refs[key] == {"name": "bertpipe-mlflow-client", "key": key}
    userinfo = re.compile(r"https?://[^\s/@'\"]+:[^\s/@'\"]*@")
    for path in _infra_files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            assert not userinfo.search(line), f"{path}:{n}: credentials inside an http(s) URI"


_FIXED_TMP = re.compile(r"(?:\$\{TMPDIR:-/tmp\}|\$TMPDIR|\$\{TMPDIR\}|(?<![\w}])/tmp)/[\w.$-]+")


def test_no_fixed_names_in_tmp_in_scripts() -> None:
    """State and pid files live in mktemp names or private folders, not /tmp/<fixed name>,
    where another user could plant a file (a pid fed to `kill`, code that gets imported)."""
    sources = [(str(p), p.read_text()) for p in _shell_scripts()]
    sources += [(where, script) for where, _, script in _embedded_shell()]
    assert len(sources) >= 12, [w for w, _ in sources]
    bad = []
    for where, text in sources:
        for line in text.splitlines():
            if line.lstrip().startswith("#"):
                continue
            bad += [f"{where}: {m}" for m in _FIXED_TMP.findall(line) if "XXXXXX" not in m]
            # a folder that defaults to /tmp itself, e.g. ${PID_DIR:-/tmp}/name
            bad += [f"{where}: {m}" for m in re.findall(r"\$\{(?!TMPDIR:)\w+:-/tmp\}", line)]
    assert not bad, bad
    assert _FIXED_TMP.findall('PID_DIR="/tmp/bertpipe-$JOB"') and _FIXED_TMP.findall(
        'd="${TMPDIR:-/tmp}/dask-$JOB"'
    )
    sbatch = (INFRA / "slurm" / "pretrain.sbatch").read_text()
    assert "/proc/$pid/cmdline" in sbatch  # the stop notice checks whose pid it signals


# --------------------------------------------------------------------------- hostfile


def test_hostfile_example_is_deepspeed_format() -> None:
    from deepspeed.launcher.runner import _parse_hostfile

    lines = (INFRA / "hostfile.example").read_text().splitlines()
    pool = _parse_hostfile(lines)
    assert len(pool) >= 2 and all(slots > 0 for slots in pool.values())


# --------------------------------------------------------------------------- helpers run


def _env(**extra: str) -> dict[str, str]:
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    env["DS_ACCELERATOR"] = "cpu"
    env.update(extra)
    return env


def test_supervise_passes_exit_status_through() -> None:
    supervise = str(BIN / "bertpipe-supervise")
    assert subprocess.run([supervise, "true"], env=_env()).returncode == 0
    assert subprocess.run([supervise, "bash", "-c", "exit 3"], env=_env()).returncode == 3
    assert subprocess.run([supervise], env=_env(), capture_output=True).returncode == 2


@pytest.mark.integration
def test_resume_args_switch_to_auto_after_the_first_new_checkpoint(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    for tag, step in (("global_step6", 6), ("global_step6_universal", 6)):
        (folder / tag).mkdir(parents=True)
        (folder / tag / "bertpipe_state.json").write_text(f'{{"global_step": {step}}}')
    (folder / "latest").write_text("global_step6")
    cmd = [
        str(BIN / "bertpipe-resume-args"),
        "global_step6_universal",
        f"output={tmp_path / 'run'}",
        f"checkpoint.dir={folder}",
    ]

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(cmd, env=_env(), capture_output=True, text=True)

    assert run().stdout.split() == [
        "checkpoint.resume=global_step6_universal",
        "checkpoint.universal=true",
    ]
    (folder / "global_step8").mkdir()
    (folder / "global_step8" / "bertpipe_state.json").write_text('{"global_step": 8}')
    (folder / "latest").write_text("global_step8")
    assert run().stdout.split() == ["checkpoint.resume=auto", "checkpoint.universal=false"]
    cmd[1] = "global_step9_universal"  # not converted
    proc = run()
    assert proc.returncode == 2 and "ds_to_universal" in proc.stderr


@pytest.mark.integration
def test_resume_args_read_checkpoints_on_object_storage(s3: Any) -> None:
    """The same decision with the checkpoints on S3 (a real S3 server: endpoint and keys in
    the environment, as for MinIO), read through fsspec, not the local filesystem."""
    import s3fs

    fs = s3fs.S3FileSystem()
    folder = s3.bucket.removeprefix("s3://") + "/run/checkpoints"
    for tag, step in (("global_step6", 6), ("global_step6_universal", 6), ("global_step8", 8)):
        fs.pipe(f"{folder}/{tag}/bertpipe_state.json", f'{{"global_step": {step}}}'.encode())
    fs.pipe(f"{folder}/latest", b"global_step8")
    proc = subprocess.run(
        [str(BIN / "bertpipe-resume-args"), "global_step6_universal", f"output={s3.bucket}/run"],
        env=_env(**s3.env),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["checkpoint.resume=auto", "checkpoint.universal=false"]


@pytest.mark.integration
def test_preflight_gates_on_the_plan() -> None:
    config = str(K8S / "config" / "pretrain.yaml")
    base = [str(BIN / "bertpipe-preflight"), "--config", config, "--gpus-per-node", "8"]
    ok = subprocess.run(
        [*base, "--nodes", "4", "--gpu", "h100"], env=_env(), capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stderr
    assert "32 GPUs = 4 nodes x 8" in ok.stdout
    bad_world = subprocess.run(
        [*base, "--nodes", "3", "--gpu", "h100"], env=_env(), capture_output=True, text=True
    )
    assert bad_world.returncode == 2 and "global_batch_size" in bad_world.stderr
    too_small = subprocess.run(
        [*base, "--nodes", "4", "--gpu", "h100", "--gpu-memory-gb", "12"],
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert too_small.returncode == 3 and "GiB per GPU" in too_small.stderr
    no_bf16 = subprocess.run(
        [*base, "--nodes", "4", "--gpu", "t4"], env=_env(), capture_output=True, text=True
    )
    assert no_bf16.returncode == 2 and "'precision'" in no_bf16.stderr


_RANK_SCRIPT = """
import os, signal, sys, time
from pathlib import Path
out = Path(sys.argv[-1])
rank = os.environ["RANK"]
def stop(signum, frame):
    time.sleep(1.0)  # an optimizer step and a checkpoint
    (out / f"rank{rank}.stopped").write_text("")
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
(out / f"rank{rank}.ready").write_text(str(os.getpid()))
for _ in range(1200):
    time.sleep(0.05)
sys.exit(5)
"""


def _wait_for(paths: list[Path], proc: subprocess.Popen[Any], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"never saw {paths} (process status {proc.poll()})")
        time.sleep(0.1)


@pytest.mark.integration
def test_supervise_sends_sigterm_to_ranks_not_to_deepspeeds_launcher(tmp_path: Path) -> None:
    """Under the real `deepspeed --no_ssh` launcher: the ranks get the SIGTERM and take their
    time, the launcher is never signalled, and the status is 143."""
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=2\n")
    pid_file = tmp_path / "supervise.pid"
    log = tmp_path / "log"
    cmd = [
        str(BIN / "bertpipe-supervise"),
        "deepspeed",
        "--no_ssh",
        "--node_rank",
        "0",
        "--num_nodes",
        "1",
        "--num_gpus",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        "29641",
        "--hostfile",
        str(hostfile),
        str(script),
        str(tmp_path),
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, env=_env(BERTPIPE_PID_FILE=str(pid_file)), stdout=out, stderr=subprocess.STDOUT
        )
        try:
            _wait_for([tmp_path / "rank0.ready", tmp_path / "rank1.ready", pid_file], proc)
            assert int(pid_file.read_text()) == proc.pid
            proc.send_signal(signal.SIGTERM)
            status = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text(errors="replace")
    assert status == 143, text[-3000:]
    assert (tmp_path / "rank0.stopped").exists() and (tmp_path / "rank1.stopped").exists()
    assert "Main process received SIGTERM" not in text, "the launcher itself was signalled"
    assert not pid_file.exists()


# --------------------------------------------------------------------------- pretrain.sbatch

_FAKE_SRUN = r"""#!/usr/bin/env bash
# srun stand-in: runs the command once per node of the job, here, with SLURM_NODEID set
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((n = 0; n < SLURM_JOB_NUM_NODES; n++)); do
    SLURM_NODEID=$n SLURM_NNODES=$SLURM_JOB_NUM_NODES "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
    wait "$pid"; s=$?
    ((s > status)) && status=$s
done
exit $status
"""

_FAKE_SCONTROL = r"""#!/usr/bin/env bash
case "$1 $2" in
"show hostnames") tr ',' '\n' <<<"$3" ;;
"requeue "*) echo "$2" >>"$FAKE_LOG/requeued" ;;
*) exit 1 ;;
esac
"""

# deepspeed stand-in: runner -> launcher -> rank, as the real one (no_ssh) nests them
_FAKE_DEEPSPEED = r"""#!/usr/bin/env bash
printf '%s\n' "$@" >"$FAKE_LOG/args-$SLURM_NODEID"
hostfile=$(awk '/^--hostfile$/ {getline; print}' "$FAKE_LOG/args-$SLURM_NODEID")
cp "$hostfile" "$FAKE_LOG/hostfile-$SLURM_NODEID"
bash "$FAKE_BIN/fake-launch" &
wait $!
"""

_FAKE_LAUNCH = r"""#!/usr/bin/env bash
trap 'touch "$FAKE_LOG/launcher-signalled-$SLURM_NODEID"; exit 1' TERM
bash "$FAKE_BIN/fake-rank" &
wait $!
"""

_FAKE_RANK = r"""#!/usr/bin/env bash
trap 'sleep 0.5; touch "$FAKE_LOG/rank-stopped-$SLURM_NODEID"; exit 143' TERM
touch "$FAKE_LOG/rank-ready-$SLURM_NODEID"
for ((i = 0; i < 1200; i++)); do
    [[ -n "${FAKE_RANK_EXIT:-}" ]] && exit "$FAKE_RANK_EXIT"
    sleep 0.05
done
exit 5
"""


def _fake_slurm(tmp_path: Path, nodes: int, **extra: str) -> tuple[dict[str, str], Path]:
    fake = tmp_path / "bin"
    venv = tmp_path / "venv" / "bin"
    log = tmp_path / "log"
    for folder in (fake, venv, log):
        folder.mkdir(parents=True)
    for name, text in (
        ("srun", _FAKE_SRUN),
        ("scontrol", _FAKE_SCONTROL),
        ("fake-launch", _FAKE_LAUNCH),
        ("fake-rank", _FAKE_RANK),
    ):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    (venv / "deepspeed").write_text(_FAKE_DEEPSPEED)
    (venv / "deepspeed").chmod(0o755)
    (venv / "bertpipe").symlink_to(VENV_BIN / "bertpipe")
    names = ",".join(f"gpu-{i:02d}" for i in range(nodes))
    env = _env(
        PATH=os.pathsep.join([str(fake), str(VENV_BIN), os.environ.get("PATH", "")]),
        FAKE_BIN=str(fake),
        FAKE_LOG=str(log),
        BERTPIPE_VENV=str(venv.parent),
        BERTPIPE_INFRA=str(INFRA),
        BERTPIPE_PID_DIR=str(tmp_path / "pids"),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NUM_NODES=str(nodes),
        SLURM_JOB_NODELIST=names,
        SLURM_SUBMIT_DIR=str(tmp_path),
        SLURM_CPUS_ON_NODE="32",
        SLURM_GPUS_ON_NODE="8",
        MLFLOW_TRACKING_URI=sqlite_uri(tmp_path / "mlflow.db"),
        GPU_TYPE="h100",
        BERTPIPE_PLAN_MEMORY_CHECK="0",
        **extra,
    )
    return env, log


def _sbatch(config: Path, *overrides: str) -> list[str]:
    return ["bash", str(INFRA / "slurm" / "pretrain.sbatch"), str(config), *overrides]


@pytest.mark.integration
def test_pretrain_sbatch_launches_every_node_and_requeues_after_the_notice(
    tmp_path: Path,
) -> None:
    config = K8S / "config" / "pretrain.yaml"  # 65,536 / 32,768: fits 2 nodes x 8
    env, log = _fake_slurm(tmp_path, nodes=2)
    out = tmp_path / "out"
    with out.open("wb") as f:
        proc = subprocess.Popen(
            _sbatch(config, "log_every_steps=5"), env=env, stdout=f, stderr=subprocess.STDOUT
        )
        try:
            _wait_for([log / "rank-ready-0", log / "rank-ready-1"], proc)
            proc.send_signal(signal.SIGTERM)  # --signal=B:TERM@180: the time-limit notice
            status = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = out.read_text()
    assert status == 143, text[-3000:]
    assert (log / "requeued").read_text().split() == ["4242"], text[-3000:]
    for node in (0, 1):
        assert (log / f"rank-stopped-{node}").exists(), text[-3000:]
        assert not (log / f"launcher-signalled-{node}").exists()
        args = (log / f"args-{node}").read_text().splitlines()
        assert args[:2] == ["--no_ssh", "--node_rank"] and args[2] == str(node)
        opts = dict(zip(args[1:13:2], args[2:13:2], strict=True))
        assert opts["--num_nodes"] == "2" and opts["--num_gpus"] == "8"
        assert opts["--master_addr"] == "gpu-00"
        assert args[13].endswith("/bertpipe") and args[14:] == [
            "pretrain",
            "--config",
            str(config),
            "log_every_steps=5",
        ]
        hostfile = (log / f"hostfile-{node}").read_text().splitlines()
        assert hostfile == ["gpu-00 slots=8", "gpu-01 slots=8"]
    assert "16 GPUs = 2 nodes x 8" in text  # the plan ran first


@pytest.mark.integration
def test_pretrain_sbatch_stops_on_an_invalid_plan_and_passes_success_through(
    tmp_path: Path,
) -> None:
    config = K8S / "config" / "pretrain.yaml"
    env, log = _fake_slurm(tmp_path / "bad", nodes=3)  # 24 GPUs do not divide 65,536
    proc = subprocess.run(_sbatch(config), env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "global_batch_size" in proc.stderr
    assert not list(log.glob("args-*")), "launched despite the failed plan"
    # success passes through; here with the object-storage switch: output and checkpoints on
    # the store, each node's checkpoint staging in a private node-local folder, removed after
    local = tmp_path / "node-local"
    local.mkdir()
    env, log = _fake_slurm(
        tmp_path / "good",
        nodes=2,
        FAKE_RANK_EXIT="0",
        BERTPIPE_OUTPUT="s3://my-bucket/runs/r1/",
        BERTPIPE_STAGING_DIR=str(local),
    )
    proc = subprocess.run(
        _sbatch(config, "log_every_steps=5"), env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert not (log / "requeued").exists()
    staged = set()
    for node in (0, 1):
        args = (log / f"args-{node}").read_text().splitlines()
        pretrain = args[args.index("pretrain") :]
        assert pretrain[:3] == ["pretrain", "--config", str(config)]
        staging = pretrain[3].removeprefix("checkpoint.local_dir=")
        assert Path(staging).parent == local and "4242" in Path(staging).name
        assert pretrain[4:] == [
            "output=s3://my-bucket/runs/r1/",
            "checkpoint.dir=s3://my-bucket/runs/r1/checkpoints",
            "log_every_steps=5",
        ]
        staged.add(staging)
    assert len(staged) == 2, "the nodes shared a staging folder"
    assert not list(local.iterdir()), "staging folders left behind"


def test_supervise_refuses_a_pid_file_that_others_can_replace(tmp_path: Path) -> None:
    supervise = str(BIN / "bertpipe-supervise")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # like /tmp: anyone could swap the file for one naming their pid
    proc = subprocess.run(
        [supervise, "true"],
        env=_env(BERTPIPE_PID_FILE=str(shared / "x.pid")),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "not a private folder" in proc.stderr
    assert not list(shared.iterdir())
    # a planted symlink is replaced, not followed
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    (private / "x.pid").symlink_to(victim)
    proc = subprocess.run(
        [supervise, "bash", "-c", 'cat "$BERTPIPE_PID_FILE" >"$0"', str(tmp_path / "seen")],
        env=_env(BERTPIPE_PID_FILE=str(private / "x.pid")),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert victim.read_text() == "untouched"
    assert (tmp_path / "seen").read_text().strip().isdigit()
    assert not (private / "x.pid").exists()  # removed at exit: it held this run's pid


@pytest.mark.integration
def test_pretrain_sbatch_stop_notice_skips_a_pid_that_is_not_bertpipe_supervise(
    tmp_path: Path,
) -> None:
    """The default pid folder is a private mktemp folder of the job; a pid file that names
    another process (stale, or planted) is not signalled."""
    config = K8S / "config" / "pretrain.yaml"
    env, log = _fake_slurm(tmp_path, nodes=1)
    del env["BERTPIPE_PID_DIR"]  # the default
    decoy = subprocess.Popen(["sleep", "120"])
    out = tmp_path / "out"
    try:
        with out.open("wb") as f:
            proc = subprocess.Popen(
                _sbatch(config),
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            _wait_for([log / "rank-ready-0"], proc)
            (pid_dir,) = (tmp_path / ".cache" / "slurm").glob("pids-4242.*")
            assert pid_dir.stat().st_mode & 0o777 == 0o700
            pid_file = pid_dir / "bertpipe-4242-node0.pid"
            _wait_for([pid_file], proc)
            pid_file.write_text(str(decoy.pid))  # someone else's process
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            while "not signalled" not in out.read_text() and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(0.5)
            assert decoy.poll() is None, "the decoy process was killed"
            assert "not bertpipe-supervise: not signalled" in out.read_text()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    finally:
        decoy.kill()
        decoy.wait()
