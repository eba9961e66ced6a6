"""What every package builds on: the config's sections (`config.py`, with `engine_args.py`: vLLM engine
arguments checked by name) and how a config is read (`config_load.py`), the address hash and the stage versions
(`digest.py`; each stage's address from its config is tasks/address/), the one error root (`errors.py`), kill
points for drills (`faults.py`), draftline's folder on the node and its file lock (`home.py`), who owns a process or
a lock (`owners.py`), small files others can write read capped (`capped.py`), the one rule for credentials given as
values (`secrets.py`), the stage registry (`stages.py`), the one way to stop (`stopping.py`) and the bound on
glibc's malloc arenas in a process that runs shards (`arenas.py`). Nothing here starts
an engine, imports torch or imports another package of tasks/.
"""
