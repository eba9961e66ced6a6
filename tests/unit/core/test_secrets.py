"""The secrets rule on a store URI's authority (tasks/core/secrets.py): urllib.parse.urlsplit reads it, any '@' in it
is user info, refused and masked up to the last '@'; a bucket scheme's authority with a ':' and an '@' after it is a
password holding a '/'. Through the command line a user runs: refused, the message never holds the secret."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.app import app
from tasks.core.config_load import load_config
from tasks.core.errors import ConfigError
from tasks.core.secrets import find_secrets, mask

CASES = [("s3://minio:12/abcSeCrEt@bucket/x", "abcSeCrEt"),      # a password starting with digits and a '/'
         ("s3://minio:pass'word@bucket/x", "pass'word"),          # a quote
         ("s3://minio:pass word@bucket/x", "pass word"),          # a space
         ("s3://minio@12:abc/Zq9SeCrEt@bucket/x", "Zq9SeCrEt")]         # an '@' in the password: up to the last '@'


@pytest.mark.parametrize("uri,secret", CASES)
def test_user_info_in_a_store_uri_is_refused_and_masked(tmp_path, uri, secret):
    assert find_secrets(uri) and secret not in mask(uri) and mask(uri).endswith("@bucket/x")
    if " " not in secret and "'" not in secret:  # inside a longer text a URI ends at a space or a quote
        assert secret not in mask(f"cannot open {uri} now")
    with pytest.raises(ConfigError) as exc:
        load_config(None, [f"store.uri={uri}"])
    assert "store.uri" in str(exc.value) and "credential" in str(exc.value) and secret not in str(exc.value)
    out = CliRunner().invoke(app, ["config", "show", "--store", uri])
    assert out.exit_code == 2 and "credential" in out.output and secret not in out.output, out.output


def test_an_at_sign_in_a_key_or_a_port_is_not_user_info():
    for uri in ("s3://bucket/with@sign", "http://host:8333/x@y", "file:///data/a@b/store", "hf://datasets/o/n@main/x"):
        assert find_secrets(uri) == [] and mask(uri) == uri
    load_config(None, ["store.uri=s3://bucket/with@sign"])


def test_a_config_path_naming_another_mapping_never_echoes_its_values(tmp_path):
    """A flow run's `config_path` can name any YAML/JSON mapping on the worker; its error is readable by every
    Prefect API user. Unknown keys are named, their values never printed."""
    other = tmp_path / "service.json"
    other.write_text('{"internal_host": "db-7.private.example:5432", "nested": {"x": "private-value-42"}}')
    with pytest.raises(ConfigError) as exc:
        load_config(other)
    text = str(exc.value)
    assert "internal_host" in text and "nested" in text and "Extra inputs are not permitted" in text, text
    assert "db-7.private.example" not in text and "private-value-42" not in text, text
