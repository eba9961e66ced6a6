"""The pull step of the GPU pools' deployments (`flows.release.use_release` in deployments/prefect.yaml):
a worker runs the flow from its node's install of the deployment's release, or refuses the run and
says how to install that release. `draftline deploy` records the commit it deployed from next to the
release's version: a node whose code is another commit is refused too, even with the same version string
(and `draftline submit` compares a config with that commit's copy)."""

from __future__ import annotations

# prefect_aws is imported where used: it is heavy, and only a deployment with a credentials block needs it.

import importlib.metadata as md
import os
import re
import socket
import subprocess
from pathlib import Path

from tasks.core.config_load import CHECKOUT as ROOT


def code_version(code_dir: Path) -> str | None:
    pyproject = code_dir / "pyproject.toml"
    if pyproject.is_file():
        m = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M)
        if m:
            return m.group(1)
    try:
        return md.version("draftline")
    except md.PackageNotFoundError:
        return None


# The commit of a code folder without git metadata (the worker image: infra/Dockerfile writes it from its
# DRAFTLINE_COMMIT build argument).
COMMIT_FILE = ".draftline-commit"


def code_commit(code_dir: Path) -> str | None:
    """The git commit a draftline code folder holds: its checkout's HEAD, else its COMMIT_FILE; None when
    neither says."""
    code_dir = Path(code_dir)
    if (code_dir / ".git").exists():
        try:
            out = subprocess.run(["git", "-C", str(code_dir), "rev-parse", "HEAD"], capture_output=True, text=True,
                                 timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            out = None
        if out is not None and out.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}", out.stdout.strip()):
            return out.stdout.strip()
    f = code_dir / COMMIT_FILE
    if f.is_file() and re.fullmatch(r"[0-9a-f]{40}", f.read_text().strip()):
        return f.read_text().strip()
    return None


def use_release(release: str, code_dir: str | None = None, credentials_block: str | None = None,
                commit: str | None = None) -> dict[str, str]:
    """Prefect pull step of the b300 deployments: run the flow from the node's install of `release`.

    The worker's environment names the install (DRAFTLINE_CODE_DIR, set by infra/node-bootstrap.sh;
    default: the checkout this module was imported from). A node with another release refuses the
    run, saying how to install the right one; with `commit` (recorded by `draftline deploy`), so does a node
    whose code is another commit of the same version. Caches go under DRAFTLINE_HOME; with
    `credentials_block`, S3 keys are read from that prefect-aws block into this process only.
    """
    code = Path(code_dir or os.environ.get("DRAFTLINE_CODE_DIR") or ROOT).expanduser().resolve()
    if not (code / "flows" / "pipeline.py").is_file():
        raise RuntimeError(f"draftline code not found at {code} on {socket.gethostname()}: run "
                           f"infra/node-bootstrap.sh with DRAFTLINE_RELEASE=v{release} on this node")
    have = code_version(code)
    if have != release.lstrip("v"):
        raise RuntimeError(f"this deployment runs draftline {release} but {socket.gethostname()} has {have} at "
                           f"{code}: run infra/node-bootstrap.sh with DRAFTLINE_RELEASE=v{release.lstrip('v')}, "
                           "or redeploy from a checkout of the node's release")
    if commit:
        node = code_commit(code)
        if node is None:
            raise RuntimeError(f"this deployment runs draftline {release} at commit {commit[:12]}, but {code} on "
                               f"{socket.gethostname()} says no commit (no git checkout, no {COMMIT_FILE}): install "
                               "the release with infra/node-bootstrap.sh, or build the image with --build-arg "
                               f"DRAFTLINE_COMMIT={commit}")
        if node != commit:
            raise RuntimeError(f"this deployment runs draftline {release} at commit {commit[:12]} but "
                               f"{socket.gethostname()} has commit {node[:12]} at {code} (same version, other code): "
                               f"install the deployed commit on the node (infra/node-bootstrap.sh with the release tag "
                               f"at {commit[:12]}), or redeploy from a checkout of the node's commit "
                               f"(git checkout {node[:12]} && draftline deploy)")
    os.chdir(code)
    home = os.environ.get("DRAFTLINE_HOME")
    if home:
        os.environ.setdefault("HF_HOME", os.path.join(home, "huggingface"))
        os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(home, "vllm"))
    if credentials_block:
        from prefect_aws import AwsCredentials

        block = AwsCredentials.load(credentials_block)
        os.environ["AWS_ACCESS_KEY_ID"] = block.aws_access_key_id or ""
        if block.aws_secret_access_key is not None:
            os.environ["AWS_SECRET_ACCESS_KEY"] = block.aws_secret_access_key.get_secret_value()
        if block.region_name:
            os.environ.setdefault("AWS_DEFAULT_REGION", block.region_name)
        endpoint = getattr(block.aws_client_parameters, "endpoint_url", None)
        if endpoint:
            os.environ.setdefault("AWS_ENDPOINT_URL", str(endpoint))
    out = {"directory": str(code), "release": have}
    if commit:
        out["commit"] = commit
    return out
