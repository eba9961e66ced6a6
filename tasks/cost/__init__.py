"""What a run will cost before it starts: `plan.py` prices a config's stages on a machine's measured rates
(configs/rates.yaml) and says what bounds each one (`draftline plan` prints it)."""
