"""The one secrets rule: credentials never enter draftline as a value.

A config, a command-line option (`--store`, `--set`, `submit --env`) or a deployment's job variables
hold names, paths and URLs, never keys: anything written there ends up in `config show`, in error
messages, in the flow run's parameters (readable by every Prefect API user), in manifests and logs.
Keys come from the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, HF_TOKEN), the AWS profile
chain (AWS_PROFILE, ~/.aws/credentials, an instance role) or a prefect-aws AwsCredentials block.

`find_secrets` finds credentials in a value; `refuse_secrets` walks a whole config (or job variables)
and raises `SecretInValue` naming each field and the fix, with the secret masked; `mask` hides any
secret in a text before it is printed.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

from tasks.core.errors import DraftlineError

# Words that make a key (a config key, an engine argument, a query parameter, an environment variable)
# name a credential: hf_token, api_key, X-Amz-Signature, AWSAccessKeyId, AWS_SECRET_ACCESS_KEY, sig, ...
SECRET_WORDS = {"token", "secret", "password", "passwd", "pwd", "key", "apikey", "credential", "credentials",
                "signature", "sig", "auth", "authorization", "passphrase"}
# ... unless its last word says it names where a credential lives: store.credentials_block, AWS_PROFILE
WHERE_WORDS = {"block", "name", "file", "path", "dir", "env", "profile", "mode", "type"}

# scheme://USER:PASSWORD@host (any characters but @ and whitespace in the password: / + %2F included)
# (a port and a path with an @ in it, host:8333/x@y, is not user info)
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)([^@\s/'\"]*(?::|%3a)(?!\d+/)[^@\s'\"]*)@")
# Schemes whose authority is a bucket (never a host:port): a ':' there is user info whose password holds a '/'.
BUCKET_SCHEMES = {"s3", "s3a", "s3n", "gs", "gcs", "az", "abfs", "abfss", "adl", "r2", "oss"}
_URI_TOKEN = re.compile(r"(?i)\b[a-z][a-z0-9+.-]*://[^\s'\"]+")
# key=value in a URL query (or a fragment, or a semicolon-separated list)
_PARAM = re.compile(r"([?&;#])([A-Za-z0-9_.-]+)=([^&#\s'\"]+)")
# credentials recognisable by their shape
_SHAPES = re.compile(
    r"\b(?:(?:AKIA|ASIA|AGPA|AIDA|AROA)[0-9A-Z]{16}"  # AWS access key ids
    r"|hf_[A-Za-z0-9]{30,}"  # Hugging Face tokens
    r"|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,}"  # GitHub tokens
    r"|xox[abprs]-[A-Za-z0-9-]{10,}"  # Slack tokens
    r"|sk-[A-Za-z0-9_-]{20,})\b"  # OpenAI-style API keys
    r"|-----BEGIN [A-Z ]*PRIVATE KEY-----")

FIX = ("put credentials in the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, HF_TOKEN), the AWS profile "
       "chain (AWS_PROFILE, ~/.aws/credentials, an instance role) or a prefect-aws AwsCredentials block "
       "(store.credentials_block); never in a config, an option or a job variable")


WORKER_FIX = ("set it where the worker runs instead: its environment (the env file infra/node-bootstrap.sh writes, "
              "or the work pool's base job template), the AWS profile chain of the worker's user (AWS_PROFILE, "
              "~/.aws/credentials, an instance role), or a prefect-aws AwsCredentials block; job variables are "
              "readable by every Prefect API user")


class SecretInValue(DraftlineError, ValueError):
    """A credential was given as a value: refused before it is printed, stored or sent anywhere."""


def secret_name(name: str) -> bool:
    """True when NAME (snake, kebab, camel or upper case) has a word that names a credential."""
    words = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1 \2", str(name)))
    parts = [w for w in re.split(r"[\s_.\-]+", words.lower()) if w]
    return bool(parts) and parts[-1] not in WHERE_WORDS and any(w in SECRET_WORDS for w in parts)


def _userinfo_span(value: str) -> tuple[int, int] | None:
    """Where the user info of the URI `value` is, by its authority as urllib.parse.urlsplit reads it: up to the
    value's last '@' when the authority holds an '@' (a user, a key id, a password with a quote or a space); for a
    bucket scheme also when the authority holds a ':' (a bucket name never has one) and an '@' follows: a password
    holding a '/' (`s3://minio:12/abcSECRET@bucket/x`). None for anything else."""
    try:
        parts = urlsplit(value)
    except ValueError:
        return None
    start = len(parts.scheme) + 3
    if not parts.scheme or value[len(parts.scheme):start] != "://":
        return None
    bucket_password = parts.scheme.lower() in BUCKET_SCHEMES and ":" in parts.netloc and "@" in value[start:]
    if "@" in parts.netloc or bucket_password:
        return start, value.rindex("@")  # (an '@' inside the password, or past it in the key: all of it masked)
    return None


def _mask_uri(value: str) -> str:
    span = _userinfo_span(value)
    return value if span is None else f"{value[:span[0]]}***{value[span[1]:]}"


def find_secrets(value: Any) -> list[str]:
    """The credentials inside one string value (user info of a URI, a secret query parameter, a key of a
    known shape); [] for anything else."""
    if not isinstance(value, str):
        return []
    out = [value[sp[0]:sp[1]]] if (sp := _userinfo_span(value)) else []
    out += [m.group(0)[sp[0]:sp[1]] for m in _URI_TOKEN.finditer(value) if (sp := _userinfo_span(m.group(0)))]
    out += [m.group(2) for m in _USERINFO.finditer(value)]
    out += [m.group(3) for m in _PARAM.finditer(value) if secret_name(m.group(2))]
    out += [m.group(0) for m in _SHAPES.finditer(value)]
    return out


def mask(text: str) -> str:
    """TEXT with every credential `find_secrets` sees replaced by ***."""
    text = _mask_uri(text)  # TEXT one URI (a config value): its user info, whatever characters it holds
    text = _URI_TOKEN.sub(lambda m: _mask_uri(m.group(0)), text)  # URIs inside a longer text
    text = _USERINFO.sub(lambda m: f"{m.group(1)}***@", text)
    text = _PARAM.sub(lambda m: f"{m.group(1)}{m.group(2)}=***" if secret_name(m.group(2)) else m.group(0), text)
    return _SHAPES.sub("***", text)


def secret_fields(data: Any, where: str = "") -> list[str]:
    """`field: why` for every credential in a nested mapping/list: a string value holding one, or a string
    value under a key that names one (engine_args.hf_token, env.AWS_SECRET_ACCESS_KEY)."""
    out: list[str] = []
    if isinstance(data, dict):
        for k, v in data.items():
            here = f"{where}.{k}" if where else str(k)
            if isinstance(v, str) and v and secret_name(str(k)):
                out.append(f"{here}: {k!r} names a credential (value ***)")
            else:
                out += secret_fields(v, here)
    elif isinstance(data, (list, tuple)):
        for i, v in enumerate(data):
            out += secret_fields(v, f"{where}[{i}]")
    elif find_secrets(data):
        out.append(f"{where or 'value'}: holds a credential ({mask(data)})")
    return out


def refuse_secrets(data: Any, origin: str, where: str = "", fix: str = FIX) -> None:
    """Raise SecretInValue naming every field of DATA that holds a credential (masked) and the fix."""
    found = secret_fields(data, where)
    if found:
        raise SecretInValue("\n".join([f"{origin}: {len(found)} credential(s) given as values, refused:",
                                       *(f"  - {f}" for f in found), f"  fix: {fix}"]))
