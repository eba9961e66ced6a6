"""How to reach a store: the S3 endpoint and s3fs's options (the one canonical URI of a store is the config's,
tasks/core/config.py `canonical_uri`).

Credentials never pass through here as arguments: s3fs/botocore read AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
AWS_SESSION_TOKEN / AWS_PROFILE from the environment (or a prefect-aws block fills them in, see
`resolve_credentials`).
"""

from __future__ import annotations

import os
from typing import Any

from tasks.core.config import StoreConfig
from tasks.store.model import StoreError
from tasks.store.uploads import upload_options

# botocore "standard" retries per S3 request (backoff: random up to 1, 2, 4, ... 20 s between attempts).
S3_MAX_ATTEMPTS = 8


def s3_endpoint(cfg: StoreConfig | None = None) -> str | None:
    """The S3 endpoint: `store.endpoint_url`, else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL; None means AWS."""
    return ((cfg.endpoint_url if cfg is not None else None) or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL"))


def resolve_credentials(cfg: StoreConfig) -> dict[str, Any]:
    """storage_options for s3fs. Keys only from the environment or a Prefect block."""
    opts: dict[str, Any] = upload_options(cfg.upload_part_mb, cfg.upload_concurrency)
    endpoint = s3_endpoint(cfg)
    client_kwargs: dict[str, Any] = {}
    if endpoint:
        client_kwargs["endpoint_url"] = endpoint
    region = cfg.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        client_kwargs["region_name"] = region
    if client_kwargs:
        opts["client_kwargs"] = client_kwargs
    if cfg.credentials_block:
        try:
            from prefect_aws import AwsCredentials
        except ImportError as exc:  # pragma: no cover - prefect-aws is a dependency
            raise StoreError("store.credentials_block needs prefect-aws: pip install prefect-aws") from exc
        try:
            block = AwsCredentials.load(cfg.credentials_block)
        except Exception as exc:
            raise StoreError(
                f"cannot load AwsCredentials block {cfg.credentials_block!r}: {exc}; "
                "create it in the Prefect UI or unset store.credentials_block and use AWS_* variables"
            ) from None
        opts["key"] = block.aws_access_key_id
        if block.aws_secret_access_key is not None:
            opts["secret"] = block.aws_secret_access_key.get_secret_value()
        if block.aws_session_token is not None:
            opts["token"] = block.aws_session_token
    if endpoint and "amazonaws.com" not in endpoint:
        # Non-AWS servers (SeaweedFS, MinIO, Ceph) reject the newer default checksums.
        os.environ.setdefault("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
        os.environ.setdefault("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
    if not (os.environ.get("AWS_MAX_ATTEMPTS") or os.environ.get("AWS_RETRY_MODE")):
        # Ride out a store that is briefly gone or busy (restart, failover, 503 SlowDown): every request
        # (each multipart part, the manifest PUT) is retried with exponential backoff, ~30 s in all,
        # before the stage fails. AWS_MAX_ATTEMPTS / AWS_RETRY_MODE in the environment override this.
        opts["config_kwargs"] = {"retries": {"max_attempts": S3_MAX_ATTEMPTS, "mode": "standard"}}
    return opts
