"""minihf.utils: the bottom layer, importing no other minihf package. Files (atomic writes,
``staged_dir``, broken-file errors), locks on run dirs and artefacts, sharded checkpoints
(DCP) and their safe loading, recipe-code imports, process start and exit."""
