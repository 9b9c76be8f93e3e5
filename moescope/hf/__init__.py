"""Observe Hugging Face transformers (or any PyTorch) MoE models with no change to their code:

    import moescope
    ins = moescope.instrument(model)   # finds the MoE blocks by structure, emits moe/v2 NVTX
    print(ins.describe())              # blocks, E and k per layer, shared experts, or why none
    ...
    ins.close()                        # hooks removed: the model is as it was

Runs inside the serving process: imports torch and numpy, never the agent. docs/transformers.md.
"""

from moescope.hf.discover import Discovery, MoeBlock, discover
from moescope.hf.emit import Instrumentation, arrange_injection, instrument
from moescope.hf.scoring import Scoring

__all__ = ["Discovery", "Instrumentation", "MoeBlock", "Scoring", "arrange_injection", "discover", "instrument"]
