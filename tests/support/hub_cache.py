"""A node's Hugging Face cache as an offline run finds it: the commit each hub dataset's branch named when the node
last fetched it (`datasets--ORG--NAME/refs/main`), which is what a hub source's address enters at offline
(tasks/address/data.py `dataset_commit`)."""

from __future__ import annotations

from pathlib import Path

KIMI_DATASETS = ("mlabonne/open-perfectblend", "open-thoughts/OpenThoughts-114k", "THUDM/LongAlign-10k")  # configs/kimi-k2.5-b300.yaml


def record_dataset_commits(monkeypatch, folder: Path, repos=KIMI_DATASETS) -> dict[str, str]:
    """Point huggingface_hub's cache at `folder` and record a commit for each repo's main branch there."""
    from huggingface_hub import constants

    from tasks.address.data import dataset_commit

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(folder))
    out = {}
    for i, repo in enumerate(repos):
        ref = Path(folder) / f"datasets--{repo.replace('/', '--')}" / "refs" / "main"
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(out.setdefault(repo, f"{i + 1}" * 40))
    dataset_commit.cache_clear()  # the per-process record of resolved commits
    return out
