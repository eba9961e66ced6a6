"""The engine child process (tasks/engine/process.py) with the transformers backend on tiny random models.

What a user relies on: the engine answers many requests from one load; its hidden
states are the layers EAGLE-3 needs (id k = output of decoder layer k-1, the last
slot = the last layer's output BEFORE the final norm) for plain decoders and for
multimodal wrappers (`model.language_model.layers`); a killed engine turns into
an EngineError with its log, never a hang.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from tasks.core import owners
from tasks.engine.process import EngineError, EngineProcess
from tasks.engine.child import find_decoder_layers

LAYER_IDS = [1, 3, 4, 6]  # 6-layer tiny model: three auxiliary layers + the last


def _word_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def tiny_llama(path, layers: int = 6, vocab: int = 512):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=1024,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    _word_tokenizer(vocab).save_pretrained(path)
    return str(path)


def reference_hidden(path, prompt: list[int], layer_ids: list[int]):
    """What the extractor must return, computed in-process with output_hidden_states."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except ValueError:
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    name, _layers = find_decoder_layers(model, layer_ids[-1])
    decoder = model.get_submodule(name.rsplit(".", 1)[0])
    with torch.no_grad():
        out = decoder(input_ids=torch.tensor([prompt]), output_hidden_states=True)
    hs = out.hidden_states  # [0] = embeddings, [k] = output of layer k-1, [-1] = after the final norm
    aux = torch.stack([hs[k][0] for k in layer_ids[:-1]], dim=1)
    return aux, hs[-1][0], decoder.norm


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def engine(llama_path):
    eng = EngineProcess("transformers", llama_path, {"max_model_len": 4096}, name="test-tf")
    eng.start(timeout_s=300)
    yield eng
    eng.close()


PROMPTS = [list(range(3, 43)), list(range(100, 117)), [5, 6, 7] * 30]


def test_extract_returns_the_eagle3_layers(engine, llama_path):
    got = engine.extract(PROMPTS, LAYER_IDS)
    assert [tuple(t.shape) for t in got] == [(40, 4, 128), (17, 4, 128), (90, 4, 128)]
    assert all(t.dtype == torch.bfloat16 for t in got)
    for prompt, hs in zip(PROMPTS, got):
        aux, post_norm, norm = reference_hidden(llama_path, prompt, LAYER_IDS)
        torch.testing.assert_close(hs[:, :3].float(), aux, atol=2e-2, rtol=2e-2)
        # last slot is the PRE-norm output: applying the final norm gives hidden_states[-1]
        with torch.no_grad():
            torch.testing.assert_close(norm(hs[:, 3].float()), post_norm, atol=5e-2, rtol=2e-2)
        assert not torch.allclose(hs[:, 3].float(), post_norm, atol=1e-2)


def test_ring_extract_matches_files_and_reuses_two_buffers(engine):
    """extract(ring=True): the same hidden states as the file path, read in place from two buffers
    the engine alternates between (no file per call): a result stays valid through the next call
    and is overwritten by the one after, as EngineProcess.extract documents."""
    files = engine.extract(PROMPTS, LAYER_IDS)
    ring = engine.extract(PROMPTS, LAYER_IDS, ring=True)
    for a, b in zip(files, ring):
        assert b.dtype == torch.bfloat16 and torch.equal(a, b)
    assert engine.last_timings["save_s"] == 0.0
    kept = [t.clone() for t in ring]
    second = engine.extract([PROMPTS[1]], LAYER_IDS, ring=True)  # the other buffer
    assert all(torch.equal(k, t) for k, t in zip(kept, ring))
    engine.extract([PROMPTS[2]] * 2, LAYER_IDS, ring=True)  # reuses the first call's buffer
    assert not torch.equal(kept[0], ring[0])
    torch.testing.assert_close(second[0].float(), files[1].float(), atol=2e-2, rtol=2e-2)  # alone vs batched
    big = engine.extract([PROMPTS[0] * 20], LAYER_IDS, ring=True)[0]  # outgrows its buffer: a new one
    assert big.shape == (800, 4, 128)
    torch.testing.assert_close(big[:40].float(), files[0].float(), atol=2e-2, rtol=2e-2)
    left = sorted(p.name for p in Path(engine.workdir).iterdir() if p.name not in ("engine.log", owners.OWNER_FILE))
    assert len(left) == 2 and all(n.startswith("ring-") for n in left), left


def test_one_engine_serves_many_requests(engine):
    pid = engine.pid
    a = engine.extract([PROMPTS[0]], LAYER_IDS)[0]
    b = engine.extract([PROMPTS[1], PROMPTS[0]], LAYER_IDS)[1]  # batching does not change results
    torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    out = engine.generate([PROMPTS[0], PROMPTS[1]], {"max_tokens": 5, "temperature": 0})
    assert [len(o["token_ids"]) for o in out] == [5, 5] and all(o["finish_reason"] == "length" for o in out)
    again = engine.generate([PROMPTS[1]], {"max_tokens": 5, "temperature": 0})
    assert again[0]["token_ids"] == out[1]["token_ids"]  # greedy is deterministic, padding or not
    assert engine.pid == pid and engine.alive
    assert engine.metrics()["vllm:prompt_tokens"] > 0


def test_bad_request_is_an_error_but_the_engine_lives(engine):
    with pytest.raises(EngineError, match="out of range"):
        engine.extract([PROMPTS[0]], [0, 6])
    with pytest.raises(EngineError, match="max_model_len"):
        engine.extract([list(range(3, 500)) * 10], LAYER_IDS)
    assert engine.alive
    assert engine.extract([PROMPTS[1]], LAYER_IDS)[0].shape == (17, 4, 128)


def test_kill_mid_request_raises_and_restart_works(engine, monkeypatch):
    """Runs last among the users of the shared engine: it kills it, then starts it again."""
    pid = engine.pid
    killer = threading.Timer(1.0, os.kill, (pid, signal.SIGKILL))
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="SIGKILL"):
        engine.generate([PROMPTS[0]] * 4, {"max_tokens": 3000, "temperature": 0})  # many seconds of work
    assert time.monotonic() - t0 < 30
    assert not engine.alive
    with pytest.raises(EngineError, match="not running"):
        engine.extract([PROMPTS[0]], LAYER_IDS)
    engine.start(timeout_s=300)  # the caller may start a new one
    assert engine.alive and engine.pid != pid
    kept = os.path.join(os.path.dirname(engine.kept_log_path()), f"draftline-{engine.name}-{pid}.log")
    assert os.path.exists(kept), "the dead engine's log is kept for the user"
    os.remove(kept)
    assert engine.extract([PROMPTS[1]], LAYER_IDS)[0].shape == (17, 4, 128)
    workdir = engine.workdir
    monkeypatch.setenv("DRAFTLINE_KEEP_ENGINE_LOGS", "1")  # a clean engine's log kept too (benchmarks/gpu_vllm.sh)
    engine.close()
    assert not engine.alive and workdir and not os.path.exists(workdir)
    assert os.path.getsize(engine.kept_log_path()) > 0
    os.remove(engine.kept_log_path())


def test_engine_that_cannot_load_reports_why(tmp_path):
    eng = EngineProcess("transformers", str(tmp_path / "no-such-model"), {}, name="test-bad")
    with pytest.raises(EngineError) as err:
        eng.start(timeout_s=120)
    assert "no-such-model" in str(err.value)
    assert not eng.alive
    assert eng.workdir and not os.path.exists(eng.workdir)
    assert os.path.exists(eng.kept_log_path())  # the full log stays for the user, and the error says where
    assert eng.kept_log_path() in str(err.value)
    # ... in a folder only this user may enter, not at a predictable path of the shared temp folder
    folder = os.path.dirname(eng.kept_log_path())
    assert os.stat(folder).st_mode & 0o777 == 0o700 and os.stat(folder).st_uid == os.getuid()
    assert os.stat(eng.kept_log_path()).st_mode & 0o077 == 0
    assert not eng.kept_log_path().startswith(tempfile.gettempdir() + os.sep)
    os.remove(eng.kept_log_path())


def test_language_model_wrapper_layout(tmp_path):
    """Multimodal wrappers keep the decoder under language_model (Kimi-K2.5, Llava)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    text = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=2,
                              image_size=28, patch_size=14)  # also 5 layers: must not be mistaken for the decoder
    torch.manual_seed(0)
    LlavaForConditionalGeneration(LlavaConfig(text_config=text, vision_config=vision, image_token_id=511)
                                  ).save_pretrained(tmp_path)
    ids = [1, 2, 3, 5]
    with EngineProcess("transformers", str(tmp_path), {}, name="test-wrapper") as eng:
        assert eng.info["layers"] == "model.language_model.layers"
        got = eng.extract([PROMPTS[1]], ids)[0]
    aux, post_norm, norm = reference_hidden(str(tmp_path), PROMPTS[1], ids)
    assert got.shape == (17, 4, 64)
    torch.testing.assert_close(got[:, :3].float(), aux, atol=2e-2, rtol=2e-2)
    with torch.no_grad():
        torch.testing.assert_close(norm(got[:, 3].float()), post_norm, atol=5e-2, rtol=2e-2)


def test_find_decoder_layers_kimi_layout():
    """Kimi-K2.5: model.language_model is a full causal LM: language_model.model.layers."""
    n = 4

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(n))

    class CausalLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Decoder()

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.vision_tower = Decoder()
            self.language_model = CausalLM()

    name, layers = find_decoder_layers(Wrapper(), n)
    assert name == "language_model.model.layers" and len(layers) == n
    with pytest.raises(ValueError, match="cannot find the decoder"):
        find_decoder_layers(Wrapper(), 7)
