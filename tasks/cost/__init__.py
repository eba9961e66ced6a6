"""What a run will cost before it starts: `plan.py` prices a config's stages on a machine's measured rates
(`rates.py`: configs/rates.yaml), on the draft's size and FLOPs (`shape.py`, kept on disk once per draft by `shape_cache.py`) and the run's own lengths where its store has them (`lengths.py`), and says
what bounds each one (`draftline plan` prints it). Pure: the caller reads the store."""
