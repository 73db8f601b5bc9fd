"""``python -m specularch.ddp_convert train.py -o train_ddp.py`` / ``--run N``: rewrite a
single-process training script into a distributed one (rules in ``rules.py``)."""
from .rewrite import convert

__all__ = ["convert"]
