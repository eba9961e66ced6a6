"""Where each stage's artifact lives (`digests.py`): its address from what made it, the stage's config section
(scheduling-only keys left out), the target's identity (what the model is: tasks/engine/weights.py's
fingerprint, never its path), the data's identity by content (`data.py`: a file by its sha256, never its path),
the warm start's and other drafts' content (tasks/formats/drafts.py) and the
inputs' addresses. Used by the stages and by the flow's tasks, so both agree. It sits above the
engine and formats packages (it asks them what a model or a draft is) and below the stages.
"""
