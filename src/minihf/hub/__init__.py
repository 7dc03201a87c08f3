"""minihf.hub: models in and out of minihf, above ``models`` and ``data``.

* ``init_model`` -- a random-init model dir with a task tokenizer (factory.py), for offline use.
* ``convert_gguf`` / ``resolve_gguf`` / ``gguf_architecture`` -- a GGUF file as an HF model
  dir (gguf.py; needs ``pip install 'minihf[gguf]'``, imported when called).
* ``export_hf`` / ``model_dir_of`` / ``role_checkpoint`` -- a training checkpoint as an HF
  model dir (export.py).
"""

from minihf.hub.export import export_hf, model_dir_of, role_checkpoint
from minihf.hub.factory import init_model
from minihf.hub.gguf import convert_gguf, gguf_architecture, resolve_gguf

__all__ = ["export_hf", "model_dir_of", "role_checkpoint", "init_model", "convert_gguf", "gguf_architecture",
           "resolve_gguf"]
