"""An engine in its own process (`process.py`, `child.py`), config to engine settings and groups
(`settings.py`), the target model and its layer-id rule (`target.py`), its weights on the node once
(`weights.py`), vLLM's KV connector that captures hidden states (`vllm_connector.py`) and the vLLM releases
the engine layer runs on, checked before an engine starts (`vllm_versions.py`).
"""
