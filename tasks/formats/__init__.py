"""What artifacts hold, read and written the same way by every stage: Parquet sample rows (`samples.py`),
hidden-state parts (`parts.py`), vocabulary maps (`vocab_maps.py`; their file read without torch:
`vocab_file.py`), the acceptance-length formula (`acceptance.py`) and drafts from outside the run (`drafts.py`:
content digest, warm start).
"""
