"""The pull step of the GPU pools' deployments (`flows.release.use_release` in deployments/prefect.yaml):
a worker runs the flow from its node's install of the deployment's release, or refuses the run and
says how to install that release."""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import socket
from pathlib import Path

from flows.console import ROOT


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


def use_release(release: str, code_dir: str | None = None, credentials_block: str | None = None) -> dict[str, str]:
    """Prefect pull step of the b300 deployments: run the flow from the node's install of `release`.

    The worker's environment names the install (DRAFTLINE_CODE_DIR, set by infra/node-bootstrap.sh;
    default: the checkout this module was imported from). A node with another release refuses the
    run, saying how to install the right one. Caches go under DRAFTLINE_HOME; with
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
    return {"directory": str(code), "release": have}
