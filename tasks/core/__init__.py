"""What every stage builds on: the config (`config.py`, with `engine_args.py`: vLLM engine arguments
checked by name), every artifact's address (`digest.py`), typed manifest stats (`stats.py`), the one
error root (`errors.py`), kill points for drills (`faults.py`), who owns a process or a lock
(`owners.py`) and the one way to stop (`stopping.py`). Nothing here starts an engine or imports torch.
"""
