"""One Store per process for each store: `Store.from_config` (tasks/store/artifacts.py) returns the Store this
process already opened for the same canonical uri, reached with the same credentials, instead of building
another (a run's tasks, its shards' threads and its commands all ask for it; each new one was a new S3 client
and one more check of the store's marker).

The key is the canonical uri and a digest of what reaches the store (the storage options and the AWS_*
variables botocore reads), so other keys for the same bucket (a read-only key beside a read-write one) get
their own Store; secrets enter the key only hashed. A forked child (an engine, a rank) opens its own: a Store
holds an S3 client whose threads the child does not have.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")

# the environment botocore reads credentials and the endpoint from
CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                  "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")

_OPEN: dict[tuple[int, str, str], Any] = {}
_LOCK = threading.Lock()


def store_key(uri: str, options: dict[str, Any]) -> tuple[int, str, str]:
    """(this process, URI, a digest of OPTIONS and the credential environment): one Store each."""
    reach = json.dumps([options, [os.environ.get(k) for k in CREDENTIAL_ENV]], sort_keys=True, default=str)
    return os.getpid(), uri, hashlib.sha256(reach.encode()).hexdigest()


def opened(uri: str, options: dict[str, Any], make: Callable[[], T]) -> T:
    """The Store this process opened for URI with OPTIONS, else MAKE's (kept for the next caller)."""
    key = store_key(uri, options)
    with _LOCK:
        if key not in _OPEN:
            _OPEN[key] = make()
        return _OPEN[key]
