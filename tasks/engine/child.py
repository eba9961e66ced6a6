"""The engine process itself: `python -m tasks.engine.child --fd N --parent PID`, started by
`tasks.engine.process.EngineProcess` (the parent side and the protocol are described there).

It loads one backend and serves requests over its end of the socketpair until the caller sends
`close`, goes away (EOF), or dies (a watcher thread polls the parent pid):
- vllm: `vllm.LLM`; extraction = the `extract_hidden_states` speculative method plus
  `tasks.engine.vllm_connector.SyncHiddenStatesConnector`;
- transformers: `from_pretrained` + forward hooks on the decoder layers (id k = output of decoder
  layer k-1; id N = the last layer's output before the final norm).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from tasks.core.faults import kill_point

# ============================================================================ child side


def _check_lengths(prompts: list[list[int]], limit: int, extra: int) -> None:
    bad = [(i, len(p)) for i, p in enumerate(prompts) if len(p) + extra > limit or not p]
    if bad:
        shown = ", ".join(f"#{i}: {n} tokens" for i, n in bad[:5])
        raise ValueError(
            f"{len(bad)} prompt(s) are empty or do not fit max_model_len={limit} (with {extra} new token(s)): "
            f"{shown}; filter or truncate them first (data.max_length < target.max_model_len)"
        )


class _VllmBackend:
    def __init__(self, model: str, llm_kwargs: dict, workdir: str):
        from vllm import LLM

        kwargs = dict(llm_kwargs)
        kwargs.setdefault("disable_log_stats", False)  # metrics() needs the stat loggers
        from tasks.core.engine_args import vllm_knows

        if kwargs.get("speculative_config") and vllm_knows("per_request_spec_decode_metrics"):
            # each request's accepted tokens per verify step (the benchmark's acceptance by context length); it
            # changes no token, so the printed `vllm serve` line leaves it out (vLLM >= 0.32; older: no per-request)
            kwargs.setdefault("per_request_spec_decode_metrics", "detailed")
        kv = kwargs.get("kv_transfer_config")
        self.layer_ids: list[int] | None = None
        if kv is not None:
            kv = dict(kv)
            extra = dict(kv.get("kv_connector_extra_config") or {})
            extra.setdefault("shared_storage_path", os.path.join(workdir, "hidden_states"))
            kv["kv_connector_extra_config"] = extra
            kwargs["kv_transfer_config"] = kv
            spec = (kwargs.get("speculative_config") or {})
            if spec.get("method") == "extract_hidden_states":
                hf = spec.get("draft_model_config", {}).get("hf_config", {})
                self.layer_ids = list(hf.get("eagle_aux_hidden_state_layer_ids") or [])
        self.llm = LLM(model=model, **kwargs)
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)

    def info(self) -> dict:
        return {"max_model_len": self.max_model_len, "layer_ids": self.layer_ids}

    def generate(self, prompt_token_ids: list[list[int]], sampling: dict) -> list[dict]:
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(**sampling)
        # vLLM's own rule (one bad prompt would fail the whole batch): a prompt leaves room for
        # at least one new token; generation stops at max_model_len ("length").
        _check_lengths(prompt_token_ids, self.max_model_len, 1)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_token_ids], params,
                                 use_tqdm=False)
        res = []
        for o in outs:
            c = o.outputs[0]
            res.append({"token_ids": list(c.token_ids), "text": c.text, "finish_reason": c.finish_reason,
                        "prompt_tokens": len(o.prompt_token_ids or [])})
            spec = getattr(c, "spec_decode_metrics", None)
            if spec is not None:
                res[-1]["spec_steps"] = [int(a) for a in spec.per_step_accepted]
        return res

    def extract(self, prompt_token_ids: list[list[int]], layer_ids: list[int]) -> dict:
        from vllm import SamplingParams, TokensPrompt

        if self.layer_ids is None:
            raise ValueError("this vLLM engine was not started for extraction; pass "
                             "tasks.engine.process.vllm_extract_kwargs(layer_ids) in llm_kwargs")
        if list(layer_ids) != self.layer_ids:
            raise ValueError(f"this engine extracts layers {self.layer_ids}, asked for {list(layer_ids)}; "
                             "start an engine for those ids")
        _check_lengths(prompt_token_ids, self.max_model_len, 1)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_token_ids],
                                 SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        paths, next_tokens = [], []
        for o in outs:
            params = o.kv_transfer_params or {}
            path = params.get("hidden_states_path")
            if not path:
                raise RuntimeError(f"vLLM returned no hidden_states_path for request {o.request_id} "
                                   f"(kv_transfer_params={params})")
            paths.append(path)
            # the engine's greedy next token after the prompt (temperature 0): what the extraction check compares
            # the stored last layer against
            next_tokens.append(int(o.outputs[0].token_ids[0]) if o.outputs and o.outputs[0].token_ids else None)
        for path in paths:
            _wait_written(path, timeout_s=600)
        return {"paths": paths, "next_tokens": next_tokens}

    def metrics(self) -> dict:
        from vllm.v1.metrics.reader import Counter, Gauge, Histogram, Vector

        out: dict[str, Any] = {}
        for m in self.llm.get_metrics():
            if isinstance(m, (Counter, Gauge)):
                out[m.name] = out.get(m.name, 0) + m.value
            elif isinstance(m, Vector):
                prev = out.get(m.name) or [0] * len(m.values)
                out[m.name] = [a + b for a, b in zip(prev, m.values)] + list(m.values[len(prev):])
            elif isinstance(m, Histogram):
                prev = out.get(m.name) or {"count": 0, "sum": 0.0}
                out[m.name] = {"count": prev["count"] + m.count, "sum": prev["sum"] + m.sum}
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.llm.llm_engine.engine_core.shutdown()


def _wait_written(path: str, timeout_s: float) -> None:
    """The connector holds LOCK_EX on PATH.lock until PATH is written."""
    lock = path + ".lock"
    deadline = time.monotonic() + timeout_s
    while True:
        if os.path.exists(lock):
            with open(lock) as fh:
                try:
                    fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    fcntl.flock(fh, fcntl.LOCK_UN)
                    if os.path.exists(path):
                        return
                except BlockingIOError:
                    pass
        elif os.path.exists(path):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"hidden states {path} were not written within {timeout_s:.0f} s")
        time.sleep(0.002)


def find_decoder_layers(model: Any, num_layers: int) -> tuple[str, Any]:
    """(dotted name, ModuleList) of the text decoder's layers, wherever the wrapper keeps them."""
    import torch

    preferred = ["model.layers", "model.language_model.layers", "language_model.model.layers",
                 "language_model.layers", "model.model.layers", "transformer.h", "model.decoder.layers"]
    found = {name: mod for name, mod in model.named_modules()
             if isinstance(mod, torch.nn.ModuleList) and len(mod) == num_layers}
    for name in preferred:
        if name in found:
            return name, found[name]
    skip = ("vision", "visual", "audio", "encoder", "mm_", "image")
    rest = [n for n in found if n.rsplit(".", 1)[-1] in ("layers", "h") and not any(s in n for s in skip)]
    if len(rest) == 1:
        return rest[0], found[rest[0]]
    raise ValueError(
        f"cannot find the decoder's {num_layers} layers in {type(model).__name__} (candidates: "
        f"{sorted(found) or 'none'}); supported layouts: model.layers, model.language_model.layers, "
        "language_model.model.layers"
    )


class _TransformersBackend:
    def __init__(self, model: str, llm_kwargs: dict, workdir: str):
        import torch
        import transformers
        from transformers import AutoConfig

        kw = dict(llm_kwargs)
        trust = bool(kw.pop("trust_remote_code", False))
        revision = kw.pop("revision", None)
        self.max_batch_tokens = int(kw.pop("max_batch_tokens", 8192))
        max_len = kw.pop("max_model_len", None)
        device = kw.pop("device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype_name = kw.pop("dtype", None) or ("bfloat16" if device.startswith("cuda") else "float32")
        # vLLM-only knobs that callers may pass to either backend.
        for k in ("tensor_parallel_size", "enforce_eager", "gpu_memory_utilization", "disable_log_stats",
                  "enable_prefix_caching", "max_num_batched_tokens", "max_num_seqs", "seed"):
            kw.pop(k, None)
        if kw:
            raise ValueError(f"the transformers backend does not take {sorted(kw)}; remove them")
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                 "auto": "auto"}[dtype_name]
        self.workdir = workdir
        self.config = AutoConfig.from_pretrained(model, trust_remote_code=trust, revision=revision)
        text = getattr(self.config, "text_config", None) or self.config
        self.num_layers = int(text.num_hidden_layers)
        self.max_model_len = int(max_len or getattr(text, "max_position_embeddings", 0) or 1 << 20)
        load = {"dtype": dtype, "trust_remote_code": trust, "revision": revision}
        multi = device.startswith("cuda") and torch.cuda.device_count() > 1
        if multi:
            load["device_map"] = "auto"
        last_err: Exception | None = None
        self.model = None
        for auto_name in ("AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoModel"):
            auto = getattr(transformers, auto_name, None)
            if auto is None:
                continue
            try:
                self.model = auto.from_pretrained(model, **load)
                break
            except ValueError as exc:  # "Unrecognized configuration class ..."
                last_err = exc
        if self.model is None:
            raise ValueError(f"transformers cannot load {model}: {last_err}")
        if not multi:
            self.model.to(device)
        self.model.eval()
        self.device = torch.device(device if not multi else "cuda:0")
        self.layers_name, self.layers = find_decoder_layers(self.model, self.num_layers)
        self.decoder = self.model.get_submodule(self.layers_name.rsplit(".", 1)[0])
        self.tokenizer = None
        with contextlib.suppress(Exception):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=trust, revision=revision)
        self.requests = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._n = 0
        self._host: Any = None
        self._ring: list[Any] = [None, None]  # (path, tensor, pinned) per slot; see extract(ring=True)
        self._ring_calls = 0
        self._ring_gen = 0

    def info(self) -> dict:
        return {"max_model_len": self.max_model_len, "layers": self.layers_name, "num_layers": self.num_layers,
                "device": str(self.device)}

    def _host_buffer(self, numel: int) -> Any:
        """A reusable host buffer (pinned on a GPU, so the device-to-host copy runs asynchronously
        at full speed)."""
        import torch

        if self._host is None or self._host.numel() < numel:
            self._host = None
            pin = self.device.type == "cuda"
            self._host = torch.empty(int(numel * 1.25), dtype=torch.bfloat16, pin_memory=pin)
        return self._host

    def _ring_buffer(self, numel: int) -> tuple[int, str, Any]:
        """The next of two bf16 buffers that are files in the work folder (shared memory where
        /dev/shm is big enough), mapped shared so the parent reads what the device copies in without
        a file being written; page-locked with cudaHostRegister on a GPU so the copy is async DMA."""
        import torch

        slot = self._ring_calls % 2
        self._ring_calls += 1
        cur = self._ring[slot]
        if cur is None or cur[1].numel() < numel:
            if cur is not None:
                self._ring_release(slot)
            self._ring_gen += 1
            n = int(numel * 1.25)
            path = os.path.join(self.workdir, f"ring-{slot}-{self._ring_gen}.bf16")
            with open(path, "wb") as fh:
                fh.truncate(n * 2)
            t = torch.from_file(path, shared=True, size=n, dtype=torch.bfloat16)
            pinned = False
            if self.device.type == "cuda":
                err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), n * 2, 0)
                pinned = int(err) == 0
                if not pinned:
                    print(f"cudaHostRegister of the {n * 2 / 1e9:.2f} GB ring buffer failed ({err}): "
                          "device-to-host copies are synchronous", flush=True)
            self._ring[slot] = (path, t, pinned)
        return slot, self._ring[slot][0], self._ring[slot][1]

    def _ring_release(self, slot: int) -> None:
        import torch

        path, t, pinned = self._ring[slot]
        self._ring[slot] = None
        if pinned:
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        del t
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)

    def _to_device(self, t: Any) -> Any:
        """A host tensor on the model's device without waiting for the GPU (pinned, non-blocking);
        on CPU the tensor itself."""
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _sync(self) -> None:
        """Wait for the queued device work (the copies into the host buffer); no-op on CPU."""
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    def extract(self, prompt_token_ids: list[list[int]], layer_ids: list[int], ring: bool = False) -> dict:
        """ring=False: the hidden states in a safetensors file of their own. ring=True: copied into
        the next of two reused shared buffers (no file written); the parent reads them in place and
        must be done with them before its second-next ring call (EngineProcess.extract). One function on purpose:
        the hooks live until the `finally` removes them, and the copies queued without a host sync are complete
        only at the one sync after the loop; split, both would cross functions."""
        import torch
        from safetensors.torch import save_file

        n = self.num_layers
        if not layer_ids or any(not 1 <= k <= n for k in layer_ids):
            raise ValueError(f"layer ids {layer_ids} out of range 1..{n} (id k = output of decoder layer k-1)")
        _check_lengths(prompt_token_ids, self.max_model_len, 0)
        t_start = time.monotonic()
        lengths = [len(p) for p in prompt_token_ids]
        hidden = int((getattr(self.config, "text_config", None) or self.config).hidden_size)
        row = len(layer_ids) * hidden
        if ring:
            ring_slot, ring_path, host = self._ring_buffer(sum(lengths) * row)
        else:
            host = self._host_buffer(sum(lengths) * row)
        captured: dict[int, Any] = {}

        def hook(slot: int):
            def fn(_mod, _inp, output):
                captured[slot] = output[0] if isinstance(output, (tuple, list)) else output
            return fn

        handles = [self.layers[k - 1].register_forward_hook(hook(slot)) for slot, k in enumerate(layer_ids)]
        tensors: dict[str, Any] = {}  # ring=False: what save_file writes
        spans: list[list[int]] = []  # [first element, rows] of each sub-batch in the buffer
        orders: list[list[int]] = []
        # the model's own greedy next token after each prompt (its norm and lm_head on the decoder's output at the
        # last position): what the extraction check compares the stored last layer against
        lm_head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        next_tokens: list[Any] = [None] * len(prompt_token_ids)
        last_pos: list[Any] = []  # per sub-batch, on the device: [B] argmax ids
        forward_s = 0.0
        try:
            order = sorted(range(len(prompt_token_ids)), key=lambda i: -lengths[i])  # little padding
            i = pos = 0
            while i < len(order):
                width = lengths[order[i]]  # longest in this sub-batch
                batch = order[i:i + max(1, self.max_batch_tokens // max(width, 1))]
                i += len(batch)
                ids = torch.zeros(len(batch), width, dtype=torch.long)
                mask = torch.zeros(len(batch), width, dtype=torch.long)
                for r, j in enumerate(batch):
                    ids[r, :lengths[j]] = torch.tensor(prompt_token_ids[j])
                    mask[r, :lengths[j]] = 1
                # The valid rows' flat positions, known here: selecting them by index (not by a
                # boolean mask) keeps the GPU queue free of host syncs.
                rows_idx = mask.view(-1).nonzero().squeeze(1)
                rows = int(rows_idx.numel())
                t0 = time.monotonic()
                captured.clear()
                with torch.inference_mode():
                    dec = self.decoder(input_ids=self._to_device(ids), attention_mask=self._to_device(mask),
                                       use_cache=False)
                    if lm_head is not None:
                        final = dec[0] if isinstance(dec, (tuple, list)) else dec.last_hidden_state
                        ends = torch.tensor([lengths[j] - 1 for j in batch], device=final.device)
                        last = final[torch.arange(len(batch), device=final.device), ends]
                        last_pos.append(lm_head(last.to(lm_head.weight.device)).argmax(-1))
                    del dec
                    idx = self._to_device(rows_idx)
                    # [B, S, H] per slot -> the valid rows [sum(len), L, H], in sub-batch order, then
                    # one copy out; on a GPU the copy is queued and the next sub-batch's forward with it
                    valid = torch.stack([captured[s].to(self.device, torch.bfloat16).reshape(-1, hidden)
                                         .index_select(0, idx) for s in range(len(layer_ids))], dim=1)
                    captured.clear()
                    dst = host[pos * row:(pos + rows) * row].view(rows, len(layer_ids), hidden)
                    dst.copy_(valid, non_blocking=True)
                    del valid
                forward_s += time.monotonic() - t0
                if not ring:
                    tensors[f"hidden_states.{len(orders)}"] = dst
                spans.append([pos * row, rows])
                orders.append(batch)
                pos += rows
            t0 = time.monotonic()
            self._sync()  # the host buffer is complete only now
            forward_s += time.monotonic() - t0
        finally:
            for h in handles:
                h.remove()
            captured.clear()
        for batch, picked in zip(orders, last_pos):
            for j, tok in zip(batch, picked.tolist()):
                next_tokens[j] = int(tok)
        self.requests += len(prompt_token_ids)
        self.prompt_tokens += sum(lengths)
        save_s = 0.0
        if ring:
            out = {"ring": ring_path, "ring_slot": ring_slot, "ring_numel": int(host.numel()), "spans": spans,
                   "row": [len(layer_ids), hidden]}
        else:
            self._n += 1
            path = os.path.join(self.workdir, f"extract-{self._n}.safetensors")
            t0 = time.monotonic()
            save_file(tensors, path)
            save_s = time.monotonic() - t0
            out = {"path": path}
        return {**out, "order": orders, "next_tokens": next_tokens,
                "timings": {"forward_s": round(forward_s, 4), "save_s": round(save_s, 4),
                                                    "engine_s": round(time.monotonic() - t_start, 4)}}

    def generate(self, prompt_token_ids: list[list[int]], sampling: dict) -> list[dict]:
        import torch

        s = dict(sampling)
        max_tokens = int(s.pop("max_tokens", 16) or 16)
        temperature = float(s.pop("temperature", 1.0))
        top_p = float(s.pop("top_p", 1.0))
        top_k = int(s.pop("top_k", 0) or 0)
        seed = s.pop("seed", None)
        stop_ids = list(s.pop("stop_token_ids", None) or [])
        s.pop("skip_special_tokens", None)
        if int(s.pop("n", 1)) != 1:
            raise ValueError("the transformers backend returns one completion per prompt (n=1)")
        if s:
            raise ValueError(f"the transformers backend does not support sampling options {sorted(s)}")
        _check_lengths(prompt_token_ids, self.max_model_len, 1)
        if seed is not None:
            torch.manual_seed(int(seed))
        gen_cfg = self.model.generation_config
        eos = gen_cfg.eos_token_id if gen_cfg is not None else None
        eos_ids = ([eos] if isinstance(eos, int) else list(eos or [])) + stop_ids
        pad = gen_cfg.pad_token_id if gen_cfg is not None and gen_cfg.pad_token_id is not None else (eos_ids or [0])[0]
        results: list[dict] = [{} for _ in prompt_token_ids]
        order = sorted(range(len(prompt_token_ids)), key=lambda i: -len(prompt_token_ids[i]))
        i = 0
        while i < len(order):
            width = len(prompt_token_ids[order[i]])
            batch = order[i:i + max(1, self.max_batch_tokens // (width + max_tokens))]
            i += len(batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for r, j in enumerate(batch):  # left padding for generation
                p = prompt_token_ids[j]
                ids[r, width - len(p):] = torch.tensor(p)
                mask[r, width - len(p):] = 1
            kwargs: dict[str, Any] = {"max_new_tokens": min(max_tokens, self.max_model_len - width),
                                      "pad_token_id": pad,
                                      "eos_token_id": eos_ids or None}
            if temperature > 0:
                kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k or None)
            else:
                kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
            with torch.inference_mode():
                gen = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                          **kwargs)
            for r, j in enumerate(batch):
                toks = gen[r, width:].tolist()
                finish = "length"
                for t_i, t in enumerate(toks):
                    if t in eos_ids:
                        toks = toks[:t_i + 1]
                        finish = "stop"
                        break
                text = self.tokenizer.decode(toks, skip_special_tokens=True) if self.tokenizer else ""
                results[j] = {"token_ids": toks, "text": text, "finish_reason": finish,
                              "prompt_tokens": len(prompt_token_ids[j])}
                self.generation_tokens += len(toks)
            self.requests += len(batch)
            self.prompt_tokens += sum(len(prompt_token_ids[j]) for j in batch)
        return results

    def metrics(self) -> dict:
        return {"draftline:requests": self.requests, "vllm:prompt_tokens": self.prompt_tokens,
                "vllm:generation_tokens": self.generation_tokens}

    def close(self) -> None:
        pass


def _die_with_parent(parent_pid: int) -> None:
    """If the caller dies, take the engine (and its process group) down with it.

    (Not PR_SET_PDEATHSIG: it fires when the parent THREAD exits, and callers start
    engines from thread pools.)
    """

    def kill_group(*_: Any) -> None:
        os.killpg(os.getpgid(0), signal.SIGKILL)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        if _WORKDIR:  # nobody is left to clean up after us (it may sit in /dev/shm, i.e. RAM)
            shutil.rmtree(_WORKDIR, ignore_errors=True)
        kill_group()

    signal.signal(signal.SIGTERM, kill_group)
    threading.Thread(target=watch, name="draftline-parent-watch", daemon=True).start()


_WORKDIR: str | None = None


def _pin_cores() -> None:
    """An engine of a CPU group (tasks/engine/settings.py `engine_groups`) runs on its own cores only."""
    cores = os.environ.get("DRAFTLINE_ENGINE_CPUS")
    if not cores:
        return
    ids = {int(c) for c in cores.split(",")}
    os.sched_setaffinity(0, ids)
    import torch

    torch.set_num_threads(len(ids))


def serve(fd: int, parent_pid: int) -> int:
    global _WORKDIR
    conn = Connection(fd)
    os.set_inheritable(fd, False)
    _die_with_parent(parent_pid)
    try:
        init = conn.recv()
    except EOFError:
        return 1
    backend: Any = None
    _WORKDIR = init.get("workdir")
    request_point = f"engine.{init.get('name', 'engine')}.request"  # tasks/core/faults.py: the engine kills itself
    _pin_cores()
    try:
        model = str(init["model"])
        if model.startswith(("/", ".", "~")) and not os.path.exists(os.path.expanduser(model)):
            raise FileNotFoundError(f"model folder {model} does not exist; fix the path (target.model)")
        cls = _VllmBackend if init["kind"] == "vllm" else _TransformersBackend
        t0 = time.monotonic()
        backend = cls(init["model"], init["llm_kwargs"], init["workdir"])
        info = backend.info()
        info["load_s"] = round(time.monotonic() - t0, 2)
        info["pid"] = os.getpid()
        conn.send({"ok": True, "result": info})
    except BaseException as exc:
        traceback.print_exc()
        with contextlib.suppress(Exception):
            conn.send({"ok": False, "fatal": True, "error": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc()})
        return 1
    code = 0
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the caller went away (killed, or closing after our death)
            if _WORKDIR:  # nobody else will remove it (it may sit in /dev/shm, i.e. RAM)
                shutil.rmtree(_WORKDIR, ignore_errors=True)
            break
        op = msg.pop("op")
        msg.pop("seq", None)
        if op == "close":
            break
        try:
            if op not in ("generate", "extract", "metrics"):
                raise ValueError(f"unknown engine request {op!r}")
            if op != "metrics":
                kill_point(request_point)
            result = getattr(backend, op)(**msg)
            conn.send({"ok": True, "result": result})
        except Exception as exc:
            traceback.print_exc()
            dead = type(exc).__name__ == "EngineDeadError"  # vLLM's engine core is gone: so are we
            conn.send({"ok": False, "fatal": dead, "error": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc()})
            if dead:
                code = 1
                break
    with contextlib.suppress(Exception):
        backend.close()
    sys.stdout.flush()
    return code


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="draftline engine process (started by tasks.engine.process.EngineProcess)")
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--parent", type=int, required=True)
    args = ap.parse_args(argv)
    return serve(args.fd, args.parent)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: vLLM's atexit hooks can hang after shutdown
