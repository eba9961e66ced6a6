"""The data stages and what they share: sources (`sources.py`), the chat template and loss mask
(`chat.py`), and the stages `prepare.py`, `regenerate.py` (the target writes the answers) and
`vocab.py` (the draft vocabulary); the anchors' evals as offline presets (`eval_sets.py`); prepare's local spill
files, rows on disk read back by index (`spill.py`); prepare's encoding, in its process or on `data.workers`
processes with the same outcome (`encoding.py`).
"""
