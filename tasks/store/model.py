"""What the store holds, as data: a manifest and its file entries, the reference a stage returns, and the store's
errors. Apart from tasks/store/artifacts.py (the Store itself) so that modules reading manifests
(tasks/store/manifests.py) need not import the Store."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from tasks.core.errors import DraftlineError

MANIFEST = "manifest.json"


class StoreError(DraftlineError, RuntimeError):
    """The store cannot be used (unreachable, credentials, bucket); the message says what to fix."""


class BucketMissing(StoreError):
    """The store's S3 bucket does not exist (`draftline store init` creates it)."""


class NotAStore(StoreError):
    """A root without draftline's store marker: gc deletes nothing there."""


class ArtifactMissing(DraftlineError, LookupError):
    pass


class ArtifactCorrupt(DraftlineError, RuntimeError):
    """A committed artifact whose files do not match its manifest."""


class FileEntry(BaseModel):
    path: str
    bytes: int
    sha256: str


class Manifest(BaseModel):
    stage: str
    digest: str
    version: str
    attempt: str
    created: str
    inputs: dict[str, str] = Field(default_factory=dict)
    files: list[FileEntry] = Field(default_factory=list)
    stats: dict[str, Any] = Field(default_factory=dict)
    config: dict[str, Any] = Field(default_factory=dict)
    run: dict[str, Any] = Field(default_factory=dict)

    def file(self, name: str) -> FileEntry:
        for f in self.files:
            if f.path == name:
                return f
        raise KeyError(f"{self.stage}/{self.digest} has no file {name!r}")


class ArtifactRef(BaseModel):
    """What a stage returns: enough to find and check its artifact anywhere."""

    stage: str
    digest: str
    uri: str
    attempt: str = ""
    created: str = ""
    stats: dict[str, Any] = Field(default_factory=dict)

    @property
    def executed_here(self) -> bool:
        """True when this process computed the artifact (False: reused from the store or cache)."""
        return self.attempt in COMMITTED_HERE


# Attempts committed by this process: how a run tells work it did from work it reused.
COMMITTED_HERE: set[str] = set()
