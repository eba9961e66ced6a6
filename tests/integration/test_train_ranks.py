"""Training on several ranks, started by the train task: `draftline run` with `train.gpus=2` on a CPU.

The train task starts two gloo ranks with torch's elastic launcher (what torchrun runs); rank 0's
metrics reach the task while they train. Checked through the CLI, a real Prefect server and the
flow, as a user runs it:

- the two-rank run commits its draft at the same address (digest) as the one-rank run;
- rank 1 SIGKILLed after its third step (a real kill, chosen with DRAFTLINE_FAULT_KILL, see
  tasks/core/faults.py) fails the train task with a message that names rank 1 and the signal;
- `draftline retry` of that run resumes from the step-2 checkpoint on two ranks and finishes.

The target is a 4-layer random Llama (hidden 64) with a byte-level tokenizer and a ChatML template,
extracted with the transformers backend; 6 steps of 128 tokens. The two ranks are fresh Python
processes (~10 s of imports each), so this takes about a minute and a half on 2 cores.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from tasks.store.artifacts import Store
from train_data import make_tiny_target
from warm import finish, start_draftline

# ChatML with {% generation %} markers (transformers' assistant mask), as SmolLM2's template renders turns.
CHATML = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
          "{%- if message['role'] == 'assistant' %}{% generation %}{{- message['content'] + '<|im_end|>' }}"
          "{% endgeneration %}{{- '\\n' }}{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}"
          "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
WORDS = ["red", "blue", "green", "cat", "dog", "sun", "rain", "tree", "road", "milk", "bread", "stone"]
LAYER_IDS = [1, 2, 3, 4]
MAX_STEPS = 6


def byte_tokenizer(folder: Path) -> None:
    """A byte-level tokenizer (one token per byte, no merges) plus ChatML specials: any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHATML
    fast.save_pretrained(str(folder))


def word_chats(path: Path, n: int) -> Path:
    """N one-turn chats of a few words (the answer: the question reversed plus a word) as a JSONL data source."""
    rng = random.Random(0)
    rows = []
    for _ in range(n):
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 7)))
        answer = " ".join(reversed(question.split())) + " " + rng.choice(WORDS)
        rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("ranks")
    target = make_tiny_target(root / "target", vocab=264)  # 256 bytes + 5 specials
    byte_tokenizer(root / "target")
    data = word_chats(root / "tiny.jsonl", 40)
    config = root / "ranks.yaml"
    config.write_text(json.dumps({  # JSON is YAML
        "name": "train-ranks",
        "target": {"model": target, "max_model_len": 256},
        "data": {"sources": [{"path": str(data), "name": "tiny"}], "max_length": 128, "num_shards": 2, "heldout": 4},
        "regenerate": {"enabled": False},
        "vocab": {"draft_vocab_size": 64},
        "extract": {"backend": "transformers", "layer_ids": LAYER_IDS, "batch_tokens": 512, "part_tokens": 600},
        "train": {"max_steps": MAX_STEPS, "batch_tokens": 128, "warmup_steps": 1, "lr": 3e-3, "checkpoint_every": 2,
                  "eval_batches": 1},
        "benchmark": {"enabled": False},
    }))
    return SimpleNamespace(root=root, config=str(config))


def draftline(args: list[str], folder: Path, name: str, **env: str) -> tuple[int | None, str, str]:
    """`draftline ARGS` in a child; its temporary folders (the ranks' logs, kept on failure) under `folder`."""
    import os

    return finish(start_draftline(args, folder, name, env={**os.environ, "TMPDIR": str(folder), **env}), folder, name)


def train_artifacts(store: Store) -> list:
    return [m for m in store.list("train")]


def prefect_artifacts(server, flow_run_id: str) -> dict:
    """The flow run's Prefect artifacts by key, from the server's API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: server.api_url}), get_client(sync_client=True) as c:
        arts = c.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {a.key: a for a in arts}


@pytest.mark.slow
def test_two_gloo_ranks_through_the_flow_same_digest_killed_rank_named_retry_resumes(prefect_server, project,
                                                                                     tmp_path):
    uri = f"file://{tmp_path}/store"
    store = Store(uri)
    run = ["run", project.config, "--until", "train", "--json", "--set", f"store.uri={uri}"]

    # One rank: today's in-process path.
    code, out, err = draftline(run, tmp_path, "one-rank")
    assert code == 0, err[-4000:]
    one = json.loads(out)
    assert one["stages"]["train"]["status"] == "ran"
    (made,) = train_artifacts(store)
    assert made.stats["world_size"] == 1 and made.stats["steps"] == MAX_STEPS
    # Train again from scratch on the same data: drop the draft and its checkpoints.
    for m in store.list("checkpoint"):
        if m.inputs.get("train") == made.digest:
            store.delete("checkpoint", m.digest)
    store.delete("train", made.digest)

    # Two ranks; rank 1 is SIGKILLed right after its third step (the step-2 checkpoint is committed).
    two = run + ["--set", "train.gpus=2"]
    code, out, err = draftline(two, tmp_path, "killed", DRAFTLINE_FAULT_KILL="train.rank1.step:3")
    assert code == 1, err[-4000:]
    failed = json.loads(out)
    train = failed["stages"]["train"]
    assert train["status"] == "failed", train
    assert "training rank 1 of 2 failed: killed by SIGKILL" in train["error"], train["error"]
    assert "retry the run (`draftline retry`)" in train["error"]
    assert ["cached"] * 3 == [failed["stages"][s]["status"] for s in ("prepare", "vocab", "extract")]
    assert store.find("train", made.digest) is None
    assert sorted(m.stats["step"] for m in store.list("checkpoint")) == [2]
    # rank 0's metrics reached the task while the ranks trained: its log and its progress artifact have them
    assert "train: 2 rank(s) on cpu" in err and "train step 1/6" in err, err[-4000:]
    progress = prefect_artifacts(prefect_server, failed["flow_run_id"])["train-progress"]
    assert progress.description.startswith("step 2/6, loss"), progress.description
    assert float(progress.data) == pytest.approx(100 * 2 / 6, abs=0.1)

    # The retry resumes from the checkpoint, on two ranks, and lands where the one-rank run did.
    code, out, err = draftline(["retry", failed["flow_run_id"]], tmp_path, "retry")
    assert code == 0, err[-4000:]
    assert "resumed from the checkpoint of step 2" in err and "train step 6/6" in err, err[-4000:]
    (again,) = train_artifacts(store)
    assert again.digest == made.digest  # train.gpus is not part of the address
    st = again.stats
    assert st["world_size"] == 2 and st["resumed_from_step"] == 2 and st["steps"] == MAX_STEPS
    assert st["tokens"] == MAX_STEPS * 2 * 128  # every step saw both ranks' batches
    assert re.search(r"train\s+.*ran", out), out[-2000:]
