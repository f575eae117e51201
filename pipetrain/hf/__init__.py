"""Hugging Face causal LMs in pipetrain: the model as keyed layers, its loss, its checkpoints.

Needs the ``hf`` extra (``pip install pipetrain[hf]``: transformers); ``import
pipetrain`` never imports this package. See docs/hf.md.
"""

from pipetrain.hf.loss import causal_lm_loss, causal_lm_targets
from pipetrain.hf.save import save
from pipetrain.hf.sequential import CausalLMLayers, initializer, sequential

__all__ = ["CausalLMLayers", "causal_lm_loss", "causal_lm_targets", "initializer", "save",
           "sequential"]
